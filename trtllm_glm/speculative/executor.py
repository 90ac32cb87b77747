"""`SpeculativeExecutor`: draft K tokens, verify ``1 + K`` rows in one target forward, accept the longest
greedy-matching prefix plus the bonus token, and commit exactly the accepted state.

Per round and request (DESIGN §6-§7):

- Verify rows go through the KDA record path (state untouched until commit) and the indexer's
  `DecodeTailRing` (the previous round's rejected ring entries are rolled back, positions decide).
- Width-one rounds (no drafts: nothing matched, budget exhausted, sampling, or an adaptive width of 0)
  decode in place: no records, no convolution shift, no draft tail backup/restore; the emitted token
  still reaches the drafter.
- MTP drafting: the MTP layer first catches up on the newly committed (token ``i + 1``, target hidden
  ``i``) pairs — those rows are real and stay in its cache — then chains ``K - 1`` more steps on its own
  output. The chained rows are speculative: the MTP tail ring is backed up before and restored after
  them (their latent rows and pools are rewritten by the next catch-up before any committed row reads
  them). The MTP plane lives in the target manager (``shared``) or in its own draft manager
  (``separate``), which the draft forward reaches through the draft slot table (§6.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CapacityError
from ..models.glm5_next import Glm5NextForCausalLM
from ..runtime.executor import Executor, ExecutorConfig
from ..runtime.request import Request
from ..runtime.sampling import top2_gap
from ..runtime.scheduler import ScheduledSeq
from .config import MTPDecodingConfig, NGramDecodingConfig, SpeculativeConfig
from .drafters import NGramDrafter, OracleDrafter
from .interface import draft_replay

__all__ = ["SpeculativeExecutor", "SpecState"]


@dataclass
class SpecState:
    """Per-request speculative state kept by the executor."""

    drafts: list[int] = field(default_factory=list)
    mtp_len: int = 0  # tokens whose (token i+1, hidden i) pair is in the MTP cache
    last_accepted: int = 0  # rows accepted in the previous verify round (tail-ring cross-check)
    index: int = 0  # submission index (oracle drafters key on it)
    mtp_disabled: bool = False  # the draft pool could not hold its history: width-one from here on


class SpeculativeExecutor(Executor):
    """Continuous batching with speculative decoding (MTP or a parallel drafter).

    Args:
        model: target model (with an MTP layer for `MTPDecodingConfig`).
        cfg: cache and batch sizes.
        spec: the speculative configuration.
        seed: base sampling seed.
        drafter: a parallel drafter overriding the configured one (tests pass an `OracleDrafter`).
    """

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        cfg: ExecutorConfig,
        spec: SpeculativeConfig,
        *,
        seed: int = 0,
        drafter: NGramDrafter | OracleDrafter | None = None,
    ) -> None:
        self.spec = spec
        self.use_mtp = isinstance(spec, MTPDecodingConfig) and drafter is None
        if self.use_mtp and model.mtp is None:
            raise ValueError("MTPDecodingConfig needs a model with an MTP layer (num_nextn_predict_layers > 0)")
        self.shared_mtp = self.use_mtp and spec.draft_kv_mode == "shared"  # type: ignore[union-attr]
        super().__init__(model, cfg, seed=seed)
        K = spec.max_draft_len
        if self.meta.max_num_tokens < 1 + K:
            raise ValueError(f"max_num_tokens={self.meta.max_num_tokens} cannot hold one verify of width {1 + K}")
        self.max_draft_len = K
        self.manager.enable_decode_tail_rings(1 + K, num_layers=len(self.config.sparse_layer_ids))
        if isinstance(spec, NGramDecodingConfig) and drafter is None:
            drafter = NGramDrafter(K, spec.max_matching_ngram_size, spec.min_matching_ngram_size)
        self.drafter = drafter
        self.draft_manager = None
        if self.use_mtp:
            if self.shared_mtp:
                self.draft_manager = self.manager
                self.mtp_plane = self.manager.num_sparse_layers - 1
            else:
                P = cfg.tokens_per_block
                from ..cache.manager import Glm5NextCacheManager

                self.draft_manager = Glm5NextCacheManager(
                    self.config,
                    num_pages=-(-(spec.draft_max_tokens or cfg.max_tokens) // P),  # type: ignore[union-attr]
                    tokens_per_block=P,
                    max_num_requests=cfg.max_batch_size,
                    num_sparse_layers=1,
                    num_kda_layers=0,
                    dtype=self.dtype,
                    device=self.device,
                )
                self.mtp_plane = 0
        if self.use_mtp:
            dm = self.draft_manager
            assert dm is not None
            # The MTP plane's rollback and snapshot planes live with the draft manager's state owner.
            dm.state.enable_speculative_rows(self.mtp_plane)
            dm.state.enable_draft_hidden(self.config.hidden_size, self.dtype)
        self.state: dict[int, SpecState] = {}
        self._n_submitted = 0

    def _target_stores_mtp_layer(self) -> bool:
        return self.shared_mtp

    @property
    def share_mtp_selection(self) -> bool:
        """Whether chained MTP steps reuse step 0's pool selection (index_share_for_mtp_iteration)."""
        if not self.use_mtp:
            return False
        want = self.spec.index_share_for_mtp_iteration  # type: ignore[union-attr]
        return self.config.index_share_for_mtp_iteration if want is None else bool(want)

    def _select_width(self) -> int:
        # A shared chained step attends step 0's open pool plus up to K - 1 later tokens.
        extra = self.spec.max_draft_len if self.share_mtp_selection else 0
        return self.config.index_select_width + extra

    # --------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params) -> Request:  # type: ignore[override]
        req = super().add_request(prompt_ids, params)
        self.state[req.request_id] = SpecState(index=self._n_submitted)
        self._n_submitted += 1
        return req

    def on_preempt(self, req: Request) -> None:
        st = self.state[req.request_id]
        st.drafts, st.mtp_len, st.last_accepted = [], 0, 0
        self._free_draft(req)

    def _free_draft(self, req: Request) -> None:
        dm = self.draft_manager
        if dm is not None and dm is not self.manager and dm.has_request(req.request_id):
            dm.free_request(req.request_id)

    def _finish(self, req: Request) -> None:
        super()._finish(req)
        self._free_draft(req)
        self.state.pop(req.request_id, None)

    def on_abort(self, req: Request) -> None:
        self._free_draft(req)
        self.state.pop(req.request_id, None)

    # --------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        widths = {r.request_id: 1 + len(self.state[r.request_id].drafts) for r in self.running if r.is_decode}
        plan = self._plan(widths)
        if not plan:
            raise CapacityError("no request can be scheduled: the cache cannot hold even one sequence's next rows")
        self.num_steps += 1
        hidden = self._forward(plan)
        return self._advance(plan, hidden)

    def _rows_for(self, s: ScheduledSeq) -> list[int]:
        rows = super()._rows_for(s)
        if s.is_decode and s.num_rows > 1:
            drafts = self.state[s.request.request_id].drafts
            assert len(drafts) == s.num_rows - 1
            rows = rows + drafts
        return rows

    def _before_forward(self, plan: list[ScheduledSeq]) -> None:
        self.meta.verify_seqs = [i for i, s in enumerate(plan) if s.is_decode and s.num_rows > 1]
        acc = [self.state[s.request.request_id].last_accepted for s in plan]
        self.meta.num_accepted_t = torch.tensor(acc, dtype=torch.int64, device=self.device)

    def _advance(self, plan: list[ScheduledSeq], hidden: torch.Tensor) -> list[Request]:
        # Rows whose logits are needed: every verify row, and the last row of sequences that end here.
        need: list[int] = []
        spans: list[tuple[int, int]] = []  # per seq: (offset into `need`, count)
        row = 0
        for s in plan:
            r = s.request
            if s.is_decode and s.num_rows > 1:
                spans.append((len(need), s.num_rows))
                need.extend(range(row, row + s.num_rows))
            elif r.num_computed + s.num_rows == len(r.tokens):
                spans.append((len(need), 1))
                need.append(row + s.num_rows - 1)
            else:
                spans.append((len(need), 0))
            row += s.num_rows
        logits = gaps = greedy = None
        if need:
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[torch.tensor(need, device=self.device)])
            gaps = top2_gap(logits).tolist()
            greedy = logits.argmax(-1).tolist()

        num_accepted = [0] * len(plan)
        committed = [0] * len(plan)
        finished: list[Request] = []
        for i, s in enumerate(plan):
            r = s.request
            st = self.state[r.request_id]
            off, cnt = spans[i]
            if s.is_decode and s.num_rows > 1:
                drafts = st.drafts
                a = 1
                while a <= len(drafts) and drafts[a - 1] == greedy[off + a - 1]:
                    a += 1
                emitted = drafts[: a - 1] + [greedy[off + a - 1]]
                num_accepted[i] = committed[i] = a
                r.num_verify_rounds += 1
                r.num_accepted_total += a
                for j in range(len(drafts)):
                    if j >= len(r.proposed_per_position):
                        r.proposed_per_position.append(0)
                        r.accepted_per_position.append(0)
                    r.proposed_per_position[j] += 1
                    r.accepted_per_position[j] += int(j < a - 1)
                st.last_accepted = a
                r.num_computed += a
                if self._emit(r, emitted, gaps[off : off + a], logits[off : off + a]):  # type: ignore[index]
                    finished.append(r)
            else:
                committed[i] = s.num_rows
                num_accepted[i] = s.num_rows
                r.num_computed += s.num_rows
                st.last_accepted = 0
                if cnt:
                    tok = greedy[off]
                    if not r.params.greedy:
                        tok = int(
                            self.sampler.sample(logits[off : off + 1], [r.params], [r.generator]).item()  # type: ignore[index]
                        )
                    if self._emit(r, [tok], gaps[off : off + 1], logits[off : off + 1]):  # type: ignore[index]
                        finished.append(r)
            st.drafts = []
        # Folds the verified KDA records (if any) and advances every slot's committed length.
        self.model.commit_kda(self.meta, self.manager, num_accepted)
        for r in finished:
            self._finish(r)
        live = [(i, s) for i, s in enumerate(plan) if not s.request.finished]
        self._draft(live, plan, committed, hidden)
        return finished

    # --------------------------------------------------------------------------------------------
    # Drafting for the next round
    def _draft_len(self, r: Request) -> int:
        """Drafts to propose for ``r``'s next round (0 = a width-one round)."""
        if not r.params.greedy or not r.is_decode:
            return 0
        k = self.max_draft_len
        if self.spec.draft_len_fn is not None:
            k = max(0, min(k, int(self.spec.draft_len_fn(r))))
        # The bonus token is always emitted: never verify past the request's budget or the context.
        k = min(k, r.params.max_tokens - len(r.output_ids) - 1, self.max_seq_len - len(r.tokens) - 1)
        if k <= 0:
            return 0
        try:  # The verify rows need pages; without them this round is width one.
            self.manager.ensure_capacity(r.request_id, len(r.tokens) + k)
        except CapacityError:
            return 0
        return k

    def _draft(
        self, live: list[tuple[int, ScheduledSeq]], plan: list[ScheduledSeq], committed: list[int], hidden: torch.Tensor
    ) -> None:
        want = {s.request.request_id: self._draft_len(s.request) for _, s in live}
        if not self.use_mtp:
            for _, s in live:
                r = s.request
                k = want[r.request_id]
                if k <= 0:
                    continue
                if isinstance(self.drafter, OracleDrafter):
                    d = self.drafter.propose_for(self.state[r.request_id].index, len(r.output_ids), k)
                else:
                    assert self.drafter is not None
                    d = self.drafter.propose(r.tokens, k)
                self.state[r.request_id].drafts = list(d[:k])
            return
        self._mtp_draft(live, plan, committed, hidden, want)

    def _mtp_draft(
        self,
        live: list[tuple[int, ScheduledSeq]],
        plan: list[ScheduledSeq],
        committed: list[int],
        hidden: torch.Tensor,
        want: dict[int, int],
    ) -> None:
        dm = self.draft_manager
        assert dm is not None
        offsets = [0]
        for s in plan:
            offsets.append(offsets[-1] + s.num_rows)
        # 1. Catch-up: the committed rows of this step, paired with the token that follows each.
        seqs, rows_h, toks = [], [], []
        for i, s in enumerate(plan):
            r = s.request
            if r.finished or not r.params.greedy:
                continue
            st = self.state[r.request_id]
            if st.mtp_disabled:
                continue
            start = r.num_computed - committed[i]
            if st.mtp_len != start:
                # The MTP history has a gap (cannot happen: every step catches up); drop speculation.
                st.mtp_disabled = True
                continue
            if dm is not self.manager:
                try:
                    if not dm.has_request(r.request_id):
                        dm.add_request(r.request_id)
                    dm.ensure_capacity(r.request_id, r.num_computed + max(want[r.request_id] - 1, 0))
                except CapacityError:
                    # The draft pool is full: this request continues without speculation (lossless).
                    st.mtp_disabled = True
                    self._free_draft(r)
                    continue
            seqs.append(r)
            rows_h.append(torch.arange(offsets[i], offsets[i] + committed[i]))
            toks.extend(r.tokens[start + 1 : r.num_computed + 1])
        if not seqs:
            return
        prev_h = hidden[torch.cat(rows_h).to(self.device)]
        nxt = torch.tensor(toks, dtype=torch.int64, device=self.device)
        out = self._mtp_step(
            seqs, [r.num_computed - len(rh) for r, rh in zip(seqs, rows_h)], [len(rh) for rh in rows_h], nxt, prev_h,
            decode=False,
        )  # fmt: skip
        for r in seqs:
            self.state[r.request_id].mtp_len = r.num_computed
        last = torch.tensor([sum(len(x) for x in rows_h[: j + 1]) - 1 for j in range(len(seqs))], device=self.device)
        draft_ids = dm.get_batch_state_slots([r.request_id for r in seqs])
        if dm is not self.manager:
            # A separate draft manager's committed length is the MTP history (shared: the target's slot).
            dm.state.commit_verified(draft_ids, [len(rh) for rh in rows_h])
        dm.state.record_draft_hidden(torch.tensor(draft_ids, device=self.device), prev_h[last])
        h_last = out[last]
        pools0 = self.meta.last_pool_ids[last] if self.share_mtp_selection else None
        with torch.inference_mode():
            d = self.model.compute_logits(h_last).argmax(-1)
        drafting = [j for j, r in enumerate(seqs) if want[r.request_id] >= 1]
        for j in drafting:
            self.state[seqs[j].request_id].drafts = [int(d[j])]
        chain = [j for j in drafting if want[seqs[j].request_id] >= 2]
        if not chain:
            return
        # 2. Chained drafts: speculative rows; the state owner restores the MTP tail ring afterwards.
        slots = torch.tensor(
            [dm.get_state_slot(seqs[j].request_id) for j in chain], dtype=torch.int64, device=self.device
        )
        with dm.state.speculative_rows(self.mtp_plane, slots):
            h = h_last[torch.tensor(chain, device=self.device)]
            active = list(chain)
            c = 1
            while active:
                reqs = [seqs[j] for j in active]
                tok = torch.tensor([self.state[r.request_id].drafts[-1] for r in reqs], device=self.device)
                shared = None
                if pools0 is not None:
                    # Step 0 ran at position num_computed - 1; its open pool starts at 4 * (num_computed // 4).
                    ws = torch.tensor([4 * (r.num_computed // 4) for r in reqs], dtype=torch.int64, device=self.device)
                    shared = (pools0[torch.tensor(active, device=self.device)], ws)
                kw = {} if shared is None else {"shared": shared}
                h = self._mtp_step(
                    reqs, [r.num_computed + c - 1 for r in reqs], [1] * len(reqs), tok, h, decode=True, **kw
                )
                with torch.inference_mode():
                    nd = self.model.compute_logits(h).argmax(-1).tolist()
                keep = []
                for k, r in enumerate(reqs):
                    st = self.state[r.request_id]
                    st.drafts.append(int(nd[k]))
                    if len(st.drafts) < want[r.request_id]:
                        keep.append(k)
                active = [active[k] for k in keep]
                h = h[torch.tensor(keep, dtype=torch.int64, device=self.device)] if keep else h[:0]
                c += 1

    def _mtp_step(
        self,
        reqs: list[Request],
        past: list[int],
        q: list[int],
        next_tokens: torch.Tensor,
        prev_hidden: torch.Tensor,
        *,
        decode: bool,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One MTP forward over ``reqs`` (rows at positions ``past[b] ..``) in the draft domain.

        ``shared`` = ``(pool_ids [n, topk_pools], window_start [n])`` makes the MTP indexer reuse step 0's
        selection (index_share_for_mtp_iteration) instead of scoring.
        """
        dm = self.draft_manager
        assert dm is not None
        rids = [r.request_id for r in reqs]
        # Target-domain description first; draft_replay then swaps slot table and state slots to the
        # draft manager's own (a no-op in shared mode).
        self.meta.prepare(rids, past_lens=past, q_lens=q, num_decode_seqs=len(rids) if decode else 0)
        if shared is not None:
            self.meta.shared_pool_ids, self.meta.shared_window_start = shared
        with torch.inference_mode(), draft_replay(self.meta, dm if dm is not self.manager else None):
            return self.model.mtp_forward(next_tokens, prev_hidden, self.meta, dm, self.mtp_plane)

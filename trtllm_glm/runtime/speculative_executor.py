"""`SpeculativeExecutor`: the runtime's speculative decoding loop. Draft K tokens, verify ``1 + K`` rows
in one target forward, accept the longest greedy-matching prefix plus the bonus token, and commit exactly
the accepted state.

Verify rows take the KDA record path and the `DecodeTailRing` rollback; width-one rounds decode in place; the state
owner folds the accepted rows (`RequestStateOwner.commit_verified`). Drafters come from the speculation registry
(`speculative/registry.py`) behind the `Drafter` interface. `runtime/` imports `speculative/`, never the other way
round. The round: docs/design.md §6-§7 and docs/architecture.md, "Speculative rounds".
"""

from __future__ import annotations

import torch

from ..cache.manager import Glm5NextCacheManager
from ..cache.prefix import Checkpoint
from ..errors import CapacityError, StateError
from ..models.glm5_next import Glm5NextForCausalLM
from ..speculative.adaptive import AdaptiveDraftPolicy
from ..speculative.config import MTPDecodingConfig, SpeculativeConfig
from ..speculative.context import DraftContext, DraftResources
from ..speculative.drafters import DeviceDrafts, Drafter, DraftSeq, DraftState, ParallelDrafter
from ..speculative.mtp import MTPDrafter
from ..speculative.mtp.build import shares_selection
from ..speculative.registry import speculation_entry
from ..transfer import to_device
from .cuda_graph import DeviceRows, padded_batch_size
from .executor import Executor, ExecutorConfig, _InFlight
from .request import Request
from .scheduler import ScheduledSeq

__all__ = ["SpeculativeExecutor", "SpecState"]


# The per-request speculative state lives with the drafters (below the runtime); the old name stays.
SpecState = DraftState


class SpeculativeExecutor(Executor):
    """Continuous batching with speculative decoding (MTP or a parallel drafter).

    Args:
        model: target model (with an MTP layer for `MTPDecodingConfig`).
        cfg: cache and batch sizes.
        spec: the speculative configuration (a registered decoding config: `speculation_entry`).
        seed: base sampling seed.
        drafter: a drafter overriding the configured one (tests and benchmarks pass an `OracleDrafter`).
        draft_policy: the adaptive draft-length policy (default: a fresh `AdaptiveDraftPolicy` when
            ``spec.adaptive_for``, else none; tests pass one with an injected clock).
    """

    # Under the overlap scheduler: width-one rounds (speculation off: `max_concurrency`, adaptive K = 0) launch ahead
    # like plain steps; MTP drafting rounds launch ahead from the in-flight round's outputs on the device
    # (`_round_may_launch_ahead`, `_launch_round_ahead`).
    supports_overlap = True

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        cfg: ExecutorConfig,
        spec: SpeculativeConfig,
        *,
        seed: int = 0,
        drafter: Drafter | None = None,
        draft_policy: AdaptiveDraftPolicy | None = None,
    ) -> None:
        self.spec = spec
        entry = speculation_entry(spec)  # an unregistered config fails here, before any allocation
        # The MTP drafter's history is part of the executor's prefix checkpoints and its shared plane part of the
        # target manager: those hooks below ask `use_mtp`.
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
        if drafter is None:
            ctx = DraftContext(
                model=model, meta=self.meta, manager=self.manager, sizes=cfg, graph_runner=self.graph_runner,
                padding_slot=self._padding_slot if self.graph_runner is not None else None,
            )  # fmt: skip
            res = entry.build(ctx, spec)  # the registered builder: drafter, draft manager, vocabulary, graphs
        else:
            res = DraftResources(drafter)
        self.draft_manager: Glm5NextCacheManager | None = res.draft_manager
        self.draft_vocab = res.draft_vocab
        self.mtp_plane = res.draft_plane
        self.drafter: Drafter = res.drafter
        self.state: dict[int, SpecState] = {}
        self._n_submitted = 0
        # Rounds run width one because the batch exceeded `max_concurrency`.
        self.num_unspeculated_rounds = 0
        # Host-made drafts of grammar requests dropped because the grammar refuses them (`_cut_drafts_by_grammar`).
        self.num_drafts_cut_by_grammar = 0
        # Each rank of a parallel world runs its own scheduler in lockstep (runtime/ranks.py): a choice made
        # from each rank's own clock would differ between ranks, so the world drafts a fixed K.
        # Graphs emulated on the CPU (tests) are not the GPU's costs: the default stays off there.
        real_graphs = self._use_graphs and self.device.type == "cuda"
        adaptive = spec.adaptive_for(cuda_graphs=real_graphs, parallel=model.mapping.is_parallel)
        if draft_policy is None and adaptive:
            # With CUDA graphs an MTP round drafts K tokens through one fused graph (and a round of fewer drafts
            # verifies K + 1 padded rows anyway): a length between 0 and K would run its draft chain eagerly (an H100,
            # trained small, batch 1: 4.7 ms a round against 2.0 ms for K = 3), so the policy picks 0 or K there.
            ends = isinstance(spec, MTPDecodingConfig) and cfg.cuda_graph_config is not None
            draft_policy = AdaptiveDraftPolicy(K, candidates=(0, K) if ends else None)
        if draft_policy is not None and draft_policy.max_draft_len != K:
            raise ValueError(f"draft_policy.max_draft_len={draft_policy.max_draft_len} but the config drafts {K}")
        self.draft_policy = draft_policy
        # The adaptive length decided at the last read-back for the next round that can draft (None: none yet),
        # and a length decided while a step launched ahead ran (it could not draft then: the next read-back
        # uses it).
        self._next_k: int | None = None
        self._carry_k: int | None = None
        # MTP catch-ups made on the device before a step launched ahead (`_before_chained_launch`).
        self.num_catchups_ahead = 0
        # Width-one rounds whose drafter had nothing to do: no `DraftSeq` list built (`_draft`).
        self.num_idle_draft_calls_skipped = 0
        self.num_early_drafts = 0  # drafts launched before their verify round was read back (`_early_draft`)
        # Drafting rounds (MTP draft + verify) launched before the previous round was read back
        # (`_launch_round_ahead`); a test asserts it grows, so a silent fall-back to synchronous rounds shows.
        self.num_overlapped_rounds = 0

    def _target_stores_mtp_layer(self) -> bool:
        return self.shared_mtp

    def capture_cuda_graphs(self) -> None:
        """Capture every target graph and, with MTP, every chained and catch-up draft graph now.

        With ``max_concurrency`` set, a verify step holds at most that many sequences (drafts are only made
        while the batch is that small), and so does the MTP catch-up after it: the verify graphs, the wide
        catch-ups and the fused drafts of larger padded sizes are not captured at start-up (first use would
        capture one; the rare round that reaches one is a request whose prefill ends beside a verify).
        """
        runner = self.graph_runner
        if runner is None:
            return
        mc = self.spec.max_concurrency
        W = 1 + self.max_draft_len
        verify_max = None if mc is None else padded_batch_size(mc, runner.sizes.get(W, []), True)
        runner.capture_all({W: verify_max} if verify_max is not None else None)
        chain = getattr(self.drafter, "chain_graphs", None)
        if chain is not None:
            flushes = bool(getattr(self.drafter, "catchup_lag", 0))
            chain.capture_all(None if mc is None else padded_batch_size(mc, chain.catch_sizes, True), flushes)
        # The prefill and mixed steps' piecewise graphs too. Until 2026-12-08 they were left to first use here: the
        # H100 rows of 2026-12-07 had MTP start-ups capturing in 0.5-0.9 s against 4-5 s plain, and a first
        # prefill of 233-302 ms against 14-20 ms for the same 480-token prompt.
        self._capture_piecewise()

    @property
    def share_mtp_selection(self) -> bool:
        """Whether chained MTP steps reuse step 0's pool selection (index_share_for_mtp_iteration)."""
        return self.use_mtp and shares_selection(self.spec, self.config)  # type: ignore[arg-type]

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
        st.clear()
        st.mtp_len, st.last_accepted, st.lag = 0, 0, 0
        self._free_draft(req)

    def _free_draft(self, req: Request) -> None:
        self.drafter.release(req.request_id)

    def on_unadmit(self, req: Request) -> None:
        self.on_preempt(req)

    # --------------------------------------------------------------------------------------------
    # Prefix caching: the drafter's side of checkpoints (docs/design.md §6.4)
    @property
    def separate_draft_manager(self) -> Glm5NextCacheManager | None:
        dm = self.draft_manager
        return dm if dm is not None and dm is not self.manager else None

    @property
    def state_reads_next_token(self) -> bool:
        return self.use_mtp

    def draft_history_len(self, req: Request) -> int:
        if not self.use_mtp:
            return req.num_computed
        st = self.state.get(req.request_id)
        return 0 if st is None or st.mtp_disabled else st.mtp_len

    def restore_draft(self, req: Request, ck: Checkpoint, draft_pages: list[int]) -> None:
        st = self.state[req.request_id]
        st.clear()
        st.last_accepted = 0
        if not self.use_mtp:
            return
        dm = self.separate_draft_manager
        if dm is not None:
            assert ck.draft is not None
            dm.add_request(req.request_id, ck.endpoint, shared_pages=draft_pages)
            try:
                dm.state.restore(dm.get_state_slot(req.request_id), ck.draft, endpoint=ck.endpoint)
                if ck.draft_partial is not None:
                    dm.copy_page_in(dm.get_batch_slot_tables([req.request_id])[0][len(draft_pages)], ck.draft_partial)
            except BaseException:
                dm.free_request(req.request_id)
                raise
        # The MTP history (its rows in the shared / copied pages, ring and last hidden in the slot) is at E.
        st.mtp_len, st.mtp_disabled, st.lag = ck.endpoint, False, 0

    def checkpoint_draft(self, req: Request, ck: Checkpoint) -> None:
        dm = self.separate_draft_manager
        if dm is None or not self.use_mtp:
            return
        E, P = ck.endpoint, dm.tokens_per_block
        ck.draft = dm.state.snapshot(dm.get_state_slot(req.request_id), E)
        if E % P:
            ck.draft_partial = dm.copy_page_out(dm.get_batch_slot_tables([req.request_id])[0][E // P])

    def seal_draft_page(self, req: Request, logical_page: int, key: bytes) -> None:
        dm = self.separate_draft_manager
        if (
            dm is not None
            and self.use_mtp
            and dm.has_request(req.request_id)
            and logical_page < len(dm.get_batch_slot_tables([req.request_id])[0])
        ):
            dm.seal_page(req.request_id, logical_page, key)

    def _finish(self, req: Request) -> None:
        super()._finish(req)
        self._free_draft(req)
        self.state.pop(req.request_id, None)

    def on_abort(self, req: Request) -> None:
        self._free_draft(req)
        self.state.pop(req.request_id, None)

    # --------------------------------------------------------------------------------------------
    def _decode_widths(self) -> dict[int, int]:
        return {r.request_id: 1 + len(self.state[r.request_id].drafts) for r in self.running if r.is_decode}

    def _rows_for(self, s: ScheduledSeq) -> list[int]:
        rows = super()._rows_for(s)
        if s.is_decode and s.num_rows > 1:
            drafts = self.state[s.request.request_id].resolve()
            assert len(drafts) == s.num_rows - 1
            rows = rows + drafts
        return rows

    def _graph_inputs(self, plan: list[ScheduledSeq]) -> tuple[list[int], DeviceRows | None]:
        # Drafts still on the device (a deferred fused MTP draft) stay there: placeholders in the host ids,
        # the values copied into the input rows on the stream. Nothing waits for the draft to finish.
        ids: list[int] = []
        src = None
        seqs: list[int] = []
        rows: list[int] = []
        for b, s in enumerate(plan):
            st = self.state[s.request.request_id]
            pend = st.pending if s.is_decode and s.num_rows > 1 else None
            if pend is not None and (src is None or pend[0] is src) and len(st.drafts) == s.num_rows - 1:
                src = pend[0]
                seqs.append(b)
                rows.append(pend[1])
                ids.extend(super()._rows_for(s))
                ids.extend(st.drafts)  # PENDING_DRAFT placeholders, overwritten on the device
            else:
                ids.extend(self._rows_for(s))
        return ids, (DeviceRows(src.tensor, seqs, rows) if src is not None else None)

    # Drafts left on the device (`DraftState.pending`) are read on the host with the results of the verify step that
    # took them (`_advance`, `_step_overlapped`: `_resolve_drafts(ready=True)`): their copy was queued before that
    # step, so the results' wait covers it and the round waits for the device once. The drafter's next call may
    # reuse its output buffers then: the verify took the drafts on the device, and consecutive drafts land in
    # alternate host buffers (`MTPDrafter._device_drafts`).
    def _resolve_drafts(self, ready: bool = False) -> None:
        """Read every pending draft on the host (``ready``: the host waited already for a step queued after their
        copy, `DeviceDrafts.rows`)."""
        for st in self.state.values():
            if st.pending is not None:
                st.resolve(ready)

    def _graph_widths(self) -> tuple[int, ...]:
        # Width-one rounds and full verify rounds (short rounds are padded to full width: `_pad_drafts`).
        return (1, 1 + self.spec.max_draft_len)

    def _proposed(self, plan: list[ScheduledSeq]) -> list[int]:
        out = []
        for s in plan:
            st = self.state[s.request.request_id]
            out.append(len(st.drafts) if st.num_proposed is None else st.num_proposed)
        return out

    def _graph_step_allowed(self, plan: list[ScheduledSeq]) -> bool:
        # A verify graph accepts drafts against the unmasked argmax on the device: a grammar request with real
        # drafts needs its masks first, so that step runs eagerly (filler-only rows accept nothing either way).
        return not any(s.request.has_grammar and k > 0 for s, k in zip(plan, self._proposed(plan)))

    def _before_forward(self, plan: list[ScheduledSeq]) -> None:
        self.meta.spec.verify_seqs = [i for i, s in enumerate(plan) if s.is_decode and s.num_rows > 1]
        # A persistent buffer (a captured verify graph reads its address), padding entries 0.
        self.meta.set_num_accepted([self.state[s.request.request_id].last_accepted for s in plan])

    @property
    def chains_eager_steps(self) -> bool:
        # An admission's first tokens start the MTP history and drafts on the host (`_advance`): read back first.
        return False

    def _may_launch_ahead(self, plan: list[ScheduledSeq], admitting: bool = False, partial: bool = False) -> bool:
        """The overlap scheduler's test, for the rounds where speculation is off: the batch exceeds
        ``max_concurrency``, or the adaptive policy's last choice was K = 0. Width-one rounds with no drafts
        pending, of a drafter that needs no model state or of the MTP drafter with CUDA graphs, whose catch-up
        on the in-flight step is launched on the device before the next step (`_before_chained_launch`).

        The step launched ahead reuses the in-flight step's accepted counts (`_before_forward` reads them
        before that step is read back). They only cross-check a tail-ring rollback, and a width-one step
        after a width-one step rolls nothing back, so a stale count there is never read.

        A verify round (drafts) may be left in flight too: `_round_may_launch_ahead` decides.
        """
        if any(s.is_decode and s.num_rows > 1 for s in plan):
            return self._round_may_launch_ahead(plan)
        mc = self.spec.max_concurrency
        above = mc is not None and len(self.running) > mc
        idle = self.draft_policy is not None and self._next_k == 0 and self._carry_k is None
        if not (above or idle):
            return False
        mtp = getattr(self.drafter, "chain_graphs", None) is not None and hasattr(self.drafter, "catch_up_ahead")
        if not (isinstance(self.drafter, ParallelDrafter) or mtp):
            return False
        if any(s.request.request_id not in self.state or self.state[s.request.request_id].drafts for s in plan):
            return False
        # A grammar request's token is chosen one step late (`_choose_under_grammar`); the MTP catch-up launched
        # with the next step reads the tokens at launch: such batches stay synchronous here.
        if any(s.request.has_grammar for s in plan):
            return False
        return super()._may_launch_ahead(plan, admitting, partial)

    def _before_chained_launch(self, cur) -> None:  # noqa: ANN001 - executor._InFlight
        """The MTP catch-up on the in-flight step's rows, on the device, before the next step overwrites them."""
        catch = getattr(self.drafter, "catch_up_ahead", None)
        if catch is None:
            return
        seqs = []
        for s in cur.plan:
            st = self.state.get(s.request.request_id)
            if st is None:  # (every request of a plan has a state; keep the rows aligned regardless)
                st = DraftState(mtp_disabled=True)
            seqs.append((s.request.request_id, st, s.start, s.request.params.greedy, s.request.tokens))
        with torch.inference_mode():
            catch(seqs, cur.out.packed[:, 0], cur.out.hidden)
        self.num_catchups_ahead += 1
        self._after_lag_flush(drafting=False, ahead=True)

    # --------------------------------------------------------------------------------------------
    # MTP drafting rounds under the overlap scheduler (docs/speculation.md)
    @property
    def drafts_ahead_supported(self) -> bool:
        """Whether drafting rounds can be launched ahead at all: asked for (``MTPDecodingConfig.overlap_rounds``),
        the overlap scheduler, and the MTP drafter with a fused draft graph whose drafts stay on the device
        (`MtpChainGraphs`, K >= 2)."""
        # The MTP drafter itself (a wrapper such as the benchmark's oracle proposes host-made drafts).
        chain = self.drafter.chain_graphs if isinstance(self.drafter, MTPDrafter) else None
        return (
            self.cfg.overlap_scheduler
            and bool(getattr(self.spec, "overlap_rounds", False))
            and self.use_mtp
            and chain is not None
            and chain.fused
            and getattr(self.drafter, "defer", False)
        )

    def _round_may_launch_ahead(self, plan: list[ScheduledSeq]) -> bool:
        """Whether the drafting round after the verify round ``plan`` may be launched before ``plan`` is read back.

        The one place that decides it (a new reason to stay synchronous is one more condition here). It must be
        the same requests again, each verifying ``K`` real drafts: no request can end by length inside this round
        or the next (``num_output + 2 (K + 1) < max_tokens``, the same for the context), nobody waits who could
        be admitted, no request samples, reads logits or has its drafts capped (``draft_len_fn``), speculation is
        on for the batch (``max_concurrency``), no request has a grammar, and the adaptive policy's last choice is
        ``K``. A stop token is not
        known ahead: a request that stops inside a round has the round after it computed and dropped.
        Preemption never happens here: a round that cannot get its pages is not launched ahead
        (`_launch_round_ahead`) and the next synchronous step plans (and preempts) as usual.
        """
        if not self.drafts_ahead_supported:
            return False
        K = self.max_draft_len
        if self.spec.draft_len_fn is not None:
            return False
        mc = self.spec.max_concurrency
        if mc is not None and len(self.running) > mc:
            return False
        if self.draft_policy is not None and (self._next_k != K or self._carry_k is not None):
            return False
        # As plain overlap: requests waiting while the batch is full could not be admitted anyway.
        if self.admission_pending():
            return False
        return self._steady_verify_round(plan)

    def _steady_verify_round(self, plan: list[ScheduledSeq]) -> bool:
        """Whether the round after the verify round ``plan`` can be drafted from ``plan``'s outputs on the device:
        the same requests again, each verifying ``K`` real drafts from an MTP history at its start, greedy, reading
        no logits, with no grammar, and none within two rounds of its length limits."""
        K = self.max_draft_len
        W = 1 + K
        if len(plan) != len(self.running) or any(not s.is_decode or s.num_rows != W for s in plan):
            return False
        for s in plan:
            r, p = s.request, s.request.params
            st = self.state.get(r.request_id)
            if r.finished or st is None or st.mtp_disabled or st.mtp_len != s.start:
                return False
            # A grammar request's verify rows are masked on the host from its drafts (`_masked_choice`): never ahead.
            if not p.greedy or r.wants_logits or r.has_grammar:
                return False
            if (len(st.drafts) if st.num_proposed is None else st.num_proposed) != K:
                return False  # filler: a short round (its budget, a short proposal) runs synchronously
            if r.num_output + 2 * W >= p.max_tokens or len(r.tokens) + 2 * W >= self.max_seq_len:
                return False
        return True

    def _reserve_next_round(self, reqs: list[Request], starts: list[int], target_rows: int) -> bool:
        """Pages for the next round drafted (and verified) from the device: ``start + target_rows`` target positions
        and the draft's ``start + W + K - 1`` MTP positions per request; False when they cannot be had now."""
        K = self.max_draft_len
        W = 1 + K
        try:
            for r, p0 in zip(reqs, starts):
                self.manager.ensure_capacity(r.request_id, p0 + target_rows)
        except CapacityError:
            return False
        drafter = self.drafter
        assert isinstance(drafter, MTPDrafter)
        return all(drafter.reserve_ahead(r.request_id, p0 + W + K - 1) for r, p0 in zip(reqs, starts))

    def _step_overlapped(self) -> list[Request]:
        """Read the in-flight step back, launching the next one first when it may (a width-one step: the base
        class; a verify round: `_launch_round_ahead`)."""
        cur = self._inflight
        assert cur is not None
        if cur.out.width == 1:
            return super()._step_overlapped()
        ahead = self._launch_round_ahead(cur) if self._round_may_launch_ahead(cur.plan) else None
        self._inflight = ahead[0] if ahead is not None else None
        cur.out._host = cur.results.wait()
        # The in-flight round's drafts: their copy preceded the round (the draft launched now lands in the other
        # host buffer).
        self._resolve_drafts(ready=True)
        self._step_out = cur.out
        finished = self._advance(cur.plan, cur.out.hidden, slots=cur.slots, drafted=ahead[1] if ahead else None)
        self._after_step(cur.plan)
        return finished

    def _launch_round_ahead(self, cur: _InFlight) -> tuple[_InFlight, DeviceDrafts] | None:
        """Launch round ``n + 1`` (its MTP draft and verify) from in-flight round ``n``'s outputs on the device.

        Pages are reserved for the worst case first (round ``n`` accepts everything: ``start + 2 W`` target
        positions, ``start + W + K - 1`` MTP positions); without them, or without the graphs, nothing is launched
        and None returned (the next round runs synchronously). The draft reads round ``n``'s hidden rows and
        argmax before the verify replays over the same buffers (stream order).

        Returns:
            The new in-flight round and its drafts (booked when round ``n`` is read back), or None.
        """
        K = self.max_draft_len
        W = 1 + K
        runner, drafter = self.graph_runner, self.drafter
        assert runner is not None and isinstance(drafter, MTPDrafter)
        reqs = [s.request for s in cur.plan]
        starts = [s.start for s in cur.plan]
        if not self._reserve_next_round(reqs, starts, 2 * W):
            return None
        key = runner.key([W] * len(reqs))
        if key is None:
            return None
        rids = [r.request_id for r in reqs]
        out = cur.out
        with torch.inference_mode():
            # Float64 ids and counts, cast as the draft copies them into its own buffers.
            acc = out.packed.view(len(reqs), W, -1)[:, 0, 2]
            drafts = drafter.draft_ahead(rids, starts, out.packed[:, 0], out.hidden, acc)
            if drafts is None:
                return None
            # Round n + 1 is described at round n's start on the host; the device adds round n's accepted counts.
            plan = [ScheduledSeq(r, W, True) for r in reqs]
            nxt = runner.replay_verify_ahead(key, plan, out, drafts.tensor, [p0 + W for p0 in starts])
        self.num_steps += 1
        self.num_overlapped_rounds += 1
        self._launched = (plan, True, True)
        return _InFlight(plan, list(self.meta.state_slots), nxt, runner.results_to_host(nxt)), drafts

    def _advance(
        self,
        plan: list[ScheduledSeq],
        hidden: torch.Tensor,
        slots: list[int] | None = None,
        drafted: DeviceDrafts | None = None,
    ) -> list[Request]:
        """Commit a step or round (accept, emit, fold), retire finished requests, then draft the next round.

        ``slots``: the step's state slots when it is read back late (the overlap scheduler; default the
        metadata's). ``drafted``: the next round was launched ahead already (`_launch_round_ahead`): its drafts,
        made on the device from this round's outputs, are only booked (`MTPDrafter.book_ahead`), not made again.
        A request that finished before its round was read back (stopped by the round before, or aborted) has its
        rows dropped.
        """
        if drafted is None and slots is None and getattr(self.spec, "early_draft", False):
            # Before anything here reads the round back. The draft re-describes the batch in the shared metadata:
            # the commit below then takes the verify round's slots from here, as a round read back late does.
            verified = list(self.meta.state_slots)
            drafted = self._early_draft(plan)
            if drafted is not None:
                slots = verified
        out = self._step_out
        if slots is not None and (out is None or out.width == 1):
            # A width-one step read back late (the overlap scheduler, `_may_launch_ahead`): the plain commit,
            # sampling and retirement, then this round's drafting decision as after any step.
            finished = super()._advance(plan, hidden, slots=slots)
            for s in plan:
                st = self.state.get(s.request.request_id)
                if st is not None:
                    st.clear()
                    st.last_accepted = 0
            live = [(i, s) for i, s in enumerate(plan) if not s.request.finished]
            self._draft(live, plan, [s.num_rows for s in plan], hidden)
            return finished
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
        # Sampled requests (never drafted for; verify filler only): row 0 of each, drawn together in plan
        # order (the order the requests' own generators are consumed in), one read-back for all. After a
        # replay the draws are queued before the host waits for the step's results, so the GPU runs them
        # right behind the graph instead of after the host has read it back.
        drawn = [(i, spans[i][0]) for i, s in enumerate(plan) if spans[i][1] and not s.request.params.greedy]
        # Grammar requests: every needed row masked with the matcher's state after the drafts before it.
        constrained = [i for i, s in enumerate(plan) if spans[i][1] and s.request.has_grammar]
        early = (
            self._draw_sampled(plan, drawn, self._step_out.logits, [need[off] for _, off in drawn])
            if (drawn and self._step_out is not None and not constrained)
            else None
        )
        if need:
            logits, packed = self._sample_rows(hidden, need)
            # The round's results are on the host: so are the drafts it verified (their copy came before it).
            self._resolve_drafts(ready=True)
            greedy = [int(p[0]) for p in packed]
            gaps = [p[1] for p in packed]
            choose = logits
            if constrained:
                items = []
                for i in constrained:
                    st, (off, cnt) = self.state[plan[i].request.request_id], spans[i]
                    k = 0
                    if cnt > 1:  # verify rows: the real drafts (filler is never accepted)
                        k = len(st.resolve()) if st.num_proposed is None else st.num_proposed
                    items.append((plan[i].request, off, st.resolve()[:k] if k else []))
                idx, packed_c, masked = self._masked_choice(logits, items, need_logits=bool(drawn))
                choose = logits if masked is None else masked
                for j, (t, gp, _) in zip(idx.tolist(), packed_c.tolist()):
                    greedy[j], gaps[j] = int(t), gp
            if drawn:
                toks = early
                if toks is None:
                    toks = self._draw_sampled(plan, drawn, choose, [off for _, off in drawn])
                for (_, off), t in zip(drawn, toks.tolist()):
                    greedy[off] = t

        num_accepted = [0] * len(plan)
        committed = [0] * len(plan)
        finished: list[Request] = []
        dead = [s.request.finished for s in plan]
        for i, s in enumerate(plan):
            r = s.request
            if dead[i]:
                continue  # its slot is freed; the device's fold went to a slot nobody reads
            st = self.state[r.request_id]
            off, cnt = spans[i]
            if s.is_decode and s.num_rows > 1:
                drafts = st.resolve()
                # Filler drafts (`_pad_drafts`) are verified but never accepted: they may run past the
                # request's budget and the draft cache's capacity.
                proposed = len(drafts) if st.num_proposed is None else st.num_proposed
                a = 1
                while a <= proposed and drafts[a - 1] == greedy[off + a - 1]:
                    a += 1
                assert proposed == 0 or r.params.greedy  # a sampled request's row 0 holds its draw
                emitted = drafts[: a - 1] + [greedy[off + a - 1]]
                num_accepted[i] = committed[i] = a
                if proposed:  # all filler: a width-one round as far as the statistics go
                    r.num_verify_rounds += 1
                    r.num_accepted_total += a
                    if self.draft_policy is not None:
                        self.draft_policy.observe_acceptance(proposed, a - 1)
                for j in range(proposed):
                    if j >= len(r.proposed_per_position):
                        r.proposed_per_position.append(0)
                        r.accepted_per_position.append(0)
                    r.proposed_per_position[j] += 1
                    r.accepted_per_position[j] += int(j < a - 1)
                st.last_accepted = a
                r.num_computed += a
                lg = logits[off : off + a] if r.wants_logits else None  # type: ignore[index]
                if self._emit(r, emitted, gaps[off : off + a], lg):  # type: ignore[index]
                    finished.append(r)
            else:
                committed[i] = s.num_rows
                num_accepted[i] = s.num_rows
                r.num_computed += s.num_rows
                st.last_accepted = 0
                if cnt:
                    tok = greedy[off]  # the draw of a sampled request
                    lg = logits[off : off + 1] if r.wants_logits else None  # type: ignore[index]
                    if self._emit(r, [tok], gaps[off : off + 1], lg):  # type: ignore[index]
                        finished.append(r)
            st.clear()
        if out is not None and out.committed_on_device:
            dev = [a for a, d in zip(out.accepted_counts(), dead) if not d]
            if dev != [a for a, d in zip(num_accepted, dead) if not d]:
                # The graph already folded the KDA records with its own counts: any difference is corrupted state.
                raise StateError(
                    f"the verify graph accepted {out.accepted_counts()} rows but the host {num_accepted}; "
                    "the KDA state no longer matches the output"
                )
        # Folds the verified KDA records (if any; a verify graph folded them already) and advances every
        # slot's committed length.
        if slots is None:
            self.model.commit_kda(self.meta, self.manager, num_accepted)
        else:
            self.manager.state.commit_verified(slots, num_accepted)
        for r in finished:
            self._finish(r)
        live = [(i, s) for i, s in enumerate(plan) if not s.request.finished]
        if drafted is None:
            self._draft(live, plan, committed, hidden)
        else:
            self._book_round_ahead(live, plan, committed, drafted)
        return finished

    def _early_draft(self, plan: list[ScheduledSeq]) -> DeviceDrafts | None:
        """``MTPDecodingConfig.early_draft``: the next round's fused MTP draft, launched from the verify round
        ``plan``'s outputs on the device before the host reads the round back (`MTPDrafter.draft_ahead`); `_advance`
        then books it (`_book_round_ahead`) instead of drafting. None (nothing launched) unless every sequence of a
        steady batch verified ``K`` real drafts and drafts ``K`` again: the conditions of a round launched ahead
        (`_round_may_launch_ahead`) other than the overlap scheduler (with the adaptive policy: its last choice was
        ``K``; a choice made at this round's read-back applies from the round after, `_book_round_ahead`)."""
        K = self.max_draft_len
        W = K + 1
        out, drafter = self._step_out, self.drafter
        if not getattr(self.spec, "early_draft", False) or out is None or out.width != W:
            return None
        chain = drafter.chain_graphs if isinstance(drafter, MTPDrafter) else None
        if chain is None or not chain.fused or not getattr(drafter, "defer", False) or not self.use_mtp:
            return None
        if self.spec.draft_len_fn is not None:
            return None
        if self.draft_policy is not None and (self._next_k != K or self._carry_k is not None):
            return None
        mc = self.spec.max_concurrency
        # A request the next step could admit keeps the round synchronous; one queued behind a full batch or held
        # (`ExecutorConfig.batch_wait_timeout_iters`) does not: a finish seen at this read-back that frees a slot is
        # admitted beside the booked drafts, as under batch waiting.
        waits = self.admission_pending()
        if (mc is not None and len(self.running) > mc) or waits or not self._steady_verify_round(plan):
            return None
        reqs = [s.request for s in plan]
        starts = [s.start for s in plan]
        # Pages for the draft's rows (its catch-up and chained steps reach start + W + K - 1), or no early draft.
        if not self._reserve_next_round(reqs, starts, W + K - 1):
            return None
        # The verify's read-back is queued before the draft: the host books the round as soon as the verify is done,
        # while the GPU runs the draft (else it would wait for both).
        assert self.graph_runner is not None
        out.start_host_copy(self.graph_runner)
        with torch.inference_mode():
            # Float64 ids and counts, cast as the draft copies them into its own buffers.
            acc = out.packed.view(len(reqs), W, -1)[:, 0, 2]
            drafts = drafter.draft_ahead([r.request_id for r in reqs], starts, out.packed[:, 0], out.hidden, acc)
        if drafts is not None:
            self.num_early_drafts += 1
        return drafts

    def _book_round_ahead(
        self,
        live: list[tuple[int, ScheduledSeq]],
        plan: list[ScheduledSeq],
        committed: list[int],
        drafted: DeviceDrafts,
    ) -> None:
        """After a round read back with the next one launched ahead: book its MTP catch-up and drafts, and stamp the
        adaptive policy (the interval since the last stamp was one round of ``K`` drafts)."""
        assert isinstance(self.drafter, MTPDrafter)
        seqs = [
            DraftSeq(request_id=s.request.request_id, state=self.state[s.request.request_id], tokens=s.request.tokens,
                     num_output=s.request.num_output, num_computed=s.request.num_computed, committed=committed[i],
                     row_offset=i, greedy=True, live=True, want=self.max_draft_len)
            for i, s in live
        ]  # fmt: skip
        self.drafter.book_ahead(seqs, drafted, [i for i, _ in live])
        pol = self.draft_policy
        if pol is not None and not live:
            pol.reset_interval()  # nobody left: no round to choose or measure (as `_policy_draft_len`)
        elif pol is not None:
            steady = pol.open_batch_size == len(plan)
            K = self.max_draft_len
            # The round launched ahead drafts K whatever is chosen now; a different choice waits for the next
            # read-back (and stops launching ahead until then).
            k = pol.begin_round(steady, len(live), running=K)
            self._next_k = k
            self._carry_k = k if k != K else None

    def _draw_sampled(
        self, plan: list[ScheduledSeq], drawn: list[tuple[int, int]], logits: torch.Tensor, rows: list[int]
    ) -> torch.Tensor:
        """Tokens of the sampled sequences ``plan[i]`` (``i`` from ``drawn``) from ``logits[rows]``, on the device."""
        with torch.inference_mode():
            return self.sampler.sample(
                logits.index_select(0, to_device(rows, logits.device)),
                [plan[i].request.params for i, _ in drawn],
                [plan[i].request.generator for i, _ in drawn],
            )

    # --------------------------------------------------------------------------------------------
    # Drafting for the next round
    def _draft_len(self, r: Request, cap: int | None = None) -> int:
        """Drafts to propose for ``r``'s next round (0 = a width-one round), at most ``cap`` (the adaptive
        policy's round length; None: ``max_draft_len``)."""
        if not r.params.greedy or not r.is_decode:
            return 0
        k = self.max_draft_len if cap is None else cap
        if k <= 0:
            return 0
        if self.spec.draft_len_fn is not None:
            k = max(0, min(k, int(self.spec.draft_len_fn(r))))
        # The bonus token is always emitted: never verify past the request's budget or the context.
        k = min(k, r.params.max_tokens - r.num_output - 1, self.max_seq_len - len(r.tokens) - 1)
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
        mc = self.spec.max_concurrency
        if mc is not None and len(self.running) > mc:
            # Too many requests for speculation to pay: a width-one round (drafters still see every sequence,
            # so the MTP layer keeps catching up and can draft again once the batch shrinks).
            want = {s.request.request_id: 0 for _, s in live}
            self.num_unspeculated_rounds += 1
            if self.draft_policy is not None:
                self.draft_policy.reset_interval()
        else:
            cap = self._policy_draft_len(live, plan)
            want = {s.request.request_id: self._draft_len(s.request, cap) for _, s in live}
        if not any(want.values()):
            # A width-one round after a step whose rows the drafter took already (the usual step launched ahead):
            # no `DraftSeq` per request when the drafter would do nothing with them.
            greedy = [s.request for _, s in live if s.request.params.greedy]
            if not self.drafter.needs_idle_call([self.state[r.request_id] for r in greedy],
                                                [r.num_computed for r in greedy]):  # fmt: skip
                self._resolve_drafts()
                self._after_lag_flush(drafting=False)
                self.num_idle_draft_calls_skipped += 1
                return
        # Drafts still pending here (a step that verified nothing read no results: rare) are read now, before the
        # drafter's call reuses the buffers they lie in.
        self._resolve_drafts()
        seqs, row = [], 0
        for i, s in enumerate(plan):
            r = s.request
            seqs.append(
                DraftSeq(
                    request_id=r.request_id,
                    # A request that finished this step has no state left; drafters skip it.
                    state=self.state.get(r.request_id) or DraftState(),
                    tokens=r.tokens,
                    num_output=r.num_output,
                    num_computed=r.num_computed,
                    committed=committed[i],
                    row_offset=row,
                    greedy=r.params.greedy,
                    live=not r.finished,
                    want=want.get(r.request_id, 0),
                )
            )
            row += s.num_rows
        self.drafter.draft(seqs, hidden)
        self._after_lag_flush(drafting=any(want.values()))
        if isinstance(self.drafter, ParallelDrafter):
            self._cut_drafts_by_grammar(plan, seqs)
        # With graphs, a round where anybody verifies drafts pads every live decode request to the full
        # width (sampled requests and greedy ones without drafts included: filler only, never accepted), so
        # that one of them does not send the batch's step down the eager path. A round where nobody drafts
        # stays width one.
        if self.graph_runner is not None and any(s.live and s.state.drafts for s in seqs):
            _pad_drafts(seqs, {s.request.request_id: self._padded_len(s.request, want[s.request.request_id])
                               for _, s in live})  # fmt: skip

    def _after_lag_flush(self, drafting: bool, ahead: bool = False) -> None:
        """Keep an MTP catch-up of held rows (`MTPDrafter`'s lag, a one-off forward over many rows) out of the
        adaptive policy's per-round costs: the round it delays (``ahead``: launched before a step in flight, it
        delays the one after) is no sample of its length but the catch-up's cost, charged to the K = 0 rounds that
        held the rows (`AdaptiveDraftPolicy.note_flush`); a round that drafts after it keeps its length one more
        round, which is measured."""
        took = getattr(self.drafter, "take_flushed", None)
        pol = self.draft_policy
        if took is None or not took() or pol is None:
            return
        pol.note_flush(ahead)
        if drafting and self._inflight is None and self._next_k:
            self._carry_k = self._next_k

    def _cut_drafts_by_grammar(self, plan: list[ScheduledSeq], seqs: list[DraftSeq]) -> None:
        """A grammar request's host-made drafts (n-gram: no model state behind them) cut before the first token
        its grammar refuses: such a draft and every one after it can never be accepted (its verify row's mask
        excludes it), so proposing it only lowers the acceptance rate. The output is unchanged (drafts never
        change it). MTP drafts are made on the device from the unmasked draft head and are not cut: see
        docs/speculation.md, "Speculation under a grammar"."""
        for s, seq in zip(plan, seqs):
            g = s.request.grammar
            st = seq.state
            if g is None or not seq.live or st.pending is not None or not st.drafts:
                continue
            n = g.valid_prefix(st.drafts)
            if n < len(st.drafts):
                self.num_drafts_cut_by_grammar += len(st.drafts) - n
                st.drafts = st.drafts[:n]

    def _policy_draft_len(self, live: list[tuple[int, ScheduledSeq]], plan: list[ScheduledSeq]) -> int | None:
        """The adaptive policy's draft length for the next round (None without a policy).

        Called once per round right after the step's results were read back (the host already waited for
        the device there), it stamps the policy's clock: the interval since the previous stamp is one round
        (its drafting, its verify step, the host's work) of the length chosen then, a cost sample when that
        step was a steady decode step of the same batch.
        """
        pol = self.draft_policy
        if pol is None:
            return None
        decode = [s.request for _, s in live if s.request.is_decode]
        if not any(r.params.greedy for r in decode):  # nothing can speculate: no round to choose or measure
            pol.reset_interval()
            return 0
        # The whole decode batch sets the cost (sampled requests ride the verify rows as filler).
        b = len(decode)
        steady = all(s.is_decode for s in plan) and pol.open_batch_size == len(plan)
        if self._inflight is not None:
            # A step launched ahead is running: the round after this one is width one whatever is chosen (drafts
            # made now would be a token stale); a length chosen now is carried to the next read-back.
            k = pol.begin_round(steady, b, running=0)
            self._next_k = k
            self._carry_k = k if k > 0 else None
            return 0
        k = pol.begin_round(steady, b, k=self._carry_k)
        self._next_k, self._carry_k = k, None
        return k

    def _padded_len(self, r: Request, k: int) -> int:
        """Draft slots of ``r``'s next round when CUDA graphs replay full-width verify steps.

        A round cut short by the request's budget (its last few tokens) or by a short proposal, and a
        sampled request (never drafted for), would make the step's widths differ, and one such request sends
        the whole batch's step down the eager path. Such rounds are padded to the full width where the
        context and the cache allow it.
        """
        K = self.max_draft_len
        if k >= K or not r.is_decode:
            return k
        kp = min(K, self.max_seq_len - len(r.tokens) - 1)
        if kp <= k:
            return k
        try:  # the filler rows need pages like any verify row; without them the round stays short
            self.manager.ensure_capacity(r.request_id, len(r.tokens) + kp)
        except CapacityError:
            return k
        return kp


def _pad_drafts(seqs: list[DraftSeq], width: dict[int, int]) -> None:
    """Fill each live request's drafts up to ``width[request_id]`` slots (graphs replay uniform widths).

    Filler (the last draft, or the last token, repeated) is verified like any draft but never accepted
    (`DraftState.num_proposed` marks where it starts), so the output, the acceptance statistics and every
    cache length are those of the unpadded round; the filler rows only cost compute.
    """
    for s in seqs:
        if not s.live:
            continue
        n = width.get(s.request_id, 0)
        d = s.state.drafts
        s.state.num_proposed = len(d)
        if len(d) < n:
            d = s.state.resolve()  # the filler repeats the last value
            fill = d[-1] if d else s.tokens[-1]
            s.state.drafts = list(d) + [fill] * (n - len(d))

"""CUDA graphs of the MTP drafter: its catch-up step, its chained steps, and the whole draft fused in one.

See `MtpChainGraphs`. The target's decode / verify graphs, the padding rules and `CudaGraphConfig` live in
`runtime/cuda_graph.py`; these graphs share that runner's metadata, memory pool, padding and statistics through
`TargetGraphRunner`, so that this package never imports the runtime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import envs
from ...attention.graph_check import GraphAddressGuard
from ...graph_capture import capture_graph, capture_session
from ...transfer import to_device
from ..context import TargetGraphRunner
from .staging import StageBuffers, stage_draft_ahead

logger = logging.getLogger(__name__)

__all__ = ["MtpChainGraphs", "defer_drafts_default", "fused_draft_default"]


# Graph kinds (a key is ``(kind, P, W)``).
CHAIN, CATCHUP, DRAFT = "chain", "catchup", "draft"
# The catch-up of a round in which nobody drafts: the MTP forward alone, no LM head.
CATCHUP_ONLY = "catchup_only"
GraphKey = tuple[str, int, int]


@dataclass
class _DraftGraph:
    graph: Any
    outputs: tuple[torch.Tensor, ...]
    guard: GraphAddressGuard


def fused_draft_default() -> bool:
    """Whether the whole MTP draft runs as one graph where it can (`MtpChainGraphs`, ``fused``);
    ``TRTLLM_GLM_MTP_FUSED_DRAFT=0`` turns it off (the per-step graphs then serve every round)."""
    return envs.MTP_FUSED_DRAFT.get()


def defer_drafts_default() -> bool:
    """Whether a fused draft's tokens stay on the device for the next verify (`DeviceDrafts`);
    ``TRTLLM_GLM_MTP_DEFER_DRAFTS=0`` reads them back right after the draft instead."""
    return envs.MTP_DEFER_DRAFTS.get()


class MtpChainGraphs:
    """CUDA graphs of the MTP drafter, per padded size ``P`` (and width ``W``): three kinds.

    * Chained step (``CHAIN``): maps each sequence's previous draft token and hidden to the next hidden and
      its greedy draft: ``mtp_forward`` + LM head + argmax, all inside the graph. Inputs live in persistent
      buffers refreshed before each replay: tokens ``[P]``, hidden ``[P, D]`` and, with selection sharing,
      step 0's pool ids ``[P, topk_pools]`` and window starts ``[P]``.
    * Catch-up (``CATCHUP``, needs ``max_draft_len``): each sequence's ``1 .. K + 1`` newly committed rows,
      run as prefill rows, per width ``W = max(committed)`` (a round that accepted little catches up on
      fewer rows); a sequence's rows past its committed count are padding rows (``row_seq = -1``,
      `AttentionMetadata.prepare`'s ``valid_q_lens``).
    * Catch-up only (``CATCHUP_ONLY``): the catch-up's MTP forward without the LM head and argmax, for rounds
      in which nobody drafts (an adaptive draft length of 0, ``max_concurrency``): the MTP cache follows every
      committed token, but a draft step's largest cost, the LM head, is skipped.
    * Fused draft (``DRAFT``, ``K >= 2``): the catch-up and then the ``K - 1`` chained steps in one graph,
      drafts ``[P, K]`` out. Between the steps the graph itself rewrites the batch description on the
      device (`AttentionMetadata.set_decode_rows`: one decode row per sequence at committed length
      ``+ c - 1``), takes each sequence's last committed row by its valid-row count, and backs up / restores
      the MTP plane's tail ring of the chained rows (`RequestStateOwner.speculative_rows`); so a round is
      one metadata preparation, one launch and one read-back where the per-step graphs need ``K`` of each
      (the host work of a step, not the GPU's, bounded the MTP round at batch 1). It serves the rounds in
      which every caught-up sequence wants ``K`` drafts (the chained rows then have their pages); other
      rounds take the per-step graphs.

    Padding follows the target graphs (`CudaGraphRunner`): ``row_seq = -1`` rows, the target's padding state
    slot, nothing written. The draft domain (a separate draft manager's slot table and state slots) is bound
    around both capture and replay by `draft_replay`, whose pre-replay call fills the persistent draft
    buffers; the address guard accepts exactly those declared swaps. A draft is only a proposal the target
    verifies, so even a wrong draft cannot change the output, only the acceptance.

    Args:
        runner: the target graphs' runner (its metadata, config, memory pool and stats).
        model: the target model (its MTP layer and LM head).
        draft_manager: the manager holding the MTP plane (the target manager in shared mode).
        mtp_plane: the MTP plane's index in ``draft_manager``.
        separate: whether ``draft_manager`` is a separate manager (bind the draft domain).
        share_selection: chained steps reuse step 0's selection (index_share_for_mtp_iteration).
        padding_slot: the target manager's padding state slot.
        replay_scope: ``replay_scope(meta, draft_manager)`` context binding the draft domain (`draft_replay`).
        max_draft_len: ``K``; 0 captures the chained steps only.
        fused: capture and use the fused draft (default `fused_draft_default`).
        draft_vocab: the restricted draft vocabulary (`speculative.draft_vocab.DraftVocab`, its ``[N, D]`` head
            rows allocated once, before any capture); None: the full LM head.
    """

    def __init__(
        self,
        runner: TargetGraphRunner,
        model: Any,
        draft_manager: Any,
        mtp_plane: int,
        *,
        separate: bool,
        share_selection: bool,
        padding_slot: int,
        replay_scope: Callable[..., Any],
        max_draft_len: int = 0,
        fused: bool | None = None,
        draft_vocab: Any = None,
    ) -> None:
        self.runner = runner
        self.draft_vocab = draft_vocab
        self.model = model
        self.meta = runner.meta
        self.draft_manager = draft_manager
        self.mtp_plane = mtp_plane
        self.separate = separate
        self.share_selection = share_selection
        self.padding_slot = padding_slot
        self.replay_scope = replay_scope
        self.max_draft_len = max_draft_len
        meta, dev = self.meta, self.meta.device
        self.sizes = runner.config.capture_sizes(meta.max_num_seqs, meta.max_num_tokens, 1)
        B = meta.max_num_seqs
        D = model.config.hidden_size
        dtype = next(model.parameters()).dtype
        self.tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(B, D, dtype=dtype, device=dev)
        self.pool_ids = torch.full((B, model.config.index_topk_pools), -1, dtype=torch.int32, device=dev)
        self.window_start = torch.zeros(B, dtype=torch.int64, device=dev)
        self.arange = torch.arange(B + 1, dtype=torch.int64, device=dev)
        self.graphs: dict[GraphKey, _DraftGraph] = {}
        self.failed: dict[GraphKey, str] = {}
        self.replays = 0
        self.width = 1 + max_draft_len if max_draft_len > 0 else 0
        W = max(self.width, 1)
        self.catch_sizes = runner.config.capture_sizes(meta.max_num_seqs, meta.max_num_tokens, W) if self.width else []
        self.c_tokens = torch.zeros(B * W, dtype=torch.int64, device=dev)
        self.c_hidden = torch.zeros(B * W, D, dtype=dtype, device=dev)
        # A draft launched ahead (`run_draft_ahead`): each sequence's valid (accepted) rows, padding entries 0, and
        # its last accepted row, persistent rather than made each round.
        self.valid = torch.zeros(B, dtype=torch.int64, device=dev)
        self.last_rows = torch.zeros(B, dtype=torch.int64, device=dev)
        self.catchup_replays = 0
        self.fused = (fused_draft_default() if fused is None else fused) and max_draft_len >= 2
        self.draft_replays = 0
        # Pinned landing buffer of the fused draft's tokens (`speculative.drafters.DeviceDrafts`), and a second one:
        # consecutive drafts land in turn in each (`host_landing`), so that a draft launched before the previous
        # one's tokens were read on the host (an early draft, a round launched ahead) does not overwrite them.
        self.host_drafts = (
            torch.zeros(B, max_draft_len, dtype=torch.int64, pin_memory=True)
            if self.fused and dev.type == "cuda"
            else None
        )
        self._host_drafts_alt: torch.Tensor | None = None
        self._landing = 1

    def host_landing(self) -> tuple[int, torch.Tensor | None]:
        """``(turn, buffer)``: the pinned buffer the next fused draft's tokens land in (None without one), the two
        buffers in turn (``turn`` 0 or 1)."""
        self._landing ^= 1
        h = self.host_drafts
        if h is None or self._landing == 0:
            return self._landing, h
        if self._host_drafts_alt is None or self._host_drafts_alt.shape != h.shape:
            # A normal tensor even when first asked for under inference mode: drafts land in it in and outside it.
            with torch.inference_mode(False):
                self._host_drafts_alt = torch.zeros(h.shape, dtype=h.dtype, pin_memory=h.is_pinned())
        return 1, self._host_drafts_alt

    # --------------------------------------------------------------------------------------------
    # Keys
    def key(self, n: int) -> GraphKey | None:
        """The key a chained step of ``n`` sequences replays at (capturing it first), or None (eager)."""
        if not self.runner.enabled:
            return None
        P = self.runner.padded_size(n, self.sizes)
        return None if P is None else self._ready((CHAIN, P, 1))

    def catchup_key(self, committed: Sequence[int], head: bool = True, capture: bool = True) -> GraphKey | None:
        """The key a catch-up of these committed counts replays at (padded size, largest count), or None;
        ``head=False``: the catch-up without the LM head (`CATCHUP_ONLY`). ``capture=False``: only a graph captured
        already (no capture now: a step launched ahead is in flight)."""
        return self._catch_or_draft_key(CATCHUP if head else CATCHUP_ONLY, committed, capture)

    def draft_key(self, committed: Sequence[int]) -> GraphKey | None:
        """The key of the fused draft for these committed counts (padded size, largest count), or None when
        it is off or cannot replay (then the per-step graphs serve the round)."""
        return self._catch_or_draft_key(DRAFT, committed) if self.fused else None

    def _catch_or_draft_key(self, kind: str, committed: Sequence[int], capture: bool = True) -> GraphKey | None:
        if not self.runner.enabled or not self.width or not committed or max(committed) > self.width:
            return None
        P = self.runner.padded_size(len(committed), self.catch_sizes)
        if P is None:
            return None
        key = (kind, P, max(committed))
        if not capture and key not in self.graphs and not self.runner.emulate:
            return None
        return self._ready(key)

    def startup_keys(self, max_wide_size: int | None = None, flushes: bool = False) -> list[GraphKey]:
        """The keys `capture_all` captures: every chained size, every catch-up (size, width) and every fused
        draft, except catch-ups wider than one row and fused drafts of more than ``max_wide_size`` sequences
        (the rounds after verify rounds, which a speculation cap keeps below it; captured on first use).
        ``flushes``: the drafter holds rows (a catch-up lag), whose flushes replay the head-free catch-up at the
        full width over the whole batch: that one is captured at every size (a flush behind a step in flight may
        not capture, and would run eagerly)."""
        keys: list[GraphKey] = [(CHAIN, size, 1) for size in self.sizes]
        for size in self.catch_sizes:
            small = max_wide_size is None or size <= max_wide_size
            for w in range(1, self.width + 1):
                if w == 1 or small:
                    keys.append((CATCHUP, size, w))
                    keys.append((CATCHUP_ONLY, size, w))
                elif flushes and w == self.width:
                    keys.append((CATCHUP_ONLY, size, w))
                if self.fused and small:
                    keys.append((DRAFT, size, w))
        return keys

    def capture_all(self, max_wide_size: int | None = None, flushes: bool = False) -> None:
        """Capture `startup_keys` now rather than on first use (a capture inside a serving loop stalls it:
        ~0.1-0.5 s each at real geometry)."""
        if not self.runner.enabled or self.runner.emulate:
            return
        with capture_session():
            for key in self.startup_keys(max_wide_size, flushes):
                self._ready(key)

    def _ready(self, key: GraphKey) -> GraphKey | None:
        if key in self.failed:
            return None
        if key not in self.graphs and not self.runner.emulate:
            try:
                self._capture(key)
            except Exception as e:  # noqa: BLE001 - the step then runs eagerly
                self.failed[key] = f"{type(e).__name__}: {e}"
                self.runner.drop_pool_after(e)
                logger.warning("CUDA graph capture of the MTP %s graph %s failed: %s", key[0], key[1:], e)
                return None
        return key

    # --------------------------------------------------------------------------------------------
    # Batch descriptions
    def _prepare(self, rids: Sequence[int], past: Sequence[int], P: int) -> None:
        pad = P - len(rids)
        mgr = self.runner.manager
        self.meta.prepare(
            list(rids) + [self.runner.padding_request_id] * pad,
            past_lens=list(past) + [self.runner.padding_past_len] * pad,
            q_lens=[1] * P,
            num_decode_seqs=P,
            state_slots=mgr.get_batch_state_slots(list(rids)) + [self.padding_slot] * pad,
            num_padding_seqs=pad,
        )
        if self.share_selection:
            self.meta.spec.shared_pool_ids = self.pool_ids[:P]
            self.meta.spec.shared_window_start = self.window_start[:P]

    def _prepare_catchup(
        self, rids: Sequence[int], starts: Sequence[int], committed: Sequence[int], P: int, W: int
    ) -> None:
        pad = P - len(rids)
        mgr = self.runner.manager
        self.meta.prepare(
            list(rids) + [self.runner.padding_request_id] * pad,
            past_lens=list(starts) + [self.runner.padding_past_len] * pad,
            q_lens=[W] * P,
            num_decode_seqs=0,  # the catch-up rows are prefill rows, as in the eager drafter
            state_slots=mgr.get_batch_state_slots(list(rids)) + [self.padding_slot] * pad,
            num_padding_seqs=pad,
            valid_q_lens=list(committed) + [0] * pad,
        )

    def _stage_catchup(
        self,
        key: GraphKey,
        rids: Sequence[int],
        starts: Sequence[int],
        committed: Sequence[int],
        tokens: Sequence[int],
        hidden: torch.Tensor,
        src_rows: Sequence[int],
    ) -> list[int]:
        """Describe a catch-up (or fused draft) batch of shape ``key`` and write its ``[P * W]`` tokens and
        hidden rows (sequence ``j``'s rows at ``j * W ..``); returns each sequence's last row. Arguments as
        `run_catchup`."""
        _, P, W = key
        self._prepare_catchup(rids, starts, committed, P, W)
        tok = [0] * (P * W)
        src = [src_rows[0]] * (P * W)  # padding rows copy some real row: finite, and never read back
        last: list[int] = []
        flat = 0
        for j, a in enumerate(committed):
            for i in range(a):
                tok[j * W + i] = tokens[flat + i]
                src[j * W + i] = src_rows[flat + i]
            flat += a
            last.append(j * W + a - 1)
        dev = self.meta.device
        self.c_tokens[: P * W].copy_(to_device(tok, dev, torch.int64))
        self.c_hidden[: P * W].copy_(hidden[to_device(src, dev)])
        return last

    # --------------------------------------------------------------------------------------------
    # Bodies (captured, or run eagerly when emulating)
    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is not None:
            return self.draft_vocab.greedy(h)
        return torch.argmax(self.model.compute_logits(h), dim=-1)

    def _mtp(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_forward(tokens, hidden, self.meta, self.draft_manager, self.mtp_plane)

    def _body(self, key: GraphKey, host_committed_lens: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
        kind, P, W = key
        if kind == CHAIN:
            h = self._mtp(self.tokens[:P], self.hidden[:P])
            return h, self._greedy(h)
        n = P * W
        h = self._mtp(self.c_tokens[:n], self.c_hidden[:n])
        if kind == CATCHUP_ONLY:
            return (h,)
        pools = self.meta.spec.last_pool_ids
        if kind == DRAFT:
            return (self._draft_chain(P, W, h, pools, host_committed_lens),)
        if pools is None:  # selection sharing reads step 0's pools; a shared plane might not score
            pools = torch.full((n, self.pool_ids.shape[1]), -1, dtype=torch.int32, device=h.device)
        return h, self._greedy(h), pools

    def _draft_chain(
        self, P: int, W: int, h: torch.Tensor, pools: torch.Tensor | None, host_committed_lens: Sequence[int] | None
    ) -> torch.Tensor:
        """The fused draft after its catch-up forward: ``[P, K]`` int64 greedy drafts.

        Args:
            P, W: the catch-up's shape.
            h: ``[P * W, D]`` the catch-up's MTP output.
            pools: ``[P * W, topk_pools]`` its selections (read with selection sharing; None: the plane did
                not score, and the chained steps share no pools).
            host_committed_lens: ``[n]`` each real sequence's committed length after the catch-up, for the host
                description of the chained steps when running eagerly (emulation: it sizes the pool scores);
                None under capture, where ``graph_max_pools`` bounds them.
        """
        meta = self.meta
        valid = (meta.row_seq_t.view(P, W) >= 0).sum(dim=1)  # committed rows; 0 for padding sequences
        real = valid > 0
        last = self.arange[:P] * W + (valid - 1).clamp(min=0)
        committed_len = meta.past_lens_t + valid  # a new tensor: the buffer is rewritten below
        h = h.index_select(0, last)
        tok = self._greedy(h)
        drafts = [tok]
        if self.share_selection:
            # As the per-step path: step 0 ran at committed_len - 1, its open pool starts at 4 * (len // 4).
            if pools is None:
                self.pool_ids[:P].fill_(-1)
            else:
                self.pool_ids[:P].copy_(torch.where(real.view(P, 1), pools.index_select(0, last), -1))
            self.window_start[:P].copy_(torch.where(real, committed_len // 4 * 4, 0))
        n_real = P - meta.num_padding_seqs
        pad_len = self.runner.padding_past_len
        host = list(host_committed_lens)[:n_real] if host_committed_lens is not None else [pad_len] * n_real
        with self.draft_manager.state.speculative_rows(self.mtp_plane, meta.state_slots_t):
            for c in range(1, self.max_draft_len):
                past = torch.where(real, committed_len + (c - 1), pad_len)
                meta.set_decode_rows(past, real, [p + c - 1 for p in host] + [pad_len] * (P - n_real))
                if self.share_selection:
                    meta.spec.shared_pool_ids = self.pool_ids[:P]
                    meta.spec.shared_window_start = self.window_start[:P]
                h = self._mtp(tok, h)
                tok = self._greedy(h)
                drafts.append(tok)
        return torch.stack(drafts, dim=1)

    def _scope(self) -> Any:
        return self.replay_scope(self.meta, self.draft_manager if self.separate else None)

    def _capture(self, key: GraphKey) -> None:
        meta = self.meta
        kind, P, W = key
        t0 = time.perf_counter()
        if kind == CHAIN:
            self.tokens[:P].zero_()
            self.hidden[:P].zero_()
            self.pool_ids[:P].fill_(-1)
            self.window_start[:P].zero_()
            self._prepare([], [], P)
        else:
            self.c_tokens.zero_()
            self.c_hidden.zero_()
            self._prepare_catchup([], [], [], P, W)
        meta.graph_max_pools = max(meta.graph_pool_capacity, meta.max_draft_pages_per_seq * meta.tokens_per_block // 4)
        try:
            with torch.inference_mode():
                with self._scope():
                    stream = torch.cuda.Stream(meta.device)
                    stream.wait_stream(torch.cuda.current_stream(meta.device))
                    with torch.cuda.stream(stream):
                        self._body(key)  # warm-up outside the capture; padding rows write nothing
                    torch.cuda.current_stream(meta.device).wait_stream(stream)
                    torch.cuda.synchronize(meta.device)
                if kind == DRAFT:
                    # The fused body rewrote the batch description: the catch-up's again, outside the draft
                    # binding (`prepare` refuses to run inside it).
                    self._prepare_catchup([], [], [], P, W)
                with self._scope():
                    graph = torch.cuda.CUDAGraph()
                    with capture_graph(graph, pool=self.runner.capture_pool()):
                        out = self._body(key)
                    guard = GraphAddressGuard()
                    guard.capture(meta)
        finally:
            meta.graph_max_pools = None
        self.graphs[key] = _DraftGraph(graph, out, guard)
        dt = time.perf_counter() - t0
        st = self.runner.stats
        st.captures += 1
        st.capture_s += dt
        st.per_graph[key] = {"capture_s": dt, "bytes": 0.0}

    def _replay_or_run(
        self, key: GraphKey, host_committed_lens: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, ...]:
        g = self.graphs.get(key)
        with torch.inference_mode(), self._scope():
            if g is None:  # emulation: the padded step, eagerly
                return self._body(key, host_committed_lens)
            g.guard.check(self.meta, declared_swaps=self.meta.draft_swap_addresses())
            # The fused draft rewrites the step description on the device (`set_decode_rows`, the staging):
            # captured, the host does not see it; the next `prepare` must copy (any MTP graph, to be safe).
            self.meta.device_rewritten()
            g.graph.replay()
            return g.outputs

    # --------------------------------------------------------------------------------------------
    # Runs
    def run(
        self,
        key: GraphKey,
        rids: Sequence[int],
        past: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained step of ``n = len(rids)`` sequences through the graph of ``key``.

        Args:
            key: from `key`.
            rids: the sequences' request ids.
            past: ``[n]`` position of each sequence's row.
            tokens: ``[n]`` previous draft tokens.
            hidden: ``[n, D]`` previous hidden rows.
            shared: ``(pool_ids [n, topk_pools], window_start [n])`` with selection sharing, else None.

        Returns:
            ``(hidden [n, D]`` (a view of the graph's output), ``[n]`` int64 greedy drafts on the device).
        """
        n, P = len(rids), key[1]
        self._prepare(rids, past, P)
        self.tokens[:n].copy_(tokens)
        self.tokens[n:P].zero_()
        self.hidden[:n].copy_(hidden)
        self.hidden[n:P].zero_()
        if shared is not None:
            self.pool_ids[:n].copy_(shared[0])
            self.pool_ids[n:P].fill_(-1)
            self.window_start[:n].copy_(shared[1])
            self.window_start[n:P].zero_()
        h, toks = self._replay_or_run(key)
        self.meta.trim_padding()
        self.replays += 1
        # The drafts stay on the device (the next replay overwrites the graph's buffer: a copy, no sync).
        return h[:n], toks[:n].clone()

    def run_catchup(
        self,
        key: GraphKey,
        rids: Sequence[int],
        starts: Sequence[int],
        committed: Sequence[int],
        tokens: Sequence[int],
        hidden: torch.Tensor,
        src_rows: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The catch-up step of ``n`` sequences through the graph of ``key`` (from `catchup_key`).

        Args:
            key: from `catchup_key`.
            rids: ``[n]`` request ids.
            starts: ``[n]`` first position of each sequence's rows.
            committed: ``[n]`` rows of each sequence (``1 .. K + 1``).
            tokens: ``sum(committed)`` token ``i + 1`` of each row, sequence after sequence.
            hidden: the target step's final hidden ``[N, D]``.
            src_rows: ``sum(committed)`` the row of ``hidden`` paired with each token.

        Returns:
            ``(h_last [n, D], pools_last [n, topk_pools] or None, drafts)``: the MTP output of each sequence's
            last row, step 0's selection of that row (with selection sharing) and its greedy draft
            (``[n]`` int64 on the device).
        """
        last = self._stage_catchup(key, rids, starts, committed, tokens, hidden, src_rows)
        h, toks, pools = self._replay_or_run(key)
        self.meta.trim_padding()
        self.catchup_replays += 1
        last_t = to_device(last, self.meta.device)
        pools_last = pools[last_t] if self.share_selection else None
        return h[last_t], pools_last, toks[last_t]

    def run_catchup_only(
        self,
        key: GraphKey,
        rids: Sequence[int],
        starts: Sequence[int],
        committed: Sequence[int],
        tokens: Sequence[int],
        hidden: torch.Tensor,
        src_rows: Sequence[int],
    ) -> None:
        """The catch-up of a round in which nobody drafts (``key`` from ``catchup_key(..., head=False)``):
        the MTP forward writes its cache rows; no LM head, nothing read back. Arguments as `run_catchup`."""
        self._stage_catchup(key, rids, starts, committed, tokens, hidden, src_rows)
        self._replay_or_run(key)
        self.meta.trim_padding()
        self.catchup_replays += 1

    def run_catchup_only_rows(
        self, key: GraphKey, rids: Sequence[int], starts: Sequence[int], tokens: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """A one-row-per-sequence catch-up without the LM head whose tokens and hidden rows are already on the
        device (`MTPDrafter.catch_up_ahead`: the overlap scheduler's in-flight step, not read back yet).

        Args:
            key: ``catchup_key([1] * n, head=False)``.
            rids: ``[n]`` request ids.
            starts: ``[n]`` position of each sequence's row.
            tokens: ``[n]`` int64 token ``i + 1`` of each row, on the device.
            hidden: ``[n, D]`` target hidden ``i`` of each row, on the device.
        """
        _, P, W = key
        n = len(rids)
        if W != 1 or tokens.shape[0] != n or hidden.shape[0] != n:
            raise ValueError(f"a catch-up of device rows needs width one and {n} rows, got {key}")
        self._prepare_catchup(rids, starts, [1] * n, P, 1)
        self.c_tokens[:n].copy_(tokens)
        self.c_tokens[n:P].zero_()
        self.c_hidden[:n].copy_(hidden)
        self.c_hidden[n:P].copy_(hidden[:1].expand(P - n, -1))  # padding rows: finite, never read back
        self._replay_or_run(key)
        self.meta.trim_padding()
        self.catchup_replays += 1

    def run_draft(
        self,
        key: GraphKey,
        rids: Sequence[int],
        starts: Sequence[int],
        committed: Sequence[int],
        tokens: Sequence[int],
        hidden: torch.Tensor,
        src_rows: Sequence[int],
    ) -> torch.Tensor:
        """The whole draft of ``n`` sequences (catch-up, then ``K - 1`` chained steps) in one replay.

        Arguments as `run_catchup` (``key`` from `draft_key`). Every sequence must want ``K`` drafts and
        hold the pages of its chained rows (positions up to its committed length ``+ K - 2``).

        Returns:
            ``[n, K]`` int64 greedy drafts on the device (a view of the graph's output: read it before the
            next replay).
        """
        self._stage_catchup(key, rids, starts, committed, tokens, hidden, src_rows)
        (drafts,) = self._replay_or_run(key, [s + a for s, a in zip(starts, committed)])
        self.meta.trim_padding()
        self.draft_replays += 1
        return drafts[: len(rids)]

    def run_draft_ahead(
        self,
        key: GraphKey,
        rids: Sequence[int],
        starts: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        valid: torch.Tensor,
        draft_hidden: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused draft of a verify round whose accepted counts are still on the device (the overlap scheduler).

        The same graph as `run_draft` at width ``W`` (every sequence's ``W`` verify rows): the rows past each
        sequence's accepted count become padding rows on the device (`speculative.mtp.staging`), so the
        catch-up covers exactly the committed rows and the chain starts from the last of them, as `run_draft` with
        ``committed = valid`` would.

        Args:
            key: ``draft_key([W] * n)``.
            rids: ``[n]`` request ids.
            starts: ``[n]`` first position of each sequence's verify rows (host-known: the round's start).
            tokens: ``[n * W]`` token ``i + 1`` of each verify row on the device: the target's argmax after it
                (equal to the next input token on every accepted row, and the bonus token on the last one); int64, or
                the float64 ids of the verify's packed results (exact), cast as they are copied.
            hidden: ``[n * W, D]`` the verify round's final hidden rows.
            valid: ``[n]`` accepted rows per sequence (``1 .. W``), on the device (int64, or float64 counts); kept
                in `valid` (int64) until the next call.
            draft_hidden: ``[S, D]`` the draft manager's draft hidden, with ``slots [n]`` (int64, on the device)
                each sequence's state slot: the target hidden of each sequence's last accepted row is recorded
                there (the hidden a restore needs); None records nothing. Each sequence's last accepted row is
                in `last_rows` (``j * W + valid[j] - 1``) afterwards either way.

        Returns:
            ``[n, K]`` int64 greedy drafts on the device (a view of the graph's output: consumed before the next
            replay of this graph).
        """
        _, P, W = key
        n = len(rids)
        if tokens.shape != (n * W,) or hidden.shape[0] != n * W or valid.shape != (n,):
            raise ValueError(
                f"a draft launched ahead needs {n} sequences of {W} rows, got {tuple(tokens.shape)} tokens"
            )
        self._prepare_catchup(rids, starts, [W] * n, P, W)
        meta = self.meta
        # Counts, tokens and hidden rows into the draft graph's persistent buffers, the rows past each count made
        # padding rows, the draft hidden recorded: one launch on CUDA (`speculative.mtp.staging`), else the reference.
        meta.device_rewritten()
        out = StageBuffers(self.valid[:P], self.c_tokens[: P * W], self.c_hidden[: P * W], meta.row_seq_t,
                           meta.row_live_t, self.last_rows[:n], draft_hidden, slots)  # fmt: skip
        stage_draft_ahead(tokens, hidden, valid, W, P, out)
        # The host lengths only size the eager (emulated) description of the chained steps: an upper bound.
        (drafts,) = self._replay_or_run(key, [s + W for s in starts])
        self.meta.trim_padding()
        self.draft_replays += 1
        return drafts[:n]

"""`MTPDrafter`: drafts with the model's MTP layer, behind the `Drafter` interface.

After every committed step the MTP layer first catches up on the newly committed (token ``i + 1``,
target hidden ``i``) pairs — those rows are real and stay in its cache — then chains ``K - 1`` more
single-row steps on its own output hidden. The chained rows are speculative: the MTP plane's tail ring
of their draft slots is restored afterwards (`RequestStateOwner.speculative_rows`); their latent rows
and pools are rewritten by the next catch-up before any committed row reads them. The MTP plane lives in
the target manager (``shared``) or in its own draft manager (``separate``), which the draft forward
reaches through the draft slot table (`draft_replay`, docs/design.md §6.1).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import envs
from ...attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from ...cache.manager import Glm5NextCacheManager
from ...errors import CapacityError
from ...models.glm5_next import Glm5NextForCausalLM
from ...transfer import to_device
from ..draft_vocab import DraftVocab
from ..drafters import PENDING_DRAFT, DeviceDrafts, Drafter, DraftSeq, DraftState
from ..interface import draft_replay

__all__ = ["MTPDrafter"]


class MTPDrafter(Drafter):
    """Chained MTP drafting with catch-up on committed rows.

    Args:
        model: the target model (with its MTP layer).
        meta: the executor's batch metadata (re-prepared for each MTP forward).
        manager: the target cache manager.
        draft_manager: the manager holding the MTP plane (``manager`` itself in shared mode).
        mtp_plane: the MTP layer's sparse plane in ``draft_manager``.
        max_draft_len: ``K``.
        share_selection: chained steps reuse step 0's pool selection (index_share_for_mtp_iteration).
        draft_vocab: the restricted draft vocabulary (`DraftVocab`: each draft is the argmax over its ids);
            None scores the full vocabulary.
        catchup_lag: rows the MTP history may fall behind in rounds where nobody drafts
            (`MTPDecodingConfig.catchup_lag`; 0: it catches up every step).

    The lag: in a round where nobody drafts, the MTP layer's only work is the catch-up on the committed rows
    (its cache must follow every token so that drafting can resume), one MTP forward with its own launch and host
    work per step, which at small batch costs more than the plain step. With ``catchup_lag > 0`` those rows'
    target hidden are copied into a per-slot ring on the device (``[S, catchup_lag, D]``, `_hold`) and the MTP layer
    catches up on all of them in one forward (`_flush_lag`) when the request drafts again, when the ring is full,
    or when its MTP history is needed. ``DraftState.lag`` counts the held rows: the history is ``mtp_len``
    (caught up) ``+ lag`` (held) rows long.

    Aligned flushes: when a ring is full, every request holding rows is caught up in the same flush, not only the
    full ones. Requests that began holding at different steps (they joined at different times) would otherwise each
    flush at its own step: a flush a step at a large batch, each replaying the catch-up graph over one request's
    rows, ``catchup_lag / W`` replays (W the graph's width) for a handful of rows each. Aligned, a batch flushes once
    per ``catchup_lag`` steps and each replay covers every request; the rows caught up are the same.
    """

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        meta: GlmKpoolMetadata,
        manager: Glm5NextCacheManager,
        draft_manager: Glm5NextCacheManager,
        mtp_plane: int,
        max_draft_len: int,
        *,
        share_selection: bool,
        draft_vocab: DraftVocab | None = None,
        catchup_lag: int = 0,
    ) -> None:
        self.model = model
        # At most the metadata's rows: a flush of one request's lag is one forward.
        self.catchup_lag = max(0, min(catchup_lag, meta.max_num_tokens))
        self._lag_hidden: torch.Tensor | None = None  # [S, catchup_lag, D], made at the first held row
        self.num_lag_flushes = 0  # catch-ups of held rows (forwards), for statistics and the executor
        self._flushed = False  # a flush ran since `take_flushed` last looked
        self.draft_vocab = draft_vocab
        self.meta = meta
        self.manager = manager
        self.draft_manager = draft_manager
        self.mtp_plane = mtp_plane
        self.max_draft_len = max_draft_len
        self.share_selection = share_selection
        self.device = manager.device
        # CUDA graphs of the chained steps (`MtpChainGraphs`), set by `build_mtp` when the target has graphs.
        self.chain_graphs: Any = None
        # Leave a fused draft's tokens on the device (`DraftState.pending`) for the next verify to take as
        # its input rows; set by an executor that resolves them (the speculative executor with graphs).
        self.defer = False
        # The drafts that landed last in each of the two host landing buffers (`_device_drafts`).
        self._landed: list[weakref.ref[DeviceDrafts] | None] = [None, None]
        self._slots_cache: tuple[tuple[int, ...], torch.Tensor] | None = None  # `_slots_t`
        # The MTP plane's rollback and snapshot planes live with the draft manager's state owner.
        draft_manager.state.enable_speculative_rows(mtp_plane)
        draft_manager.state.enable_draft_hidden(model.config.hidden_size, next(model.parameters()).dtype)

    @property
    def separate(self) -> bool:
        """Whether the MTP plane has its own draft manager."""
        return self.draft_manager is not self.manager

    def release(self, request_id: int) -> None:
        dm = self.draft_manager
        if self.separate and dm.has_request(request_id):
            dm.free_request(request_id)

    def _draft_pages(self, state: DraftState, request_id: int, num_tokens: int) -> bool:
        """A separate draft manager's pages for ``num_tokens`` MTP positions of ``request_id`` (added on first use).
        When the draft pool cannot hold them the request continues without speculation (lossless): False."""
        dm = self.draft_manager
        try:
            if not dm.has_request(request_id):
                dm.add_request(request_id)
            dm.ensure_capacity(request_id, num_tokens)
        except CapacityError:
            state.mtp_disabled = True
            self.release(request_id)
            return False
        return True

    def needs_idle_call(self, states: Sequence[DraftState], num_computed: Sequence[int]) -> bool:
        # With nobody drafting, `draft` skips a sequence caught up (or held) ahead already (`catch_up_ahead`) or
        # without speculation; any other needs its catch-up or hold.
        return any(not st.mtp_disabled and not st.mtp_history_at(n) for st, n in zip(states, num_computed))

    def draft(self, seqs: Sequence[DraftSeq], hidden: torch.Tensor) -> None:
        drafting = any(s.live and s.greedy and s.want > 0 for s in seqs)
        # 1. Catch-up: the committed rows of this step, paired with the token that follows each.
        cat: list[DraftSeq] = []
        rows_h, toks = [], []
        behind: list[DraftSeq] = []  # held rows to catch up on before this round's rows
        hold: list[DraftSeq] = []  # this round's rows to hold (`_hold`)
        for s in seqs:
            if not s.live or not s.greedy:
                continue
            st = s.state
            if st.mtp_disabled:
                continue
            if st.mtp_history_at(s.num_computed):
                # Caught up (or its rows held) already, on the device, before the step after it launched
                # (`catch_up_ahead`): nothing to draft from (drafts would be a token stale).
                if st.lag and drafting:
                    behind.append(s)
                continue
            start = s.num_computed - s.committed
            if st.mtp_len + st.lag != start:
                # The MTP history has a gap (cannot happen: every step catches up or holds); drop speculation.
                st.mtp_disabled = True
                continue
            if self.separate and not self._draft_pages(st, s.request_id, s.num_computed + max(s.want - 1, 0)):
                continue
            if not drafting and s.committed <= self.catchup_lag and start >= len(s.tokens) - s.num_output:
                # Nobody drafts: its generated rows wait on the device instead of an MTP forward. Prompt rows never
                # wait: a prompt's checkpoints and sealed pages need the MTP history to reach them.
                hold.append(s)
                continue
            if st.lag:
                behind.append(s)
            cat.append(s)
            rows_h.append(range(s.row_offset, s.row_offset + s.committed))
            toks.extend(s.tokens[start + 1 : s.num_computed + 1])
        # Held rows first (a full ring, or a request drafting or catching up on a long prefill chunk now).
        if any(s.state.lag + s.committed > self.catchup_lag for s in hold):
            # Every held row goes with the full rings (aligned flushes: the class docstring).
            behind += [s for s in hold if s.state.lag > 0]
        if behind:
            self._flush_lag(behind)
        self._hold(hold, hidden)
        if not cat:
            return
        committed = [len(rh) for rh in rows_h]
        starts = [s.num_computed - c for s, c in zip(cat, committed)]
        src_rows = [i for rh in rows_h for i in rh]  # host ints: torch ops on the CPU cost ~5 µs each
        graphs = self.chain_graphs
        rids = [s.request_id for s in cat]
        K = self.max_draft_len
        fused = graphs.draft_key(committed) if graphs is not None and all(s.want == K for s in cat) else None
        # Each sequence's last committed row of the target step (the graph paths take it from `hidden`).
        last_src = [s.row_offset + c - 1 for s, c in zip(cat, committed)]
        if not any(s.want > 0 for s in cat):
            # Nobody drafts this round (an adaptive length of 0, max_concurrency, budgets): the MTP layer only
            # catches up (its cache must follow every committed token), without the LM head, which is most of
            # a draft step's cost at real geometry.
            self._catch_up_only(cat, rids, starts, committed, toks, hidden, src_rows, last_src)
            return
        if fused is not None:
            # The whole draft in one replay (catch-up + chained steps; `MtpChainGraphs`, fused draft).
            drafts = graphs.run_draft(fused, rids, starts, committed, toks, hidden, src_rows)
            self._caught_up(cat, committed, hidden[to_device(last_src, self.device)])
            if self.defer:
                # No read-back here: the next verify takes the drafts on the device (`DeviceDrafts`).
                pend = self._device_drafts(drafts)
                for j, s in enumerate(cat):
                    s.state.drafts, s.state.pending = [PENDING_DRAFT] * K, (pend, j)
                return
            for s, row in zip(cat, drafts.tolist()):
                s.state.drafts = [int(t) for t in row]
            return
        key = graphs.catchup_key(committed) if graphs is not None else None
        if key is not None:
            # Captured catch-up (each sequence padded to the round's largest count): the same rows, one replay.
            h_last, pools0, d = graphs.run_catchup(key, rids, starts, committed, toks, hidden, src_rows)
            prev_last = hidden[to_device(last_src, self.device)]
        else:
            prev_h = hidden[to_device(src_rows, self.device)]
            nxt = to_device(toks, self.device, torch.int64)
            out = self._mtp_step(cat, starts, committed, nxt, prev_h, decode=False)
            last = to_device([sum(committed[: j + 1]) - 1 for j in range(len(cat))], self.device)
            prev_last = prev_h[last]
            h_last = out[last]
            pools0 = self.meta.spec.last_pool_ids[last] if self.share_selection else None
            d = self.greedy(h_last)
        self._caught_up(cat, committed, prev_last)
        # The drafts stay on the device until the round is drafted: one host copy for all of them (each
        # chained step needs only the previous step's tokens, which it reads on the device).
        pieces: list[tuple[list[int], torch.Tensor]] = [(list(range(len(cat))), d)]
        chain = [j for j, s in enumerate(cat) if s.want >= 2]
        if chain:
            self._chain(cat, chain, h_last, d, pools0, pieces)
        flat = torch.cat([t.reshape(-1) for _, t in pieces]).tolist()
        pos = 0
        for s in cat:
            s.state.drafts = []
        for idx, _ in pieces:
            for j in idx:
                if len(cat[j].state.drafts) < cat[j].want:
                    cat[j].state.drafts.append(int(flat[pos]))
                pos += 1

    # --------------------------------------------------------------------------------------------
    # The catch-up lag (see the class docstring)
    def _lag_buffer(self) -> torch.Tensor:
        """The held rows' ring ``[S, catchup_lag, D]`` (S: the draft manager's state slots), made at first use."""
        if self._lag_hidden is None:
            dh = self.draft_manager.state.draft_hidden  # [S, D] in the model's dtype
            S, D = dh.shape
            # A normal tensor even when first held under inference mode (rounds launched ahead): rows are held
            # both inside and outside it, and an inference tensor cannot be updated outside.
            with torch.inference_mode(False):
                self._lag_hidden = torch.empty(S, self.catchup_lag, D, dtype=dh.dtype, device=dh.device)
        return self._lag_hidden

    def _hold(self, cat: Sequence[DraftSeq], hidden: torch.Tensor) -> None:
        """Keep the committed rows of ``cat`` (rows ``row_offset ..`` of ``hidden [N, D]``, ``committed`` each) for
        a later catch-up, after each sequence's held rows; one device copy for all, no MTP forward."""
        if cat:
            self._hold_rows([s.request_id for s in cat], [s.state for s in cat], [s.row_offset for s in cat],
                            [s.committed for s in cat], hidden)  # fmt: skip

    def _hold_rows(
        self,
        rids: Sequence[int],
        states: Sequence[DraftState],
        offsets: Sequence[int],
        counts: Sequence[int],
        hidden: torch.Tensor,
    ) -> None:
        """`_hold` on columns: request ``rids[i]`` (state ``states[i]``) holds rows ``offsets[i] ..`` of ``hidden``,
        ``counts[i]`` of them (a width-one step held ahead builds no `DraftSeq` per request: `catch_up_ahead`)."""
        ring = self._lag_buffer()
        R = self.catchup_lag
        n_seq = len(states)
        # Index arithmetic on arrays, not per-row Python lists: this runs every width-one step of a large batch.
        slots = np.fromiter(self.draft_manager.get_batch_state_slots(rids), np.int64, n_seq)
        lags = np.fromiter((st.lag for st in states), np.int64, n_seq)
        off = np.asarray(offsets, dtype=np.int64)
        cnt = np.asarray(counts, dtype=np.int64)
        if (cnt == 1).all():  # the usual width-one step: one row each
            dst, src = slots * R + lags, off
        else:
            within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            dst, src = np.repeat(slots * R + lags, cnt) + within, np.repeat(off, cnt) + within
        for st, n in zip(states, counts):
            st.lag += n
            st.drafts = []
        flat = ring.view(-1, ring.shape[-1])
        n_rows = len(dst)
        if (src == np.arange(n_rows)).all():
            # The rows in order from the first (a whole width-one batch): a slice, no gather.
            flat.index_copy_(0, to_device(dst, self.device, torch.int64), hidden[:n_rows])
        else:
            both = to_device(np.concatenate((dst, src)), self.device, torch.int64)  # one host-to-device copy
            flat.index_copy_(0, both[:n_rows], hidden.index_select(0, both[n_rows:]))

    def _flush_lag(self, seqs: Sequence[DraftSeq], capture: bool = True) -> None:
        """Catch the MTP layer up on the held rows of ``seqs`` (each ``state.lag > 0``; their next tokens are on
        the host: ``tokens[mtp_len + 1 .. mtp_len + lag]``); afterwards each history is caught up to
        ``mtp_len + lag`` and nothing is held.

        With the catch-up graphs, in slices of at most their width per sequence (`_flush_through_graphs`), as
        per-step catch-ups would have run: a flush's row counts vary from one to the whole lag, and an eager forward
        meets a new shape at many of them (the adaptive runs of 2026-12-06 averaged 9-30 ms a step with every step
        a replay and 6-12 flushes: kernel compiles in the eager flushes, most likely; not counted then). Otherwise as
        prefill rows of one eager forward per metadata-sized group. ``capture=False``: use only graphs captured
        already (a step launched ahead is in flight)."""
        ring = self._lag_buffer()
        D = ring.shape[-1]
        flat = ring.view(-1, D)
        todo = [s for s in seqs if s.state.lag > 0]
        graphs = self.chain_graphs
        W = graphs.width if envs.MTP_FLUSH.get() != "eager" and graphs is not None and graphs.width else 0
        # Through the graphs a group's forward holds at most W rows per sequence (a slice), so the group is as wide as
        # the graphs' batch allows; a group of every held row (the eager forward) as the metadata's rows allow (batch
        # 64, a 64-row lag, 2,048 rows a forward: 1 group of 16 slices instead of 2 groups of 16).
        for group in self._flush_groups(todo, W):
            if not W or not self._flush_group_through_graphs(group, flat, capture):
                # No graph for so wide a group: the eager rule's groups, each through the graphs where it can.
                for sub in self._flush_groups(group, 0):
                    if not W or not self._flush_group_through_graphs(sub, flat, capture):
                        self._flush_group_eagerly(sub, flat)
                    self._flushed_group(sub)
                continue
            self._flushed_group(group)

    def _flush_groups(self, seqs: Sequence[DraftSeq], width: int) -> list[list[DraftSeq]]:
        """``seqs`` cut, in order, into groups a flush forward can hold: at most the metadata's sequences and rows,
        counting ``min(lag, width)`` rows per sequence (``width`` 0: its whole lag, one eager forward)."""
        groups: list[list[DraftSeq]] = []
        rows = 0
        for s in seqs:
            n = min(s.state.lag, width) if width else s.state.lag
            if not groups or len(groups[-1]) >= self.meta.max_num_seqs or rows + n > self.meta.max_num_tokens:
                groups.append([])
                rows = 0
            groups[-1].append(s)
            rows += n
        return groups

    def _flush_group_through_graphs(self, group: Sequence[DraftSeq], flat: torch.Tensor, capture: bool) -> bool:
        slots = self.draft_manager.get_batch_state_slots([s.request_id for s in group])
        starts = [s.state.mtp_len for s in group]
        return self._flush_through_graphs(group, slots, starts, [s.state.lag for s in group], flat, capture)

    def _flush_group_eagerly(self, group: Sequence[DraftSeq], flat: torch.Tensor) -> None:
        """One eager forward over every held row of ``group`` (at most the metadata's rows)."""
        R = self.catchup_lag
        slots = self.draft_manager.get_batch_state_slots([s.request_id for s in group])
        starts = [s.state.mtp_len for s in group]
        lags = [s.state.lag for s in group]
        src = [slot * R + j for slot, n in zip(slots, lags) for j in range(n)]
        toks = [t for s, p, n in zip(group, starts, lags) for t in s.tokens[p + 1 : p + n + 1]]
        # The rows as a catch-up of `lag` committed rows ending at mtp_len + lag (the state is shared).
        done = [dataclasses.replace(s, num_computed=p + n, committed=n) for s, p, n in zip(group, starts, lags)]
        prev_h = flat.index_select(0, to_device(src, self.device))
        self._mtp_step(done, starts, lags, to_device(toks, self.device, torch.int64), prev_h, decode=False)
        last = to_device([slot * R + n - 1 for slot, n in zip(slots, lags)], self.device)
        self._caught_up(done, lags, flat.index_select(0, last))

    def _flushed_group(self, group: Sequence[DraftSeq]) -> None:
        for s in group:
            s.state.lag = 0
        self.num_lag_flushes += 1
        self._flushed = True

    def _flush_through_graphs(
        self,
        group: Sequence[DraftSeq],
        slots: Sequence[int],
        starts: Sequence[int],
        lags: Sequence[int],
        flat: torch.Tensor,
        capture: bool,
    ) -> bool:
        """Catch ``group`` up on its held rows by replaying the catch-up graph without the LM head over slices of
        at most its width ``W`` rows per sequence (slice ``j``: rows ``j W ..`` of each sequence that has them);
        False (nothing run) when a slice has no graph.

        Args:
            group: the sequences, ``starts[i]`` each one's MTP history length, ``lags[i]`` its held rows.
            slots: their draft state slots (held row ``k`` of sequence ``i`` is ``flat[slots[i] * R + k]``).
            flat: ``[S * R, D]`` the held rows' ring.
            capture: whether a missing graph may be captured now.
        """
        graphs = self.chain_graphs
        if graphs is None or not graphs.width:
            return False
        W, R = graphs.width, self.catchup_lag
        plan = []
        for j0 in range(0, max(lags), W):
            sub = [i for i, n in enumerate(lags) if n > j0]
            committed = [min(W, lags[i] - j0) for i in sub]
            key = graphs.catchup_key(committed, head=False, capture=capture)
            if key is None:
                return False
            plan.append((j0, sub, committed, key))
        for j0, sub, committed, key in plan:
            at = [starts[i] + j0 for i in sub]  # each sequence's MTP history before the slice
            toks = [t for i, p, c in zip(sub, at, committed) for t in group[i].tokens[p + 1 : p + c + 1]]
            src = [slots[i] * R + j0 + k for i, c in zip(sub, committed) for k in range(c)]
            graphs.run_catchup_only(key, [group[i].request_id for i in sub], at, committed, toks, flat, src)
            # Booked slice by slice, as per-step catch-ups are (a separate draft manager commits each).
            last = to_device([slots[i] * R + j0 + c - 1 for i, c in zip(sub, committed)], self.device)
            rids, states = [group[i].request_id for i in sub], [group[i].state for i in sub]
            ends = [p + c for p, c in zip(at, committed)]
            self._book_caught_up(rids, states, ends, committed, flat.index_select(0, last))
        return True

    def take_flushed(self) -> bool:
        """Whether held rows were caught up since the last call (that round's time includes the catch-up)."""
        out, self._flushed = self._flushed, False
        return out

    def catch_up_ahead(
        self, seqs: Sequence[tuple[int, DraftState, int, bool]], tokens: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """Catch the MTP layer up on a width-one step whose tokens the host has not read yet (the overlap
        scheduler, about to launch the next step over the same graph buffers): the step's chosen tokens and
        hidden rows are taken on the device; no LM head (nobody drafts from a step followed by one launched
        ahead: its drafts would be one token stale). The next `draft` call skips these sequences.

        With a catch-up lag (``catchup_lag``), the rows are held instead (`_hold`, a device copy), a full ring being
        caught up first (its rows' next tokens are on the host: the in-flight step's input is the last of them).

        Args:
            seqs: ``(request_id, state, row position, greedy, tokens)`` of each row of the step, in row order
                (``tokens``: the request's tokens on the host, up to the row's own).
            tokens: ``[B]`` the step's chosen token of each row (``GraphOutputs.packed[:, 0]``, float64 ids).
            hidden: ``[B, D]`` the step's final hidden rows.
        """
        sel: list[int] = []
        for b, (rid, st, pos, greedy, _) in enumerate(seqs):
            if not greedy or st.mtp_disabled:
                continue
            if not st.mtp_history_at(pos):
                st.mtp_disabled = True  # a gap in the MTP history (as in `draft`): no speculation from here
                continue
            if self.separate and not self._draft_pages(st, rid, pos + 1):
                continue
            sel.append(b)
        if not sel:
            return
        R = self.catchup_lag
        if R:
            # The usual width-one step: each row held, no `DraftSeq` per request (host time at large batch).
            if any(seqs[b][1].lag + 1 > R for b in sel):
                # Every held row goes with the full rings (aligned flushes: the class docstring).
                self._flush_lag([self._ahead_seq(seqs[b], b) for b in sel if seqs[b][1].lag > 0], capture=False)
            self._hold_rows([seqs[b][0] for b in sel], [seqs[b][1] for b in sel], sel, [1] * len(sel), hidden)
            return
        cat = [self._ahead_seq(seqs[b], b) for b in sel]
        idx = to_device(sel, self.device)
        toks = tokens.index_select(0, idx).to(torch.int64)
        rows = hidden.index_select(0, idx)
        rids = [s.request_id for s in cat]
        starts = [s.num_computed - 1 for s in cat]
        graphs = self.chain_graphs
        key = graphs.catchup_key([1] * len(cat), head=False) if graphs is not None else None
        if key is not None:
            graphs.run_catchup_only_rows(key, rids, starts, toks, rows)
        else:
            self._mtp_step(cat, starts, [1] * len(cat), toks, rows, decode=False)
        self._caught_up(cat, [1] * len(cat), rows)
        for s in cat:
            s.state.drafts = []

    @staticmethod
    def _ahead_seq(seq: tuple[int, DraftState, int, bool, Sequence[int]], row: int) -> DraftSeq:
        """A row of a step caught up ahead (`catch_up_ahead`'s ``seqs`` entry) as a one-row `DraftSeq`."""
        rid, st, pos, _, held = seq
        return DraftSeq(request_id=rid, state=st, tokens=held, num_output=0, num_computed=pos + 1, committed=1,
                        row_offset=row, greedy=True, live=True, want=0)  # fmt: skip

    def reserve_ahead(self, request_id: int, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` positions of ``request_id``'s MTP history (a draft launched ahead: its catch-up
        and chained rows reach at most the round's start ``+ W + K - 1``). False when the draft pool cannot hold
        them now (the round then runs synchronously; nothing is disabled)."""
        if not self.separate:
            return True  # the MTP plane's pages are the target's (the executor reserves those)
        dm = self.draft_manager
        if not dm.has_request(request_id):
            return False
        try:
            dm.ensure_capacity(request_id, num_tokens)
        except CapacityError:
            return False
        return True

    def draft_ahead(
        self,
        rids: Sequence[int],
        starts: Sequence[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        accepted: torch.Tensor,
    ) -> DeviceDrafts | None:
        """Draft the next round from a verify round's outputs still on the device (the overlap scheduler launches the
        round after it before reading it back): the fused draft graph catches up on each sequence's accepted rows,
        their count read on the device (`MtpChainGraphs.run_draft_ahead`), and chains ``K - 1`` steps.

        Every sequence drafts ``K``; its MTP history must end at ``starts[j]`` (caught up to the verify round's
        start). The host books the catch-up when it reads the verify round back (`book_ahead`).

        Args:
            rids: ``[n]`` request ids, in the verify round's order.
            starts: ``[n]`` each sequence's first verify position.
            tokens: ``[n * W]`` the target's argmax of every verify row (device; int64, or the float64 ids of the
                verify's packed results).
            hidden: ``[n * W, D]`` the verify round's final hidden rows (device).
            accepted: ``[n]`` accepted rows per sequence (device; int64, or float64 counts).

        Returns:
            The drafts (``[n, K]`` on the device, on their way to the host), or None when no fused graph serves
            this batch (the caller then runs the round synchronously; nothing was launched).
        """
        graphs = self.chain_graphs
        W = self.max_draft_len + 1
        n = len(rids)
        key = graphs.draft_key([W] * n) if graphs is not None else None
        if key is None:
            return None
        # The draft hidden a restore needs (the target hidden of each sequence's last accepted row) is recorded as the
        # draft's inputs are staged.
        dm = self.draft_manager
        dh = dm.state.draft_hidden
        slots = self._slots_t(dm.get_batch_state_slots(list(rids))) if dh is not None else None
        drafts = graphs.run_draft_ahead(key, rids, starts, tokens, hidden, accepted, draft_hidden=dh, slots=slots)
        return self._device_drafts(drafts)

    def _slots_t(self, slots: list[int]) -> torch.Tensor:
        """``slots`` on the device: the tensor of the last call when they are the same (a steady batch drafts the
        same slots every round), else a new one. Only ever read (an index)."""
        key = tuple(slots)
        if self._slots_cache is None or self._slots_cache[0] != key:
            with torch.inference_mode(False):  # read in and outside inference mode
                self._slots_cache = (key, to_device(slots, self.device, torch.int64))
        return self._slots_cache[1]

    def _device_drafts(self, drafts: torch.Tensor) -> DeviceDrafts:
        """``drafts`` (the fused draft graph's output) on their way to the host, in the landing buffer whose turn it
        is (`MtpChainGraphs.host_landing`). The drafts that landed there two drafts ago are read first if somebody
        still holds them unread (never in the executor's rounds, which read each round's drafts with its results):
        their host copy is about to be overwritten."""
        turn, host = self.chain_graphs.host_landing()
        prev = self._landed[turn]() if self._landed[turn] is not None else None
        if prev is not None:
            prev.rows()
        out = DeviceDrafts(drafts, host)
        self._landed[turn] = weakref.ref(out)
        return out

    def book_ahead(self, seqs: Sequence[DraftSeq], drafts: DeviceDrafts, rows: Sequence[int]) -> None:
        """The host's share of a `draft_ahead`, once its verify round was read back: each sequence's MTP history
        now ends at its committed length, and its next round's drafts are row ``rows[j]`` of ``drafts``.

        Args:
            seqs: the verify round's live sequences (``num_computed`` and ``committed`` after its commit).
            drafts: what `draft_ahead` returned.
            rows: ``[len(seqs)]`` each sequence's row in ``drafts`` (its index in the verify round).
        """
        K = self.max_draft_len
        for s, j in zip(seqs, rows):
            st = s.state
            st.mtp_len = s.num_computed
            st.drafts, st.num_proposed, st.pending = [PENDING_DRAFT] * K, None, (drafts, j)
        if self.separate and seqs:
            dm = self.draft_manager
            # A separate draft manager's committed length is the MTP history (shared: the target's slot).
            slots = dm.get_batch_state_slots([s.request_id for s in seqs])
            dm.state.commit_verified(slots, [s.committed for s in seqs])

    def _catch_up_only(
        self,
        cat: list[DraftSeq],
        rids: list[int],
        starts: list[int],
        committed: list[int],
        toks: list[int],
        hidden: torch.Tensor,
        src_rows: list[int],
        last_src: list[int],
    ) -> None:
        """The catch-up of a round in which nobody drafts: the MTP forward over the committed rows, no LM head.

        Args: as `draft` computed them (``toks`` / ``src_rows``: ``sum(committed)`` tokens and rows of
        ``hidden [N, D]``; ``last_src``: each sequence's last committed row).
        """
        graphs = self.chain_graphs
        key = graphs.catchup_key(committed, head=False) if graphs is not None else None
        if key is not None:
            graphs.run_catchup_only(key, rids, starts, committed, toks, hidden, src_rows)
        else:
            prev_h = hidden[to_device(src_rows, self.device)]
            nxt = to_device(toks, self.device, torch.int64)
            self._mtp_step(cat, starts, committed, nxt, prev_h, decode=False)
        self._caught_up(cat, committed, hidden[to_device(last_src, self.device)])
        for s in cat:
            s.state.drafts = []

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """``h [n, D]`` MTP output -> ``[n]`` int64 greedy drafts: over the draft vocabulary when there is one
        (`DraftVocab.greedy`), else over the full LM head."""
        with torch.inference_mode():
            if self.draft_vocab is not None:
                return self.draft_vocab.greedy(h)
            return self.model.compute_logits(h).argmax(-1)

    def _caught_up(self, cat: Sequence[DraftSeq], committed: Sequence[int], prev_last: torch.Tensor) -> None:
        """Book the catch-up: MTP history lengths, a separate draft manager's committed lengths, and each
        sequence's last target hidden ``prev_last [len(cat), D]`` (the draft hidden a restore needs)."""
        self._book_caught_up([s.request_id for s in cat], [s.state for s in cat], [s.num_computed for s in cat],
                             committed, prev_last)  # fmt: skip

    def _book_caught_up(
        self,
        rids: Sequence[int],
        states: Sequence[DraftState],
        lengths: Sequence[int],
        committed: Sequence[int],
        prev_last: torch.Tensor,
    ) -> None:
        """`_caught_up` on columns: request ``rids[i]``'s MTP history now ends at ``lengths[i]``, ``committed[i]``
        rows later (a flush books its slices so, without a `DraftSeq` per sequence and slice)."""
        dm = self.draft_manager
        for st, n in zip(states, lengths):
            st.mtp_len = n
        draft_ids = dm.get_batch_state_slots(list(rids))
        if self.separate:
            # A separate draft manager's committed length is the MTP history (shared: the target's slot).
            dm.state.commit_verified(draft_ids, committed)
        dm.state.record_draft_hidden(self._slots_t(draft_ids), prev_last)

    def _chain(
        self,
        cat: list[DraftSeq],
        chain: list[int],
        h_last: torch.Tensor,
        d: torch.Tensor,
        pools0: torch.Tensor | None,
        pieces: list[tuple[list[int], torch.Tensor]],
    ) -> None:
        """Chained drafts 2 .. want of the sequences ``cat[j]``, ``j`` in ``chain``, appended to ``pieces``.

        Speculative rows: the state owner restores the MTP tail ring afterwards.

        Args:
            cat: the round's caught-up sequences.
            chain: indices into ``cat`` of those wanting two drafts or more.
            h_last: ``[len(cat), D]`` MTP output of each sequence's last committed row.
            d: ``[len(cat)]`` int64 first drafts (device).
            pools0: ``[len(cat), topk_pools]`` step 0's selections (selection sharing), else None.
            pieces: ``(indices into cat, [len(indices)] device drafts)`` per chained step, appended in order.
        """
        dm = self.draft_manager
        slots = to_device([dm.get_state_slot(cat[j].request_id) for j in chain], self.device, torch.int64)
        with dm.state.speculative_rows(self.mtp_plane, slots):
            sel = to_device(chain, self.device, torch.int64)
            h, tok = h_last[sel], d[sel]
            active = list(chain)
            c = 1
            while active:
                reqs = [cat[j] for j in active]
                shared = None
                if pools0 is not None:
                    # Step 0 ran at position num_computed - 1; its open pool starts at 4 * (num_computed // 4).
                    ws = to_device([4 * (s.num_computed // 4) for s in reqs], self.device, torch.int64)
                    shared = (pools0[to_device(active, self.device, torch.int64)], ws)
                past = [s.num_computed + c - 1 for s in reqs]
                key = self.chain_graphs.key(len(reqs)) if self.chain_graphs is not None else None
                if key is not None:
                    h, nd = self.chain_graphs.run(key, [s.request_id for s in reqs], past, tok, h, shared)
                else:
                    h = self._mtp_step(reqs, past, [1] * len(reqs), tok, h, decode=True, shared=shared)
                    nd = self.greedy(h)
                pieces.append((list(active), nd))
                # After step c a sequence has c + 1 drafts.
                keep = [k for k, s in enumerate(reqs) if c + 1 < s.want]
                active = [active[k] for k in keep]
                if keep:
                    ksel = to_device(keep, self.device, torch.int64)
                    h, tok = h[ksel], nd[ksel]
                c += 1

    def _mtp_step(
        self,
        reqs: Sequence[DraftSeq],
        past: list[int],
        q: list[int],
        next_tokens: torch.Tensor,
        prev_hidden: torch.Tensor,
        *,
        decode: bool,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One MTP forward over ``reqs`` (rows at positions ``past[b] ..``) in the draft domain.

        Args:
            reqs: the sequences (``request_id`` each).
            past: ``[n]`` first position of each sequence's rows.
            q: ``[n]`` rows per sequence.
            next_tokens: ``[sum(q)]`` token ``i + 1`` of each row.
            prev_hidden: ``[sum(q), D]`` hidden ``i`` of each row (target's, or the previous MTP step's).
            decode: rows are decode rows (chained steps) rather than a prefill-like catch-up.
            shared: ``(pool_ids [n, topk_pools], window_start [n])`` makes the MTP indexer reuse step 0's
                selection (index_share_for_mtp_iteration) instead of scoring.

        Returns:
            ``[sum(q), D]`` the MTP layer's output hidden.
        """
        dm = self.draft_manager
        rids = [r.request_id for r in reqs]
        # Target-domain description first; draft_replay then swaps slot table and state slots to the
        # draft manager's own (a no-op in shared mode).
        self.meta.prepare(rids, past_lens=past, q_lens=q, num_decode_seqs=len(rids) if decode else 0)
        if shared is not None:
            self.meta.spec.shared_pool_ids, self.meta.spec.shared_window_start = shared
        with torch.inference_mode(), draft_replay(self.meta, dm if self.separate else None):
            return self.model.mtp_forward(next_tokens, prev_hidden, self.meta, dm, self.mtp_plane)

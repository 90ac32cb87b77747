"""Per-step batch metadata, TensorRT-LLM ``AttentionMetadata`` style.

Everything a layer kernel (or a captured CUDA graph) reads lives in a persistent buffer allocated once
for ``max_num_seqs`` / ``max_num_tokens``; ``prepare()`` fills pinned host staging and issues one
non-blocking copy per buffer, so buffer addresses never change between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import traffic
from ..errors import TableWidthError
from ..state.spec_metadata import SpecMetadata

__all__ = ["AttentionMetadata", "HostStaging"]


class HostStaging:
    """Double-buffered (pinned where CUDA exists) host staging for non-blocking H2D copies.

    A pinned buffer must not be rewritten while an earlier non-blocking copy from it may still be in
    flight; alternating two sets and waiting on the event of the copy issued two steps ago makes reuse
    safe without a per-step device sync.

    Each set is also seen as numpy arrays (`arrays`, the same memory): the host fills staging through
    them, because a numpy op on a few dozen ints costs ~1 µs where a torch op costs ~5-10 µs, and a step
    description is a dozen such ops (`AttentionMetadata.prepare` went from ~80 to ~15 µs).
    """

    def __init__(self, specs: dict[str, tuple[torch.Size, torch.dtype]], *, pin_memory: bool) -> None:
        self._sets = [
            {k: torch.zeros(shape, dtype=dt, pin_memory=pin_memory) for k, (shape, dt) in specs.items()}
            for _ in range(2)
        ]
        self._arrays = [{k: t.numpy() for k, t in s.items()} for s in self._sets]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if pin_memory else None
        self._recorded = [False, False]
        self._cur = 0

    def acquire(self) -> dict[str, torch.Tensor]:
        """The staging set to fill now (waits for its previous copy to have been consumed)."""
        if self._events is not None and self._recorded[self._cur]:
            self._events[self._cur].synchronize()
        return self._sets[self._cur]

    @property
    def index(self) -> int:
        """Which of the two sets `acquire` returns now (0 or 1)."""
        return self._cur

    def all_arrays(self) -> list[dict[str, np.ndarray]]:
        """Numpy views of both sets (for initialising them)."""
        return self._arrays

    def arrays(self) -> dict[str, np.ndarray]:
        """Numpy views of the set `acquire` returned (call `acquire` first: it waits for the set)."""
        return self._arrays[self._cur]

    def release(self) -> None:
        """Mark the copies from the current set as issued and switch sets."""
        if self._events is not None:
            self._events[self._cur].record()
            self._recorded[self._cur] = True
        self._cur ^= 1


class AttentionMetadata:
    """The flat token batch of one step: decode/verify sequences first, then prefill chunks.

    Args:
        max_num_seqs: sequences per step the buffers hold.
        max_num_tokens: flat rows per step the buffers hold.
        device: where the device buffers live.

    Host attributes after ``prepare()`` (plain Python, for eager bookkeeping):
        request_ids, q_lens, past_lens, cu_seqlens (len num_seqs + 1), state_slots, num_seqs,
        num_decode_seqs, num_decode_tokens, num_tokens, max_kv_len.

    Device views after ``prepare()`` (slices of persistent buffers):
        positions_t ``[N]`` int64, row_seq_t ``[N]`` int64, row_live_t ``[N]`` int64, state_slots_t ``[B]`` int64,
        past_lens_t ``[B]`` int64, q_lens_t ``[B]`` int64, kv_lens_t ``[B]`` int64,
        cu_seqlens_t ``[B + 1]`` int64.

    CUDA-graph padding (docs/design.md §5): ``prepare(..., num_padding_seqs=n)`` marks the last ``n``
    sequences as padding of a captured batch size. Their rows get ``row_seq = -1`` (every sparse kernel
    and the tail-ring rollback skip such rows, so they write no page, pool or ring), and the KDA layers
    run them on the state slot they name (the executor's reserved padding slot). `trim_padding` drops
    them from the host description after the step ran.

    Row liveness: ``row_live_t`` is 1 on the rows whose outputs somebody reads and 0 on padding rows
    (``row_seq = -1``) and on the verify filler rows ``prepare(..., live_q_lens=...)`` names (rows of a real
    sequence past its proposed drafts: computed, never accepted). The MoE leaves dead rows' routed experts
    out (`trtllm_glm.modules.ffn.MoE`), so they make no expert's weights be read.
    """

    def __init__(self, *, max_num_seqs: int, max_num_tokens: int, device: torch.device | str = "cpu") -> None:
        if max_num_seqs <= 0 or max_num_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_tokens must be positive")
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        i64 = torch.int64
        B, N = max_num_seqs, max_num_tokens
        # [per-seq buffers]: state_slots, past_lens, q_lens, kv_lens, cu_seqlens (B + 1 wide).
        self._seq_buf = torch.zeros(5, B + 1, dtype=i64, device=self.device)
        # [per-token buffers]: positions, row_seq, row_live.
        self._tok_buf = torch.zeros(3, N, dtype=i64, device=self.device)
        # 0 .. B: cu_seqlens and row owners of one-row-per-sequence steps written on the device (`set_decode_rows`).
        self._arange = torch.arange(B + 1, dtype=i64, device=self.device)
        self._staging = HostStaging(
            {"seq": (self._seq_buf.shape, i64), "tok": (self._tok_buf.shape, i64)}, pin_memory=pin
        )
        # The description the device buffers hold as `prepare` copied it: ``(key, cu_seqlens)`` with ``key`` =
        # (num_padding_seqs, rows cut on real sequences (`_row_cuts`), q_lens, past_lens, state_slots); None once
        # something rewrote them on the device (`device_rewritten`). `prepare` neither stages nor copies a
        # description with the same key (an MTP catch-up described right after the verify it follows).
        self._described: tuple[tuple, list[int]] | None = None
        self.num_copies_skipped = 0
        # The scheduler's accepted counts of the previous step (`set_num_accepted`), persistent so that a
        # captured verify graph reads the same address every replay.
        self._acc_buf = torch.zeros(B, dtype=i64, device=self.device)
        # The counts last copied into ``_acc_buf`` while it still holds them (None once the device wrote it,
        # `accepted_written_on_device`): width-one rounds set all zeros every step, which need no copy after the first.
        self._acc_on_device: tuple[int, ...] | None = None
        self._acc_staging = HostStaging({"acc": (self._acc_buf.shape, i64)}, pin_memory=pin)
        self.num_padding_seqs = 0
        self.valid_q_lens: list[int] | None = None
        self.request_ids: list[int] = []
        self.q_lens: list[int] = []
        self.past_lens: list[int] = []
        self.cu_seqlens: list[int] = [0]
        self.state_slots: list[int] = []
        self.num_seqs = 0
        self.num_decode_seqs = 0
        self.num_decode_tokens = 0
        self.num_tokens = 0
        self.max_kv_len = 0
        # Speculative fields live apart, in their own dataclass (filled by the speculative executor after
        # prepare(); prepare() replaces it with an empty one).
        self.spec = SpecMetadata()
        self.kda_scratch: dict = {}  # per-step index tensors the KDA layers share (`kda.layer._step_cached`)

    # --------------------------------------------------------------------------------------------
    def prepare(
        self,
        request_ids: Sequence[int],
        past_lens: Sequence[int],
        q_lens: Sequence[int],
        state_slots: Sequence[int],
        num_decode_seqs: int,
        num_padding_seqs: int = 0,
        valid_q_lens: Sequence[int] | None = None,
        live_q_lens: Sequence[int] | None = None,
    ) -> None:
        """Describe this step's batch and refresh the device buffers in place.

        Args:
            request_ids: ``[B]`` request of each sequence; decode/verify sequences first.
            past_lens: ``[B]`` tokens already cached before this step.
            q_lens: ``[B]`` rows of each sequence this step (>= 1).
            state_slots: ``[B]`` state slot of each request.
            num_decode_seqs: how many leading sequences are decode/verify rows (the rest are prefill).
            num_padding_seqs: how many trailing sequences are CUDA-graph padding (``row_seq = -1``).
            valid_q_lens: optional ``[B]`` real rows of each sequence (``<= q_lens``); the rest of its rows are
                padding of a captured width (``row_seq = -1``). Page checks use these.
            live_q_lens: optional ``[B]`` leading rows of each sequence whose outputs are read (verify: one
                plus the proposed drafts); the rest get ``row_live = 0`` but keep their ``row_seq`` (they are
                computed like any row, caches included). Padding rows are never live.
        """
        B = len(request_ids)
        if not (len(past_lens) == len(q_lens) == len(state_slots) == B):
            raise ValueError("request_ids, past_lens, q_lens and state_slots must have the same length")
        if self.max_num_seqs < B:
            raise TableWidthError(f"{B} sequences exceed max_num_seqs={self.max_num_seqs}")
        if not 0 <= num_decode_seqs <= B:
            raise ValueError(f"num_decode_seqs={num_decode_seqs} outside [0, {B}]")
        if any(q <= 0 for q in q_lens) or any(p < 0 for p in past_lens):
            raise ValueError("q_lens must be >= 1 and past_lens >= 0")
        if not 0 <= num_padding_seqs <= B:
            raise ValueError(f"num_padding_seqs={num_padding_seqs} outside [0, {B}]")
        if valid_q_lens is not None and (
            len(valid_q_lens) != B or any(not 0 <= v <= q for v, q in zip(valid_q_lens, q_lens))
        ):
            raise ValueError("valid_q_lens must have one entry per sequence, each in [0, q_len]")
        if live_q_lens is not None and (
            len(live_q_lens) != B or any(not 0 <= v <= q for v, q in zip(live_q_lens, q_lens))
        ):
            raise ValueError("live_q_lens must have one entry per sequence, each in [0, q_len]")
        N = sum(q_lens)
        if self.max_num_tokens < N:
            raise TableWidthError(f"{N} tokens exceed max_num_tokens={self.max_num_tokens}")
        self.request_ids = list(request_ids)
        self.q_lens = list(q_lens)
        self.past_lens = list(past_lens)
        self.state_slots = list(state_slots)
        key = (num_padding_seqs, _row_cuts(valid_q_lens, live_q_lens, self.q_lens, B - num_padding_seqs),
               tuple(self.q_lens), tuple(self.past_lens), tuple(self.state_slots))  # fmt: skip
        if self._described is not None and self._described[0] == key:
            # The device buffers hold these very rows (an MTP catch-up described right after the verify it follows):
            # the host fields only, no staging, no copy.
            self._describe_host(self._described[1], N, num_decode_seqs, num_padding_seqs, valid_q_lens)
            self.num_copies_skipped += 1
            return
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        self._describe_host(cu, N, num_decode_seqs, num_padding_seqs, valid_q_lens)

        host = self._staging.acquire()
        arr = self._staging.arrays()
        sh, th = arr["seq"], arr["tok"]
        sh[0, :B] = self.state_slots
        sh[1, :B] = self.past_lens
        sh[2, :B] = self.q_lens
        sh[3, :B] = sh[1, :B] + sh[2, :B]
        sh[4, : B + 1] = cu
        if N:
            row_seq = np.repeat(np.arange(B, dtype=np.int64), sh[2, :B])
            th[1, :N] = row_seq
            th[0, :N] = (sh[1, :B] - sh[4, :B])[row_seq] + np.arange(N, dtype=np.int64)
            if num_padding_seqs:
                th[1, cu[B - num_padding_seqs] : N] = -1
            if valid_q_lens is not None:
                for b, (v, q) in enumerate(zip(valid_q_lens, q_lens)):
                    if v < q:
                        th[1, cu[b] + v : cu[b + 1]] = -1
            th[2, :N] = th[1, :N] >= 0
            if live_q_lens is not None:
                for b, (v, q) in enumerate(zip(live_q_lens, q_lens)):
                    if v < q:
                        th[2, cu[b] + v : cu[b + 1]] = 0
        sh, th = host["seq"], host["tok"]
        self._seq_buf.copy_(sh, non_blocking=True)
        self._tok_buf.copy_(th, non_blocking=True)
        traffic.put(n=2)
        self._staging.release()
        self._described = (key, cu)

    def _describe_host(
        self,
        cu: list[int],
        N: int,
        num_decode_seqs: int,
        num_padding_seqs: int,
        valid_q_lens: Sequence[int] | None,
    ) -> None:
        """`prepare`'s host fields other than the four per-sequence lists (set already)."""
        self.cu_seqlens = cu
        self.num_seqs = len(self.q_lens)
        self.num_decode_seqs = num_decode_seqs
        self.num_decode_tokens = cu[num_decode_seqs]
        self.num_tokens = N
        self.max_kv_len = max((p + q for p, q in zip(self.past_lens, self.q_lens)), default=0)
        self.num_padding_seqs = num_padding_seqs
        self.valid_q_lens = list(valid_q_lens) if valid_q_lens is not None else None
        self.spec = SpecMetadata()
        self.kda_scratch: dict = {}  # per-step index tensors the KDA layers share (`kda.layer._step_cached`)

    def device_rewritten(self) -> None:
        """The per-sequence and per-token buffers were (or will be, on the stream) rewritten on the device: the
        next `prepare` copies its description whatever it is (`set_decode_rows`, `describe_verify_rows`,
        `speculative.mtp.staging`, and the replay of a captured graph that calls them)."""
        self._described = None

    def set_decode_rows(self, past_lens: torch.Tensor, real: torch.Tensor, host_past_lens: Sequence[int]) -> None:
        """Make the current batch one decode row per sequence at device-held lengths, by device ops only.

        Nothing is copied from the host, so a captured CUDA graph can change its step's shape midway (the
        fused MTP draft: a catch-up over several rows per sequence, then chained single-row steps). The
        sequences, their state slots and the slot table stay; lengths, positions and row ownership are
        rewritten as `prepare` would write them for ``q_lens = 1``.

        Args:
            past_lens: ``[num_seqs]`` int64 on the device: each sequence's cached tokens before its row.
            real: ``[num_seqs]`` bool on the device; False makes the sequence's row a padding row
                (``row_seq = -1``).
            host_past_lens: ``[num_seqs]`` the same lengths for the host description (``max_kv_len``, which
                sizes the pool scores outside graph capture); placeholders are fine while capturing, where
                ``graph_max_pools`` bounds them.
        """
        B = self.num_seqs
        if past_lens.shape != (B,) or real.shape != (B,) or len(host_past_lens) != B:
            raise ValueError(f"set_decode_rows needs {B} lengths and flags, got {tuple(past_lens.shape)}")
        self.device_rewritten()
        seq, tok, ar = self._seq_buf, self._tok_buf, self._arange
        seq[1, :B].copy_(past_lens)
        seq[2, :B].fill_(1)
        torch.add(past_lens, 1, out=seq[3, :B])
        seq[4, : B + 1].copy_(ar[: B + 1])
        tok[0, :B].copy_(past_lens)
        tok[1, :B].copy_(torch.where(real, ar[:B], -1))
        tok[2, :B].copy_(real)
        self.q_lens = [1] * B
        self.past_lens = list(host_past_lens)
        self.cu_seqlens = list(range(B + 1))
        self.num_decode_seqs = B
        self.num_decode_tokens = B
        self.num_tokens = B
        self.max_kv_len = max((p + 1 for p in self.past_lens), default=0)
        self.valid_q_lens = None
        self.spec = SpecMetadata()
        self.kda_scratch: dict = {}  # per-step index tensors the KDA layers share (`kda.layer._step_cached`)

    def describe_verify_rows(self, width: int, host_past_lens: Sequence[int]) -> None:
        """Make the current batch ``width`` verify rows per sequence whose lengths are known only on the device (a round
        launched before the previous round's accepted counts reached the host): the host's description, for
        lengths bounded by ``host_past_lens`` (an upper bound only sizes ``max_kv_len``). The device buffers
        (`row_buffers`) are the caller's to write, as `prepare` would for ``q_lens = [width] * num_seqs``
        (`runtime.verify_staging`); the next `prepare` copies its description whatever they hold."""
        B = self.num_seqs
        if width < 1 or self.max_num_tokens < B * width:
            raise ValueError(f"{B} sequences of {width} rows do not fit max_num_tokens={self.max_num_tokens}")
        if len(host_past_lens) != B:
            raise ValueError(f"describe_verify_rows needs {B} host lengths, got {len(host_past_lens)}")
        self.device_rewritten()
        self.q_lens = [width] * B
        self.past_lens = list(host_past_lens)
        self.cu_seqlens = [width * b for b in range(B + 1)]
        self.num_decode_seqs = B
        self.num_decode_tokens = B * width
        self.num_tokens = B * width
        self.max_kv_len = max((p + width for p in self.past_lens), default=0)
        self.valid_q_lens = None

    def accepted_written_on_device(self) -> None:
        """The device wrote ``accepted_buffer[:num_seqs]`` (a round launched before the previous one was read back:
        `runtime.verify_staging`): ``spec.num_accepted_t`` views it, and the next `set_num_accepted` copies its counts
        whatever they were."""
        self._acc_on_device = None
        self.spec.num_accepted_t = self._acc_buf[: self.num_seqs]

    @property
    def row_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq [5, max_num_seqs + 1], tok [3, max_num_tokens])`` int64: the persistent per-sequence rows (state
        slots, past, q lens, kv lens, cumulative rows) and per-row rows (position, owner or -1, live) the graphs read;
        a device-side writer calls `describe_verify_rows` (or the like) for the host's side."""
        return self._seq_buf, self._tok_buf

    @property
    def accepted_buffer(self) -> torch.Tensor:
        """``[B]`` int64 persistent accepted counts of the previous step (`set_num_accepted`): a captured graph reads
        this address every replay."""
        return self._acc_buf

    def set_num_accepted(self, counts: Sequence[int]) -> None:
        """Set ``spec.num_accepted_t`` ``[num_seqs]`` from per-sequence counts (padding entries get 0).

        The counts go into a persistent buffer (one non-blocking copy), never a fresh tensor, so a graph
        captured with them reads the live values on replay.

        Args:
            counts: ``[n]`` with ``n <= num_seqs`` accepted rows of each leading sequence's previous step.
        """
        if len(counts) > self.num_seqs:
            raise ValueError(f"{len(counts)} accepted counts for {self.num_seqs} sequences")
        key = tuple(counts)
        if key != self._acc_on_device:
            host = self._acc_staging.acquire()["acc"]
            arr = self._acc_staging.arrays()["acc"]
            arr[:] = 0
            arr[: len(counts)] = counts
            self._acc_buf.copy_(host, non_blocking=True)
            traffic.put()
            self._acc_staging.release()
            # (The whole buffer was written: counts past ``len(counts)`` are 0, as the same key writes them.)
            self._acc_on_device = key
        self.spec.num_accepted_t = self._acc_buf[: self.num_seqs]

    def trim_padding(self) -> None:
        """Drop the padding sequences from the host description (the device buffers keep them).

        After a padded (captured) step the executor commits and samples only the real sequences; the
        device views (``state_slots_t`` ...) then cover the real prefix as well.
        """
        n = self.num_padding_seqs
        if not n:
            return
        B = self.num_seqs - n
        self.request_ids = self.request_ids[:B]
        self.q_lens = self.q_lens[:B]
        self.past_lens = self.past_lens[:B]
        self.state_slots = self.state_slots[:B]
        self.cu_seqlens = self.cu_seqlens[: B + 1]
        self.num_seqs = B
        self.num_decode_seqs = min(self.num_decode_seqs, B)
        self.num_decode_tokens = self.cu_seqlens[self.num_decode_seqs]
        self.num_tokens = self.cu_seqlens[-1]
        self.max_kv_len = max((p + q for p, q in zip(self.past_lens, self.q_lens)), default=0)
        self.num_padding_seqs = 0
        if self.valid_q_lens is not None:
            self.valid_q_lens = self.valid_q_lens[:B]
        self.spec.verify_seqs = [b for b in self.spec.verify_seqs if b < B]
        if self.spec.num_accepted_t is not None:
            self.spec.num_accepted_t = self.spec.num_accepted_t[:B]

    # --------------------------------------------------------------------------------------------
    @property
    def positions_t(self) -> torch.Tensor:
        return self._tok_buf[0, : self.num_tokens]

    @property
    def row_seq_t(self) -> torch.Tensor:
        return self._tok_buf[1, : self.num_tokens]

    @property
    def row_live_t(self) -> torch.Tensor:
        """``[N]`` int64: 1 where the row's output is read, 0 on padding and verify filler rows."""
        return self._tok_buf[2, : self.num_tokens]

    @property
    def state_slots_t(self) -> torch.Tensor:
        return self._seq_buf[0, : self.num_seqs]

    @property
    def past_lens_t(self) -> torch.Tensor:
        return self._seq_buf[1, : self.num_seqs]

    @property
    def q_lens_t(self) -> torch.Tensor:
        return self._seq_buf[2, : self.num_seqs]

    @property
    def kv_lens_t(self) -> torch.Tensor:
        return self._seq_buf[3, : self.num_seqs]

    @property
    def cu_seqlens_t(self) -> torch.Tensor:
        return self._seq_buf[4, : self.num_seqs + 1]

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent tensors a captured graph may read, by name (for address checks)."""
        return {"seq_buf": self._seq_buf, "tok_buf": self._tok_buf, "acc_buf": self._acc_buf}


def _row_cuts(
    valid_q_lens: Sequence[int] | None, live_q_lens: Sequence[int] | None, q_lens: list[int], real: int
) -> tuple | None:
    """The rows a description cuts from its ``real`` leading (non-padding) sequences: ``(valid, live)`` with each
    None when it cuts none (all ``q_lens``), or None when neither does (padding sequences' rows are never valid or
    live whatever the counts say)."""
    v = l_ = None
    # (Counts are at most ``q_lens``: any difference is a cut.)
    if valid_q_lens is not None and list(valid_q_lens[:real]) != q_lens[:real]:
        v = tuple(valid_q_lens[:real])
    if live_q_lens is not None and list(live_q_lens[:real]) != q_lens[:real]:
        l_ = tuple(live_q_lens[:real])
    return None if v is None and l_ is None else (v, l_)

"""The drafter interface and the parallel drafters (no model: the n-gram and oracle drafters).

Every drafter proposes the next round's drafts of a step's sequences through one call,
`Drafter.draft(seqs, hidden)`, after the step is committed; `Drafter.release` forgets a request (finish,
abort, preemption). The MTP drafter (`speculative/mtp/`) implements the same interface. This package
sits below the runtime: it knows requests only through `DraftSeq` and never imports `runtime/`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import traffic
from ..transfer import to_device

__all__ = [
    "PENDING_DRAFT",
    "DeviceDrafts",
    "DraftSeq",
    "DraftState",
    "Drafter",
    "NGramDrafter",
    "OracleAcceptanceDrafter",
    "OracleDrafter",
    "ParallelDrafter",
]

# What ``DraftState.drafts`` holds in place of a draft still on the device (never a token id: if one ever
# reached the model, the embedding lookup would fail loudly instead of verifying a wrong token).
PENDING_DRAFT = -1


class DeviceDrafts:
    """One drafting call's drafts, still on the device and on their way to the host.

    A drafter that drafts on the device (the fused MTP draft graph) can return without waiting for its
    drafts: the next verify step takes them as its input rows on the device (`DeviceDrafts.tensor`), and the
    host reads them (`rows`) once that step is launched. The GPU then runs the verify right behind the
    draft instead of idling while the host reads the drafts back and prepares the step.

    Args:
        tensor: ``[n, K]`` int64 drafts on the device; it may be a view of a graph's output buffer, so it is
            valid until the drafter's next call (by then every state holding it was resolved: the
            speculative executor resolves them all after each forward, and drafting follows a forward).
        host: ``[>= n, K]`` int64 pinned host buffer for the copy (CUDA; ``None`` on the CPU), not reused
            before `rows` returned.
    """

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor | None = None) -> None:
        self.tensor = tensor
        self.event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            if host is None or not host.is_pinned():
                raise ValueError("drafts on a CUDA device need a pinned host buffer")
            self._host = host[: tensor.shape[0]]
            self._host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._host = tensor.clone()
        self._rows: list[list[int]] | None = None

    def rows(self, ready: bool = False) -> list[list[int]]:
        """``[n][K]`` the drafts as host ints (waits for the copy the first time).

        ``ready``: the host has already waited for work queued behind the copy on its stream (the results of the
        verify step that took these drafts): the copy is done and nothing waits (a blocking read is counted only
        when the event is not complete after all, `trtllm_glm.traffic`)."""
        if self._rows is None:
            ev = self.event
            if not ready or (ev is not None and not ev.query()):
                traffic.read("speculative/drafters.py DeviceDrafts.rows")
                if ev is not None:
                    ev.synchronize()
            self._rows = self._host.tolist()
        return self._rows


@dataclass
class DraftState:
    """Per-request speculative state kept across rounds (the speculative executor's ``state[rid]``).

    While ``pending`` is set, ``drafts`` holds `PENDING_DRAFT` placeholders (its length is the round's draft
    count) and the values are row ``pending[1]`` of ``pending[0]`` (`DeviceDrafts`); `resolve` fetches them.
    """

    drafts: list[int] = field(default_factory=list)
    mtp_len: int = 0  # tokens whose (token i+1, hidden i) pair is in the MTP cache
    last_accepted: int = 0  # rows accepted in the previous verify round (tail-ring cross-check)
    index: int = 0  # submission index (oracle drafters key on it)
    mtp_disabled: bool = False  # the draft pool could not hold its history: width-one from here on
    num_proposed: int | None = None  # drafts the drafter proposed; the rest of ``drafts`` is graph filler
    pending: tuple[DeviceDrafts, int] | None = None  # drafts still on the device (see above)
    # Committed rows after ``mtp_len`` whose target hidden is held for a later MTP catch-up (`MTPDrafter`'s lag).
    lag: int = 0

    def resolve(self, ready: bool = False) -> list[int]:
        """``drafts`` with any pending values fetched from the device (waits for their copy unless ``ready``:
        `DeviceDrafts.rows`)."""
        if self.pending is not None:
            src, j = self.pending
            self.pending = None
            self.drafts = src.rows(ready)[j][: len(self.drafts)]
        return self.drafts

    def mtp_history_at(self, num_computed: int) -> bool:
        """Whether the MTP history (caught up ``mtp_len`` plus ``lag`` held rows) ends at ``num_computed``: the
        step's rows were caught up or held ahead already (`MTPDrafter.catch_up_ahead`)."""
        return self.mtp_len + self.lag == num_computed

    def clear(self) -> None:
        """Drop this round's drafts (pending ones included)."""
        self.drafts, self.num_proposed, self.pending = [], None, None


@dataclass
class DraftSeq:
    """One sequence of the step just committed, as a drafter sees it.

    Attributes:
        request_id: the request.
        state: its `DraftState`; the drafter sets ``state.drafts``.
        tokens: the request's tokens (prompt + emitted, the step's emitted tokens included).
        num_output: tokens emitted so far.
        num_computed: committed length after the step.
        committed: rows of this step that were committed (all rows, or root + accepted drafts).
        row_offset: first row of the sequence in the step's hidden ``[N, D]``.
        greedy: whether the request samples greedily (only greedy requests speculate).
        live: False when the request finished this step.
        want: drafts wanted for the next round (0: a width-one round).
    """

    request_id: int
    state: DraftState
    tokens: Sequence[int]
    num_output: int
    num_computed: int
    committed: int
    row_offset: int
    greedy: bool
    live: bool
    want: int


class Drafter(ABC):
    """Proposes up to ``max_draft_len`` drafts per request for the next verify round."""

    max_draft_len: int

    @abstractmethod
    def draft(self, seqs: Sequence[DraftSeq], hidden: torch.Tensor) -> None:
        """Set ``seq.state.drafts`` (at most ``seq.want`` tokens) for the step's sequences.

        A drafter may leave them on the device (``seq.state.pending``, `DeviceDrafts`) when its caller
        allows it (the MTP drafter's ``defer``); the caller then resolves them (`DraftState.resolve`).

        Args:
            seqs: every sequence of the step, in batch order (finished ones with ``live=False``).
            hidden: ``[N, D]`` the step's final target hidden of every row.
        """

    def release(self, request_id: int) -> None:  # noqa: B027 - an optional hook, no-op by default
        """Forget ``request_id``'s drafter-side state (finish, abort or preemption)."""

    def needs_idle_call(self, states: Sequence[DraftState], num_computed: Sequence[int]) -> bool:
        """Whether a round where nobody drafts (every ``want`` 0) must still call `draft` for the step's live greedy
        sequences (their states and committed lengths after the step); False lets the caller skip building the
        `DraftSeq` list, which at large batch costs more host time than the rest of a width-one round's drafting
        work. True (always call) unless the drafter knows the call would do nothing."""
        return True


class ParallelDrafter(Drafter):
    """A drafter that proposes per request from its tokens alone (no model state)."""

    @abstractmethod
    def propose_seq(self, seq: DraftSeq) -> list[int]:
        """Up to ``seq.want`` drafts for ``seq``."""

    def needs_idle_call(self, states: Sequence[DraftState], num_computed: Sequence[int]) -> bool:
        return False  # `draft` proposes only where ``want > 0``

    def draft(self, seqs: Sequence[DraftSeq], hidden: torch.Tensor) -> None:
        for seq in seqs:
            if seq.live and seq.want > 0:
                seq.state.drafts = list(self.propose_seq(seq)[: seq.want])


class _NGramIndex:
    """The latest start of every ``min_n .. max_n``-gram of a growing token list that ends before its last
    token: exactly the occurrences `NGramDrafter.propose` scans for, kept up to date as tokens are appended.

    ``end`` is how many positions have their ending n-grams indexed; with ``T`` tokens, positions up to
    ``T - 2`` are (an n-gram starting at ``s <= T - 1 - n``: it starts before a length-``n`` suffix does).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.end = 0

    def extend(self, toks: Sequence[int]) -> None:
        for e in range(self.end, len(toks) - 1):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self.latest[tuple(toks[e - n + 1 : e + 1])] = e - n + 1  # later starts overwrite: the latest
        self.end = max(self.end, len(toks) - 1)


class NGramDrafter(ParallelDrafter):
    """Prompt lookup: match the longest suffix (``max_n`` down to ``min_n`` tokens) against earlier text
    and propose what followed its most recent earlier occurrence.

    `propose` is the plain scan (the reference: O(context) per call, ~0.2 ms at 512 tokens and ~3.5 ms at 8K
    when nothing matches); the executor's calls (`propose_seq`) look the suffixes up in a per-request index
    (`_NGramIndex`) extended by the tokens appended since the last call, with the same result.

    Args:
        max_draft_len: most drafts per proposal.
        max_n: longest suffix tried.
        min_n: shortest suffix accepted.
    """

    def __init__(self, max_draft_len: int, max_n: int = 4, min_n: int = 1) -> None:
        self.max_draft_len = max_draft_len
        self.max_n = max_n
        self.min_n = min_n
        self._index: dict[int, _NGramIndex] = {}

    def release(self, request_id: int) -> None:
        self._index.pop(request_id, None)

    def propose_indexed(self, request_id: int, tokens: Sequence[int], k: int) -> list[int]:
        """`propose` through ``request_id``'s index (built on first use; ``tokens`` may only grow)."""
        k = min(k, self.max_draft_len)
        T = len(tokens)
        if k <= 0 or T < 2:
            return []
        idx = self._index.get(request_id)
        if idx is None or idx.end > T - 1:  # new, or a token list that shrank: index it afresh
            idx = self._index[request_id] = _NGramIndex(self.min_n, self.max_n)
        idx.extend(tokens)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            s = idx.latest.get(tuple(tokens[T - n :]))
            if s is not None:
                return list(tokens[s + n : s + n + k])
        return []

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``min(k, max_draft_len)`` drafts following ``tokens`` (empty when nothing matches)."""
        k = min(k, self.max_draft_len)
        T = len(tokens)
        if k <= 0 or T < 2:
            return []
        toks = list(tokens)
        for n in range(min(self.max_n, T - 1), self.min_n - 1, -1):
            suffix = toks[T - n :]
            # Most recent earlier occurrence whose continuation starts before the suffix itself.
            for s in range(T - n - 1, -1, -1):
                if toks[s : s + n] == suffix:
                    cont = toks[s + n : s + n + k]
                    if cont:
                        return cont
        return []

    def propose_seq(self, seq: DraftSeq) -> list[int]:
        return self.propose_indexed(seq.request_id, seq.tokens, seq.want)


class OracleDrafter(ParallelDrafter):
    """Replays a known continuation, corrupting chosen draft positions (tests, and the end-to-end benchmark's
    controlled-acceptance runs: it stays in the package because `benchmarks/bench_e2e.py` needs it).

    Args:
        continuation: ``request_index -> the target's greedy output tokens`` (from a non-speculative run).
        corrupt: ``(request_index, output_position) -> bool``; a corrupted draft is replaced by a different
            token, so the target must reject it.
        vocab_size: token range for corruptions.
    """

    def __init__(
        self,
        continuation: dict[int, list[int]],
        corrupt: Callable[[int, int], bool] | None = None,
        vocab_size: int = 256,
    ) -> None:
        self.continuation = continuation
        self.corrupt = corrupt or (lambda i, j: False)
        self.vocab_size = vocab_size
        self.max_draft_len = 1 << 30  # the executor's width bounds it

    def propose_seq(self, seq: DraftSeq) -> list[int]:
        return self.propose_for(seq.state.index, seq.num_output, seq.want)

    def propose_for(self, index: int, num_output: int, k: int) -> list[int]:
        """Drafts for output positions ``num_output .. num_output + k - 1`` of request ``index``."""
        ref = self.continuation.get(index, [])
        out = []
        for j in range(num_output, min(num_output + k, len(ref))):
            t = ref[j]
            if self.corrupt(index, j):
                t = (t + 1 + j) % self.vocab_size
                if t == ref[j]:
                    t = (t + 1) % self.vocab_size
            out.append(t)
        return out


class OracleAcceptanceDrafter(Drafter):
    """Drafts through a real drafter (its full cost) but proposes an oracle's tokens: the end-to-end benchmark's
    way to time MTP rounds at a chosen acceptance rate (random weights accept nothing).

    ``inner`` (the MTP drafter) runs exactly as it would: its catch-up, its chained steps and the LM head of
    each; then each sequence's drafts are replaced by ``oracle``'s for the same positions (right with the
    oracle's rate). Drafts the inner drafter left on the device (`DeviceDrafts`, the fused MTP graph) are
    replaced on the device: the oracle's tokens are copied up and queued behind the draft on the same stream,
    so the verify still waits for the MTP compute and no host synchronisation is added.

    Args:
        inner: the drafter whose compute is timed (attributes such as ``chain_graphs`` are reached through).
        oracle: proposes the tokens (`OracleDrafter`: a continuation with chosen positions corrupted).
        vocab_size: token range (fills a proposal cut short by the end of the continuation).
    """

    def __init__(self, inner: Drafter, oracle: OracleDrafter, vocab_size: int) -> None:
        self.inner = inner
        self.oracle = oracle
        self.vocab_size = vocab_size
        self.max_draft_len = inner.max_draft_len
        self._host: torch.Tensor | None = None  # pinned landing buffer of the replaced device drafts

    def __getattr__(self, name: str) -> object:
        # Only called for attributes this object lacks: the inner drafter's (chain_graphs, defer, ...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def release(self, request_id: int) -> None:
        self.inner.release(request_id)

    def _oracle_row(self, seq: DraftSeq, k: int) -> list[int]:
        row = self.oracle.propose_for(seq.state.index, seq.num_output, k)
        while len(row) < k:  # past the continuation: a token the target will not take there
            row.append((row[-1] + 1) % self.vocab_size if row else (int(seq.tokens[-1]) + 1) % self.vocab_size)
        return row

    def draft(self, seqs: Sequence[DraftSeq], hidden: torch.Tensor) -> None:
        self.inner.draft(seqs, hidden)
        on_device: list[tuple[DraftSeq, list[int]]] = []
        for s in seqs:
            if not s.live or not s.state.drafts:
                continue
            row = self._oracle_row(s, len(s.state.drafts))
            if s.state.pending is not None:
                on_device.append((s, row))
            else:
                s.state.drafts = row
        if not on_device:
            return
        # One [n, K] device tensor of the oracle's tokens, queued behind the draft; its host copy is what the
        # executor reads back for acceptance, the device rows what the verify takes as input.
        K = max(len(r) for _, r in on_device)
        rows = [r + [r[-1]] * (K - len(r)) for _, r in on_device]
        dev = on_device[0][0].state.pending[0].tensor.device  # type: ignore[index]
        host = None
        if dev.type == "cuda":
            if self._host is None or self._host.shape[0] < len(rows) or self._host.shape[1] < K:
                self._host = torch.zeros(max(len(rows), 64), K, dtype=torch.int64, pin_memory=True)
            host = self._host[:, :K]
        # Through the pinned staging ring: a plain host tensor's copy would wait for the stream (the draft).
        t = to_device([x for r in rows for x in r], dev, torch.int64).view(len(rows), K)
        pend = DeviceDrafts(t, host)
        for j, (s, _) in enumerate(on_device):
            s.state.pending = (pend, j)


# Counted by their own site (`traffic`): their tensor read is of a host buffer.
traffic.HOST_BUFFER_READERS.add(DeviceDrafts.rows.__code__)

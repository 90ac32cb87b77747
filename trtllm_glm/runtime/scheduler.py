"""Batch scheduling: decode rows first, then prefill chunks under a token budget.

In the batch-invariant mode (`trtllm_glm.numerics`) a prompt's chunk boundaries are a function of the prompt
alone: chunks end at multiples of `Scheduler.invariant_chunk` (or at the prompt's end), and a chunk that does
not fit the step's budget waits for a later step instead of being cut shorter. Otherwise the budget left by the
decode rows would move the boundaries, and with them the chunked recurrent (KDA) state's bits. A preempted
request recomputes its generated tokens one row per step, as its decode steps computed them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..numerics import batch_invariant
from .request import Request

__all__ = ["ScheduledSeq", "Scheduler", "check_mixed_prefill_budget"]


def check_mixed_prefill_budget(value: object) -> None:
    """Refuse a `Scheduler.mixed_prefill_budget` that is not a positive int (rows) or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"mixed_prefill_budget must be a positive int (rows) or None, got {value!r}")


@dataclass
class ScheduledSeq:
    """One sequence of a step: ``num_rows`` rows starting at ``request.num_computed``.

    ``past_len`` overrides that start for a step launched before the previous one was read back (the
    overlap scheduler: the request's host length is one behind then).
    """

    request: Request
    num_rows: int
    is_decode: bool
    past_len: int | None = None

    @property
    def start(self) -> int:
        """Cached tokens before this step's rows."""
        return self.request.num_computed if self.past_len is None else self.past_len


class Scheduler:
    """Builds mixed batches (TensorRT-LLM's capacity + micro-batch scheduling, simplified).

    Args:
        max_batch_size: sequences per step.
        max_num_tokens: flat rows per step (decode rows count one each, or their verify width).
        prefill_chunk_size: cap on one prefill chunk (``None``: only the token budget caps it); in the
            batch-invariant mode the chunk grid (`invariant_chunk`).
        mixed_prefill_budget: cap on all prefill rows of a step that also decodes (``None``: only the token budget
            caps them). A step's cost grows with its rows (a MoE touches more experts), and every decoding sequence
            waits for the whole step: the cap bounds the inter-token gap an admission makes, at the price of
            prefilling a prompt over more steps (Sarathi-Serve's stall-free batching). A step with nothing to
            decode is not capped. In the batch-invariant mode a chunk is whole or deferred, so the step's first
            chunk goes even when larger than the cap (else a chunk wider than the cap would never be scheduled).
    """

    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        prefill_chunk_size: int | None = None,
        mixed_prefill_budget: int | None = None,
    ) -> None:
        if max_batch_size <= 0 or max_num_tokens <= 0:
            raise ValueError("max_batch_size and max_num_tokens must be positive")
        if prefill_chunk_size is not None and prefill_chunk_size <= 0:
            raise ValueError("prefill_chunk_size must be positive")
        check_mixed_prefill_budget(mixed_prefill_budget)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.mixed_prefill_budget = mixed_prefill_budget

    @property
    def invariant_chunk(self) -> int:
        """The batch-invariant mode's chunk grid: ``prefill_chunk_size`` (at most ``max_num_tokens``), else half
        of ``max_num_tokens`` (so that a whole chunk still fits beside the decode rows of a busy step)."""
        if self.prefill_chunk_size is not None:
            return min(self.prefill_chunk_size, self.max_num_tokens)
        return max(1, self.max_num_tokens // 2)

    @staticmethod
    def _invariant_chunk_rows(r: Request, grid: int) -> int:
        """The mode's next chunk of ``r``: to the next multiple of ``grid`` inside the prompt, never past the
        prompt's end; beyond the prompt (a preempted request recomputing what it generated) one row, as the
        decode steps that first computed those rows had."""
        c, prompt = r.num_computed, len(r.prompt_ids)
        if c >= prompt:
            return 1
        return min(r.num_pending, grid - c % grid, prompt - c)

    def schedule(
        self, running: Iterable[Request], waiting: Iterable[Request], decode_width: dict[int, int] | None = None
    ) -> list[ScheduledSeq]:
        """Pick this step's sequences.

        Args:
            running: admitted requests, oldest first.
            waiting: requests not yet admitted, in arrival order (admitted here while budget lasts).
            decode_width: rows a decode request needs this step (speculative verify width), default 1.

        Returns:
            Decode sequences first, then prefill chunks.
        """
        decode_width = decode_width or {}
        budget = self.max_num_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        running = list(running)
        for r in running:
            if r.is_decode and len(decodes) < self.max_batch_size:
                w = decode_width.get(r.request_id, 1)
                if w <= budget:
                    decodes.append(ScheduledSeq(r, w, True))
                    budget -= w
        n_seqs = len(decodes)
        grid = self.invariant_chunk if batch_invariant() else None
        # Prefill rows this step may still take beside its decode rows (`mixed_prefill_budget`).
        mixed = self.mixed_prefill_budget if decodes and self.mixed_prefill_budget is not None else None
        for r in [*[r for r in running if not r.is_decode], *waiting]:
            if n_seqs >= self.max_batch_size or budget <= 0 or (mixed is not None and mixed <= 0):
                break
            if grid is not None:
                n = self._invariant_chunk_rows(r, grid)
                if n > budget or (mixed is not None and n > mixed and prefills):
                    continue
            else:
                n = min(r.num_pending, budget, mixed if mixed is not None else budget)
            if self.prefill_chunk_size is not None:
                n = min(n, self.prefill_chunk_size)
            prefills.append(ScheduledSeq(r, n, False))
            budget -= n
            if mixed is not None:
                mixed -= n
            n_seqs += 1
        return decodes + prefills

"""Parallel drafters: propose up to K next tokens from a request's token history without a model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["NGramDrafter", "OracleDrafter"]


class NGramDrafter:
    """Prompt lookup: match the longest suffix (``max_n`` down to ``min_n`` tokens) against earlier text
    and propose what followed its most recent earlier occurrence.

    Args:
        max_draft_len: most drafts per proposal.
        max_n: longest suffix tried.
        min_n: shortest suffix accepted.
    """

    def __init__(self, max_draft_len: int, max_n: int = 4, min_n: int = 1) -> None:
        self.max_draft_len = max_draft_len
        self.max_n = max_n
        self.min_n = min_n

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


class OracleDrafter:
    """Test drafter: replays a known continuation, corrupting chosen draft positions.

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

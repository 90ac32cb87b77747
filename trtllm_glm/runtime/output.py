"""Server-side output processing: incremental detokenization, stop strings and token strings.

The executor emits token ids; a server streams text. `OutputProcessor` turns one request's growing token
list into text deltas, holds back text that may still change (an unfinished UTF-8 sequence, the start of
a stop string) and truncates the text at the first stop string. Tokens are fed one at a time, so the text
(and the number of tokens counted before a stop string) does not depend on how many tokens an engine step
emitted (speculative steps emit several).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "OutputProcessor", "TokenStrings"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing token list, released piece by piece.

    Each new token re-decodes a short window: the tokens of the last released piece (``[prefix, read)``,
    context that tokenizers with leading-space or byte-fallback rules need) plus the unreleased ones. The
    text is released only when it grew and does not end in U+FFFD, which is what an unfinished multi-byte
    character decodes to; `flush` releases whatever is left at the end.

    Args:
        tokenizer: an object with ``decode(ids, skip_special_tokens=True) -> str``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def add(self, token: int) -> str:
        """Append ``token``; returns the text released by it (often ``""``)."""
        self.ids.append(int(token))
        return self._release(final=False)

    def flush(self) -> str:
        """Release the text still held back (the sequence ended)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._tok.decode(self.ids[self._prefix : self._read])
        now = self._tok.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or (now.endswith(_REPLACEMENT) and not final):
            if final:
                self._read = len(self.ids)
            return ""
        piece = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


class OutputProcessor:
    """Detokenizes one generation and applies its stop strings.

    Text that could be the beginning of a stop string is held back until it is known not to be one, so a
    stream never shows text that the final response leaves out. The returned text excludes the stop
    string (OpenAI semantics).

    Args:
        tokenizer: the model's tokenizer.
        stop: stop strings (non-empty).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = list(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.text = ""  # released text
        self.stopped = False

    @property
    def decoded_len(self) -> int:
        """Characters decoded so far (released plus held back): where the next token's text starts."""
        return len(self.text) + len(self._held)

    def add(self, token: int) -> str:
        """Feed one token; returns the newly released text. Sets `stopped` when a stop string appeared."""
        if self.stopped:
            raise RuntimeError("add() after a stop string ended the output")
        return self._take(self.detok.add(token), final=False)

    def finish(self) -> str:
        """The sequence ended: release everything held back (still applying the stop strings)."""
        if self.stopped:
            return ""
        return self._take(self.detok.flush(), final=True)

    def _take(self, new: str, *, final: bool) -> str:
        buf = self._held + new
        if not self.stop:
            self._held = ""
            self.text += buf
            return buf
        # A stop string cannot straddle released text: its start would have been held back.
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            out = buf[: min(hits)]
            self._held = ""
            self.text += out
            self.stopped = True
            return out
        hold = 0 if final else self._partial_stop_len(buf)
        out = buf[: len(buf) - hold]
        self._held = buf[len(buf) - hold :]
        self.text += out
        return out

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


class TokenStrings:
    """The text and UTF-8 bytes of single tokens (for logprobs), cached.

    Token strings must tell tokens apart (the completions API keys ``top_logprobs`` by them), so: a token
    whose bytes are not valid UTF-8 on their own (one byte of a multi-byte character) is spelled
    ``bytes:\\xe4`` (OpenAI's convention), with its real bytes in ``bytes``; a token that decodes to nothing
    (a spare vocabulary row) is ``token_id:261`` (vLLM's); special tokens are spelled out (``<|eos|>``).

    Args:
        tokenizer: the model's tokenizer (`ByteTokenizer` gets exact bytes through ``decode_bytes``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of ``token``."""
        hit = self._cache.get(token)
        if hit is None:
            text = self._tok.decode([token], skip_special_tokens=False)
            raw = None
            if hasattr(self._tok, "decode_bytes"):
                raw = self._tok.decode_bytes([token])
            if not raw:
                raw = text.encode("utf-8")
            if _REPLACEMENT in text:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if not text:
                text = f"token_id:{token}"
            hit = (text, list(raw))
            if len(self._cache) < 1 << 16:
                self._cache[token] = hit
        return hit

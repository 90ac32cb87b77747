"""Structured output: grammars compiled against the tokenizer's vocabulary, and token masks on the logits.

Each request with ``SamplingParams.guided_decoding`` gets a `RequestGrammar` (an ``llguidance`` matcher, imported on
first use) at admission; `GrammarCompiler` keeps an LRU of built matchers that requests copy. Masks are bitmasks
``[rows, ceil(V / 32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed), filled on the host and
applied on the logits' device; verify row ``j`` is masked with the state after drafts ``0 .. j - 1`` and the
matcher keeps the accepted tokens only. Behaviour, reasoning modes and why llguidance: docs/python_api.md,
"Structured output"; under speculation: docs/speculation.md, "Speculation under a grammar".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import envs
from ..logits import apply_bitmask

__all__ = [
    "GuidedDecodingParams",
    "GrammarCompiler",
    "RequestGrammar",
    "apply_token_bitmask",
    "bitmask_words",
    "fill_bitmasks",
    "allowed_tokens",
    "JSON_DEFAULTS",
    "REASONING_MODES",
    "THINK_OPEN",
    "THINK_CLOSE",
]

# How generated JSON is spaced unless the schema's own "x-guidance" says otherwise: one space after ':' and
# ',' and no other whitespace (Python's json.dumps). Free whitespace lets a weak model pad forever; a fixed
# layout always progresses.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct grammars kept compiled (each holds its lexer tables; a few MB at most for a big schema).
CACHE_SIZE = 256
# Where a constrained output's thinking is (`GuidedDecodingParams.reasoning`): None, the grammar applies from the
# first token; "inside", the output starts inside the thinking (the prompt ends with the opening tag); "optional",
# the output may open the thinking with the opening tag (else it is the answer from its first token).
REASONING_MODES = ("inside", "optional")
# GLM's reasoning tags (the glm45 reasoning parser's: serve/reasoning.py).
THINK_OPEN, THINK_CLOSE = b"<think>", b"</think>"


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What the output must match (exactly one field set; TensorRT-LLM's ``GuidedDecodingParams``).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it.
        json_object: the output is any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        grammar: a context-free grammar in llguidance's Lark dialect (``start: ...``), or GBNF (llama.cpp's);
            ``%json {schema}`` inlines a JSON schema.
        reasoning: ``None`` (default): the grammar applies from the first output token. ``"inside"``: the output
            starts inside a ``<think>`` block (the prompt ends with ``<think>``, as GLM's templates write it with
            thinking on): free text up to ``</think>``, then the grammar. ``"optional"``: the output may open the
            thinking with ``<think>`` (leading whitespace allowed); otherwise it is the answer from its first
            non-whitespace token. End of sequence is not allowed inside the thinking.
        max_reasoning_tokens: with ``reasoning``: after this many tokens of thinking only the closing tag may
            follow (``None``: no cap; the request's ``max_tokens`` still bounds the whole output).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    reasoning: str | None = None
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the problem (the grammar itself is checked when it is compiled)."""
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object must be a bool, got {self.json_object!r}")
        given = [n for n in ("json", "regex", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "guided_decoding: give exactly one of json, json_object, regex or grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"guided_decoding.json: not valid JSON text ({e})") from None
                except RecursionError:
                    raise ValueError("guided_decoding.json: nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided_decoding.json: a JSON schema is an object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"guided_decoding.{name} must be a non-empty string, got {v!r}")
        if self.reasoning is not None and self.reasoning not in REASONING_MODES:
            raise ValueError(f"guided_decoding.reasoning must be None, 'inside' or 'optional', got {self.reasoning!r}")
        b = self.max_reasoning_tokens
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ValueError(f"guided_decoding.max_reasoning_tokens must be None or an int >= 0, got {b!r}")
            if self.reasoning is None:
                raise ValueError("guided_decoding.max_reasoning_tokens needs reasoning ('inside' or 'optional')")

    @property
    def kind(self) -> str:
        """``"json"``, ``"json_object"``, ``"regex"`` or ``"grammar"``."""
        if self.json is not None:
            return "json"
        if self.json_object:
            return "json_object"
        return "regex" if self.regex is not None else "grammar"

    def schema(self) -> Any:
        """The JSON schema of a ``json`` / ``json_object`` request (parsed), else ``None``."""
        if self.json is not None:
            return json.loads(self.json) if isinstance(self.json, str) else self.json
        return {"type": "object"} if self.json_object else None

    def key(self) -> str:
        """One string per distinct grammar (the compile cache's key; the thinking before it is per request)."""
        if self.kind in ("json", "json_object"):
            return "json:" + json.dumps(self.schema(), sort_keys=True, ensure_ascii=False)
        return f"{self.kind}:{self.regex if self.kind == 'regex' else self.grammar}"


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits set to ``-inf``, in place (`trtllm_glm.logits.apply_bitmask`: ``logits [n, V]``,
    ``bitmask [n, W]`` int32, bit ``t % 32`` of word ``t // 32`` allowing token ``t``). Returns ``logits``."""
    return apply_bitmask(logits, bitmask)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids a host bitmask row ``[W]`` allows (tests and debugging)."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise ValueError(
            "structured output (guided_decoding, response_format, tool_choice 'required' or a named function) "
            "needs the 'llguidance' package: pip install 'trtllm_glm[structured]'"
        ) from e
    return llguidance


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the tokenizer: each id's bytes (specials marked so text never matches them)."""
    llg = _llguidance()
    from .tokenizer import NUM_BYTES, ByteTokenizer, HFTokenizer

    eos = list(eos_ids) or None
    if isinstance(tokenizer, ByteTokenizer):

        class _Bytes:  # the shape llguidance.TokenizerWrapper reads
            eos_token_id = tokenizer.eos_id
            bos_token_id = tokenizer.bos_id
            tokens = [bytes([i]) for i in range(NUM_BYTES)] + [
                f"<|special_{i}|>".encode() for i in range(NUM_BYTES, vocab_size)
            ]
            special_token_ids = list(range(NUM_BYTES, vocab_size))

            def __call__(self, s: str | bytes) -> list[int]:
                return list(s if isinstance(s, bytes) else s.encode("utf-8"))

        return llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers fast tokenizer passed to LLM
    if backend is not None and hasattr(backend, "to_str"):
        return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    raise ValueError(
        f"structured output needs the model's vocabulary, and this tokenizer ({type(tokenizer).__name__}) does not "
        "give it: use the checkpoint's tokenizer.json"
    )


class GrammarCompiler:
    """Compiles `GuidedDecodingParams` against one tokenizer, once per distinct grammar (thread-safe).

    Args:
        tokenizer: the LLM's tokenizer (`ByteTokenizer`, `HFTokenizer`, or a transformers fast tokenizer).
        vocab_size: the model's vocabulary (logits width; ids past the tokenizer's are never allowed).
        eos_ids: the model's end-of-sequence ids (allowed where the grammar accepts).

    llguidance's tokenizer tables (~1 s for a 155K vocabulary) are built on the first compile.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._ll_tok: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._tags: TagTables | None = None  # built on the first request that thinks before its grammar
        self._lock = threading.Lock()
        self.num_compiles = 0

    def _tok(self) -> Any:
        if self._ll_tok is None:
            self._ll_tok = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._ll_tok

    def _source(self, p: GuidedDecodingParams) -> str:
        llg = _llguidance()
        if p.kind in ("json", "json_object"):
            schema = p.schema()
            if schema is False:
                raise ValueError("invalid JSON schema: false matches no output")
            try:
                return llg.LLMatcher.grammar_from_json_schema(
                    json.dumps({} if schema is True else schema), defaults=JSON_DEFAULTS
                )
            except ValueError as e:
                raise ValueError(f"invalid JSON schema: {e}") from None
        if p.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(p.regex)
        try:
            return llg.grammar_from("grammar", p.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The compiled (never advanced) matcher of ``params``; raises ``ValueError`` naming what is invalid.

        Built outside the lock (a large schema takes a while; the server compiles on a worker thread while the
        engine thread copies cached matchers): two threads compiling one new grammar both build it, once each.
        """
        try:
            key = params.key()
        except RecursionError:
            raise ValueError("invalid JSON schema: nested too deeply") from None
        if params.reasoning is not None:  # thinking first: its token tables too, before the request runs
            self.tag_tables().warm()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tok = self._tok()
        llg = _llguidance()
        src = self._source(params)
        err = llg.LLMatcher.validate_grammar(src, tok)
        if err and not err.startswith("WARNING"):
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex"}
            raise ValueError(f"invalid {what.get(params.kind, 'grammar')}: {err.strip()}")
        m = llg.LLMatcher(tok, src, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {params.kind}: {m.get_error()}")
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = m
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def tag_tables(self) -> TagTables:
        """The reasoning tags' token tables of this vocabulary (built once, on first use)."""
        with self._lock:
            if self._tags is None:
                self._tags = TagTables(self._tok(), self.vocab_size)
            return self._tags

    def matcher(self, params: GuidedDecodingParams, stop_ids: Iterable[int]) -> RequestGrammar:
        """A fresh `RequestGrammar` for one request (a copy of the compiled matcher).

        Args:
            params: the request's grammar.
            stop_ids: ids that end the request (`SamplingParams.stop_ids`): where the grammar accepts, these
                are allowed in place of the model's EOS ids.
        """
        template = self.compile(params)
        with self._lock:
            m = template.deep_copy()
        tags = self.tag_tables() if params.reasoning is not None else None
        return RequestGrammar(m, self.vocab_size, self.eos_ids, stop_ids, params.reasoning,
                              params.max_reasoning_tokens, tags)  # fmt: skip


class TagTables:
    """Each token's bytes, and which tokens continue a reasoning tag from a given partial tag (built once per
    compiler, on first use: one pass over the vocabulary per partial tag, cached)."""

    def __init__(self, ll_tok: Any, vocab_size: int) -> None:
        self._ll_tok = ll_tok
        self.vocab_size = vocab_size
        n = min(vocab_size, ll_tok.vocab_size)
        self._bytes: list[bytes] | None = None
        self._cands: list[int] = []  # tokens that can continue a tag: whitespace, or starting with a tag's byte
        self._with_close: list[int] = []  # those and the tokens holding a whole closing tag
        self._cross: dict[bytes, np.ndarray] = {}
        self._n = n
        self._cont: dict[tuple[bytes, bytes, bool], np.ndarray] = {}
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the byte table and the tables a request needs first (~0.1-0.3 s for a 155K vocabulary, once):
        the server and `LLM.generate` call it while compiling, off the engine's step."""
        self.token_bytes(0)
        self.continuing(THINK_OPEN, b"", True)
        self.continuing(THINK_CLOSE, b"", False)
        self.crossing(b"")

    def token_bytes(self, t: int) -> bytes:
        if self._bytes is None:
            with self._lock:
                if self._bytes is None:
                    table = [self._ll_tok.decode_bytes([i]) for i in range(self._n)]
                    first = set(THINK_OPEN + THINK_CLOSE)
                    self._cands = [i for i, b in enumerate(table) if b and (not b.strip() or b.lstrip()[0] in first)]
                    self._with_close = sorted(set(self._cands) | {i for i, b in enumerate(table) if THINK_CLOSE in b})
                    self._bytes = table
        return self._bytes[t] if 0 <= t < self._n else b""

    def continuing(self, tag: bytes, have: bytes, lead_space: bool) -> np.ndarray:
        """Ids of the tokens whose bytes, after ``have`` (a proper prefix of ``tag``; leading whitespace first
        when ``lead_space``), leave a prefix of ``tag`` or complete it (bytes after a completed tag allowed only
        for the opening tag: they are thinking text)."""
        key = (tag, have, lead_space)
        hit = self._cont.get(key)
        if hit is not None:
            return hit
        self.token_bytes(0)
        assert self._bytes is not None
        ids = []
        for i in self._cands:
            b = self._bytes[i]
            if have and b[:1].isspace():
                continue
            x = have + (b.lstrip() if lead_space else b)
            if not x and lead_space:
                ids.append(i)  # whitespace before the tag
            elif x and (tag.startswith(x) or (tag == THINK_OPEN and x.startswith(tag) and _ends_clean(x[len(tag) :]))):
                ids.append(i)
        arr = np.asarray(ids, dtype=np.int64)
        with self._lock:
            self._cont[key] = arr
        return arr

    def crossing(self, have: bytes) -> np.ndarray:
        """Ids of the tokens that, after thinking text ending in ``have`` (a proper prefix of the closing tag, or
        empty), would close the thinking and carry answer bytes past the tag in the same token (``>{`` after
        ``</think``): excluded while thinking, so that the grammar sees the whole answer (a tokenizer with
        ``</think>`` as one special token has none)."""
        hit = self._cross.get(have)
        if hit is not None:
            return hit
        self.token_bytes(0)
        assert self._bytes is not None
        arr = np.asarray([i for i in self._with_close if not _ends_clean(have + self._bytes[i])], dtype=np.int64)
        with self._lock:
            self._cross[have] = arr
        return arr


def _ends_clean(text: bytes) -> bool:
    """Whether thinking text ``text`` holds no closing tag, or its first one ends it."""
    i = text.find(THINK_CLOSE)
    return i < 0 or i + len(THINK_CLOSE) == len(text)


def _clear_bits(row: np.ndarray, ids: np.ndarray) -> None:
    if len(ids):
        np.bitwise_and.at(row, ids >> 5, ~((np.uint32(1) << (ids & 31).astype(np.uint32)).astype(np.uint32)))


def _set_bits(row: np.ndarray, ids: np.ndarray) -> None:
    if len(ids):
        np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)).astype(np.uint32))


class RequestGrammar:
    """One request's grammar state: the next tokens' mask, and the tokens emitted so far.

    Args:
        matcher: an ``llguidance.LLMatcher`` at the start of the output.
        vocab_size: logits width.
        eos_ids: the ids llguidance allows where the grammar accepts (the model's EOS).
        stop_ids: the ids that end this request; where they differ from ``eos_ids`` (``end_id``,
            ``stop_token_ids``, ``ignore_eos``) the mask allows these instead.
        reasoning: `GuidedDecodingParams.reasoning` (``None``: the grammar applies from the first token).
        max_reasoning_tokens: `GuidedDecodingParams.max_reasoning_tokens`.
        tags: the compiler's `TagTables` (needed with ``reasoning``).

    ``phase``: ``"answer"`` (the grammar applies), ``"think"`` (inside the thinking: any token but the end of
    sequence, or only the closing tag's once ``max_reasoning_tokens`` are spent), ``"start"`` (``reasoning=
    "optional"`` before the output has shown whether it thinks: the opening tag's tokens, leading whitespace, or
    the grammar's first tokens).
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        eos_ids: Sequence[int],
        stop_ids: Iterable[int],
        reasoning: str | None = None,
        max_reasoning_tokens: int | None = None,
        tags: TagTables | None = None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.stop_ids = sorted(set(stop_ids))
        self._swap_stop = set(self.stop_ids) != set(self.eos_ids)
        self.num_consumed = 0
        self.failed: str | None = None  # why the matcher refused a token (it then allows only end of sequence)
        self.phase = {None: "answer", "inside": "think", "optional": "start"}[reasoning]
        if reasoning is not None and tags is None:
            raise ValueError("a grammar after reasoning needs the compiler's TagTables")
        self.tags = tags
        self.max_reasoning_tokens = max_reasoning_tokens
        self.num_reasoning_tokens = 0  # tokens of the thinking (the opening tag's excluded)
        self._tail = b""  # "start": the output's bytes so far; "think": its last bytes (a closing tag's start)
        self._in_sync = True  # "start": the matcher consumed every non-whitespace token (the output may be answer)

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; ``False`` (and `failed` set) when the grammar refuses it."""
        if self.failed is not None:
            return False
        if self.phase != "answer":
            return self._accept_reasoning(int(token))
        if not self.matcher.consume_token(int(token)):
            self.failed = self.matcher.get_error() or f"token {token} is outside the grammar"
            return False
        self.num_consumed += 1
        return True

    def _accept_reasoning(self, t: int) -> bool:
        assert self.tags is not None
        b = self.tags.token_bytes(t)
        if self.phase == "start":
            lead = not self._tail.strip()
            x = self._tail.lstrip() + (b.lstrip() if lead else b)
            if (not x and lead) or (x and (THINK_OPEN.startswith(x) or x.startswith(THINK_OPEN))):
                if x and self._in_sync:  # the answer may also begin so (a grammar whose output starts with '<')
                    self._in_sync = self.matcher.try_consume_tokens([t]) == 1
                    self.num_consumed += self._in_sync
                if not x.startswith(THINK_OPEN):
                    self._tail = self._tail + b
                    return True
                self.phase, self._tail = "think", b""
                self.matcher.reset()
                self.num_consumed = 0
                return self._think_bytes(x[len(THINK_OPEN) :])
            self.phase = "answer"
            if not self._in_sync or not self.matcher.consume_token(t):
                self.failed = self.matcher.get_error() or f"token {t} is outside the grammar"
                return False
            self.num_consumed += 1
            return True
        self.num_reasoning_tokens += 1
        return self._think_bytes(b)

    def _think_bytes(self, b: bytes) -> bool:
        buf = self._tail + b
        if buf.find(THINK_CLOSE) >= 0:  # the answer starts with the next token (bytes after the tag are free)
            self.phase, self._tail = "answer", b""
            self.matcher.reset()
            self.num_consumed = 0
        else:
            self._tail = buf[-(len(THINK_CLOSE) - 1) :]
        return True

    def _close_prefix(self) -> bytes:
        """The longest end of the thinking so far that begins the closing tag."""
        for k in range(min(len(self._tail), len(THINK_CLOSE) - 1), 0, -1):
            if THINK_CLOSE.startswith(self._tail[-k:]):
                return self._tail[-k:]
        return b""

    def fill_reasoning_row(self, row: np.ndarray, ptr: int, row_bytes: int) -> None:
        """The mask of the current state into host row ``row`` (uint32 view at address ``ptr``) when the phase
        is not ``"answer"`` (`fix_row` follows as for any row)."""
        assert self.tags is not None
        if self.phase == "think":
            b = self.max_reasoning_tokens
            if b is not None and self.num_reasoning_tokens >= b:
                row[:] = 0
                _set_bits(row, self.tags.continuing(THINK_CLOSE, self._close_prefix(), False))
            else:
                row[:] = 0xFFFFFFFF
                _clear_bits(row, self.tags.crossing(self._close_prefix()))
            for t in self.eos_ids + self.stop_ids:  # the answer must follow: no end inside the thinking
                row[t >> 5] &= ~np.uint32(1 << (t & 31))
            return
        # "start": the opening tag's tokens (after any whitespace), or the grammar's.
        if self._in_sync:
            self.matcher.unsafe_compute_mask_ptr(ptr, row_bytes)
        else:
            row[:] = 0
        lead = not self._tail.strip()
        _set_bits(row, self.tags.continuing(THINK_OPEN, self._tail.lstrip(), lead))

    def fill_reasoning_rows(self, host: np.ndarray, row: int, drafts: Sequence[int], ptr: int, row_bytes: int) -> None:
        """Rows ``row .. row + len(drafts)``: the state's mask, then the mask after each draft it allows (the
        state is restored after; drafts past a refused one leave their rows all-allowed, as `fill_bitmasks`)."""
        if not drafts:
            self.fill_reasoning_row(host[row], ptr + row * row_bytes, row_bytes)
            return
        saved = (self.phase, self._tail, self._in_sync, self.num_reasoning_tokens, self.num_consumed, self.matcher)
        self.matcher = self.matcher.deep_copy()
        try:
            for n in range(len(drafts) + 1):
                r = row + n
                if self.phase == "answer":
                    self.matcher.unsafe_compute_mask_ptr(ptr + r * row_bytes, row_bytes)
                else:
                    self.fill_reasoning_row(host[r], ptr + r * row_bytes, row_bytes)
                if n == len(drafts):
                    break
                t = int(drafts[n])
                if not (host[r][t >> 5] >> np.uint32(t & 31)) & 1 or t in self.stop_ids:
                    break
                if not self.accept(t):
                    break
        finally:
            self.phase, self._tail, self._in_sync, self.num_reasoning_tokens, self.num_consumed, self.matcher = saved
            self.failed = None

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (from the start) the grammar allows in turn (state unchanged): a draft past the
        first refused one can never be accepted, so a drafter's proposal may be cut there."""
        if not drafts or self.failed is not None:
            return 0
        if self.phase == "answer":
            n = self.matcher.try_consume_tokens([int(t) for t in drafts])
            if n:
                self.matcher.rollback(n)
            return n
        W = bitmask_words(self.vocab_size)
        host = np.full((len(drafts) + 1, W), 0xFFFFFFFF, dtype=np.uint32)
        self.fill_reasoning_rows(host, 0, drafts, host.ctypes.data, W * 4)
        for n, t in enumerate(drafts):
            if not (host[n][t >> 5] >> np.uint32(t & 31)) & 1:
                return n
        return len(drafts)

    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is complete under the grammar."""
        return self.failed is None and self.phase == "answer" and self.matcher.is_accepting()

    def fix_row(self, row: np.ndarray) -> None:
        """Adjust one filled host row ``[W]`` (uint32 view): the request's own stop ids where the grammar
        allows the model's EOS, and the EOS ids alone when nothing is allowed (a dead end ends the request)."""
        if self._swap_stop:
            eos_ok = any((row[t >> 5] >> (t & 31)) & 1 for t in self.eos_ids)
            for t in self.eos_ids:
                row[t >> 5] &= ~np.uint32(1 << (t & 31))
            if eos_ok:
                for t in self.stop_ids:
                    row[t >> 5] |= np.uint32(1 << (t & 31))
        if self.failed is not None or not row.any():
            row[:] = 0
            for t in self.stop_ids or self.eos_ids:
                row[t >> 5] |= np.uint32(1 << (t & 31))


_EXECUTOR: Any = None
# Up to this many grammar requests in a step fill their masks on the calling thread: a JSON mask over a 155K
# vocabulary takes ~25 µs, and waking llguidance's pool (its threads sleep between steps) cost more than 16 of
# them on a 2-core host (1.6 ms against 0.4 ms a step; benchmarks/bench_structured.py ``masks-pool`` /
# ``masks-serial`` measure both).
SERIAL_MAX = envs.GRAMMAR_SERIAL_MAX.get()


def _fill_serial(m: Any, row: int, drafts: list[int], ptr: int, row_bytes: int) -> None:
    """One request's rows on this thread: its state's mask, then each draft's (consumed, rolled back after)."""
    m.unsafe_compute_mask_ptr(ptr + row * row_bytes, row_bytes)
    n = 0
    for t in drafts:
        # (try_: a refused token leaves the matcher as it was; consume_token would put it in its error state)
        if m.try_consume_tokens([t]) != 1:  # a refused draft: later rows stay all-allowed (never emitted)
            break
        n += 1
        m.unsafe_compute_mask_ptr(ptr + (row + n) * row_bytes, row_bytes)
    if n:
        m.rollback(n)


def _executor() -> Any:
    """llguidance's thread pool for computing a batch's masks in parallel (shared, built once)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llguidance().LLExecutor()
    return _EXECUTOR


def fill_bitmasks(
    items: Sequence[tuple[RequestGrammar, int, Sequence[int]]], num_rows: int, vocab_size: int
) -> torch.Tensor:
    """Host bitmasks of a step's grammar rows, computed in parallel across requests.

    Args:
        items: per grammar request ``(grammar, first_row, drafts)``: row ``first_row`` gets the mask of the
            request's current state and row ``first_row + 1 + i`` the mask after drafts ``0 .. i`` (a verify
            step; the matcher is rolled back afterwards). Drafts past the first one the grammar refuses leave
            their rows all-allowed: such a row's token is never emitted (acceptance stops at the refused draft,
            whose own row's mask excludes it).
        num_rows: rows of the returned bitmask.
        vocab_size: logits width.

    Returns:
        ``[num_rows, ceil(vocab_size / 32)]`` int32 on the CPU; rows no item names are all-allowed.
    """
    W = bitmask_words(vocab_size)
    out = torch.full((num_rows, W), -1, dtype=torch.int32)
    # llguidance writes row r at out + r * W * 4 bytes (its `llguidance.torch` helpers do the same, but importing
    # that module compiles a torch function: a second at first use).
    ptr, row_bytes = out.data_ptr(), W * 4
    host = out.numpy().view(np.uint32)
    live = [(g.matcher, row, list(d)) for g, row, d in items if g.failed is None and g.phase == "answer"]
    for g, row, d in items:  # thinking before the grammar: computed here (the phase may change across drafts)
        if g.failed is None and g.phase != "answer":
            g.fill_reasoning_rows(host, row, list(d), ptr, row_bytes)
    if len(live) <= SERIAL_MAX:
        for m, row, d in live:
            _fill_serial(m, row, d, ptr, row_bytes)
        live = []
    drafted = [x for x in live if x[2]]
    if drafted:  # (llguidance refuses an empty draft list here: those go to the plain call)
        _executor().unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, num_rows)
    plain = [(m, row) for m, row, d in live if not d]
    if plain:
        _executor().unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
    for g, row, d in items:
        for r in range(row, row + 1 + len(d)):
            if r == row or g.failed is None:
                g.fix_row(host[r])
    return out

"""Structured output: grammars compiled against the tokenizer's vocabulary, and token masks on the logits.

A request with ``SamplingParams.guided_decoding`` (`GuidedDecodingParams`, TensorRT-LLM's name: a JSON schema,
any JSON object, a regular expression or a Lark / GBNF grammar) gets its own `RequestGrammar` when the executor
admits it: an ``llguidance`` matcher that says, before each token, which tokens keep the output inside the
grammar. The executor masks that request's logits rows with it before choosing a token (`apply_token_bitmask`:
disallowed tokens get ``-inf``), and advances the matcher over every token it emits. End of sequence is
allowed only where the grammar accepts, so a request ends either with complete output (finish reason
``stop``) or at ``max_tokens`` (``length``).

Why llguidance: one 3 MB wheel with no Python dependencies (abi3, any CPython >= 3.9), JSON schema, regex and
Lark grammars in one engine, masks computed in ~50 µs per token on the CPU, and rollback (speculative
decoding) built in. It is imported on first use only: ``pip install llguidance`` (the ``structured`` extra).

Compilation happens once per distinct grammar (`GrammarCompiler`: an LRU of built matchers that each request
copies in microseconds), so a schema sent with every request is parsed once.

Masks are bitmasks ``[rows, ceil(V / 32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set: token ``t`` is
allowed), filled on the host and applied on the logits' device. Under speculative decoding each verify row
``j`` of a grammar request is masked with the matcher state after drafts ``0 .. j - 1`` (`fill_bitmasks`),
then the matcher keeps the accepted tokens only (rejected drafts are rolled back, never consumed).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "GuidedDecodingParams",
    "GrammarCompiler",
    "RequestGrammar",
    "apply_token_bitmask",
    "bitmask_words",
    "fill_bitmasks",
    "allowed_tokens",
    "JSON_DEFAULTS",
]

# How generated JSON is spaced unless the schema's own "x-guidance" says otherwise: one space after ':' and
# ',' and no other whitespace (Python's json.dumps). Free whitespace lets a weak model pad forever; a fixed
# layout always progresses.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Distinct grammars kept compiled (each holds its lexer tables; a few MB at most for a big schema).
CACHE_SIZE = 256


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What the output must match (exactly one field set; TensorRT-LLM's ``GuidedDecodingParams``).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it.
        json_object: the output is any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        grammar: a context-free grammar in llguidance's Lark dialect (``start: ...``), or GBNF (llama.cpp's);
            ``%json {schema}`` inlines a JSON schema.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

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
        """One string per distinct grammar (the compile cache's key)."""
        if self.kind in ("json", "json_object"):
            return "json:" + json.dumps(self.schema(), sort_keys=True, ensure_ascii=False)
        return f"{self.kind}:{self.regex if self.kind == 'regex' else self.grammar}"


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits set to ``-inf``, in place (the plain torch reference; a few launches).

    Args:
        logits: ``[n, V]`` float logits (any device).
        bitmask: ``[n, W]`` int32 with ``W >= ceil(V / 32)`` (any device; copied to ``logits``' device): bit
            ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed.

    Returns:
        ``logits``.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [n, V] and bitmask [n, W] expected, got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")  # fmt: skip
    n, V = logits.shape
    if bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {V}")
    words = bitmask.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :V].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


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
        return RequestGrammar(m, self.vocab_size, self.eos_ids, stop_ids)


class RequestGrammar:
    """One request's grammar state: the next tokens' mask, and the tokens emitted so far.

    Args:
        matcher: an ``llguidance.LLMatcher`` at the start of the output.
        vocab_size: logits width.
        eos_ids: the ids llguidance allows where the grammar accepts (the model's EOS).
        stop_ids: the ids that end this request; where they differ from ``eos_ids`` (``end_id``,
            ``stop_token_ids``, ``ignore_eos``) the mask allows these instead.
    """

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int], stop_ids: Iterable[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.stop_ids = sorted(set(stop_ids))
        self._swap_stop = set(self.stop_ids) != set(self.eos_ids)
        self.num_consumed = 0
        self.failed: str | None = None  # why the matcher refused a token (it then allows only end of sequence)

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; ``False`` (and `failed` set) when the grammar refuses it."""
        if self.failed is not None:
            return False
        if not self.matcher.consume_token(int(token)):
            self.failed = self.matcher.get_error() or f"token {token} is outside the grammar"
            return False
        self.num_consumed += 1
        return True

    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is complete under the grammar."""
        return self.failed is None and self.matcher.is_accepting()

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
SERIAL_MAX = int(os.environ.get("TRTLLM_GLM_GRAMMAR_SERIAL_MAX", "16"))


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
    live = [(g.matcher, row, list(d)) for g, row, d in items if g.failed is None]
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
    host = out.numpy().view(np.uint32)
    for g, row, d in items:
        for r in range(row, row + 1 + len(d)):
            if r == row or g.failed is None:
                g.fix_row(host[r])
    return out

"""``--config options.yaml``: LLM API options for ``trtllm-glm serve``, with the keys of ``LLM(...)``.

Every key of ``LLM.__init__`` except ``model`` and ``tokenizer`` is accepted (objects are built from mappings), plus
the server's own `SERVE_KEYS` (``engine_process``, ``http``, ``loop``); an unknown key, or a value a key does not take,
is a `ConfigError` that names it. ``speculative_config`` takes a
``decoding_type`` of the speculation registry and its config class's fields. A complete example:
examples/serve_options.yaml; the keys: docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from ..config import ConfigError
from .http_loop import HTTP_CHOICES, LOOP_CHOICES

__all__ = ["load_llm_options", "llm_options_from_dict", "split_serve_options", "SERVE_KEYS"]

# Keys LLM does not take but the YAML accepts, with the only value that matches what the runtime does.
_FIXED_KEYS = {"enable_chunked_prefill": True}
# Keys of the server itself, not of LLM (split off by `split_serve_options`), with what each takes: a type, or the
# names it may be (uvicorn's HTTP parser and event loop, `http_loop.choose_http_loop`).
SERVE_KEYS: dict[str, type | tuple[str, ...]] = {"engine_process": bool, "http": HTTP_CHOICES, "loop": LOOP_CHOICES}
# Keys that cannot come from a YAML file.
_NOT_FROM_FILE = {"self", "model", "tokenizer", "_spawned_rank"}
_INT_KEYS = {"max_seq_len", "seed", "tensor_parallel_size"}
_OPTIONAL_INT_KEYS = {
    "max_batch_size", "max_num_tokens", "prefill_chunk_size", "mixed_prefill_budget", "num_threads",
    "moe_expert_parallel_size", "moe_tensor_parallel_size",
}  # fmt: skip
_OPTIONAL_STR_KEYS = {"dtype", "device", "quantization"}
_BOOL_KEYS = {"disable_overlap_scheduler", "warmup"}
_OPTIONAL_BOOL_KEYS = {"batch_invariant"}


def _llm_keys() -> list[str]:
    from ..runtime.llm import LLM

    return [k for k in inspect.signature(LLM.__init__).parameters if k not in _NOT_FROM_FILE]


def _dataclass_from(cls: type, d: Any, where: str, skip: tuple[str, ...] = ()) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    # Old key names the class still takes (`DecodingBaseConfig.ALIASES`), checked under the field's type.
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    fields = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in skip} | set(aliases)
    for k in d:
        if k not in fields:
            raise ConfigError(f"{where}: unknown key {k!r} (known: {', '.join(sorted(fields))})")
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    types.update({old: types[new] for old, new in aliases.items()})
    for k, v in d.items():
        t = types[k]
        if v is None and "None" in t:
            continue
        # Annotations are strings (postponed evaluation); bool is an int to isinstance(), so refuse it. A string is
        # left to the class where the field takes one too (``checkpoint_interval: auto``).
        if isinstance(v, str) and "str" in t:
            pass
        elif t.startswith("int") and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{where}.{k}: expected an int, got {v!r}")
        if t.startswith("str") and not isinstance(v, str):
            raise ConfigError(f"{where}.{k}: expected a string, got {v!r}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _speculative(d: Any) -> Any:
    from ..speculative.registry import decoding_types_text, speculation_entry

    where = "speculative_config"
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping with decoding_type, got {type(d).__name__}")
    d = dict(d)
    kind = d.pop("decoding_type", None)
    try:
        cls = speculation_entry(kind).config_cls if isinstance(kind, str) else None
    except ValueError:
        cls = None
    if cls is None:
        raise ConfigError(f"{where}.decoding_type: expected {decoding_types_text()}, got {kind!r}")
    # draft_len_fn is a Python callable: not something a YAML file can hold.
    return _dataclass_from(cls, d, where, skip=("draft_len_fn",))


def _serve_value(v: Any, takes: type | tuple[str, ...], where: str) -> Any:
    """``v`` checked against what a `SERVE_KEYS` key takes (``where`` names the key in the message)."""
    if isinstance(takes, tuple):
        if not isinstance(v, str) or v not in takes:
            raise ConfigError(f"{where}: expected one of {', '.join(takes)}, got {v!r}")
    elif not isinstance(v, takes):  # only bool so far
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    return v


def llm_options_from_dict(d: Any, source: str = "config") -> dict[str, Any]:
    """``LLM(**options)`` keyword arguments from a parsed YAML mapping.

    Args:
        d: the mapping (``None``, as an empty file parses, means no options).
        source: file name for messages.

    Raises:
        ConfigError: unknown key, wrong type or invalid value; the message names the key.
    """
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: top level must be a mapping of LLM options, got {type(d).__name__}")
    keys = _llm_keys()
    out: dict[str, Any] = {}
    for k, v in d.items():
        where = f"{source}: {k}"
        if k in _FIXED_KEYS:
            if v is not _FIXED_KEYS[k]:
                raise ConfigError(f"{where}: only {_FIXED_KEYS[k]!r} is supported")
            continue
        if k in SERVE_KEYS:
            out[k] = _serve_value(v, SERVE_KEYS[k], where)
            continue
        if k not in keys:
            known = ", ".join(sorted([*keys, *_FIXED_KEYS, *SERVE_KEYS]))
            raise ConfigError(f"{source}: unknown key {k!r} (known: {known})")
        if k == "kv_cache_config":
            from ..runtime.llm import KvCacheConfig

            out[k] = None if v is None else _dataclass_from(KvCacheConfig, v, where)
        elif k == "cuda_graph_config":
            from ..runtime.cuda_graph import CudaGraphConfig

            try:
                out[k] = CudaGraphConfig.from_value(v)
            except (TypeError, ValueError) as e:  # the message names cuda_graph_config (and the field)
                raise ConfigError(f"{source}: {e}") from None
        elif k == "speculative_config":
            try:
                out[k] = _speculative(v)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        elif k in _INT_KEYS or k in _OPTIONAL_INT_KEYS:
            if (v is None and k in _OPTIONAL_INT_KEYS) or (isinstance(v, int) and not isinstance(v, bool)):
                if isinstance(v, int) and v < (0 if k == "seed" else 1):
                    raise ConfigError(f"{where}: must be >= {0 if k == 'seed' else 1}, got {v}")
                out[k] = v
            else:
                raise ConfigError(f"{where}: expected an int, got {v!r}")
        elif k in _BOOL_KEYS or k in _OPTIONAL_BOOL_KEYS:
            if not isinstance(v, bool) and not (v is None and k in _OPTIONAL_BOOL_KEYS):
                also = " or null" if k in _OPTIONAL_BOOL_KEYS else ""
                raise ConfigError(f"{where}: expected true or false{also}, got {v!r}")
            out[k] = v
        elif k == "fp8_lm_head":
            # YAML's true / false / auto / null (as stored); "on" and the like are refused, not guessed.
            if not (v is None or isinstance(v, bool) or v == "auto"):
                raise ConfigError(f"{where}: expected auto, true, false or null, got {v!r}")
            out[k] = v
        elif k in _OPTIONAL_STR_KEYS:
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"{where}: expected a string, got {v!r}")
            out[k] = v
        else:  # a newer LLM option: passed through, LLM validates it
            out[k] = v
    return out


def split_serve_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(LLM options, server options)``: the `SERVE_KEYS` (``engine_process``, ``http``, ``loop``) apart from ``LLM``'s
    keys."""
    llm = {k: v for k, v in options.items() if k not in SERVE_KEYS}
    return llm, {k: v for k, v in options.items() if k in SERVE_KEYS}


def load_llm_options(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML options file into ``LLM`` keyword arguments (see the module docstring)."""
    import yaml

    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            d = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None
    return llm_options_from_dict(d, source=p)

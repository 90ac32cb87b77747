"""Tokenizers: a dependency-free byte tokenizer for presets, and HF ``tokenizer.json`` through ``tokenizers``.

Both expose the same small interface the runtime uses: ``encode(text, add_bos=True) -> list[int]``,
``decode(ids, skip_special_tokens=True) -> str``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from ..config import Glm5NextConfig, resolve_preset_dir

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "NoTokenizer", "load_tokenizer"]

NUM_BYTES = 256


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


def _as_int_list(ids: Iterable[Any]) -> list[int]:
    # Accepts lists, tuples and 1-D tensors (whose items are 0-d tensors with __index__).
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, special ids live above them.

    Decoding joins the bytes and decodes with ``errors="replace"``, so a cut multi-byte character becomes
    U+FFFD. Ids ``>= 256`` that are not one of the specials (the spare rows a small preset's vocabulary has)
    decode to nothing. Special ids decode to nothing when ``skip_special_tokens``, else to ``<|bos|>``,
    ``<|eos|>``, ``<|pad|>``. Ids outside ``[0, vocab_size)`` raise ``ValueError``.

    Args:
        vocab_size: must be > 256 when any special id is set, >= 256 otherwise.
        bos_id: begin-of-sequence id (``None``: no BOS is added).
        eos_id: end-of-sequence id.
        pad_id: padding id.
    """

    def __init__(self, vocab_size: int, bos_id: int | None, eos_id: int | None, pad_id: int | None) -> None:
        if vocab_size < NUM_BYTES:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {NUM_BYTES}, got {vocab_size}")
        names = {}
        for label, sid in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
            if sid is None:
                continue
            if not NUM_BYTES <= sid < vocab_size:
                raise ValueError(f"{label}_id={sid} must be in [{NUM_BYTES}, {vocab_size}) (ids 0..255 are bytes)")
            # Two roles may share an id (e.g. pad == eos); the first label names it.
            names.setdefault(sid, f"<|{label}|>")
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self._special_names = names

    @property
    def special_ids(self) -> set[int]:
        return set(self._special_names)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``, after ``bos_id`` when ``add_bos`` and a BOS id exists."""
        ids = list(text.encode("utf-8"))
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of ``ids`` (specials and spare ids dropped), for incremental UTF-8 decoding."""
        out = bytearray()
        for i in self._checked(ids):
            if i < NUM_BYTES:
                out.append(i)
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; see the class docstring for specials, spare ids and invalid UTF-8."""
        parts: list[str] = []
        buf = bytearray()
        for i in self._checked(ids):
            if i < NUM_BYTES:
                buf.append(i)
            elif i in self._special_names and not skip_special_tokens:
                parts.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                parts.append(self._special_names[i])
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def _checked(self, ids: Iterable[Any]) -> list[int]:
        vals = _as_int_list(ids)
        bad = [i for i in vals if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} outside [0, {self.vocab_size})")
        return vals


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``) behind the `ByteTokenizer` interface.

    ``encode`` never lets the tokenizer's post-processor add specials; BOS is prepended from the model
    config instead, so ``add_bos`` means the same thing for both tokenizers.

    Args:
        tok: a ``tokenizers.Tokenizer``.
        config: supplies ``vocab_size`` and the BOS / EOS / PAD ids.
    """

    def __init__(self, tok: Any, config: Glm5NextConfig) -> None:
        self._tok = tok
        self.vocab_size = config.vocab_size
        self.bos_id = config.bos_token_id
        eos = config.eos_token_ids
        self.eos_id = eos[0] if eos else None
        self.pad_id = config.pad_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(_as_int_list(ids), skip_special_tokens=skip_special_tokens)


class NoTokenizer:
    """The tokenizer of a checkpoint that ships none and whose special ids rule out the byte tokenizer.

    Token-id prompts run as usual (outputs carry token ids and empty text); text prompts are refused with
    a ``ValueError`` naming the missing ``tokenizer.json``.

    Args:
        source: the checkpoint directory (named in the error).
        config: supplies ``vocab_size`` and the BOS / EOS / PAD ids.
        reason: why the byte tokenizer does not apply.
    """

    def __init__(self, source: str, config: Glm5NextConfig, reason: str) -> None:
        self.source = source
        self.reason = reason
        self.vocab_size = config.vocab_size
        self.bos_id = config.bos_token_id
        eos = config.eos_token_ids
        self.eos_id = eos[0] if eos else None
        self.pad_id = config.pad_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise ValueError(
            f"text prompts need a tokenizer, and {self.source} has no tokenizer.json ({self.reason}): give "
            f"token-id prompts, or a tokenizer (LLM(tokenizer=...))"
        )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """No text without a tokenizer: the token ids are the output."""
        _as_int_list(ids)
        return ""


def load_tokenizer(model_dir_or_preset: str | os.PathLike[str], config: Glm5NextConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model.

    A directory holding ``tokenizer.json`` gets an `HFTokenizer` (needs the optional ``tokenizers``
    package); anything else (a preset name, a directory without ``tokenizer.json``) gets a `ByteTokenizer`
    over the config's vocabulary and special ids, or, for a directory whose vocabulary or special ids leave
    no room for the 256 byte tokens, a `NoTokenizer` (token-id prompts only).

    Args:
        model_dir_or_preset: checkpoint directory or preset name.
        config: the model's config.

    Raises:
        ImportError: ``tokenizer.json`` exists but ``tokenizers`` is not installed.
    """
    model_dir_or_preset = resolve_preset_dir(model_dir_or_preset)
    path = os.path.join(os.fspath(model_dir_or_preset), "tokenizer.json")
    if os.path.isdir(os.fspath(model_dir_or_preset)) and os.path.isfile(path):
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(
                f"{path} needs the 'tokenizers' package (pip install tokenizers); it is an optional dependency"
            ) from e
        return HFTokenizer(tokenizers.Tokenizer.from_file(path), config)
    eos = config.eos_token_ids
    try:
        return ByteTokenizer(config.vocab_size, config.bos_token_id, eos[0] if eos else None, config.pad_token_id)
    except ValueError as e:
        if not os.path.isdir(os.fspath(model_dir_or_preset)):
            raise  # a preset's config is ours: a mismatch there is a bug, not a missing file
        return NoTokenizer(os.fspath(model_dir_or_preset), config, f"a byte tokenizer cannot stand in: {e}")

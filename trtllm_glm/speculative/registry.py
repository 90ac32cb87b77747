"""The speculation registry: each ``decoding_type`` names its config class and the builder of its drafter.

The LLM API, the speculative executor, the CLI's ``--speculative`` and the server's YAML ``speculative_config``
all read this table; a new drafter is its module (config class, drafter, builder) and one `register_speculation`
call (docs/speculation.md, "Adding a drafter").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import DecodingBaseConfig, MTPDecodingConfig, NGramDecodingConfig

if TYPE_CHECKING:
    from .context import DraftContext, DraftResources

__all__ = [
    "SpeculationEntry",
    "decoding_types",
    "decoding_types_text",
    "register_speculation",
    "speculation_entry",
    "unregister_speculation",
]

Builder = Callable[["DraftContext", Any], "DraftResources"]


@dataclass(frozen=True)
class SpeculationEntry:
    """One decoding type.

    Attributes:
        decoding_type: the YAML's ``decoding_type`` (matched case-insensitively); lower-cased, the CLI's
            ``--speculative`` choice.
        config_cls: its config class (a `DecodingBaseConfig`).
        build: ``build(ctx, config) -> DraftResources``: the drafter and what it owns, made once per executor.
    """

    decoding_type: str
    config_cls: type[DecodingBaseConfig]
    build: Builder

    @property
    def cli_name(self) -> str:
        return self.decoding_type.lower()


_ENTRIES: dict[str, SpeculationEntry] = {}


def register_speculation(decoding_type: str, config_cls: type[DecodingBaseConfig], build: Builder) -> SpeculationEntry:
    """Add a decoding type (see `SpeculationEntry`); a name or config class already taken is refused."""
    if not isinstance(config_cls, type) or not issubclass(config_cls, DecodingBaseConfig):
        raise TypeError(f"{decoding_type}: the config class must subclass DecodingBaseConfig, got {config_cls!r}")
    key = decoding_type.lower()
    if key in _ENTRIES:
        raise ValueError(f"decoding_type {decoding_type!r} is registered already")
    if any(e.config_cls is config_cls for e in _ENTRIES.values()):
        raise ValueError(f"{config_cls.__name__} is registered already")
    entry = SpeculationEntry(decoding_type, config_cls, build)
    _ENTRIES[key] = entry
    return entry


def unregister_speculation(decoding_type: str) -> None:
    """Remove a decoding type (a test's or a plugin's own)."""
    _ENTRIES.pop(decoding_type.lower(), None)


def decoding_types() -> list[str]:
    """The registered ``decoding_type`` names, in registration order."""
    return [e.decoding_type for e in _ENTRIES.values()]


def decoding_types_text() -> str:
    """The registered names for a message: ``"MTP or NGram"``."""
    names = decoding_types()
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def speculation_entry(key: str | DecodingBaseConfig) -> SpeculationEntry:
    """The entry of a ``decoding_type`` name (any case) or of a config object.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
        TypeError: a config object of no registered class.
    """
    if isinstance(key, str):
        entry = _ENTRIES.get(key.lower())
        if entry is None:
            raise ValueError(f"unknown decoding_type {key!r}: expected {decoding_types_text()}")
        return entry
    for entry in _ENTRIES.values():
        if type(key) is entry.config_cls:
            return entry
    for entry in _ENTRIES.values():  # a subclass of a registered config
        if isinstance(key, entry.config_cls):
            return entry
    classes = ", ".join(e.config_cls.__name__ for e in _ENTRIES.values())
    raise TypeError(
        f"speculative_config must be one of {classes} (decoding_type {decoding_types_text()}), got {type(key).__name__}"
    )


# The built-in builders import their drafters when first called: the CLI reads this table (its ``--speculative``
# choices) without loading torch.
def _build_mtp(ctx: DraftContext, spec: MTPDecodingConfig) -> DraftResources:
    from .mtp.build import build_mtp

    return build_mtp(ctx, spec)


def _build_ngram(ctx: DraftContext, spec: NGramDecodingConfig) -> DraftResources:
    from .context import DraftResources
    from .drafters import NGramDrafter

    return DraftResources(NGramDrafter(spec.max_draft_len, spec.max_matching_ngram_size, spec.min_matching_ngram_size))


register_speculation("MTP", MTPDecodingConfig, _build_mtp)
register_speculation("NGram", NGramDecodingConfig, _build_ngram)

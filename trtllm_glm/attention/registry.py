"""Attention backends by name: the model builds its sparse layers from one (``Glm5NextForCausalLM(...,
attention_backend=name)``), the cache manager allocates its planes and the executor its metadata from it.

`register_attention_backend` adds one (docs/architecture.md, "Attention backends").
"""

from __future__ import annotations

from .interface import AttentionBackend
from .sparse.glm_kpool.backend import GlmKpoolBackend

__all__ = [
    "DEFAULT_ATTENTION_BACKEND",
    "get_attention_backend",
    "register_attention_backend",
    "resolve_attention_backend",
]

DEFAULT_ATTENTION_BACKEND = GlmKpoolBackend.name

_BACKENDS: dict[str, AttentionBackend] = {GlmKpoolBackend.name: GlmKpoolBackend()}


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    """Make ``backend`` available under ``backend.name`` (a name already taken is refused); returns it."""
    if backend.name in _BACKENDS and _BACKENDS[backend.name] is not backend:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r} (registered: {sorted(_BACKENDS)})") from None


def resolve_attention_backend(backend: str | AttentionBackend | None) -> AttentionBackend:
    """A backend from its name, itself, or None (the default, `DEFAULT_ATTENTION_BACKEND`)."""
    if isinstance(backend, AttentionBackend):
        return backend
    return get_attention_backend(backend or DEFAULT_ATTENTION_BACKEND)

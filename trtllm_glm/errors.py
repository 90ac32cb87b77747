"""Errors raised by trtllm_glm. Each one says what ran out or what was wrong, never silently truncates."""

from __future__ import annotations

__all__ = ["CapacityError", "TableWidthError", "StateError"]


class CapacityError(RuntimeError):
    """A page pool or a state-slot pool has no room left for the request."""


class TableWidthError(ValueError):
    """A request needs a wider slot table (or selection) than the persistent buffer was allocated for."""


class StateError(RuntimeError):
    """Per-request state is inconsistent (unknown request, double allocation, bad restore)."""

"""Errors raised by trtllm_glm. Each one says what ran out or what was wrong, never silently truncates."""

from __future__ import annotations

__all__ = ["CapacityError", "TableWidthError", "StateError", "CheckpointError"]


class CapacityError(RuntimeError):
    """A page pool or a state-slot pool has no room left for the request."""


class TableWidthError(ValueError):
    """A request needs a wider slot table (or selection) than the persistent buffer was allocated for."""


class StateError(RuntimeError):
    """Per-request state is inconsistent (unknown request, double allocation, bad restore)."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded as the config describes it (missing, unexpected, misshapen
    or non-finite tensors, unreadable files, not enough memory); the message names the file or tensor."""

"""Strict, opt-in check that every graph-visible metadata tensor kept its address since capture.

A CUDA graph bakes in the device address of every tensor it reads. Metadata therefore refreshes its
persistent buffers in place; the only sanctioned exception is a *declared* rebind, such as a draft forward
binding ``slot_table`` to the draft table (docs/design.md §5). `GraphAddressGuard` records the addresses of
``attn_metadata.graph_buffers()`` at capture and, before a replay, rejects any tensor whose address moved,
unless the caller declared that name as a swap and the new address is one it declared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

__all__ = ["GraphAddressError", "GraphAddressGuard", "HasGraphBuffers"]


class GraphAddressError(RuntimeError):
    """A graph-visible tensor moved since capture (or appeared / disappeared) without a declared swap."""


class HasGraphBuffers(Protocol):
    def graph_buffers(self) -> dict[str, torch.Tensor]: ...


def _ptr(x: int | torch.Tensor) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else int(x)


class GraphAddressGuard:
    """Records graph-visible addresses at capture and verifies them before replay.

    Example:
        guard = GraphAddressGuard()
        with torch.cuda.graph(g):
            ...
        guard.capture(meta)
        ...
        guard.check(meta, declared_swaps=meta.draft_swap_addresses())
        g.replay()
    """

    def __init__(self) -> None:
        self._addresses: dict[str, int] | None = None

    @property
    def addresses(self) -> dict[str, int]:
        """The addresses recorded by `capture` (name -> ``data_ptr()``)."""
        if self._addresses is None:
            raise RuntimeError("GraphAddressGuard.check() before capture()")
        return dict(self._addresses)

    def capture(self, attn_metadata: HasGraphBuffers) -> dict[str, int]:
        """Record ``data_ptr()`` of every tensor in ``attn_metadata.graph_buffers()``; returns the record."""
        self._addresses = {name: t.data_ptr() for name, t in attn_metadata.graph_buffers().items()}
        return dict(self._addresses)

    def check(
        self,
        attn_metadata: HasGraphBuffers,
        declared_swaps: Mapping[str, Iterable[int | torch.Tensor]] | None = None,
    ) -> None:
        """Raise unless every graph-visible tensor is where it was at capture, or at a declared swap target.

        Args:
            attn_metadata: the metadata the graph reads.
            declared_swaps: name -> addresses (or tensors) that name may be bound to instead of its captured
                address, e.g. ``{"slot_table": {target_table_ptr, draft_table_ptr}}``.

        Raises:
            GraphAddressError: listing every offending name (a moved tensor, an undeclared rebind, a name that
                appeared or disappeared since capture).
        """
        captured = self.addresses
        allowed: dict[str, set[int]] = {k: {_ptr(x) for x in v} for k, v in (declared_swaps or {}).items()}
        current = {name: t.data_ptr() for name, t in attn_metadata.graph_buffers().items()}
        problems: list[str] = []
        for name in sorted(captured.keys() - current.keys()):
            problems.append(f"{name}: captured at {captured[name]:#x} but no longer reported")
        for name in sorted(current.keys() - captured.keys()):
            problems.append(f"{name}: reported at {current[name]:#x} but not present at capture")
        for name in sorted(captured.keys() & current.keys()):
            was, now = captured[name], current[name]
            if now == was:
                continue
            if name in allowed and now in allowed[name]:
                continue
            how = "to an undeclared address" if name in allowed else "without a declared swap"
            problems.append(f"{name}: moved from {was:#x} to {now:#x} {how}")
        if problems:
            raise GraphAddressError("graph-visible tensors changed address since capture: " + "; ".join(problems))

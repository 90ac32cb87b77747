"""Parameters that are views of one shared storage: the check that a view is still in place, and a group of
``.weight`` parameters concatenated into one tensor (one GEMM instead of several)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FusedWeights", "refuse_stale", "same_memory"]


def same_memory(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """``t`` covers exactly ``ref``'s elements (same address, layout, dtype and device)."""
    return (
        t.data_ptr() == ref.data_ptr()
        and t.shape == ref.shape
        and t.stride() == ref.stride()
        and t.dtype == ref.dtype
        and t.device == ref.device
    )


@dataclass
class FusedWeights:
    """One storage ``weight`` whose row blocks (``sizes`` rows each, in order) are parameters of ``modules``
    (attribute ``names[i]`` of module ``i``, ``.weight`` by default): each parameter is a view of its block
    (`build`) until something replaces it (`intact`)."""

    weight: torch.Tensor
    modules: list[nn.Module]
    sizes: list[int]
    names: list[str] | None = None

    def _names(self) -> list[str]:
        return self.names or ["weight"] * len(self.modules)

    @classmethod
    def build(cls, modules: list[nn.Module], names: list[str] | None = None) -> FusedWeights | None:
        """Concatenate the modules' parameters (dim 0) into new storage and re-point each at its block;
        ``None`` (parameters left as they are) when dtypes, devices or trailing shapes differ.

        Args:
            modules: the owners, in block order.
            names: each owner's parameter attribute (default ``"weight"`` for all).
        """
        names = list(names) if names is not None else ["weight"] * len(modules)
        if len(names) != len(modules):
            raise ValueError(f"{len(modules)} modules but {len(names)} parameter names")
        ws = [getattr(m, n) for m, n in zip(modules, names)]
        if len({(w.dtype, w.device, tuple(w.shape[1:])) for w in ws}) != 1:
            return None
        fused = torch.cat([w.detach() for w in ws], dim=0)
        sizes = [w.shape[0] for w in ws]
        out = cls(fused, list(modules), sizes, None if all(n == "weight" for n in names) else names)
        for m, n, w, block in zip(modules, names, ws, out.blocks()):
            setattr(m, n, nn.Parameter(block, requires_grad=w.requires_grad))
        return out

    @classmethod
    def ensure(
        cls, current: FusedWeights | None, modules: list[nn.Module], names: list[str] | None = None
    ) -> FusedWeights | None:
        """``current`` while it is `intact` (its storage kept: CUDA graphs captured on it stay valid), else a
        new `build`, made of ordinary tensors even under inference mode (parameters must stay usable outside it)."""
        if current is not None and current.intact():
            return current
        with torch.inference_mode(False):
            return cls.build(modules, names)

    def blocks(self) -> list[torch.Tensor]:
        """The row blocks of ``weight``, one per module."""
        return list(self.weight.split(self.sizes, dim=0))

    def usable(self) -> bool:
        """Whether a forward may multiply by ``weight``: `intact`, and no gradient is wanted for the parameters
        (``weight`` is no parameter: a GEMM on it would give them none)."""
        if torch.is_grad_enabled() and any(getattr(m, n).requires_grad for m, n in zip(self.modules, self._names())):
            return False
        return self.intact()

    def intact(self) -> bool:
        """Whether every parameter is still exactly its block (none was replaced or re-homed since `build`)."""
        return all(same_memory(getattr(m, n), b) for m, n, b in zip(self.modules, self._names(), self.blocks()))


def refuse_stale(module: nn.Module, attrs: tuple[str, ...]) -> None:
    """After ``module._apply`` (a cast or move): the `FusedWeights` attributes ``attrs`` whose parameters got new
    storage are dropped (releasing the old storage) and ``module.fuse_weights()`` fuses again. A conversion that
    changed nothing leaves every group intact and its storage in place, so graphs captured on it stay valid."""
    stale = [a for a in attrs if getattr(module, a) is not None and not getattr(module, a).intact()]
    if stale:
        for a in stale:
            setattr(module, a, None)
        module.fuse_weights()  # type: ignore[operator]

"""Parameters that are views of one shared storage: the check that a view is still in place, and a group of
``.weight`` parameters concatenated into one tensor (one GEMM instead of several)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FusedWeights", "same_memory"]


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
    """One storage ``weight`` whose row blocks (``sizes`` rows each, in order) are the ``.weight`` parameters of
    ``modules``: each parameter is a view of its block (`build`) until something replaces it (`intact`)."""

    weight: torch.Tensor
    modules: list[nn.Module]
    sizes: list[int]

    @classmethod
    def build(cls, modules: list[nn.Module]) -> FusedWeights | None:
        """Concatenate the modules' weights (dim 0) into new storage and re-point each parameter at its block;
        ``None`` (parameters left as they are) when dtypes, devices or trailing shapes differ."""
        ws = [m.weight for m in modules]
        if len({(w.dtype, w.device, tuple(w.shape[1:])) for w in ws}) != 1:
            return None
        fused = torch.cat([w.detach() for w in ws], dim=0)
        sizes = [w.shape[0] for w in ws]
        out = cls(fused, list(modules), sizes)
        for m, w, block in zip(modules, ws, out.blocks()):
            m.weight = nn.Parameter(block, requires_grad=w.requires_grad)
        return out

    def blocks(self) -> list[torch.Tensor]:
        """The row blocks of ``weight``, one per module."""
        return list(self.weight.split(self.sizes, dim=0))

    def intact(self) -> bool:
        """Whether every parameter is still exactly its block (none was replaced or re-homed since `build`)."""
        return all(same_memory(m.weight, b) for m, b in zip(self.modules, self.blocks()))

"""Parameters that are views of one shared storage: the check that a view is still in place, and a group of
``.weight`` parameters concatenated into one tensor (one GEMM instead of several).

Block-FP8 parts (`trtllm_glm.modules.linear.Fp8Linear`) fuse their e4m3 weights and their scales alike, along
``out`` only: that needs every part's ``out`` but the last one's to be a multiple of the scale tile (a ragged last
tile row would otherwise share scale rows with the next part), and a group of unequal kinds (FP8 next to float)
stays unfused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..linear import model_linear
from ..quant.ops import fp8_linear

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
    scale: FusedWeights | None = None
    """Block-FP8 groups: the parts' ``weight_scale_inv`` fused the same way (``[sum(out) / block, in / block]``)."""
    block: int = 0

    def _names(self) -> list[str]:
        return self.names or ["weight"] * len(self.modules)

    @classmethod
    def build(cls, modules: list[nn.Module], names: list[str] | None = None) -> FusedWeights | None:
        """Concatenate the modules' parameters (dim 0) into new storage and re-point each at its block;
        ``None`` (parameters left as they are) when dtypes, devices or trailing shapes differ, or for block-FP8
        parts when a part's ``out`` other than the last is not a multiple of the scale tile, or the tiles differ.

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
        scale = None
        block = 0
        if ws[0].dtype == torch.float8_e4m3fn:
            blocks = {getattr(m, "block", None) for m in modules}
            if len(blocks) != 1 or None in blocks or any(not hasattr(m, "weight_scale_inv") for m in modules):
                return None
            block = int(blocks.pop())
            # A ragged last tile row may only end the group: it must not share scale rows with a later part.
            if set(names) != {"weight"} or any(w.shape[0] % block for w in ws[:-1]):
                return None
            scale = cls.build(modules, ["weight_scale_inv"] * len(modules))
            if scale is None:
                return None
        fused = torch.cat([w.detach() for w in ws], dim=0)
        sizes = [w.shape[0] for w in ws]
        out = cls(fused, list(modules), sizes, None if all(n == "weight" for n in names) else names, scale, block)
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

    @classmethod
    def ensure_first(
        cls, current: FusedWeights | None, candidates: list[tuple[list[nn.Module], list[str] | None]]
    ) -> FusedWeights | None:
        """`ensure` over several candidate groups, largest first: ``current`` while `intact`, else the first
        candidate that builds (e.g. a block-FP8 group without the part whose ``out`` is not a multiple of the
        tile), else ``None``."""
        if current is not None and current.intact():
            return current
        for modules, names in candidates:
            with torch.inference_mode(False):
                out = cls.build(modules, names)
            if out is not None:
                return out
        return None

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
        if self.scale is not None and not self.scale.intact():
            return False
        return all(same_memory(getattr(m, n), b) for m, n, b in zip(self.modules, self._names(), self.blocks()))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` times the fused weight: ``[..., sum(sizes)]`` in ``x.dtype`` (`fp8_linear` for a block-FP8
        group, ``F.linear`` otherwise; both take their batch-invariant path in that mode: `model_linear`)."""
        if self.scale is not None:
            backend = getattr(self.modules[0], "backend", None)
            return fp8_linear(x, self.weight, self.scale.weight, self.block, backend=backend)
        return model_linear(x, self.weight)


def refuse_stale(module: nn.Module, attrs: tuple[str, ...]) -> None:
    """After ``module._apply`` (a cast or move): the `FusedWeights` attributes ``attrs`` whose parameters got new
    storage are dropped (releasing the old storage) and ``module.fuse_weights()`` fuses again. A conversion that
    changed nothing leaves every group intact and its storage in place, so graphs captured on it stay valid."""
    stale = [a for a in attrs if getattr(module, a) is not None and not getattr(module, a).intact()]
    if stale:
        for a in stale:
            setattr(module, a, None)
        module.fuse_weights()  # type: ignore[operator]

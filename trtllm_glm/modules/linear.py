"""`Fp8Linear`: an ``nn.Linear`` whose weight is held as block-FP8 (DeepSeek-V3 convention), and the swap of
chosen ``nn.Linear`` modules of a model for it; `NumericsLinear`: the float ``nn.Linear`` that follows the
batch-invariant mode (`trtllm_glm.numerics`), and `use_numerics_linears_`, which makes a model's plain
``nn.Linear`` modules one (one central dispatch point: no layer changes its calls).

Parameters (checkpoint names unchanged): ``weight [out, in]`` float8_e4m3fn and ``weight_scale_inv
[ceil(out/block), ceil(in/block)]`` fp32, ``W ~= weight.float() * weight_scale_inv`` per ``block x block`` tile;
neither needs a gradient. A forward is `trtllm_glm.quant.fp8_linear` (the Triton kernel for CUDA inference, the
dequantise-then-matmul reference otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..linear import model_linear
from ..quant.fp8 import block_scale_shape, dequantize_block_fp8, quantize_block_fp8
from ..quant.ops import fp8_linear
from .weight_views import FusedWeights

__all__ = [
    "Fp8Linear",
    "NumericsLinear",
    "dequantize_fp8_linears_",
    "is_fp8_linear",
    "swap_fp8_linears_",
    "unswap_empty_",
    "use_numerics_linears_",
]

_FP8 = torch.float8_e4m3fn


class NumericsLinear(nn.Linear):
    """A float ``nn.Linear`` (same parameters, state-dict names and ``isinstance``) whose forward is
    `trtllm_glm.linear.model_linear`: ``F.linear`` normally, with the batch-invariant mode on the
    `trtllm_glm.linear.invariant_linear` whose rows never depend on the other rows of the call. The mode is read
    at every call, so one model serves both modes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        return model_linear(x, self.weight, self.bias)


def use_numerics_linears_(root: nn.Module) -> int:
    """Make every plain ``nn.Linear`` under ``root`` (exactly that class: `Fp8Linear` and other subclasses keep
    their own forward) a `NumericsLinear`, in place (the class is changed; parameters, hooks and graphs captured on
    them stay as they are). Idempotent.

    Returns:
        How many modules changed class.
    """
    changed = 0
    for m in root.modules():
        if type(m) is nn.Linear:
            m.__class__ = NumericsLinear
            changed += 1
    return changed


class Fp8Linear(nn.Linear):
    """Block-FP8 weight-only linear layer (no bias), an ``nn.Linear`` to every ``isinstance`` check.

    Args:
        in_features: ``in``.
        out_features: ``out``.
        block: scale tile edge (``quantization_config.weight_block_size``).
        device: where the (uninitialised) parameters live.

    Attributes:
        backend: ``None`` follows ``TRTLLM_GLM_FP8_LINEAR_BACKEND`` (`trtllm_glm.quant.fp8_linear_backend`).
    """

    def __init__(
        self, in_features: int, out_features: int, *, block: int = 128, device: torch.device | str | None = None
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a float weight
        self.in_features = in_features
        self.out_features = out_features
        self.block = int(block)
        self.backend: str | None = None
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=_FP8, device=device), requires_grad=False
        )
        scale = torch.empty(
            block_scale_shape((out_features, in_features), self.block), dtype=torch.float32, device=device
        )
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Nothing: the weights come from `set_weight_` or a checkpoint (`modules.init.init_linear_` draws them)."""

    @torch.no_grad()
    def set_weight_(self, w: torch.Tensor) -> None:
        """Quantise the float ``w [out, in]`` (`quantize_block_fp8`) into the parameters, in place."""
        if tuple(w.shape) != tuple(self.weight.shape):
            raise ValueError(f"Fp8Linear: weight {tuple(w.shape)} does not match {tuple(self.weight.shape)}")
        q, s = quantize_block_fp8(w.to(self.weight.device), self.block)
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(s)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: int = 128) -> Fp8Linear:
        """An `Fp8Linear` on ``linear``'s device holding its weight quantised (meta stays meta, unfilled)."""
        if linear.bias is not None:
            raise ValueError("Fp8Linear: a linear layer with a bias cannot be held in block FP8")
        dev = linear.weight.device
        out = cls(linear.in_features, linear.out_features, block=block, device=dev)
        if dev.type != "meta":
            out.set_weight_(linear.weight.detach())
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[out, in]`` weight in ``dtype`` (a new tensor: for callers that need the matrix itself)."""
        return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in ``x.dtype`` (fp32 accumulation)."""
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, backend=self.backend)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Moves keep the dtypes: a whole-model ``.to(torch.bfloat16)`` must neither widen the e4m3 codes nor
        round the fp32 scales (a conversion's result of another dtype is replaced by a same-dtype move)."""
        keep = {id(self.weight): _FP8, id(self.weight_scale_inv): torch.float32}

        def convert(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            want = keep.get(id(t))
            if want is None or out.dtype == want:
                return out
            if t.device.type == "meta":
                return torch.empty_like(t, device=out.device)
            return t.detach().to(out.device)

        return super()._apply(convert, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, fp8_e4m3"


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` holds a block-FP8 weight (an `Fp8Linear`)."""
    return isinstance(module, Fp8Linear)


def swap_fp8_linears_(root: nn.Module, names: Iterable[str], block: int = 128) -> list[str]:
    """Replace the ``nn.Linear`` submodules ``names`` of ``root`` by `Fp8Linear` (weights quantised unless on meta).

    Args:
        root: the model.
        names: dotted module names (``root.named_modules()``); names already `Fp8Linear` are left alone.
        block: scale tile edge.

    Returns:
        The names swapped.

    Raises:
        ValueError: a name that is not an ``nn.Linear`` without bias.
    """
    done = []
    replaced: set[int] = set()
    for name in names:
        mod = root.get_submodule(name)
        if isinstance(mod, Fp8Linear):
            continue
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"{name}: only nn.Linear modules can hold block-FP8 weights, got {type(mod).__name__}")
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        with torch.no_grad():
            setattr(parent, attr, Fp8Linear.from_linear(mod, block))
        replaced.add(id(mod))
        done.append(name)
    _forget_replaced(root, replaced)
    return done


def _forget_replaced(root: nn.Module, replaced: set[int]) -> None:
    """After modules were swapped: fused groups holding a replaced module are dropped (``fuse_weights`` builds
    them again from the new modules), and modules that keep views of their children's weights (the MoE's stacked
    experts) re-check them."""
    for m in root.modules():
        for attr, value in list(vars(m).items()):
            if isinstance(value, FusedWeights) and any(id(x) in replaced for x in value.modules):
                setattr(m, attr, None)
        mark = getattr(m, "mark_weights_changed", None)
        if callable(mark):
            mark()


def dequantize_fp8_linears_(root: nn.Module, dtype: torch.dtype, names: Iterable[str] | None = None) -> list[str]:
    """Replace every `Fp8Linear` under ``root`` (or those of ``names``; others are left alone) by an ``nn.Linear``
    holding its dequantised weight in ``dtype`` (the same module names; benchmarks compare the two paths on one set
    of weights, and the model dequantises an FP8-stored LM head with ``fp8_lm_head=False``).

    Returns:
        The names replaced.
    """
    only = None if names is None else set(names)
    picked = [n for n, m in root.named_modules() if isinstance(m, Fp8Linear) and (only is None or n in only)]
    replaced = {id(root.get_submodule(n)) for n in picked}
    for name in picked:
        mod = root.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        with torch.no_grad():
            lin = NumericsLinear(mod.in_features, mod.out_features, bias=False, device="meta")
            lin.weight = nn.Parameter(mod.dequantized(dtype), requires_grad=False)
        setattr(parent, attr, lin)
    _forget_replaced(root, replaced)
    return picked


def unswap_empty_(root: nn.Module, names: Iterable[str]) -> list[str]:
    """Replace the `Fp8Linear` submodules ``names`` by uninitialised ``nn.Linear`` (float, on their device: meta
    for a model about to be loaded), e.g. where a checkpoint turns out to store a weight unquantised.

    Returns:
        The names replaced.
    """
    done = []
    replaced: set[int] = set()
    for name in names:
        mod = root.get_submodule(name)
        if not isinstance(mod, Fp8Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, attr, NumericsLinear(mod.in_features, mod.out_features, bias=False, device=mod.weight.device))
        replaced.add(id(mod))
        done.append(name)
    _forget_replaced(root, replaced)
    return done

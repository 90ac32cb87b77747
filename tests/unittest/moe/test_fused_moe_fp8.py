"""Fused MoE with block-FP8 expert weights on the CPU (the Triton kernels through Triton's interpreter).

The kernels (``kernels.fused_moe`` with ``w_gate_up_scale`` / ``w_down_scale``) against the fp32 reference
(``ops.fused_moe_ref``, weights dequantised per 128 x 128 tile) on fresh random inputs whose tile scales vary
over two orders of magnitude (a transposed or shifted scale index changes the result far beyond the tolerance:
checked), with ``H`` and ``I`` not multiples of 128 (``I = 136``: the up rows' tiles start at scale row 2, not
at ``136 // 128 = 1``), fp32 and bf16 activations, dead rows, and outputs and work buffers poisoned with NaN.
The `MoE` module with FP8 experts (simulating a quantized checkpoint: each expert linear's ``weight`` becomes
float8_e4m3fn and gains an fp32 ``weight_scale_inv``) against the same module with the dequantised weights in
fp32, on both backends, and its stacked FP8 storage across ``.to()``, state-dict loads and ``deepcopy``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.checkpoint import dequantize_block_fp8, quantize_block_fp8
from trtllm_glm.modules.ffn import MoE
from trtllm_glm.moe import kernels as K
from trtllm_glm.moe import ops as R

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    # The interpreter's sigmoid of a clamped-away, very negative gate: exp overflows to inf, the result is 0.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

LIMIT = 10.0
FP8 = torch.float8_e4m3fn


def _tiled(rows: int, cols: int, g: torch.Generator, std: float) -> torch.Tensor:
    """``[rows, cols]`` normal weights whose 128 x 128 tiles differ in magnitude by up to ~30x (so that every
    tile has its own scale and a wrong tile index shows)."""
    tiles = torch.exp(torch.randn(math.ceil(rows / 128), math.ceil(cols / 128), generator=g) * 1.2)
    factor = tiles.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return torch.randn(rows, cols, generator=g) * std * factor


def _quantize_stacks(w13: torch.Tensor, w2: torch.Tensor):
    """Stacked bf16/fp32 weights -> ``(q13, s13, q2, s2)`` in the stacked FP8 layout, each linear quantised
    on its own (gate and up apart: the layout of two quantized checkpoint tensors)."""
    inter = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (qg, sg), (qu, su) = quantize_block_fp8(w13[e, :inter]), quantize_block_fp8(w13[e, inter:])
        qd, sd = quantize_block_fp8(w2[e])
        q13.append(torch.cat([qg, qu]))
        s13.append(torch.cat([sg, su]))
        q2.append(qd)
        s2.append(sd)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def _problem(n: int, h: int, inter: int, e: int, k: int, seed: int, skewed: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * 4.0
    pool = torch.arange(k + 1) if skewed else torch.arange(e)
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(n)])
    w = torch.rand(n, k, generator=g) + 0.1
    w13 = torch.stack([_tiled(2 * inter, h, g, 0.5) for _ in range(e)])
    w2 = torch.stack([_tiled(h, inter, g, inter**-0.5) for _ in range(e)])
    return (x, ids, w, *_quantize_stacks(w13, w2))


def _poisoned(x, ids, w, q13, s13, q2, s2, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One call to size the work buffers, then NaN in them and in the output, then the call that counts."""
    scratch: dict[str, torch.Tensor] = {}
    K.fused_moe(x, ids, w, q13, q2, LIMIT, scratch=scratch, w_gate_up_scale=s13, w_down_scale=s2, **kw)
    scratch["inter"].fill_(float("nan"))
    scratch["pair_out"].fill_(float("nan"))
    out = torch.full(x.shape, float("nan"))
    K.fused_moe(x, ids, w, q13, q2, LIMIT, out=out, scratch=scratch, w_gate_up_scale=s13, w_down_scale=s2, **kw)
    return out, scratch


def _ref(x, ids, w, q13, s13, q2, s2, **kw) -> torch.Tensor:
    return R.fused_moe_ref(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2, **kw)


def _close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    torch.testing.assert_close(out, ref, rtol=rel, atol=rel * ref.abs().max().item())


# ------------------------------------------------------------------------------------------------------
# Reference layout
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("h", "inter"), [(300, 136), (256, 128)])  # ragged tiles; whole tiles (broadcast path)
def test_dequantize_experts_is_the_per_linear_dequantisation(h: int, inter: int) -> None:
    g = torch.Generator().manual_seed(0)
    w13 = torch.stack([_tiled(2 * inter, h, g, 0.5) for _ in range(2)])
    w2 = torch.stack([_tiled(h, inter, g, 0.1) for _ in range(2)])
    q13, s13, q2, s2 = _quantize_stacks(w13, w2)
    ti, th = math.ceil(inter / 128), math.ceil(h / 128)
    assert s13.shape == (2, 2 * ti, th) and s2.shape == (2, th, ti)
    assert R.expert_scale_shapes(2, h, inter) == ((2, 2 * ti, th), (2, th, ti))
    d13 = R.dequantize_experts(q13, s13, inter)
    for e in range(2):
        for rows, s_rows in ((slice(0, inter), slice(0, ti)), (slice(inter, None), slice(ti, None))):
            assert torch.equal(d13[e, rows], dequantize_block_fp8(q13[e, rows], s13[e, s_rows]))
        assert torch.equal(R.dequantize_experts(q2[e], s2[e]), dequantize_block_fp8(q2[e], s2[e]))
    assert (d13 - w13).abs().max() < 0.07 * w13.abs().max()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="scale must be"):
        R.dequantize_experts(q13, s13[:, 1:], inter)


# ------------------------------------------------------------------------------------------------------
# Kernels vs reference
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "h", "inter", "e", "k", "skewed", "kw"),
    [
        (1, 300, 136, 4, 2, False, {}),  # H, I not multiples of 128; default tiles (128-wide K steps)
        (7, 300, 136, 5, 3, False, {"block_k": (64, 32), "block_n": (16, 32)}),  # several K steps per tile
        (20, 256, 128, 3, 2, True, {"block_m": 16, "block_k": (128, 64), "block_n": (64, 16)}),  # exact tiles
    ],
)
def test_fp8_kernel_matches_reference(n, h, inter, e, k, skewed, kw) -> None:
    x, ids, w, q13, s13, q2, s2 = _problem(n, h, inter, e, k, seed=n, skewed=skewed)
    assert s13.std() > 0.5 * s13.mean() and s2.std() > 0.5 * s2.mean(), "tile scales should vary"
    out, scratch = _poisoned(x, ids, w, q13, s13, q2, s2, **kw)
    used = scratch["block_expert"] >= 0
    m = kw.get("block_m", K.default_block_m(n * k, e))
    assert not scratch["pair_out"].isnan().any()
    assert not scratch["inter"].view(-1, m, inter)[used].isnan().any()
    ref = _ref(x, ids, w, q13, s13, q2, s2)
    _close(out, ref, 1e-5)
    assert torch.equal(K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2, **kw), out)


def test_fp8_wrong_scale_index_is_caught() -> None:
    """Scales of the right shape but the wrong tiles (down's square grid transposed; gate and up tile rows
    swapped; a column tile shifted) move the result far beyond the kernel test's tolerance."""
    x, ids, w, q13, s13, q2, s2 = _problem(6, 200, 136, 4, 2, seed=9)
    assert s2.shape[1] == s2.shape[2]
    ref = _ref(x, ids, w, q13, s13, q2, s2)
    wrong = [
        (s13, s2.transpose(1, 2).contiguous()),
        (torch.cat([s13[:, 2:], s13[:, :2]], 1), s2),
        (s13.roll(1, dims=2), s2),
    ]
    for a, b in wrong:
        for out in (
            _ref(x, ids, w, q13, a, q2, b),
            K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=a, w_down_scale=b),
        ):
            assert (out - ref).abs().max() > 1e-2 * ref.abs().max()


def test_fp8_bf16_activations() -> None:
    x, ids, w, q13, s13, q2, s2 = _problem(9, 300, 136, 4, 3, seed=4)
    xb = (x / 4).to(torch.bfloat16)
    out, scratch = _poisoned(xb, ids, w, q13, s13, q2, s2)
    assert scratch["inter"].dtype == torch.bfloat16
    ref = _ref(xb, ids, w, q13, s13, q2, s2)
    # The SwiGLU output is rounded to bf16 once (2^-9 relative) before the down product.
    _close(out, ref, 1e-2)
    assert (out - ref).abs().max() > 0  # the bf16 intermediate really is used


def test_fp8_bf16_activations_beyond_fp16_range() -> None:
    """bf16 rows far outside fp16's range (the kernels multiply in fp16 after a power-of-two scaling per row):
    each row matches the reference to its own scale. No clamp, so the SwiGLU output (the down GEMM's
    activations) spans that range too."""
    x, ids, w, q13, s13, q2, s2 = _problem(6, 300, 136, 4, 2, seed=8)
    row_scale = torch.tensor([1e5, 1e-7, 1.0, 3e4, 1e-3, 2e-6])
    xb = (x / 4 * row_scale[:, None]).to(torch.bfloat16)
    out = K.fused_moe(xb, ids, w, q13, q2, None, w_gate_up_scale=s13, w_down_scale=s2)
    ref = R.fused_moe_ref(xb, ids, w, q13, q2, None, w_gate_up_scale=s13, w_down_scale=s2)
    assert ref.isfinite().all() and (ref.abs().amax(1) > 0).all()
    err = (out - ref).abs().amax(1) / ref.abs().amax(1)
    assert (err < 2e-2).all(), err


@pytest.mark.parametrize("align", ["triton", "torch"])
def test_fp8_dead_rows(align: str) -> None:
    x, ids, w, q13, s13, q2, s2 = _problem(10, 300, 136, 6, 2, seed=12)
    live = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1, 0])
    on = live.bool()
    out, scratch = _poisoned(x, ids, w, q13, s13, q2, s2, row_live=live, align=align)
    ref = _ref(x, ids, w, q13, s13, q2, s2, row_live=live)
    _close(out, ref, 1e-5)
    assert torch.equal(out[~on], torch.zeros_like(out[~on]))
    assert scratch["pair_out"].view(10, 2, 300)[~on].isnan().all()  # never computed


def test_fp8_bad_args() -> None:
    x, ids, w, q13, s13, q2, s2 = _problem(3, 200, 136, 4, 2, seed=5)
    with pytest.raises(ValueError, match="w_gate_up_scale is required"):
        K.fused_moe(x, ids, w, q13, q2, LIMIT)
    with pytest.raises(ValueError, match="w_down_scale is required"):
        R.fused_moe_ref(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13)
    with pytest.raises(ValueError, match="float8_e4m3fn w_gate_up"):
        K.fused_moe(x, ids, w, q13.float(), q2.float(), LIMIT, w_gate_up_scale=s13, w_down_scale=s2)
    with pytest.raises(ValueError, match="w_down_scale must be fp32"):
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2.double())
    with pytest.raises(ValueError, match="w_gate_up_scale must be fp32"):  # one scale grid for gate and up
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13[:, 1:], w_down_scale=s2)
    with pytest.raises(ValueError, match="w_down_scale must be fp32"):
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2[:, :, :1])
    with pytest.raises(ValueError, match="block_k must be at most 128"):
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2, block_k=(256, 128))
    with pytest.raises(ValueError, match="block_n must be at most 128"):
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2, block_n=(32, 256))


# ------------------------------------------------------------------------------------------------------
# MoE module with FP8 experts
# ------------------------------------------------------------------------------------------------------
def _cfg(h: int = 200, inter: int = 136, e: int = 5, k: int = 2) -> Glm5NextConfig:
    d = Glm5NextConfig.from_pretrained("tiny").text_dict()
    d.update(
        hidden_size=h,
        moe_intermediate_size=inter,
        intermediate_size=2 * h,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        swiglu_limit=LIMIT,
    )
    return Glm5NextConfig.from_dict(d)


def _quantize_experts(m: MoE) -> None:
    """What a block-FP8 checkpoint load gives each routed expert linear: an fp8 ``weight`` and an fp32
    ``weight_scale_inv`` parameter (the shared experts stay as they are)."""
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for ex in m.experts:
            for lin in (ex.gate_proj, ex.up_proj, ex.down_proj):
                # Tile-varying magnitudes on top of the init, so that every tile's scale differs.
                q, s = quantize_block_fp8(lin.weight * _tiled(*lin.weight.shape, g, 1.0).abs())
                lin.weight = nn.Parameter(q, requires_grad=False)
                lin.weight_scale_inv = nn.Parameter(s, requires_grad=False)


def _dequantised_copy(m: MoE) -> MoE:
    """The same module with every FP8 expert linear's weight dequantised to fp32 (and no scale)."""
    ref = copy.deepcopy(m)
    for ex in ref.experts:
        for lin in (ex.gate_proj, ex.up_proj, ex.down_proj):
            w = dequantize_block_fp8(lin.weight, lin.weight_scale_inv)
            del lin.weight_scale_inv
            lin.weight = nn.Parameter(w)
    ref.mark_weights_changed()
    return ref


def _fp8_module(seed: int = 0, **cfg) -> MoE:
    m = MoE(_cfg(**cfg))
    m.reset_parameters(torch.Generator().manual_seed(seed), 0.3)
    _quantize_experts(m)
    return m


def _run(m: MoE, x: torch.Tensor, backend: str, **kw) -> torch.Tensor:
    m.backend = backend
    try:
        with torch.no_grad():
            return m(x, **kw)
    finally:
        m.backend = None


def _bytes_held(m: MoE) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()}.values())


def test_module_fp8_matches_dequantised_module() -> None:
    m = _fp8_module()
    ref_m = _dequantised_copy(m)
    x = torch.randn(2, 7, 200, generator=torch.Generator().manual_seed(1)) * 3
    want = _run(ref_m, x, "torch")  # plain fp32 experts on the dequantised weights
    loop, fused = _run(m, x, "torch"), _run(m, x, "triton")
    _close(loop, want, 1e-5)
    _close(fused, want, 1e-5)
    # Dead rows: the shared experts only, on both backends.
    live = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    shared = m.shared_experts(x.reshape(-1, 200)).detach()
    for backend in ("torch", "triton"):
        got = _run(m, x.reshape(-1, 200), backend, row_live=live)
        _close(got[live.bool()], want.reshape(-1, 200)[live.bool()], 1e-5)
        torch.testing.assert_close(got[~live.bool()], shared[~live.bool()], rtol=1e-5, atol=1e-6)


def test_module_fp8_stacking_and_bf16_activations() -> None:
    m = _fp8_module(seed=2)
    w13, w2 = m.stacked_expert_weights()
    s13, s2 = m.stacked_expert_scales()
    assert w13.dtype == FP8 and w2.dtype == FP8 and w13.shape == (5, 272, 200) and w2.shape == (5, 200, 136)
    assert s13.dtype == torch.float32 and s13.shape == (5, 4, 2) and s2.shape == (5, 2, 2)
    ex = m.experts[3]
    assert w13[3, :136].data_ptr() == ex.gate_proj.weight.data_ptr()
    assert w13[3, 136:].data_ptr() == ex.up_proj.weight.data_ptr()
    assert s13[3, 2:].data_ptr() == ex.up_proj.weight_scale_inv.data_ptr()
    assert s2[3].data_ptr() == ex.down_proj.weight_scale_inv.data_ptr()
    assert _bytes_held(m) == sum(p.numel() * p.element_size() for p in m.parameters())  # nothing held twice
    assert "experts.3.up_proj.weight_scale_inv" in m.state_dict()
    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(3)) * 3
    want = _run(m, x, "torch")
    # A dtype cast leaves FP8 experts and their scales as they are (and the stack in place).
    m.to(torch.bfloat16)
    assert m.experts[0].gate_proj.weight.dtype == FP8 and m.experts[4].down_proj.weight_scale_inv.dtype == torch.float32
    assert m.gate.weight.dtype == torch.bfloat16 and m.shared_experts.up_proj.weight.dtype == torch.bfloat16
    assert m._stack_is_current() and m.stacked_expert_weights()[0].data_ptr() == w13.data_ptr()
    xb = x.to(torch.bfloat16)
    loop, fused = _run(m, xb, "torch"), _run(m, xb, "triton")
    assert fused.dtype == torch.bfloat16
    _close(fused.float(), loop.float(), 2e-2)
    _close(loop.float(), want, 5e-2)  # bf16 router, shared expert and input against the fp32 module
    m.float()  # back to fp32 (router and shared experts keep their bf16 rounding)
    assert m.experts[1].up_proj.weight.dtype == FP8
    _close(_run(m, x, "triton"), _run(m, x, "torch"), 1e-5)


def test_module_fp8_follows_loads_and_copies() -> None:
    src = _fp8_module(seed=4)
    x = torch.randn(8, 200, generator=torch.Generator().manual_seed(5)) * 3
    want = _run(src, x, "torch")
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    # In place, into a module already quantized (other values): lands in its stacked storage.
    a = _fp8_module(seed=9)
    stack = a.stacked_expert_scales()[0]
    a.load_state_dict(sd)
    assert a.stacked_expert_scales()[0].data_ptr() == stack.data_ptr()
    _close(_run(a, x, "triton"), want, 1e-5)
    # assign=True replaces the parameters: re-stacked on the next fused call.
    b = _fp8_module(seed=9)
    b.load_state_dict(sd, assign=True)
    _close(_run(b, x, "triton"), want, 1e-5)
    assert b._stack_is_current() and b.stacked_expert_weights()[0].dtype == FP8
    # deepcopy: the copy re-stacks apart and computes the same function.
    d = copy.deepcopy(src)
    _close(_run(d, x, "triton"), want, 1e-5)
    assert d.stacked_expert_scales()[1].data_ptr() != src.stacked_expert_scales()[1].data_ptr()
    # A misshapen scale or a half-quantized set of experts is refused with the tensor named.
    with torch.no_grad():
        d.experts[2].up_proj.weight_scale_inv = nn.Parameter(torch.ones(1, 2), requires_grad=False)
    d.mark_weights_changed()
    with pytest.raises(RuntimeError, match=r"experts\.2\.up_proj\.weight_scale_inv must be \[2, 2\]"):
        _run(d, x, "triton")
    del d.experts[2].up_proj.weight_scale_inv
    with pytest.raises(RuntimeError, match=r"experts\.2\.up_proj has no weight_scale_inv"):
        _run(d, x, "triton")


def test_module_fp8_built_on_meta_then_loaded() -> None:
    """The loader's path without a second copy: experts made FP8 on the meta device and stacked there (free),
    then ``to_empty`` allocates the stacks once and an in-place load fills them."""
    src = _fp8_module(seed=6)
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(7)) * 3
    want = _run(src, x, "torch")
    with torch.device("meta"):
        m = MoE(_cfg())
    for ex in m.experts:
        for lin in (ex.gate_proj, ex.up_proj, ex.down_proj):
            grid = (math.ceil(lin.weight.shape[0] / 128), math.ceil(lin.weight.shape[1] / 128))
            lin.weight = nn.Parameter(torch.empty(lin.weight.shape, dtype=FP8, device="meta"), requires_grad=False)
            lin.weight_scale_inv = nn.Parameter(torch.empty(grid, device="meta"), requires_grad=False)
    m.mark_weights_changed()
    assert m.stacked_expert_scales()[0].shape == (5, 4, 2)
    m.to_empty(device="cpu")
    assert m._stack_is_current() and m.stacked_expert_weights()[1].dtype == FP8
    m.load_state_dict({k: v.clone() for k, v in src.state_dict().items()})
    assert _bytes_held(m) == sum(p.numel() * p.element_size() for p in m.parameters())
    _close(_run(m, x, "triton"), want, 1e-5)


def _tiles32_case(g: torch.Generator, n: int, h: int, inter: int, e: int, k: int) -> tuple[torch.Tensor, ...]:
    """Rows, routing and block-FP8 experts quantised in 32-wide tiles whose scales vary tile to tile (an exp-normal
    factor per tile): ``(x [n, h], ids [n, k], w [n, k], q13 [e, 2I, h], s13, q2 [e, h, I], s2)``."""
    x = torch.randn(n, h, generator=g) * 4.0
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g) + 0.1

    def quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor = torch.exp(torch.randn(math.ceil(t.shape[0] / 32), math.ceil(t.shape[1] / 32), generator=g))
        t = t * factor.repeat_interleave(32, 0)[: t.shape[0]].repeat_interleave(32, 1)[:, : t.shape[1]]
        return quantize_block_fp8(t, 32)

    gate_up = [[quant(torch.randn(inter, h, generator=g) * 0.5) for _ in range(2)] for _ in range(e)]
    down = [quant(torch.randn(h, inter, generator=g) * inter**-0.5) for _ in range(e)]
    q13 = torch.stack([torch.cat([gq for gq, _ in pair]) for pair in gate_up])
    s13 = torch.stack([torch.cat([gs for _, gs in pair]) for pair in gate_up])
    q2, s2 = torch.stack([q for q, _ in down]), torch.stack([s for _, s in down])
    return x, ids, w, q13, s13, q2, s2


def test_kernels_with_32_wide_scale_tiles() -> None:
    """A checkpoint with ``weight_block_size`` 32 (the small test models use it: several tiles per matrix): the
    kernels' K steps and column blocks shrink to the tile and read scale ``[r // 32, c // 32]``; equal to the
    reference dequantised with the same tiles (a kernel reading 128-wide tiles takes the wrong scales)."""
    g = torch.Generator().manual_seed(11)
    n, h, inter, e, k = 5, 96, 72, 3, 2
    x, ids, w, q13, s13, q2, s2 = _tiles32_case(g, n, h, inter, e, k)
    assert s13.shape == (e, 2 * math.ceil(inter / 32), math.ceil(h / 32))
    ref = _ref(x, ids, w, q13, s13, q2, s2, fp8_block=32)
    out, _ = _poisoned(x, ids, w, q13, s13, q2, s2, fp8_block=32)
    _close(out, ref, 2e-5)
    with pytest.raises(ValueError, match="w_gate_up_scale must be fp32"):  # the 128-tile grid is another shape
        K.fused_moe(x, ids, w, q13, q2, LIMIT, w_gate_up_scale=s13, w_down_scale=s2)


def test_large_m_launch_with_fp8_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-sized batch (`kernels.large_m_launch`) of block-FP8 experts: the large-M tiles shrink to the scale
    tile (32 here) and the result is the reference's (H = 96, I = 72: ragged column blocks)."""
    launches: list[object] = []
    mod = K._interpreted_module()
    real = mod.large_m_launch
    monkeypatch.setattr(mod, "large_m_launch", lambda p, e: launches.append(real(p, e)) or launches[-1])
    g = torch.Generator().manual_seed(12)
    n, h, inter, e, k = 200, 96, 72, 3, 2
    x, ids, w, q13, s13, q2, s2 = _tiles32_case(g, n, h, inter, e, k)
    out, scratch = _poisoned(x, ids, w, q13, s13, q2, s2, fp8_block=32)
    assert launches and all(c is not None for c in launches), "the large-M launch should be taken"
    assert not scratch["pair_out"].isnan().any()
    _close(out, _ref(x, ids, w, q13, s13, q2, s2, fp8_block=32), 2e-5)

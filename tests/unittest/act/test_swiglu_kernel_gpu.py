"""The clamped SwiGLU kernel (compiled, CUDA) against the torch reference `clamped_swiglu`, bit for bit in bf16:
every bf16 value as gate and as up, and random GEMM-like outputs at the real GLM-5.3-Flash widths (I = 2048 for
the shared experts, 12288 for the dense layers); then the fused `GatedMLP` against the unfused one, and both
under CUDA-graph replay. Outputs are poisoned with NaN first. Needs CUDA (tests/conftest.py skips ``gpu`` tests
without it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtllm_glm.act import swiglu, swiglu_backend, swiglu_reference
from trtllm_glm.modules.ffn import GatedMLP, clamped_swiglu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN = 4096  # Glm5NextConfig.hidden_size
SHARED_I = 2048  # moe_intermediate_size * n_shared_experts
DENSE_I = 12288  # intermediate_size
LIMIT = 10.0  # swiglu_limit

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _assert_bits_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Same bits wherever either is a number (signed zeros too); NaN exactly where the reference has NaN."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    gi, ri = got.view(_INT[got.dtype]), ref.view(_INT[ref.dtype])
    bad = (gi != ri) & ~nan
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. got {got[bad][:4]} vs ref {ref[bad][:4]}"


def _poisoned(n: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n, inter), float("nan"), dtype=dtype, device="cuda")


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float type as ``[256, 256]`` (NaNs, infinities, subnormals included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype).view(256, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("limit", [LIMIT, None])
@pytest.mark.parametrize("side", ["gate", "up"])
def test_every_16bit_value(dtype: torch.dtype, limit: float | None, side: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    every = _every_value(dtype)
    other = (torch.randn(256, 256, device="cuda", generator=g) * 8).to(dtype)
    gate, up = (every, other) if side == "gate" else (other, every)
    gate_up = torch.cat([gate, up], dim=1)
    got = swiglu(gate_up, limit, "triton", out=_poisoned(256, 256, dtype))
    _assert_bits_equal(got, clamped_swiglu(gate, up, limit))


@pytest.mark.parametrize("n", [1, 16, 64, 2048])
@pytest.mark.parametrize("inter", [SHARED_I, DENSE_I])
@pytest.mark.parametrize("limit", [LIMIT, None])
def test_bf16_bit_exact_real_sizes(n: int, inter: int, limit: float | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + inter)
    # A spread well beyond +-L (so both clamps act), with a few rows far larger.
    scale = torch.exp(torch.randn(n, 1, device="cuda", generator=g))
    gate_up = (torch.randn(n, 2 * inter, device="cuda", generator=g) * 6 * scale).to(torch.bfloat16)
    ref = clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], limit)
    assert swiglu_backend(gate_up) == "triton"  # "auto" takes the kernel for CUDA tensors
    _assert_bits_equal(swiglu(gate_up, limit, out=_poisoned(n, inter, torch.bfloat16)), ref)
    # A row stride wider than 2I (a column slice of a wider GEMM output) is read in place.
    wide = torch.zeros(n, 2 * inter + 64, dtype=torch.bfloat16, device="cuda")
    wide[:, 16 : 16 + 2 * inter] = gate_up
    _assert_bits_equal(swiglu(wide[:, 16 : 16 + 2 * inter], limit, "triton"), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_bit_exact(dtype: torch.dtype) -> None:
    # These pin the fp32 arithmetic itself: Triton's approximate tl.exp still rounds to the same bf16 values for
    # every input, but differs from torch in tens of thousands of these fp32 results.
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = (torch.randn(64, 2 * SHARED_I, device="cuda", generator=g) * 12).to(dtype)
    _assert_bits_equal(swiglu(gate_up, LIMIT, "triton"), swiglu_reference(gate_up, LIMIT))


def _mlp_pair(inter: int) -> tuple[GatedMLP, GatedMLP]:
    """The same random bf16 MLP twice on CUDA: unfused, then fused."""
    ref = GatedMLP(HIDDEN, inter, LIMIT)
    ref.reset_parameters(torch.Generator().manual_seed(inter), 0.02)
    ref = ref.to(device="cuda", dtype=torch.bfloat16)
    fused = GatedMLP(HIDDEN, inter, LIMIT).to(device="cuda", dtype=torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    fused.fuse_weights()
    return ref, fused


def _hidden(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Large enough activations that some gate / up values pass +-L.
    return (torch.randn(n, HIDDEN, device="cuda", generator=g) * 40).to(torch.bfloat16)


@pytest.mark.parametrize("n", [1, 16, 64, 2048])
@pytest.mark.parametrize("inter", [SHARED_I, DENSE_I])
@torch.no_grad()
def test_fused_gated_mlp_matches_unfused(n: int, inter: int) -> None:
    ref, fused = _mlp_pair(inter)
    w = fused._gate_up.weight
    assert fused.gate_proj.weight.data_ptr() == w.data_ptr()
    assert fused.up_proj.weight.data_ptr() == w.data_ptr() + inter * HIDDEN * w.element_size()
    x = _hidden(n, n)
    gate_up = F.linear(x, w)
    assert (gate_up.float().abs() > LIMIT).any()
    got = fused(x)
    # Exactly the reference SwiGLU on the fused GEMM's own output...
    same_gemm = fused.down_proj(clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], LIMIT))
    _assert_bits_equal(got, same_gemm)
    # ...and the unfused module up to the bf16 rounding of GEMMs of another shape.
    want = ref(x)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 0.02 * want.float().abs().max().item() + 1e-3, err


@torch.no_grad()
def test_cuda_graph_replay() -> None:
    _, fused = _mlp_pair(SHARED_I)
    static_x = _hidden(16, 1)
    static_gu = torch.randn(16, 2 * SHARED_I, device="cuda").to(torch.bfloat16) * 20
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm up outside the capture
            fused(static_x)
            swiglu(static_gu, LIMIT)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused(static_x)
        h = swiglu(static_gu, LIMIT)
    for seed in (2, 3):
        static_x.copy_(_hidden(16, seed))
        static_gu.copy_(torch.randn(16, 2 * SHARED_I, device="cuda").to(torch.bfloat16) * 20)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bits_equal(h, swiglu_reference(static_gu, LIMIT))
        _assert_bits_equal(y, fused(static_x))

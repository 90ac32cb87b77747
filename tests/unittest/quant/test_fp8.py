"""Block-FP8 weights held as FP8 (issue 28): the weight-only FP8 linear kernel under Triton's interpreter against
its torch reference, the dispatcher, `Fp8Linear`, fused FP8 projections, and a block-FP8 real-layout checkpoint
(two shards, an MTP layer, ``modules_to_not_convert``) loaded as FP8 against the same weights dequantised.

Kernel shapes are awkward on purpose: ``N``, ``K`` not multiples of the scale tile nor of the kernel's steps, scale
grids that are square (a kernel reading the scales transposed gets the right shape and the wrong values) and
scales that vary by a factor of ~100 from tile to tile (a misaligned tile is off by far more than the bound).
Activations are fp32 and fp16 (the interpreter's bf16 arithmetic is wrong). Outputs are poisoned with NaN first.

Error bound of the fp32 path: the kernel forms every product ``x * q * s`` as ``(x * q)`` summed over a step, then
times ``s``: an fp32 sum of at most ``d`` terms in any order is within ``d * u * sum|terms|`` of the exact sum
(``u = 2^-24``), and the scale multiply and the partial sums add a few roundings: ``|y - ref| <= (K + 8) * u *
(|x| @ |W|^T)`` with ``W`` the dequantised weight (the reference itself is an fp32 GEMM of the same terms).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.config import Glm5NextConfig, QuantConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.modules.ffn import GatedMLP
from trtllm_glm.modules.linear import Fp8Linear, swap_fp8_linears_
from trtllm_glm.modules.weight_views import FusedWeights
from trtllm_glm.quant import dequantize_block_fp8, quantize_block_fp8
from trtllm_glm.quant.ops import (
    FP8_LINEAR_BACKEND_ENV,
    fp8_linear,
    fp8_linear_backend,
    fp8_linear_reference,
    fp8_linear_triton,
)

pytestmark = pytest.mark.cpu_only

U = 2.0**-24
FP8 = torch.float8_e4m3fn


def _weight(n: int, k: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes and scales that differ by ~100x between tiles (and are not symmetric)."""
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_block_fp8(torch.randn(n, k, generator=g), block)
    s = s * torch.exp(torch.randn(s.shape, generator=g) * 1.5)
    return q, s


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(m, k, generator=g).to(dtype)


@pytest.mark.parametrize(
    "m, n, k, block, dtype, split",
    [
        (1, 200, 300, 128, torch.float32, None),  # ragged tiles in both dims
        (3, 150, 140, 64, torch.float32, 3),  # square 3x3 scale grid, forced split
        (5, 150, 140, 64, torch.float16, None),  # 16-bit activations, fp16 out
        (17, 100, 96, 32, torch.float32, 2),  # 32-row activation tile
        (70, 90, 160, 32, torch.float32, None),  # beyond the split path: row tiles
    ],
)
def test_fp8_linear_kernel_equals_reference(m, n, k, block, dtype, split) -> None:
    q, s = _weight(n, k, block, seed=m)
    x = _x(m, k, dtype, seed=m)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = fp8_linear_triton(x, q, s, block, out=out, split_k=split)
    assert y is out and torch.isfinite(y).all(), "an output element was not written"
    w = dequantize_block_fp8(q, s, block).double()
    exact = x.double() @ w.T
    if dtype == torch.float32:
        bound = (k + 8) * U * (x.double().abs() @ w.abs().T)
        assert ((y.double() - exact).abs() <= bound).all()
    else:  # the fp32 result rounded once to fp16
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-10 + 1e-3).all()
    ref = fp8_linear_reference(x, q, s, block)
    assert ref.dtype == dtype
    # A transposed or misaligned scale grid gives visibly different numbers (the test can fail).
    if s.shape[0] == s.shape[1]:
        wrong = fp8_linear_reference(x, q, s.T.contiguous(), block)
        assert (wrong.double() - exact).abs().max() > 100 * (y.double() - exact).abs().max()


@pytest.mark.parametrize(
    "m, n, k, block, dtype, knobs",
    [
        # The fused MoE's orientation (x as the MMA's left operand, weight tiles [K, N]): ragged N and K, the split
        # reduction over three chunks, partials of the live rows only (M = 1 of a 16-row tile).
        (1, 200, 300, 64, torch.float32, dict(x_as_a=True, k_chunk=128)),
        (5, 150, 140, 64, torch.float16, dict(x_as_a=True, block_n=32)),  # square scale grid, fp16 out
        (17, 100, 96, 32, torch.float32, dict(x_as_a=True, split_k=2, block_n=16)),  # 32-row tile, 2 chunks
        # Two K steps per iteration; the last iteration's second step lies past K (masked, scale 0), and chunks
        # are whole iterations (k_chunk 64 rounds up to 2 x 32).
        (3, 90, 160, 32, torch.float32, dict(unroll=2, k_chunk=64, block_k=32)),
        (3, 90, 160, 32, torch.float32, dict(x_as_a=True, unroll=2, k_chunk=64, block_k=16)),
        (2, 70, 100, 32, torch.float32, dict(x_as_a=True, unroll=3, k_chunk=1 << 30)),  # no split, K % 96 != 0
        # Ten chunks: the last program reads the partials in groups of four (the last group partly past SPLIT).
        (2, 70, 300, 32, torch.float32, dict(x_as_a=True, k_chunk=32)),
        (2, 70, 300, 32, torch.float32, dict(k_chunk=32, block_k=32)),
        # Stream-K: runs that end inside a tile, cover whole tiles, start in one tile and end in another; fewer
        # programs than tiles (a run spans several), more (a tile has up to ceil(P / T) + 1 partials), more than
        # units (capped: one unit each), ragged N and K, 16-bit activations.
        (1, 200, 300, 64, torch.float32, dict(stream_k=7, block_n=32)),
        (3, 150, 140, 64, torch.float32, dict(stream_k=2, block_n=32, block_k=32)),
        (5, 150, 140, 64, torch.float16, dict(stream_k=11, block_n=16, block_k=32)),
        (17, 100, 96, 32, torch.float32, dict(stream_k=13, block_n=16, block_k=16)),
        (2, 70, 300, 32, torch.float32, dict(stream_k=1000, block_n=32, block_k=16)),
        (2, 70, 300, 32, torch.float32, dict(stream_k=1)),
    ],
)
def test_fp8_linear_variants_equal_reference(m, n, k, block, dtype, knobs) -> None:
    """Every launch variant the H200 sweep may pick (`kernels.launch_config` knobs) computes the same product."""
    q, s = _weight(n, k, block, seed=m + n)
    x = _x(m, k, dtype, seed=m + k)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = fp8_linear_triton(x, q, s, block, out=out, **knobs)
    assert y is out and torch.isfinite(y).all(), "an output element was not written"
    w = dequantize_block_fp8(q, s, block).double()
    exact = x.double() @ w.T
    if dtype == torch.float32:
        assert ((y.double() - exact).abs() <= (k + 8) * U * (x.double().abs() @ w.abs().T)).all()
    else:
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-10 + 1e-3).all()
    # Reproducible, and the same split launch again (counters were reset by the last program of each tile).
    assert torch.equal(fp8_linear_triton(x, q, s, block, **knobs), y)
    if s.shape[0] == s.shape[1]:
        wrong = fp8_linear_reference(x, q, s.T.contiguous(), block)
        assert (wrong.double() - exact).abs().max() > 100 * (y.double() - exact).abs().max()


def test_fp8_linear_tuned_table_keys_on_the_weight_only(monkeypatch) -> None:
    """Tuned knobs apply per weight shape (or size class) for every M of the 16-row tile alike, explicit knobs win,
    larger row tiles, fp32 activations and non-128 scale tiles keep the rule; bad knobs are one-line errors."""
    from trtllm_glm.quant import kernels as kern

    monkeypatch.setattr(kern, "_TUNED_SHAPES", {(4096, 8192): dict(x_as_a=True, block_n=32, k_chunk=2048)})
    monkeypatch.setattr(kern, "_TUNED_CLASSES", {"large": dict(x_as_a=True, unroll=2), "tiny": dict(block_n=16)})
    cfgs = {m: kern.launch_config(m, 4096, 8192, 128, False) for m in (1, 4, 16)}
    assert len(set(cfgs.values())) == 1
    c = cfgs[1]
    assert (c.x_as_a, c.block_n, c.k_per_split, c.split, c.block_m) == (True, 32, 2048, 4, 16)
    assert not kern.launch_config(17, 4096, 8192, 128, False).x_as_a  # 32-row tiles and up: the rule
    assert kern.launch_config(65, 4096, 8192, 128, False).x_as_a is False  # prefill chunks: the rule
    assert kern.launch_config(1, 4096, 8192, 128, False, block_n=64).block_n == 64
    assert kern.launch_config(1, 4096, 8192, 128, False, split_k=2).split == 2  # split_k drops the tuned chunk
    assert kern.launch_config(1, 4096, 8192, 128, False, tuned=False) == kern.launch_config(
        1, 4096, 8192, 128, False, tuned=False, x_as_a=False
    )
    assert not kern.launch_config(1, 4096, 8192, 128, False, tuned=False).x_as_a
    assert not kern.launch_config(1, 4096, 8192, 128, True).x_as_a  # fp32 activations: the rule
    big = kern.launch_config(1, 24576, 4096, 128, False)  # class "large"
    assert big.x_as_a and big.unroll == 2 and big.k_per_split % 256 == 0
    assert kern.launch_config(1, 8192, 128, 128, False).block_n == 16  # class "tiny"
    assert kern.launch_config(1, 2176, 4096, 128, False) == kern.launch_config(1, 2176, 4096, 128, False, tuned=False)
    assert kern.shape_class(8192, 128) == "tiny" and kern.shape_class(4096, 4096) == "small"
    for bad, msg in ((dict(unroll=0), "unroll must be >= 1"), (dict(k_chunk=0), "k_chunk must be >= 1")):
        with pytest.raises(ValueError, match=msg):
            kern.launch_config(1, 256, 256, 128, False, **bad)


def test_stream_k_cut_and_row_independence(monkeypatch) -> None:
    """A stream-K launch (`kernels._fp8_linear_sk_kernel`): its configuration, the partials a tile can need, and a
    row's bits alone equal to its bits inside a batch of the same row tile (the cut never depends on M); the
    interpreter runs the programs in order, so every tile's last partial arrives last: the bits are the fixed slot
    order's, and a second launch (counters reset) gives them again."""
    from trtllm_glm.quant import kernels as kern

    c = kern.launch_config(1, 4096, 8192, 128, False, stream_k=264, block_n=128)
    tiles, steps = 32, 64
    assert (c.programs, c.x_as_a, c.unroll) == (264, True, 1)
    assert c.split == min(264, steps, -(-264 // tiles) + 1) == 10  # ceil(264 / 32) + 1 partials at most
    assert kern.launch_config(16, 4096, 8192, 128, False, stream_k=264, block_n=128) == c  # M-independent
    assert kern.launch_config(1, 256, 256, 128, False, stream_k=100, block_n=128).programs == 4  # 2 x 2 units
    assert not kern.launch_config(65, 4096, 8192, 128, False, stream_k=264).programs  # prefill: the row grid
    for bad, msg in ((dict(stream_k=-1), "stream_k must be >= 0"), (dict(stream_k=8, x_as_a=False), "x_as_a"),
                     (dict(stream_k=8, unroll=2), "unroll 1")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            kern.launch_config(1, 256, 256, 128, False, **bad)
    monkeypatch.setattr(kern, "_TUNED_CLASSES", {"tiny": dict(stream_k=9, block_n=16, x_as_a=False)})
    tuned = kern.launch_config(1, 200, 300, 128, False)
    assert (tuned.programs, tuned.x_as_a) == (9, True)  # a tuned knob like the others; it implies x_as_a
    q, s = _weight(200, 300, 64, seed=11)
    x = _x(16, 300, torch.float16, seed=11)
    knobs = dict(stream_k=9, block_n=16, block_k=32)
    y = fp8_linear_triton(x, q, s, 64, **knobs)
    for r in (0, 7, 15):
        assert torch.equal(fp8_linear_triton(x[r : r + 1], q, s, 64, **knobs), y[r : r + 1])
    assert torch.equal(fp8_linear_triton(x, q, s, 64, **knobs), y)


def test_fp8_linear_split_is_deterministic_and_counters_reset() -> None:
    q, s = _weight(64, 256, 128, seed=7)
    x = _x(2, 256, torch.float32, seed=7)
    a = fp8_linear_triton(x, q, s, 128, split_k=2)
    b = fp8_linear_triton(x, q, s, 128, split_k=2)
    assert torch.equal(a, b)


def test_fp8_linear_dispatch_and_errors(monkeypatch) -> None:
    q, s = _weight(70, 64, 32, seed=3)
    x = _x(4, 64, torch.float32, seed=3)
    assert fp8_linear_backend(x, q, s, 32) == "torch"  # CPU: the reference by default
    monkeypatch.setenv(FP8_LINEAR_BACKEND_ENV, "triton")
    assert fp8_linear_backend(x, q, s, 32) == "triton"
    assert fp8_linear_backend(x, q, s, 24) == "torch"  # no power-of-two K step divides 24
    torch.testing.assert_close(fp8_linear(x, q, s, 32), fp8_linear_reference(x, q, s, 32), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(FP8_LINEAR_BACKEND_ENV, "cublas")
    with pytest.raises(ValueError, match="FP8 linear backend must be one of"):
        fp8_linear(x, q, s, 32)
    monkeypatch.delenv(FP8_LINEAR_BACKEND_ENV)
    with pytest.raises(ValueError, match=r"scale_inv must be \[3, 2\] float32"):
        fp8_linear(x, q, s.T.contiguous(), 32)
    with pytest.raises(ValueError, match="weight must be 2-D float8_e4m3fn"):
        fp8_linear(x, q.float(), s, 32)


def test_fp8_linear_module_keeps_its_dtypes_and_names() -> None:
    lin = nn.Linear(96, 80, bias=False)
    f = Fp8Linear.from_linear(lin, block=32)
    assert isinstance(f, nn.Linear) and f.weight.dtype == FP8 and not f.weight.requires_grad
    assert set(f.state_dict()) == {"weight", "weight_scale_inv"} and f.weight_scale_inv.shape == (3, 3)
    q, s = quantize_block_fp8(lin.weight.detach(), 32)
    assert torch.equal(f.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(f.weight_scale_inv, s)
    s_before = f.weight_scale_inv.clone()
    f.to(torch.bfloat16)  # a whole-model cast neither widens the codes nor rounds the scales
    assert f.weight.dtype == FP8 and f.weight_scale_inv.dtype == torch.float32
    assert torch.equal(f.weight_scale_inv, s_before)
    x = torch.randn(3, 96)
    torch.testing.assert_close(f(x), x @ dequantize_block_fp8(q, s, 32).T, rtol=1e-5, atol=1e-5)
    assert f(x.bfloat16()).dtype == torch.bfloat16
    with torch.device("meta"):
        m = Fp8Linear(96, 80, block=32)
    m.to_empty(device="cpu")
    assert m.weight.dtype == FP8


@pytest.mark.parametrize("inter, fused", [(64, True), (48, False)])
def test_fp8_gate_up_fuse_only_in_whole_tiles(inter, fused) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(64, inter, swiglu_limit=7.0)
    swap_fp8_linears_(mlp, ["gate_proj", "up_proj", "down_proj"], block=32)
    x = torch.randn(5, 64)
    before = mlp(x)
    mlp.fuse_weights()
    assert (mlp._gate_up is not None) == fused
    if fused:
        f = mlp._gate_up
        assert f.weight.dtype == FP8 and f.scale is not None and f.scale.weight.shape == (2 * inter // 32, 2)
        assert f.usable() and mlp.gate_proj.weight.data_ptr() == f.weight.data_ptr()
    torch.testing.assert_close(mlp(x), before, rtol=1e-6, atol=1e-6)
    # A replaced scale is noticed: the separate GEMMs again.
    if fused:
        mlp.up_proj.weight_scale_inv = nn.Parameter(mlp.up_proj.weight_scale_inv.clone() * 2, requires_grad=False)
        assert mlp._fused_weight() is None


def test_fp8_and_float_parts_never_fuse_and_a_ragged_part_only_last() -> None:
    root = nn.Module()
    root.a, root.b, root.c = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False), nn.Linear(32, 40, bias=False)
    swap_fp8_linears_(root, ["a"], block=32)
    assert FusedWeights.build([root.a, root.b]) is None
    swap_fp8_linears_(root, ["b", "c"], block=32)
    assert FusedWeights.build([root.c, root.a]) is None  # c's ragged tile row would share a scale row with a
    x = torch.randn(3, 32)
    want = torch.cat([root.a(x), root.c(x)], dim=-1)
    f = FusedWeights.build([root.a, root.c])
    assert f is not None and f.scale is not None and f.scale.weight.shape == (2 + 2, 1)
    torch.testing.assert_close(f.linear(x), want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# A block-FP8 real-layout checkpoint
# --------------------------------------------------------------------------------------------------
SKIP = ["lm_head", "mlp.shared_experts"]


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """The tiny preset (with its MTP layer) quantised to 32 x 32 tiles (several tiles per matrix, so a misplaced
    scale shows), shared experts and the LM head kept, saved in the real layout as two shards or more."""
    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.index_topk = 64  # every pool selected: logits comparable without near-tied top-k flips
    m = Glm5NextForCausalLM.from_config(cfg, seed=5)
    m.quantize_fp8_(QuantConfig.block_fp8(32, SKIP))
    d = tmp_path_factory.mktemp("fp8ckpt")
    files = m.save_pretrained(d, max_shard_bytes=400_000)
    assert len(files) >= 2
    return d


def test_fp8_checkpoint_loads_as_fp8(fp8_ckpt) -> None:
    m = Glm5NextForCausalLM.from_pretrained(str(fp8_ckpt))
    p = dict(m.named_parameters())
    L = m.config.num_hidden_layers
    fp8 = {n for n, t in p.items() if t.dtype == FP8}
    held_fp8 = ["model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.kv_b_proj",
                "model.layers.3.self_attn.indexer.wq_b", "model.layers.0.mlp.down_proj",
                "model.layers.2.mlp.experts.3.up_proj", "mtp.eh_proj", "mtp.block.mlp.experts.0.gate_proj"]  # fmt: skip
    for name in held_fp8:
        assert name + ".weight" in fp8 and p[name + ".weight_scale_inv"].dtype == torch.float32, name
    assert p["lm_head.weight"].dtype == torch.float32
    assert p["model.layers.2.mlp.shared_experts.gate_proj.weight"].dtype == torch.float32
    assert p["model.layers.3.self_attn.indexer.weights_proj.weight"].dtype == torch.float32  # kept fp32
    assert p["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router is no linear
    # Bytes held: one per FP8 weight, four per scale and per fp32 weight; the estimate counts the same.
    held = sum(t.numel() * t.element_size() for t in p.values())
    assert held == m.param_bytes(torch.float32)
    n_fp8 = sum(p[n].numel() for n in fp8)
    assert held == n_fp8 + 4 * sum(t.numel() for n, t in p.items() if n not in fp8)
    plain = Glm5NextForCausalLM.from_pretrained(str(fp8_ckpt), quantization="none")
    others = sum(t.numel() for n, t in p.items() if n not in fp8 and not n.endswith("_scale_inv"))
    assert plain.param_bytes(torch.float32) == 4 * (n_fp8 + others)
    assert not any(t.dtype == FP8 for t in plain.parameters())
    # The round trip writes the same layout back.
    assert f"layers.{L}.eh_proj" in " ".join(m.hf_state_dict())


def test_fp8_checkpoint_logits_tokens_and_speculation(fp8_ckpt) -> None:
    from trtllm_glm import LLM, SamplingParams
    from trtllm_glm.speculative.config import MTPDecodingConfig

    m = Glm5NextForCausalLM.from_pretrained(str(fp8_ckpt))
    ref = Glm5NextForCausalLM.from_pretrained(str(fp8_ckpt), quantization="none", dtype="float32")
    toks = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a = ModelHarness(m).prefill_logits(0, toks)
    b = ModelHarness(ref).prefill_logits(0, toks)
    assert (a - b).abs().max() <= 2e-3 * b.abs().max()
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [toks[:12], toks[5:30]]
    kw = dict(device="cpu", max_seq_len=128)
    greedy = [o.outputs[0].token_ids for o in LLM(str(fp8_ckpt), **kw).generate(prompts, sp)]
    deq = [o.outputs[0].token_ids for o in LLM(str(fp8_ckpt), quantization="none", **kw).generate(prompts, sp)]
    assert greedy == deq
    spec = LLM(str(fp8_ckpt), speculative_config=MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2), **kw)
    assert isinstance(spec.model.mtp.eh_proj, Fp8Linear)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == greedy


def test_bf16_checkpoint_quantised_at_load(tmp_path) -> None:
    m = Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=2)
    m.save_pretrained(tmp_path)
    q = Glm5NextForCausalLM.from_pretrained(str(tmp_path), quantization="fp8")
    m.quantize_fp8_()
    a, b = m.state_dict(), q.state_dict()
    assert a.keys() == b.keys() and any(t.dtype == FP8 for t in b.values())
    for k in a:
        x, y = (t.view(torch.uint8) if t.dtype == FP8 else t for t in (a[k], b[k]))
        assert torch.equal(x, y), k
    assert q.config.quantization is not None and q.config.quantization.modules_to_not_convert == ["lm_head"]
    assert not isinstance(q.lm_head, Fp8Linear)
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        Glm5NextForCausalLM.from_pretrained("tiny", quantization="int4")


def test_fp8_linear_gpu_variants_compile_for_sm90() -> None:
    """The compiled-only paths (hardware e4m3 conversion, bf16 tensor-core dot) build for the H200: the interpreted
    tests above only run (and the conftest only compiles) the integer decode with fp32 dots."""
    from tests.triton_compile import KernelSpec, compile_sm90

    def spec(act: str, num_warps: int = 4, **constexprs) -> KernelSpec:
        sig = {"x_ptr": f"*{act}", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": f"*{act}", "part_ptr": "*fp32",
               "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
               "stride_sn": "i32", "stride_ym": "i32", "K_PER_SPLIT": "i32", "SPLIT": "i32"}  # fmt: skip
        consts = dict(QBLOCK=128, HW_FP8=True, UNROLL=1, X_AS_A=False, PDL=False, PREFETCH=0, PDL_LATE=False)
        consts.update(constexprs)
        return KernelSpec("trtllm_glm.quant.kernels", "_fp8_linear_kernel", sig, consts, num_warps)

    specs = [
        spec("bf16", SPLIT_K=True, BLOCK_N=16, BLOCK_M=16, BLOCK_K=128, DOT_FP32=False, X_POW2=True),  # decode
        spec("bf16", 8, SPLIT_K=False, BLOCK_N=128, BLOCK_M=64, BLOCK_K=128, DOT_FP32=False, X_POW2=True),  # prefill
        spec("fp16", SPLIT_K=True, BLOCK_N=32, BLOCK_M=32, BLOCK_K=64, DOT_FP32=False, X_POW2=False),
        spec("fp32", SPLIT_K=True, BLOCK_N=16, BLOCK_M=16, BLOCK_K=32, DOT_FP32=True, X_POW2=False),
        # The sweep's x-as-A candidates (mma.sync at 16 rows, wgmma with the weight in shared memory at 64).
        spec("bf16", SPLIT_K=True, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, DOT_FP32=False, X_POW2=True, X_AS_A=True),
        spec("bf16", SPLIT_K=True, BLOCK_N=64, BLOCK_M=64, BLOCK_K=128, DOT_FP32=False, X_POW2=True, X_AS_A=True),
        spec(
            "bf16",
            SPLIT_K=False,
            BLOCK_N=32,
            BLOCK_M=16,
            BLOCK_K=128,
            DOT_FP32=False,
            X_POW2=True,
            X_AS_A=True,
            UNROLL=2,
        ),  # fmt: skip
        spec("fp32", SPLIT_K=True, BLOCK_N=16, BLOCK_M=16, BLOCK_K=32, DOT_FP32=True, X_POW2=False, X_AS_A=True),
    ]
    dq_sig = {"w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
              "stride_sn": "i32", "stride_on": "i32"}  # fmt: skip
    specs.append(
        KernelSpec("trtllm_glm.quant.kernels", "_fp8_dequant_kernel", dq_sig, dict(QBLOCK=128, HW_FP8=True), 8)
    )
    for s, res in zip(specs, compile_sm90(specs)):
        assert res["ok"], (s.constexprs, res.get("error", "")[:2000])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_kernel_is_the_reference(dtype: torch.dtype) -> None:
    """The prefill path's one-launch dequantisation (`fp8_dequantize_triton`, interpreted) equals the reference's
    fp32 dequantisation rounded once to ``dtype``, bit for bit, with ragged tiles and tile-varying scales; every
    element is written (the output is allocated fresh: compared whole)."""
    from trtllm_glm.quant.ops import fp8_dequantize_triton

    g = torch.Generator().manual_seed(4)
    w = torch.randn(70, 100, generator=g) * torch.exp(torch.randn(70, 1, generator=g))
    q, sc = quantize_block_fp8(w, 32)
    sc = sc * torch.exp(torch.randn(sc.shape, generator=g))  # every tile its own scale: a wrong tile shows
    got = fp8_dequantize_triton(q, sc, 32, dtype)
    want = dequantize_block_fp8(q, sc, 32).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="scale_inv must be"):
        fp8_dequantize_triton(q, sc.T.contiguous(), 32, dtype)


def test_swaps_drop_stale_fused_groups_and_dequantize_back() -> None:
    from trtllm_glm.modules.linear import NumericsLinear, dequantize_fp8_linears_

    torch.manual_seed(1)
    mlp = GatedMLP(64, 64, swiglu_limit=None)
    mlp.fuse_weights()
    assert mlp._gate_up is not None and mlp._gate_up.scale is None
    x = torch.randn(3, 64)
    swap_fp8_linears_(mlp, ["gate_proj", "up_proj", "down_proj"], block=32)
    assert mlp._gate_up is None  # the float group would multiply by the old weights
    fp8_out = mlp(x)
    mlp.fuse_weights()
    assert mlp._gate_up is not None and mlp._gate_up.scale is not None
    torch.testing.assert_close(mlp(x), fp8_out, rtol=1e-6, atol=1e-6)
    assert dequantize_fp8_linears_(mlp, torch.float32) == ["gate_proj", "up_proj", "down_proj"]
    # A float linear again: the plain nn.Linear that follows the numerics mode.
    assert mlp._gate_up is None and type(mlp.up_proj) is NumericsLinear and mlp.up_proj.weight.dtype == torch.float32
    torch.testing.assert_close(mlp(x), fp8_out, rtol=1e-5, atol=1e-6)


def test_fp8_model_fuses_the_largest_whole_tile_groups() -> None:
    """32 x 32 tiles on the tiny preset: KDA's b_proj (4 rows, a ragged tile) fuses as the last part, the MLA
    pooling gate (a plain parameter) stays apart; logits equal the unfused model's."""
    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.index_topk = 64
    m = Glm5NextForCausalLM.from_config(cfg, seed=6)
    m.quantize_fp8_(QuantConfig.block_fp8(32))
    toks = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    before = ModelHarness(m).prefill_logits(0, toks)
    m.fuse_weights()
    kda, mla = m.model.layers[0].self_attn, m.model.layers[3].self_attn
    assert kda._in_fused is not None and kda._in_fused.modules == [kda.q_proj, kda.k_proj, kda.v_proj,
                                                                   kda.f_a_proj, kda.g_a_proj, kda.b_proj]  # fmt: skip
    assert mla._in_fused is not None and mla._in_fused.modules == [mla.q_a_proj, mla.kv_a_proj_with_mqa,
                                                                   mla.indexer.wk]  # fmt: skip
    assert kda._in_fused.scale is not None and mla._in_fused.weight.dtype == FP8
    torch.testing.assert_close(ModelHarness(m).prefill_logits(0, toks), before, rtol=1e-5, atol=1e-5)


def test_quantization_option_reaches_the_cli_and_serve_yaml() -> None:
    from trtllm_glm.cli import build_parser
    from trtllm_glm.serve.config import llm_options_from_dict

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    assert build_parser().parse_args(["generate", "--prompt", "hi"]).quantization is None
    assert llm_options_from_dict({"quantization": "none"}) == {"quantization": "none"}
    with pytest.raises(ValueError, match="quantization: expected a string"):
        llm_options_from_dict({"quantization": 8})


def test_fp8_kv_b_proj_dequantised_once_and_refreshed_after_a_load() -> None:
    from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA

    cfg = Glm5NextConfig.from_pretrained("tiny")
    mla = GlmKpoolSparseMLA(cfg)
    swap_fp8_linears_(mla, ["kv_b_proj"], block=32)
    w_uk, w_uv = mla.absorbed_weights()
    cached = mla._kv_b_cache[1]
    assert mla.absorbed_weights()[0].data_ptr() == cached.data_ptr()  # reused, not dequantised per step
    want = mla.kv_b_proj.dequantized().view(w_uk.shape[0], -1, w_uk.shape[-1])
    assert torch.equal(torch.cat([w_uk, w_uv], dim=1), want)
    with torch.no_grad():
        mla.kv_b_proj.weight_scale_inv.mul_(2)  # an in-place load
    assert torch.equal(mla.absorbed_weights()[0], 2 * w_uk)

"""Fused MoE (``trtllm_glm.moe``) on the CPU: the Triton kernels run through Triton's interpreter.

Kernel vs the fp32 torch reference (``ops.fused_moe_ref``) vs the existing per-expert loop of `MoE`, on fresh
random inputs: N = 1 and N not a multiple of the row block, experts with no tokens, duplicate-heavy routing
(experts with several row blocks), the SwiGLU clamp active (pre-activations beyond ``swiglu_limit``), reduction
widths that are and are not multiples of the tile. Outputs and work buffers are poisoned with NaN first so
that an element the kernels should write but do not shows up. The pair sorting (``ops.moe_align``) is checked
against a plain Python layout, and the `MoE` module's forced triton path against its loop path, including the
stacked weight storage across ``.to()``, state-dict loads and ``deepcopy``. Numerics in fp32 (and fp16, which
the interpreter computes in fp32 after loading); bf16 is for the GPU test.
"""

from __future__ import annotations

import copy

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.modules.ffn import MOE_BACKEND_ENV, MoE, clamped_swiglu
from trtllm_glm.moe import kernels as K
from trtllm_glm.moe import ops as R
from trtllm_glm.numerics import batch_invariant_mode

pytestmark = [
    pytest.mark.cpu_only,
    # Triton's interpreter itself trips this numpy deprecation.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

LIMIT = 10.0


def _routing(n: int, e: int, k: int, mode: str, g: torch.Generator) -> torch.Tensor:
    """``[N, k]`` int64 ids, distinct within a row (as the router gives).

    ``random``: uniform; ``skewed``: every row picks from the first ``k + 1`` experts (several row blocks per
    expert, most experts empty); ``sparse``: only even experts are used (zero-token experts in between).
    """
    if mode == "random":
        pool = torch.arange(e)
    elif mode == "skewed":
        pool = torch.arange(k + 1)
    elif mode == "sparse":
        pool = torch.arange(0, e, 2)
    else:
        raise ValueError(mode)
    rows = [pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(n)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)


def _problem(n: int, h: int, inter: int, e: int, k: int, mode: str, seed: int, x_scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * x_scale
    ids = _routing(n, e, k, mode, g)
    w = torch.rand(n, k, generator=g) + 0.1
    # Weights of std 0.5 over H inputs: gate/up pre-activations of std ~ x_scale * 0.5 * sqrt(H) >> LIMIT.
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.5
    w2 = torch.randn(e, h, inter, generator=g) * (1.0 / inter**0.5)
    return x, ids, w, w13, w2


def _poisoned_run(x, ids, w, w13, w2, limit, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the kernel once to size the work buffers, poison them and the output with NaN, run again."""
    scratch: dict[str, torch.Tensor] = {}
    K.fused_moe(x, ids, w, w13, w2, limit, scratch=scratch, **kw)
    scratch["inter"].fill_(float("nan"))
    scratch["pair_out"].fill_(float("nan"))
    out = torch.full((x.shape[0], x.shape[1]), float("nan"))
    res = K.fused_moe(x, ids, w, w13, w2, limit, out=out, scratch=scratch, **kw)
    assert res is out
    return out, scratch


def _assert_written(scratch: dict[str, torch.Tensor], block_m: int) -> None:
    """Every pair row, and every intermediate row of a used block, was written."""
    assert not scratch["pair_out"].isnan().any()
    used = scratch["block_expert"] >= 0
    rows = scratch["inter"].view(-1, block_m, scratch["inter"].shape[1])[used]
    assert not rows.isnan().any()


def _clamp_active(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, limit: float) -> bool:
    inter = w13.shape[1] // 2
    gu = torch.einsum("nh,nkih->nki", x, w13[ids])
    return bool((gu[..., :inter] > limit).any()) and bool((gu[..., inter:].abs() > limit).any())


# ------------------------------------------------------------------------------------------------------
# Pair sorting
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(params=["sort", "large"])
def align_kernel(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both sizes of `kernels.moe_align`: the register sort (decode sizes) and, past its limit, the torch ops."""
    if request.param == "large":
        for mod in (K, K._interpreted_module()):
            monkeypatch.setattr(mod, "SORT_ALIGN_MAX_PAIRS", 0)
    return request.param


@pytest.mark.parametrize(
    ("n", "e", "k", "m", "mode"),
    [(1, 6, 3, 16, "random"), (13, 5, 2, 4, "skewed"), (9, 12, 3, 16, "sparse"), (30, 4, 4, 8, "random")],
)
def test_align_layout(n: int, e: int, k: int, m: int, mode: str, align_kernel: str) -> None:
    ids = _routing(n, e, k, mode, torch.Generator().manual_seed(n))
    sorted_pairs, block_expert = R.moe_align(ids, e, m)
    p = n * k
    length = R.padded_pairs_bound(p, e, m)
    assert sorted_pairs.shape == (length,) and block_expert.shape == (length // m,)
    assert sorted_pairs.dtype == torch.int32 and block_expert.dtype == torch.int32
    # Expected layout: expert runs in id order, pairs ascending within a run, each run padded to M with P.
    flat = ids.reshape(-1).tolist()
    want_slots: list[int] = []
    want_blocks: list[int] = []
    for ex in range(e):
        run = [q for q in range(p) if flat[q] == ex]
        padded = -(-len(run) // m) * m
        want_slots += run + [p] * (padded - len(run))
        want_blocks += [ex] * (padded // m)
    assert len(want_slots) <= length
    want_slots += [p] * (length - len(want_slots))
    want_blocks += [-1] * (length // m - len(want_blocks))
    assert sorted_pairs.tolist() == want_slots
    assert block_expert.tolist() == want_blocks
    # The single-program Triton version gives the same layout.
    k_sorted, k_blocks = K.moe_align(ids, e, m)
    assert torch.equal(k_sorted, sorted_pairs) and torch.equal(k_blocks, block_expert)


def test_padded_bound_is_tight(align_kernel: str) -> None:
    # Every expert non-empty with one pair each: each wastes M - 1 slots, exactly the bound.
    ids = torch.arange(6).view(6, 1)
    sorted_pairs, block_expert = R.moe_align(ids, 6, 16)
    assert sorted_pairs.numel() == 6 * 16 and (block_expert >= 0).all()
    assert torch.equal(K.moe_align(ids, 6, 16)[0], sorted_pairs)
    # Many pairs per expert, several blocks each, and more pairs than one chunk of the kernel's scan.
    ids = torch.randint(0, 3, (150, 1), generator=torch.Generator().manual_seed(0))
    for a, b in zip(R.moe_align(ids, 7, 16), K.moe_align(ids, 7, 16)):
        assert torch.equal(a, b)
    assert R.padded_pairs_bound(1024, 288, 16) == (1024 + 288 * 15) // 16 * 16


# ------------------------------------------------------------------------------------------------------
# Kernel vs reference vs per-expert loop
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "h", "inter", "e", "k", "mode", "kw"),
    [
        (1, 40, 24, 6, 3, "random", {}),
        (19, 40, 24, 6, 3, "random", {}),  # N * k = 57 pairs: not a multiple of the block
        (40, 40, 24, 5, 2, "skewed", {}),  # duplicate-heavy: 3 experts x ~27 pairs -> 2 row blocks each
        (7, 40, 24, 12, 2, "sparse", {}),  # odd experts never chosen
        (10, 64, 32, 6, 3, "random", {"block_k": (32, 16), "block_n": (16, 32)}),  # exact tiles (EVEN_K)
        (6, 48, 40, 4, 2, "skewed", {"block_m": 32, "block_n": (32, 16), "block_k": (16, 32)}),
    ],
)
def test_kernel_matches_reference_and_loop(n, h, inter, e, k, mode, kw) -> None:
    x, ids, w, w13, w2 = _problem(n, h, inter, e, k, mode, seed=100 + n)
    assert _clamp_active(x, ids, w13, LIMIT)
    out, scratch = _poisoned_run(x, ids, w, w13, w2, LIMIT, **kw)
    _assert_written(scratch, kw.get("block_m", K.default_block_m(n * k, e)))
    ref = R.fused_moe_ref(x, ids, w, w13, w2, LIMIT)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
    # The module's per-expert loop on the same weights and routing.
    m = _module(h, inter, e, k)
    with torch.no_grad():
        m.stacked_expert_weights()[0].copy_(w13)
        m.stacked_expert_weights()[1].copy_(w2)
        loop = m._routed_loop(x, ids, w)
    torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-5 * scale)
    # Bit-deterministic: a second call gives the same bits, with either pair sorting (same layout).
    assert torch.equal(K.fused_moe(x, ids, w, w13, w2, LIMIT, **kw), out)
    assert torch.equal(K.fused_moe(x, ids, w, w13, w2, LIMIT, align="torch", **kw), out)


def test_no_limit_and_clamp_matter() -> None:
    x, ids, w, w13, w2 = _problem(5, 40, 24, 6, 3, "random", seed=3)
    plain = K.fused_moe(x, ids, w, w13, w2, None)
    torch.testing.assert_close(plain, R.fused_moe_ref(x, ids, w, w13, w2, None), rtol=1e-5, atol=1e-3)
    clamped = K.fused_moe(x, ids, w, w13, w2, LIMIT)
    assert (plain - clamped).abs().max() > 1.0  # the clamp really changed the result


def test_fp16_close_to_fp32_reference() -> None:
    x, ids, w, w13, w2 = _problem(9, 40, 24, 6, 3, "random", seed=5, x_scale=1.0)
    x16, w13_16, w2_16 = x.half(), w13.half(), w2.half()
    out, scratch = _poisoned_run(x16, ids, w, w13_16, w2_16, LIMIT)
    _assert_written(scratch, 16)
    assert scratch["inter"].dtype == torch.float16
    ref = R.fused_moe_ref(x16, ids, w, w13_16, w2_16, LIMIT)
    # The intermediate is rounded to fp16 once: error ~ 2^-11 of its size, through the down product.
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_reference_is_the_module_math() -> None:
    # The reference's per-expert math is GatedMLP's: gate rows first, then up, clamped SwiGLU, then down.
    m = _module(32, 16, 4, 2)
    m.reset_parameters(torch.Generator().manual_seed(1), 0.5)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2)) * 4
    ids = torch.tensor([[1, 3], [0, 1], [2, 1]])
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.75, 0.125]])
    w13, w2 = m.stacked_expert_weights()
    with torch.no_grad():
        ref = R.fused_moe_ref(x, ids, w, w13, w2, LIMIT)
        ex = m.experts[1]
        y = ex.down_proj(clamped_swiglu(ex.gate_proj(x[0:1]), ex.up_proj(x[0:1]), LIMIT))
        want = 0.5 * y[0] + 0.25 * m.experts[3](x[0:1])[0]
    torch.testing.assert_close(ref[0], want, rtol=1e-5, atol=1e-5)


def test_empty_and_bad_args() -> None:
    x, ids, w, w13, w2 = _problem(4, 40, 24, 6, 3, "random", seed=7)
    assert K.fused_moe(x[:0], ids[:0], w[:0], w13, w2, LIMIT).shape == (0, 40)
    with pytest.raises(ValueError, match="w_down"):
        K.fused_moe(x, ids, w, w13, w2[:, :, :8], LIMIT)
    with pytest.raises(ValueError, match="topk_w"):
        K.fused_moe(x, ids, w[:, :2], w13, w2, LIMIT)
    with pytest.raises(ValueError, match="block_m"):
        K.fused_moe(x, ids, w, w13, w2, LIMIT, block_m=8)
    with pytest.raises(ValueError, match="topk_ids must lie"):
        R.fused_moe_ref(x, ids + 6, w, w13, w2, LIMIT)


# ------------------------------------------------------------------------------------------------------
# Dead rows (row_live): padding and verify filler get no expert
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "e", "k", "m", "mode"), [(9, 12, 3, 4, "random"), (40, 5, 2, 16, "skewed")])
def test_align_leaves_dead_rows_out(n: int, e: int, k: int, m: int, mode: str, align_kernel: str) -> None:
    g = torch.Generator().manual_seed(40 + n)
    ids = _routing(n, e, k, mode, g)
    live = (torch.rand(n, generator=g) < 0.5).to(torch.int64)
    live[0], live[-1] = 1, 0
    sorted_pairs, block_expert = R.moe_align(ids, e, m, live)
    # Same layout as sorting the live rows' pairs alone (their pair ids kept): dead pairs sit in no slot.
    p = n * k
    flat = ids.reshape(-1).tolist()
    alive = [q for q in range(p) if live[q // k]]
    want_slots: list[int] = []
    want_blocks: list[int] = []
    for ex in range(e):
        run = [q for q in alive if flat[q] == ex]
        padded = -(-len(run) // m) * m
        want_slots += run + [p] * (padded - len(run))
        want_blocks += [ex] * (padded // m)
    length = R.padded_pairs_bound(p, e, m)
    assert sorted_pairs.tolist() == want_slots + [p] * (length - len(want_slots))
    assert block_expert.tolist() == want_blocks + [-1] * (length // m - len(want_blocks))
    # Experts only dead rows chose get no block (their weights are never read).
    dead_only = {ids[r, j].item() for r in range(n) if not live[r] for j in range(k)} - {flat[q] for q in alive}
    assert dead_only.isdisjoint(block_expert.tolist())
    for flags in (live, live.bool()):
        k_sorted, k_blocks = K.moe_align(ids, e, m, flags)
        assert torch.equal(k_sorted, sorted_pairs) and torch.equal(k_blocks, block_expert)
    # All rows live: the unflagged layout.
    for a, b in zip(R.moe_align(ids, e, m, torch.ones(n, dtype=torch.int64)), R.moe_align(ids, e, m)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("align", ["triton", "torch"])
def test_dead_rows_are_zero_and_live_rows_unchanged(align: str) -> None:
    n, h, inter, e, k = 11, 40, 24, 8, 3
    x, ids, w, w13, w2 = _problem(n, h, inter, e, k, "random", seed=21)
    live = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0])
    full = K.fused_moe(x, ids, w, w13, w2, LIMIT, align=align)
    # Poisoned buffers: a dead row's stale pair rows (NaN here) must not reach its output.
    out, scratch = _poisoned_run(x, ids, w, w13, w2, LIMIT, align=align, row_live=live)
    on = live.bool()
    # Not bit-equal here: the interpreter's dot is a BLAS matmul whose rounding depends on a row's place in
    # its block (AMD EPYC hosts differ in the last bits), and the flags move rows between blocks.
    torch.testing.assert_close(out[on], full[on], rtol=1e-5, atol=1e-5 * full.abs().max().item())
    assert torch.equal(out[~on], torch.zeros(int((~on).sum()), h))
    assert scratch["pair_out"].view(n, k, h)[~on].isnan().all()  # never computed
    ref = R.fused_moe_ref(x, ids, w, w13, w2, LIMIT, row_live=live)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(ref[~on], torch.zeros_like(ref[~on]))
    # Fewer blocks of work than the unflagged call (dead rows' experts dropped).
    assert (scratch["block_expert"] >= 0).sum() < (K.moe_align(ids, e, K.default_block_m(n * k, e))[1] >= 0).sum()
    # Every row dead: nothing computed, all zero.
    none = K.fused_moe(x, ids, w, w13, w2, LIMIT, align=align, row_live=torch.zeros(n, dtype=torch.int64))
    assert torch.equal(none, torch.zeros(n, h))
    with pytest.raises(ValueError, match="row_live"):
        K.fused_moe(x, ids, w, w13, w2, LIMIT, row_live=live[:-1])
    with pytest.raises(ValueError, match="row_live"):
        K.fused_moe(x, ids, w, w13, w2, LIMIT, row_live=live.float())


def test_module_dead_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_glm.modules.ffn import MOE_SKIP_DEAD_ROWS_ENV

    m = MoE(_cfg())
    m.reset_parameters(torch.Generator().manual_seed(31), 0.4)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(32)) * 3
    live = torch.tensor([1, 1, 0, 1, 0, 1, 0])
    on = live.bool()
    with torch.no_grad():
        base = _forced(m, x, "torch")
        shared = m.shared_experts(x)
        for backend in ("torch", "triton"):
            m.backend = backend
            try:
                got = m(x, row_live=live)
                torch.testing.assert_close(got[on], base[on], rtol=1e-5, atol=1e-5 * base.abs().max().item())
                # Dead rows: the shared experts only.
                torch.testing.assert_close(got[~on], shared[~on], rtol=1e-5, atol=1e-6)
                monkeypatch.setenv(MOE_SKIP_DEAD_ROWS_ENV, "0")  # the A/B switch: flags ignored
                torch.testing.assert_close(m(x, row_live=live), base, rtol=1e-5, atol=1e-5 * base.abs().max().item())
                with pytest.raises(ValueError, match="row_live"):  # bad flags are refused even when ignored
                    m(x, row_live=live[:3])
                monkeypatch.delenv(MOE_SKIP_DEAD_ROWS_ENV)
                with pytest.raises(ValueError, match="row_live"):
                    m(x, row_live=live[:3])
            finally:
                m.backend = None


# ------------------------------------------------------------------------------------------------------
# MoE module: forced triton path vs loop path, stacked weight storage
# ------------------------------------------------------------------------------------------------------
def _cfg(h: int = 40, inter: int = 24, e: int = 6, k: int = 3) -> Glm5NextConfig:
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


def _module(h: int, inter: int, e: int, k: int) -> MoE:
    return MoE(_cfg(h, inter, e, k))


def _forced(m: MoE, x: torch.Tensor, backend: str) -> torch.Tensor:
    m.backend = backend
    try:
        with torch.no_grad():
            return m(x)
    finally:
        m.backend = None


def test_module_triton_path_matches_loop() -> None:
    m = MoE(_cfg())
    m.reset_parameters(torch.Generator().manual_seed(11), 0.4)
    x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(12)) * 3
    loop, fused = _forced(m, x, "torch"), _forced(m, x, "triton")
    assert fused.shape == x.shape
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-5 * loop.abs().max().item())
    with torch.no_grad():
        assert _forced(m, x[:, :0], "triton").shape == (2, 0, 40)


def test_module_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    m = MoE(_cfg())
    m.reset_parameters(torch.Generator().manual_seed(2), 0.4)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    calls: list[int] = []
    real = K.fused_moe

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(K, "fused_moe", spy)
    with torch.no_grad():
        base = m(x)  # auto on the CPU: the loop
        assert not calls
        monkeypatch.setenv(MOE_BACKEND_ENV, "triton")
        torch.testing.assert_close(m(x), base, rtol=1e-5, atol=1e-5)
        assert calls == [1]
        m.backend = "torch"  # the attribute wins over the environment
        m(x)
        assert calls == [1]
        m.backend = "bogus"
        with pytest.raises(ValueError, match="backend"):
            m(x)
    m.backend = "triton"
    with pytest.raises(RuntimeError, match="backward"):
        m(x)  # grad enabled and parameters require grad: no silent gradient loss


def _storage_bytes(m: MoE) -> int:
    seen: dict[int, int] = {}
    for p in m.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def test_stacked_storage_is_the_parameters() -> None:
    cfg = _cfg()
    with torch.device("meta"):
        m = MoE(cfg)
    m.to_empty(device="cpu")
    m.reset_parameters(torch.Generator().manual_seed(4), 0.4)
    w13, w2 = m.stacked_expert_weights()
    assert torch.equal(w13[2, :24], m.experts[2].gate_proj.weight)
    assert torch.equal(w13[2, 24:], m.experts[2].up_proj.weight)
    assert torch.equal(w2[5], m.experts[5].down_proj.weight)
    # No second copy: the parameters' storages add up to the parameter bytes.
    assert _storage_bytes(m) == sum(p.numel() * p.element_size() for p in m.parameters())
    names = set(m.state_dict())
    assert "experts.3.up_proj.weight" in names and not any("_w_" in n for n in names)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)) * 3
    ref = _forced(m, x, "torch")
    # A dtype round trip keeps the stack (converted once) and the values.
    m.to(torch.float16).float()
    assert m._stack_is_current()
    assert _storage_bytes(m) == sum(p.numel() * p.element_size() for p in m.parameters())
    ref16 = _forced(m, x, "torch")
    torch.testing.assert_close(_forced(m, x, "triton"), ref16, rtol=1e-5, atol=1e-4)
    assert (ref16 - ref).abs().max() < 0.05 * ref.abs().max()


def test_stack_follows_loads_and_copies() -> None:
    cfg = _cfg()
    src = MoE(cfg)
    src.reset_parameters(torch.Generator().manual_seed(6), 0.4)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(7)) * 3
    want = _forced(src, x, "torch")
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    # In-place load: values land in the stacked storage.
    a = MoE(cfg)
    a.load_state_dict(sd)
    torch.testing.assert_close(_forced(a, x, "triton"), want, rtol=1e-5, atol=1e-4)
    # assign=True replaces the parameters: re-stacked (one copy) on the next fused call.
    b = MoE(cfg)
    b.load_state_dict(sd, assign=True)
    torch.testing.assert_close(_forced(b, x, "triton"), want, rtol=1e-5, atol=1e-4)
    assert b._stack_is_current()
    # assign=True from tensors already laid out as one stacked block (a reference model's fused
    # gate_up_proj / down_proj split into per-expert views): viewed, not copied.
    gu = torch.cat([torch.stack([src.experts[e].gate_proj.weight, src.experts[e].up_proj.weight]) for e in range(6)])
    gu = gu.detach().view(6, 48, 40).clone()
    dn = torch.stack([src.experts[e].down_proj.weight.detach() for e in range(6)]).clone()
    sd2 = dict(sd)
    for e in range(6):
        sd2[f"experts.{e}.gate_proj.weight"] = gu[e, :24]
        sd2[f"experts.{e}.up_proj.weight"] = gu[e, 24:]
        sd2[f"experts.{e}.down_proj.weight"] = dn[e]
    c = MoE(cfg)
    c.load_state_dict(sd2, assign=True)
    w13, w2 = c.stacked_expert_weights()
    assert w13.data_ptr() == gu.data_ptr() and w2.data_ptr() == dn.data_ptr()
    torch.testing.assert_close(_forced(c, x, "triton"), want, rtol=1e-5, atol=1e-4)
    # deepcopy clones each parameter apart: the copy re-stacks and still computes the same function.
    d = copy.deepcopy(src)
    torch.testing.assert_close(_forced(d, x, "triton"), want, rtol=1e-5, atol=1e-4)
    assert d.stacked_expert_weights()[0].data_ptr() != src.stacked_expert_weights()[0].data_ptr()
    # A parameter replaced by hand (not the first / last expert): noticed after mark_weights_changed.
    with torch.no_grad():
        d.experts[2].up_proj.weight = torch.nn.Parameter(d.experts[2].up_proj.weight * 0.5)
    d.mark_weights_changed()
    torch.testing.assert_close(_forced(d, x, "triton"), _forced(d, x, "torch"), rtol=1e-5, atol=1e-4)


def test_align_env_is_read_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    x, ids, w, w13, w2 = _problem(5, 40, 24, 6, 2, "random", seed=41)
    want = K.fused_moe(x, ids, w, w13, w2, LIMIT, align="torch")
    monkeypatch.setenv(K.ALIGN_ENV, "torch")
    assert K.default_align() == "torch"
    torch.testing.assert_close(K.fused_moe(x, ids, w, w13, w2, LIMIT), want, rtol=0, atol=0)
    monkeypatch.setenv(K.ALIGN_ENV, "cub")
    with pytest.raises(ValueError, match=K.ALIGN_ENV):
        K.fused_moe(x, ids, w, w13, w2, LIMIT)


# ------------------------------------------------------------------------------------------------------
# Prefill sizes: the large-M launch and the module's row slabs
# ------------------------------------------------------------------------------------------------------
def test_large_m_launch_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-sized batches (>= LARGE_M_PAIRS_PER_EXPERT pairs per expert on average) take the large-M tiles
    (64-row blocks, 128-wide down tiles, 64-wide K steps): H = 72 and I = 40 leave ragged K steps and column
    blocks, skewed routing gives experts several row blocks and others none."""
    launches: list[dict] = []
    mod = K._interpreted_module()
    real = mod.large_m_launch

    def spy(p: int, e: int):
        got = real(p, e)
        launches.append({"p": p, "cfg": got})
        return got

    monkeypatch.setattr(mod, "large_m_launch", spy)
    n, h, inter, e, k = 203, 72, 40, 3, 2
    assert K.large_m_launch(n * k, e) is not None and K.large_m_launch(n * k, 2 * e) is None
    with batch_invariant_mode():
        assert K.large_m_launch(n * k, e) is None  # no launch that depends on the row count in that mode
    x, ids, w, w13, w2 = _problem(n, h, inter, e, k, "random", seed=77)
    assert _clamp_active(x, ids, w13, LIMIT)
    out, scratch = _poisoned_run(x, ids, w, w13, w2, LIMIT)
    assert launches and all(c["cfg"] is not None for c in launches), "the large-M launch should be taken"
    _assert_written(scratch, 64)
    ref = R.fused_moe_ref(x, ids, w, w13, w2, LIMIT)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # Explicit tiles win over the large-M launch (and give the same values: each row depends on its operands).
    launches.clear()
    small = K.fused_moe(x, ids, w, w13, w2, LIMIT, block_m=16)
    torch.testing.assert_close(small, out, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert all(c["cfg"] is None for c in launches) or not launches


def test_module_slabs_equal_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MoE` on the fused path splits a prefill chunk into slabs of `fused_max_rows` rows (bounded pair buffer):
    the result, dead rows included, equals one call over all rows."""
    m = MoE(_cfg())
    m.reset_parameters(torch.Generator().manual_seed(21), 0.4)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(23, 40, generator=g) * 3
    live = (torch.rand(23, generator=g) > 0.3).to(torch.int32)
    m.backend = "triton"
    with torch.no_grad():
        whole = m(x, row_live=live)
        m.fused_max_rows = 7  # 23 rows: slabs of 7, 7, 7, 2
        rows: list[int] = []
        real = K.fused_moe

        def spy(x2, *a, **kw):
            rows.append(x2.shape[0])
            return real(x2, *a, **kw)

        monkeypatch.setattr(K, "fused_moe", spy)
        slabbed = m(x, row_live=live)
    assert rows == [7, 7, 7, 2]
    torch.testing.assert_close(slabbed, whole, rtol=1e-6, atol=1e-6 * whole.abs().max().item())
    m.backend = "torch"
    with torch.no_grad():
        loop = m(x, row_live=live)
    torch.testing.assert_close(slabbed, loop, rtol=1e-5, atol=1e-5 * loop.abs().max().item())

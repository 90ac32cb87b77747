"""Triton kernels of the pooled (C4) FP8 indexer against the torch reference ops, on the CPU interpreter.

The kernels package runs CPU tensors through an interpreted copy of its kernels (see its docstring), so
this module needs no ``TRITON_INTERPRET`` in the environment and does not set it: setting it process-wide
at import would also turn the GPU tests of the same pytest run into interpreter runs, and would only work
if no other module had imported triton first.

Every comparison uses fresh seeded random inputs and poisoned outputs (garbage e4m3 bytes including NaN
codes, NaN scales, random rings, NaN latent rows, a garbage selection buffer), so an element that should
be written but is not, or one written that should not be, shows in the bitwise comparisons. Pools,
scales, rings, latent rows and selections must be bit-identical to the reference; scores agree to fp32
rounding (the kernel accumulates the exact fp8 products in fp32, the reference sums exactly then rounds).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.manager import KpoolLayerCache

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only

D = 128
LATENT = 24


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cache(num_pages: int, page_size: int, num_slots: int, g: torch.Generator, latent_dtype=torch.float32):
    """Cache planes full of garbage: random e4m3 bytes (NaN codes included), NaN scales, random rings."""
    index_k = torch.randint(0, 256, (num_pages, page_size // 4, D), generator=g, dtype=torch.uint8)
    index_scale = torch.full((num_pages, page_size // 4), float("nan"))
    # Rings are inputs too (members before the batch); random finite values stand for earlier steps.
    ring = torch.randn(num_slots, 2, 4, D, generator=g) * 3
    latent = torch.full((num_pages, page_size, LATENT), float("nan")).to(latent_dtype)
    return KpoolLayerCache(latent, index_k.view(torch.float8_e4m3fn), index_scale, ring, page_size)


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), c.index_scale.clone(), c.tail_ring.clone(), c.page_size)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_planes_equal(ref: KpoolLayerCache, ker: KpoolLayerCache, what: str) -> None:
    bad = (_bits(ref.index_k) != _bits(ker.index_k)).sum().item()
    assert bad == 0, f"{what}: {bad} index_k bytes differ"
    bad = (_bits(ref.index_scale) != _bits(ker.index_scale)).sum().item()
    assert bad == 0, f"{what}: {bad} index scales differ"
    bad = (_bits(ref.tail_ring) != _bits(ker.tail_ring)).sum().item()
    assert bad == 0, f"{what}: {bad} ring values differ"


def _batch(past: list[int], qlen: list[int], page_size: int, num_pages: int, num_slots: int, g: torch.Generator):
    """A flat batch: positions, row_seq, a slot table of distinct random pages, distinct state slots."""
    width = max(-(-(p + q) // page_size) for p, q in zip(past, qlen)) + 1
    perm = torch.randperm(num_pages, generator=g)
    assert len(past) * width <= num_pages
    table = perm[: len(past) * width].view(len(past), width).to(torch.int32)
    slots = torch.randperm(num_slots, generator=g)[: len(past)]
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(past, qlen)])
    row_seq = torch.cat([torch.full((q,), b) for b, q in enumerate(qlen)])
    return positions, row_seq, table, slots


def _rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.randn(n, D, generator=g)
    gate = torch.randn(n, D, generator=g) * 2
    return key, gate


# ------------------------------------------------------------------------------------------------
# Loader
def test_cpu_kernels_are_interpreted_without_touching_the_process() -> None:
    from triton.runtime.jit import JITFunction

    before_env = os.environ.get("TRITON_INTERPRET")
    before_call = JITFunction.__call__
    q, s = K.rotate_quant(torch.randn(3, D, generator=_gen(0)))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3,)
    mod = K.kernel_module("quant", "cpu")
    assert mod.__name__ == f"{K.__name__}._interpreted.quant"
    assert sys.modules[f"{K.__name__}._interpreted._common"].INTERPRETED
    assert os.environ.get("TRITON_INTERPRET") == before_env
    assert JITFunction.__call__ is before_call


# ------------------------------------------------------------------------------------------------
# FP8 chain
def test_round_to_e4m3_and_pow2_scale_bit_exact() -> None:
    g = _gen(1)
    x = torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours, both signs
    special = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 2**-10, -(2**-10), 3 * 2**-11, 2**-6, 0.0155, 448, 449, 463.9, 464, 1e4, -1e4]
    )
    x = torch.cat([x, grid, mids, special, torch.tensor([float("inf"), float("-inf")])])
    assert torch.equal(_bits(K.round_to_e4m3(x)), _bits(R.round_to_e4m3(x)))

    amax = torch.cat(
        [
            x[:20000].abs(),
            torch.tensor([0.0, 1e-4, 9.99e-5, 1e-5, 448.0, 448.0 * 2**-20, 448.0 * 2**10, 1.75, 1.7500001]),
            448.0 * torch.exp2(torch.arange(-20, 20, dtype=torch.float32)),  # exact powers of two of the ratio
        ]
    )
    assert torch.equal(_bits(K.pow2_scale(amax)), _bits(R.pow2_scale(amax)))


def test_fwht_bit_exact() -> None:
    """fp32 output before any bf16 rounding: a different butterfly order shows in the last bits."""
    g = _gen(3)
    x = torch.randn(40, D, generator=g) * torch.exp(torch.randn(40, D, generator=g) * 4)
    ref = R.fwht(x)
    ker = K.fwht(x)
    assert torch.equal(_bits(ker), _bits(ref))
    # Sanity of the test itself: the inputs make fp32 sums order-dependent (a matrix product differs).
    assert not torch.equal(x @ R.hadamard_matrix(D) * torch.tensor(D**-0.5), ref)


def test_pool_keys_bit_exact() -> None:
    """fp32 pooled keys before the bf16 rounding: exp, divide and summation order must match exactly."""
    g = _gen(4)
    key = torch.randn(3, 37, 4, D, generator=g) * torch.exp(torch.randn(3, 37, 4, D, generator=g))
    gate = torch.randn(3, 37, 4, D, generator=g) * 4
    ape = torch.randn(4, D, generator=g)
    assert torch.equal(_bits(K.pool_keys(key, gate, ape)), _bits(R.pool_keys(key, gate, ape)))


def test_rotate_quant_bit_exact() -> None:
    g = _gen(2)
    # Wide exponent range: fp32 butterfly sums are inexact, so only the reference's stage order matches.
    x = torch.randn(7, 5, D, generator=g) * torch.exp(torch.randn(7, 5, D, generator=g) * 3)
    x[0, 0] = 0.0  # all-zero row: floor scale
    x[0, 1] = torch.randn(D, generator=g) * 1e-7  # below the 1e-4 amax floor
    x[0, 2, 17] = 1e6  # one outlier
    x[0, 3] = -x[0, 3].abs()
    q_k, s_k = K.rotate_quant(x)
    q_r, s_r = R.rotate_quant(x)
    assert q_k.shape == q_r.shape and s_k.shape == s_r.shape
    assert torch.equal(_bits(q_k), _bits(q_r))
    assert torch.equal(_bits(s_k), _bits(s_r))


# ------------------------------------------------------------------------------------------------
# Cache writes
@pytest.mark.parametrize("page_size", [8, 16])
def test_decode_update_bit_exact_over_steps(page_size: int) -> None:
    """Plain decode and verify-style multi-row steps, every ring alignment, 3 steps in lockstep."""
    g = _gen(10 + page_size)
    num_pages, num_slots = 64, 7
    past = [0, 1, 2, 3, 6, 13]
    widths = [[1, 3, 8, 2, 1, 5], [8, 1, 2, 4, 7, 1], [2, 6, 1, 1, 3, 8]]
    ref = _cache(num_pages, page_size, num_slots, g)
    ker = _clone(ref)
    ape = torch.randn(4, D, generator=g)
    final = [p + sum(w[b] for w in widths) for b, p in enumerate(past)]
    _, _, table, slots = _batch(past, [f - p for f, p in zip(final, past)], page_size, num_pages, num_slots, g)
    for step, qlen in enumerate(widths):
        positions = torch.cat([torch.arange(p, p + q) for p, q in zip(past, qlen)])
        row_seq = torch.cat([torch.full((q,), b) for b, q in enumerate(qlen)])
        key, gate = _rows(positions.numel(), g)
        R.update_decode_pools(ref, key, gate, ape, positions, row_seq, table, slots)
        K.update_decode_pools(ker, key, gate, ape, positions, row_seq, table, slots)
        _assert_planes_equal(ref, ker, f"step {step}")
        past = [p + q for p, q in zip(past, qlen)]
    # The steps completed pools (so the comparison covered real writes, not only untouched garbage).
    assert torch.isfinite(ref.index_scale).sum() >= 15


def test_decode_update_skips_padding_rows() -> None:
    g = _gen(20)
    ref = _cache(32, 8, 4, g)
    ker = _clone(ref)
    ape = torch.randn(4, D, generator=g)
    positions, row_seq, table, slots = _batch([3, 7], [2, 5], 8, 32, 4, g)
    key, gate = _rows(positions.numel() + 3, g)
    R.update_decode_pools(ref, key[:-3], gate[:-3], ape, positions, row_seq, table, slots)
    pad_pos = torch.cat([positions, torch.tensor([3, 7, 11])])
    pad_seq = torch.cat([row_seq, torch.full((3,), -1)])
    K.update_decode_pools(ker, key, gate, ape, pad_pos, pad_seq, table, slots)
    _assert_planes_equal(ref, ker, "padded decode")


@pytest.mark.parametrize(
    ("page_size", "past", "qlen"),
    [
        (8, [0, 1, 2, 3], [1, 2, 3, 4]),
        (8, [0, 5, 6, 7, 12], [17, 9, 4, 13, 3]),
        (16, [0, 3, 10, 21], [33, 20, 1, 6]),
    ],
)
def test_prefill_pools_and_tail_bit_exact(page_size: int, past: list[int], qlen: list[int]) -> None:
    g = _gen(30 + sum(qlen))
    num_pages, num_slots = 48, 6
    ref = _cache(num_pages, page_size, num_slots, g)
    ker = _clone(ref)
    ape = torch.randn(4, D, generator=g)
    more = [q + 2 for q in qlen]  # a second chunk per sequence, at another alignment
    _, _, table, slots = _batch(past, [q + m for q, m in zip(qlen, more)], page_size, num_pages, num_slots, g)
    positions, row_seq, _, _ = _batch(past, qlen, page_size, num_pages, num_slots, g)
    key, gate = _rows(positions.numel(), g)
    R.update_prefill_pools(ref, key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill_pools(ker, key, gate, ape, positions, row_seq, table, slots)
    _assert_planes_equal(ref, ker, "prefill pools")
    R.write_prefill_tail(ref.tail_ring, key, gate, positions, row_seq, slots)
    K.write_prefill_tail(ker.tail_ring, key, gate, positions, row_seq, slots)
    _assert_planes_equal(ref, ker, "prefill tail")
    # The second chunk reads the first one's tail from the ring, through the combined entry point.
    ker2 = _clone(ker)
    ref2 = _clone(ker)
    positions, row_seq, _, _ = _batch([p + q for p, q in zip(past, qlen)], more, page_size, num_pages, num_slots, g)
    key, gate = _rows(positions.numel(), g)
    R.update_prefill(ref2, key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill(ker2, key, gate, ape, positions, row_seq, table, slots)
    _assert_planes_equal(ref2, ker2, "second chunk")


def test_kernel_decode_prefill_and_chunked_prefill_agree() -> None:
    """One token stream through kernel prefill (one chunk, chunks of 5) and kernel decode (widths 1..4)."""
    g = _gen(40)
    page_size, num_pages, num_slots, total = 8, 24, 3, 27
    base = _cache(num_pages, page_size, num_slots, g)
    base.tail_ring.zero_()
    ape = torch.randn(4, D, generator=g)
    key, gate = _rows(total, g)
    _, _, table, slots = _batch([0], [total], page_size, num_pages, num_slots, g)

    def run(chunks: list[int], decode: bool) -> KpoolLayerCache:
        c = _clone(base)
        start = 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            seq = torch.zeros(n, dtype=torch.int64)
            fn = K.update_decode_pools if decode else K.update_prefill
            fn(c, key[start : start + n], gate[start : start + n], ape, pos, seq, table, slots)
            start += n
        return c

    one = run([total], decode=False)
    _assert_planes_equal(one, run([5, 5, 5, 5, 5, 2], decode=False), "chunks of 5")
    _assert_planes_equal(one, run([1] * total, decode=True), "decode")
    _assert_planes_equal(one, run([1, 2, 3, 4, 4, 3, 2, 1, 4, 3], decode=True), "verify widths")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mixed_step_decode_rows_through_the_prefill_writes(impl: str) -> None:
    """A mixed step's decode rows (first, one row each, one of them completing a pool from three ring members) written
    with its prefill chunks by the prefill writes alone (`GlmKpoolIndexer.forward` without verify backups) leave the
    pools, scales and rings the decode pass plus the prefill writes leave, bit for bit."""
    ops = R if impl == "torch" else K
    g = _gen(77)
    page_size, num_pages, num_slots = 8, 48, 8
    past, qlen = [7, 12, 5, 0, 9, 2], [1, 1, 1, 11, 6, 1]  # decode rows first (pos 7 completes pool 1), then chunks
    split = _cache(num_pages, page_size, num_slots, g)
    merged = _clone(split)
    ape = torch.randn(4, D, generator=g)
    positions, row_seq, table, slots = _batch(past, qlen, page_size, num_pages, num_slots, g)
    nd = 3
    key, gate = _rows(positions.numel(), g)
    ops.update_decode_pools(split, key[:nd], gate[:nd], ape, positions[:nd], row_seq[:nd], table, slots)
    ops.update_prefill_pools(split, key[nd:], gate[nd:], ape, positions[nd:], row_seq[nd:], table, slots)
    ops.write_prefill_tail(split.tail_ring, key[nd:], gate[nd:], positions[nd:], row_seq[nd:], slots)
    ops.update_prefill_pools(merged, key, gate, ape, positions, row_seq, table, slots)
    ops.write_prefill_tail(merged.tail_ring, key, gate, positions, row_seq, slots)
    _assert_planes_equal(split, merged, f"{impl}: decode rows through the prefill writes")


@pytest.mark.parametrize(
    ("rows_dtype", "latent_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_write_latent_rows_bit_exact(rows_dtype: torch.dtype, latent_dtype: torch.dtype) -> None:
    g = _gen(50)
    page_size, num_pages = 8, 20
    ref = _cache(num_pages, page_size, 2, g, latent_dtype=latent_dtype).latent
    ker = ref.clone()
    positions, row_seq, table, _ = _batch([0, 5, 14], [3, 11, 6], page_size, num_pages, 2, g)
    rows = (torch.randn(positions.numel(), LATENT, generator=g) * 1e3).to(rows_dtype)
    R.write_latent_rows(ref, rows, positions, row_seq, table, page_size)
    K.write_latent_rows(ker, rows, positions, row_seq, table, page_size)
    assert torch.equal(_bits(ref), _bits(ker))


# ------------------------------------------------------------------------------------------------
# Scores and selection
def _scored_cache(page_size: int, num_pages: int, g: torch.Generator) -> KpoolLayerCache:
    """Valid pools everywhere: random finite e4m3 codes (wide exponent range) and power-of-two scales."""
    c = _cache(num_pages, page_size, 2, g)
    codes = _bits(c.index_k)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes in pools that are read
    c.index_scale.copy_(torch.exp2(torch.randint(-12, 4, c.index_scale.shape, generator=g).float()))
    return c


def _score_bound(q8, w, index_k, index_scale, positions, row_seq, table, page_size, max_pools) -> torch.Tensor:
    """``sum_h |w_h| * (|q_h| . |k_p|) * kscale_p``: the scale of the fp32 rounding error of a score."""
    return R.score_pools(
        q8.float().abs().to(torch.float8_e4m3fn),
        w.abs(),
        index_k.float().abs().to(torch.float8_e4m3fn),
        index_scale,
        positions,
        row_seq,
        table,
        page_size,
        max_pools,
    )


@pytest.mark.parametrize(
    ("n_heads", "page_size", "launch"),
    [
        (4, 8, {}),  # the interpreter's default: one block covering the pools per program
        (16, 16, {}),
        (4, 8, {"block_p": 64, "iters": 4}),  # the CUDA default
        (16, 16, {"block_p": 16, "iters": 2}),  # several chunks of several blocks per row
    ],
)
def test_score_pools_matches_reference(n_heads: int, page_size: int, launch: dict) -> None:
    g = _gen(60 + n_heads)
    num_pages = 96
    c = _scored_cache(page_size, num_pages, g)
    # Rows with no complete pool (pos < 3), exact pool boundaries, multi-row sequences, long rows.
    past, qlen = [0, 2, 9, 60, 117], [3, 3, 4, 6, 3]
    positions, row_seq, table, _ = _batch(past, qlen, page_size, num_pages, 2, g)
    n = positions.numel()
    q8, _ = R.rotate_quant(torch.randn(n, n_heads, D, generator=g))
    w = torch.randn(n, n_heads, generator=g)
    max_pools = 40  # more columns than any row's (pos + 1) // 4
    args = (q8, w, c.index_k, c.index_scale, positions, row_seq, table, page_size, max_pools)
    ref = R.score_pools(*args)
    out = torch.full((n, max_pools), 12345.0)
    # The package entry point, or the kernel module with an explicit launch shape.
    score = K.score_pools if not launch else functools.partial(K.kernel_module("score", "cpu").score_pools, **launch)
    ker = score(*args, out=out)
    assert ker.data_ptr() == out.data_ptr()
    assert torch.equal(torch.isneginf(ker), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert torch.isfinite(ker[fin]).all()
    bound = _score_bound(*args)[fin]
    err = (ker[fin] - ref[fin]).abs()
    assert (err <= 1e-5 * bound + 1e-30).all(), f"max err/bound {(err / bound.clamp(min=1e-30)).max().item():.3e}"
    # Allocation path too.
    assert torch.equal(score(*args), ker)


def test_score_pools_padding_rows_score_nothing() -> None:
    g = _gen(65)
    c = _scored_cache(8, 64, g)
    positions, row_seq, table, _ = _batch([20, 41], [2, 3], 8, 64, 2, g)
    q8, _ = R.rotate_quant(torch.randn(7, 4, D, generator=g))
    w = torch.randn(7, 4, generator=g)
    ref = R.score_pools(q8[:5], w[:5], c.index_k, c.index_scale, positions, row_seq, table, 8, 16)
    pad_pos = torch.cat([positions, torch.tensor([30, 60])])
    pad_seq = torch.cat([row_seq, torch.tensor([-1, -1])])
    ker = K.score_pools(q8, w, c.index_k, c.index_scale, pad_pos, pad_seq, table, 8, 16)
    assert torch.isneginf(ker[5:]).all()
    bound = _score_bound(q8[:5], w[:5], c.index_k, c.index_scale, positions, row_seq, table, 8, 16)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(ker[:5]), torch.isneginf(ref))
    assert ((ker[:5][fin] - ref[fin]).abs() <= 1e-5 * bound[fin]).all()


def test_cache_writes_accept_int32_metadata_and_int64_tables() -> None:
    g = _gen(66)
    ref = _cache(32, 8, 4, g)
    ker = _clone(ref)
    ape = torch.randn(4, D, generator=g)
    positions, row_seq, table, slots = _batch([1, 6], [9, 7], 8, 32, 4, g)
    key, gate = _rows(positions.numel(), g)
    R.update_prefill(ref, key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill(ker, key, gate, ape, positions.int(), row_seq.int(), table.long(), slots.int())
    _assert_planes_equal(ref, ker, "int32 metadata prefill")
    positions, row_seq, _, _ = _batch([10, 13], [3, 2], 8, 32, 4, g)
    key, gate = _rows(positions.numel(), g)
    R.update_decode_pools(ref, key, gate, ape, positions, row_seq, table, slots)
    K.update_decode_pools(ker, key, gate, ape, positions.int(), row_seq.int(), table.long(), slots.int())
    _assert_planes_equal(ref, ker, "int32 metadata decode")


@pytest.mark.parametrize(("k", "width"), [(3, 15), (5, 23), (8, 40)])
def test_expand_selection_matches_reference(k: int, width: int) -> None:
    g = _gen(70 + k)
    n = 12
    positions = torch.cat([torch.tensor([0, 1, 2, 3, 4, 7]), torch.randint(8, 120, (n - 6,), generator=g)])
    n_c = (positions + 1) // 4
    scores = torch.randn(n, 40, generator=g)
    ids = R.select_topk_pools(scores, positions, k)
    # Shuffle each row: expansion must sort the ids itself; -1 entries stay where they land.
    perm = torch.argsort(torch.rand(n, k, generator=g), dim=1)
    ids = torch.gather(ids, 1, perm)
    ref = R.expand_selection(ids, positions, width)
    out = torch.randint(-5, 1000, (n, width), generator=g, dtype=torch.int32)
    ker = K.expand_selection(ids, positions, width, out=out)
    assert ker.data_ptr() == out.data_ptr()
    assert torch.equal(ker, ref)
    assert torch.equal(K.expand_selection(ids.to(torch.int64), positions, width), ref)
    assert (n_c == 0).any()


def test_expand_selection_drops_out_of_range_ids() -> None:
    """Ids the row cannot see are ignored (the reference raises; a kernel must never expand them)."""
    positions = torch.tensor([10, 30])
    # Row 0 sees (10 + 1) // 4 = 2 pools (ids 2 and 9 are beyond), row 1 sees 7 (id 7 is beyond).
    ids = torch.tensor([[1, 2, 9], [0, 7, -1]], dtype=torch.int32)
    ker = K.expand_selection(ids, positions, 14)
    ref = R.expand_selection(torch.tensor([[1, -1, -1], [0, -1, -1]], dtype=torch.int32), positions, 14)
    assert torch.equal(ker, ref)

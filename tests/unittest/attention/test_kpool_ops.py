"""Reference ops of the pooled (C4) FP8 indexer and sparse MLA against brute force and each other.

Caches are poisoned (NaN latent rows, NaN e4m3 bytes, NaN scales and rings) before any write, so an
element that should have been written but was not shows up in the bitwise comparisons.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_glm.attention.sparse.glm_kpool.ops import (
    AMAX_FLOOR,
    E4M3_MAX,
    dequant,
    expand_selection,
    fwht,
    hadamard_matrix,
    indexer_head_weights,
    pool_keys,
    pow2_scale,
    rotate_quant,
    round_to_e4m3,
    score_pools,
    select_tokens,
    select_topk_pools,
    sparse_mla_attention,
    update_decode_pools,
    update_prefill,
    update_prefill_pools,
    write_latent_rows,
    write_prefill_tail,
)
from trtllm_glm.cache.manager import Glm5NextCacheManager, KpoolLayerCache
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import TableWidthError

pytestmark = pytest.mark.cpu_only

D = 128
E4M3_NAN_BYTE = 0x7F


# ------------------------------------------------------------------------------------------------
# Helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that NaN poison and signed zeros compare exactly."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(bits(a), bits(b))


def poisoned_cache(num_pages: int, page_size: int, num_slots: int, rank: int = 16) -> KpoolLayerCache:
    return KpoolLayerCache(
        latent=torch.full((num_pages, page_size, rank), float("nan")),
        index_k=torch.full((num_pages, page_size // 4, D), E4M3_NAN_BYTE, dtype=torch.uint8).view(torch.float8_e4m3fn),
        index_scale=torch.full((num_pages, page_size // 4), float("nan")),
        tail_ring=torch.full((num_slots, 2, 4, D), float("nan")),
        tokens_per_block=page_size,
    )


def assert_caches_equal(a: KpoolLayerCache, b: KpoolLayerCache) -> None:
    for name in ("latent", "index_k", "index_scale", "tail_ring"):
        assert_same_bits(getattr(a, name), getattr(b, name))


def random_slot_table(g: torch.Generator, pages_per_seq: list[int], num_pages: int, width: int) -> torch.Tensor:
    """Disjoint, shuffled page ids per sequence; unused entries -1."""
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(pages_per_seq), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return table


def layout(rows: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat batch of ``(seq, first_pos, count)`` runs -> ``(positions, row_seq)``."""
    pos = [torch.arange(p, p + c) for _, p, c in rows]
    seq = [torch.full((c,), b) for b, _, c in rows]
    return torch.cat(pos).to(torch.int64), torch.cat(seq).to(torch.int64)


class Prompts:
    """Per-sequence indexer keys, gate logits and latent rows of fixed random prompts."""

    def __init__(self, seed: int, lengths: list[int], rank: int = 16) -> None:
        g = gen(seed)
        self.lengths = lengths
        self.key = [randn(g, n, D) for n in lengths]
        self.gate = [randn(g, n, D, scale=2.0) for n in lengths]
        self.latent = [randn(g, n, rank) for n in lengths]
        self.ape = randn(g, 4, D)

    def batch(self, rows: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
        positions, row_seq = layout(rows)
        key = torch.cat([self.key[b][p : p + c] for b, p, c in rows])
        gate = torch.cat([self.gate[b][p : p + c] for b, p, c in rows])
        latent = torch.cat([self.latent[b][p : p + c] for b, p, c in rows])
        return key, gate, latent, positions, row_seq


def run_steps(
    cache: KpoolLayerCache,
    prompts: Prompts,
    steps: list[list[tuple[int, int, int]]],
    table: torch.Tensor,
    slots: torch.Tensor,
    mode: str,
) -> None:
    for rows in steps:
        key, gate, latent, positions, row_seq = prompts.batch(rows)
        write_latent_rows(cache.latent, latent, positions, row_seq, table, cache.page_size)
        update = update_prefill if mode == "prefill" else update_decode_pools
        update(cache, key, gate, prompts.ape, positions, row_seq, table, slots)


def chunk_steps(starts: list[int], ends: list[int], chunks: list[int]) -> list[list[tuple[int, int, int]]]:
    """Steps where every unfinished sequence advances by its chunk size (sequences in index order)."""
    cur, steps = list(starts), []
    while any(c < e for c, e in zip(cur, ends)):
        rows = []
        for b, (c, e) in enumerate(zip(cur, ends)):
            if c < e:
                n = min(chunks[b], e - c)
                rows.append((b, c, n))
                cur[b] = c + n
        steps.append(rows)
    return steps


def gather_pools(cache: KpoolLayerCache, table_row: torch.Tensor, n_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    ppp = cache.page_size // 4
    pages = [int(table_row[(4 * p) // cache.page_size]) for p in range(n_pools)]
    k = torch.stack([cache.index_k[pg, p % ppp] for p, pg in enumerate(pages)]) if pages else None
    s = torch.stack([cache.index_scale[pg, p % ppp] for p, pg in enumerate(pages)]) if pages else None
    return k, s


def expected_pools(key: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = key.shape[0] // 4
    return rotate_quant(pool_keys(key[: 4 * n].view(n, 4, D), gate[: 4 * n].view(n, 4, D), ape))


def pow2_scale_ref(amax: float) -> float:
    """Smallest power of two s with max(amax, 1e-4) <= 448 s, in exact float64 arithmetic."""
    a = max(amax, float(torch.tensor(AMAX_FLOOR, dtype=torch.float32)))
    e = math.frexp(a / E4M3_MAX)[1] - 2  # a start at or below the answer
    while a > E4M3_MAX * 2.0**e:
        e += 1
    return 2.0**e


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)]
    return torch.unique(vals)


# ------------------------------------------------------------------------------------------------
# Walsh-Hadamard transform


def test_hadamard_matrix_is_sylvester() -> None:
    for n in (1, 2, 4, 16, 128):
        h = hadamard_matrix(n)
        assert h.shape == (n, n) and h.dtype == torch.float32
        assert torch.equal(h.abs(), torch.ones(n, n))
        assert torch.equal(h, h.T)
        assert torch.equal(h @ h.T, n * torch.eye(n))
    h = hadamard_matrix(16, dtype=torch.float64)
    for i in range(16):
        for j in range(16):
            assert h[i, j] == (-1) ** bin(i & j).count("1")
    for bad in (0, 3, 96):
        with pytest.raises(ValueError):
            hadamard_matrix(bad)


def test_fwht_equals_matrix_product() -> None:
    g = gen(1)
    for n in (1, 2, 4, 8, 32, 128):
        x = randn(g, 3, 5, n)
        ref = (x.double() @ hadamard_matrix(n, dtype=torch.float64)) / math.sqrt(n)
        out = fwht(x)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        fwht(randn(g, 2, 96))


def test_fwht_is_orthonormal() -> None:
    g = gen(2)
    x = randn(g, 64, D, scale=3.0)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    # bf16 input is computed in fp32.
    xb = x.to(torch.bfloat16)
    assert_same_bits(fwht(xb), fwht(xb.float()))


def test_fwht_butterfly_order_is_pinned() -> None:
    """Bitwise equal to an explicit element-by-element butterfly: the documented order kernels mirror."""
    g = gen(3)
    n = D
    # Wide dynamic range so that the order of additions changes the rounding.
    x = randn(g, 4, n) * torch.exp2(torch.randint(-20, 20, (4, n), generator=g).float())
    y = [x[:, i].clone() for i in range(n)]
    h = 1
    while h < n:
        for i in range(n):
            if i & h == 0:
                a, b = y[i], y[i + h]
                y[i], y[i + h] = a + b, a - b
        h *= 2
    norm = torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)
    ref = torch.stack(y, dim=1) * norm
    assert_same_bits(fwht(x), ref)
    assert_same_bits(norm, torch.tensor(0x3DB504F3, dtype=torch.int32).view(torch.float32))


# ------------------------------------------------------------------------------------------------
# FP8 e4m3 rounding, scales and the rotate-quantise chain


def torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def test_round_to_e4m3_random_binades() -> None:
    g = gen(4)
    n = 200_000
    mant = 1.0 + torch.rand(n, generator=g)
    exp = torch.randint(-16, 10, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = sign * mant * torch.exp2(exp)  # binades 2^-16 .. 2^9: fp8 subnormals through saturation
    assert_same_bits(round_to_e4m3(x), torch_e4m3(x))


def test_round_to_e4m3_grid_and_halfway_ties() -> None:
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    for vals in (grid, mids, up, down):
        for x in (vals, -vals):
            assert_same_bits(round_to_e4m3(x), torch_e4m3(x))
    assert torch.equal(round_to_e4m3(grid), grid)
    # Ties to even, in the normal range and among subnormals (step 2^-9).
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 432.0, -1.0625])
    assert torch.equal(round_to_e4m3(x), torch.tensor([1.0, 1.25, 0.0, 2.0**-8, 448.0, -1.0]))


def test_round_to_e4m3_random_fp32_bit_patterns() -> None:
    g = gen(5)
    raw = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = raw.view(torch.float32)
    x = x[torch.isfinite(x)]  # includes fp32 subnormals, signed zeros and huge values (saturate)
    assert_same_bits(round_to_e4m3(x), torch_e4m3(x))


def test_round_to_e4m3_every_bf16_and_specials() -> None:
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = x[~torch.isnan(x)]
    assert_same_bits(round_to_e4m3(x), torch_e4m3(x))
    sp = torch.tensor([0.0, -0.0, math.inf, -math.inf, 448.0, 464.0, 1e30, 1e-45, -1e-45])
    assert_same_bits(round_to_e4m3(sp), torch_e4m3(sp))
    assert torch.isnan(round_to_e4m3(torch.tensor([math.nan]))).all()


def test_pow2_scale_rule() -> None:
    g = gen(6)
    vals = []
    for k in range(-20, 21):
        exact = torch.tensor(448.0 * 2.0**k, dtype=torch.float32)
        vals += [exact, torch.nextafter(exact, torch.tensor(math.inf)), torch.nextafter(exact, torch.tensor(0.0))]
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32)
    vals += [floor, torch.nextafter(floor, torch.tensor(math.inf)), torch.nextafter(floor, torch.tensor(0.0))]
    vals += [torch.tensor(0.0), torch.tensor(1e-30)]
    amax = torch.cat([torch.stack(vals), torch.exp2(torch.rand(20_000, generator=g) * 130 - 40)])
    scale = pow2_scale(amax)
    ref = torch.tensor([pow2_scale_ref(float(a)) for a in amax], dtype=torch.float32)
    assert_same_bits(scale, ref)
    # Exact powers of two come out exact; the floor gives 2^-22; amax / scale never exceeds 448.
    for k in range(-20, 21):
        assert pow2_scale(torch.tensor([448.0 * 2.0**k])).item() == 2.0**k
    assert pow2_scale(torch.tensor([0.0, 1e-5, 1e-4])).tolist() == [2.0**-22] * 3
    assert bool((amax / scale <= E4M3_MAX).all())
    big = amax >= AMAX_FLOOR
    assert bool((amax[big] / scale[big] > E4M3_MAX / 2).all())


def test_rotate_quant_matches_step_by_step() -> None:
    g = gen(7)
    row_scale = torch.tensor([1e-7, 1e-3, 1.0, 37.0, 1e4])[:, None, None]
    x = randn(g, 5, 3, D) * row_scale
    x[2, 1, 5] = 60.0  # an outlier channel, the reason for the rotation
    q, scale = rotate_quant(x)
    assert q.shape == (5, 3, D) and q.dtype == torch.float8_e4m3fn
    assert scale.shape == (5, 3) and scale.dtype == torch.float32
    y = x.to(torch.bfloat16).float()
    y = fwht(y).to(torch.bfloat16).float()
    amax = y.abs().amax(dim=-1)
    ref_scale = torch.tensor([pow2_scale_ref(float(a)) for a in amax.flatten()], dtype=torch.float32).view(5, 3)
    ref_q = (y / ref_scale[..., None]).to(torch.float8_e4m3fn)
    assert_same_bits(scale, ref_scale)
    assert_same_bits(q, ref_q)
    # Dequantised values are within half an e4m3 step (relative 2^-4) of the rotated bf16 input.
    err = (dequant(q, scale) - y).abs()
    bound = torch.maximum(y.abs() * 2.0**-4, (2.0**-10) * scale[..., None])
    assert bool((err <= bound).all())
    with pytest.raises(ValueError):
        rotate_quant(randn(g, 2, 64))


# ------------------------------------------------------------------------------------------------
# Pooling and head weights


def test_pool_keys_equals_explicit_loop() -> None:
    g = gen(8)
    key, gate, ape = randn(g, 2, 3, 4, D), randn(g, 2, 3, 4, D, scale=3.0), randn(g, 4, D)
    out = pool_keys(key, gate, ape)
    assert out.shape == (2, 3, D) and out.dtype == torch.float32
    for i in range(2):
        for p in range(3):
            for d in range(0, D, 7):
                logits = [float(gate[i, p, m, d]) + float(ape[m, d]) for m in range(4)]
                mx = max(logits)
                e = [math.exp(v - mx) for v in logits]
                ref = sum(e[m] / sum(e) * float(key[i, p, m, d]) for m in range(4))
                assert out[i, p, d].item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    # Neither a mean nor a max of the members.
    assert not torch.allclose(out, key.mean(dim=-2)) and not torch.allclose(out, key.amax(dim=-2))


def test_pool_keys_rounding_order_is_pinned() -> None:
    """Bitwise equal to the documented fp32 op order (exp through fp64), member by member."""
    g = gen(23)
    key, gate, ape = randn(g, 5, 4, D, scale=8.0), randn(g, 5, 4, D, scale=3.0), randn(g, 4, D)
    logits = [gate[:, m] + ape[m] for m in range(4)]
    mx = torch.maximum(torch.maximum(logits[0], logits[1]), torch.maximum(logits[2], logits[3]))
    e = [torch.exp((v - mx).double()).float() for v in logits]
    den = ((e[0] + e[1]) + e[2]) + e[3]
    wk = [(e[m] / den) * key[:, m] for m in range(4)]
    assert_same_bits(pool_keys(key, gate, ape), ((wk[0] + wk[1]) + wk[2]) + wk[3])


def test_pool_keys_is_batch_invariant() -> None:
    g = gen(9)
    key, gate, ape = randn(g, 40, 4, D), randn(g, 40, 4, D, scale=4.0), randn(g, 4, D)
    full = pool_keys(key, gate, ape)
    for i in (0, 17, 39):
        assert_same_bits(pool_keys(key[i : i + 1], gate[i : i + 1], ape), full[i : i + 1])


def test_indexer_head_weights() -> None:
    g = gen(10)
    logits = randn(g, 6, 4)
    qscale = torch.exp2(torch.randint(-10, 3, (6, 4), generator=g).float())
    out = indexer_head_weights(logits, qscale, 4)
    ref = (logits * qscale) * torch.tensor((128 * 4) ** -0.5, dtype=torch.float32)
    assert_same_bits(out, ref)
    torch.testing.assert_close(out.double(), logits.double() * qscale.double() / math.sqrt(512), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# Scores and selection


def random_index_cache(g: torch.Generator, num_pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = (randn(g, num_pages, page_size // 4, D) * 100).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-12, 2, (num_pages, page_size // 4), generator=g).float())
    return k, s


def test_score_pools_equals_brute_force() -> None:
    g = gen(11)
    page_size, num_pages, heads = 8, 12, 4
    index_k, index_scale = random_index_cache(g, num_pages, page_size)
    table = random_slot_table(g, [4, 3, 1], num_pages, width=5)
    positions, row_seq = layout([(0, 25, 3), (1, 10, 12), (2, 0, 4)])  # includes rows with no pool yet
    n = positions.shape[0]
    q8 = (randn(g, n, heads, D) * 50).to(torch.float8_e4m3fn)
    w = randn(g, n, heads)  # negative weights too
    max_pools = 8
    out = score_pools(q8, w, index_k, index_scale, positions, row_seq, table, page_size, max_pools)
    assert out.shape == (n, max_pools) and out.dtype == torch.float32
    for r in range(n):
        pos, b = int(positions[r]), int(row_seq[r])
        n_c = (pos + 1) // 4
        for p in range(max_pools):
            if p >= n_c:
                assert out[r, p].item() == -math.inf
                continue
            page = int(table[b, 4 * p // page_size])
            k = index_k[page, p % (page_size // 4)].double()
            terms = [float(w[r, h]) * max(float(q8[r, h].double() @ k), 0.0) for h in range(heads)]
            ref = sum(terms) * float(index_scale[page, p % (page_size // 4)])
            tol = 1e-5 * sum(abs(t) for t in terms) * float(index_scale[page, p % (page_size // 4)]) + 1e-30
            assert abs(out[r, p].item() - ref) <= tol
    with pytest.raises(ValueError, match="max_pools"):
        score_pools(q8, w, index_k, index_scale, positions, row_seq, table, page_size, 6)


def test_score_pools_is_batch_invariant() -> None:
    g = gen(12)
    page_size, num_pages = 8, 10
    index_k, index_scale = random_index_cache(g, num_pages, page_size)
    table = random_slot_table(g, [5, 5], num_pages, width=5)
    positions, row_seq = layout([(0, 0, 40), (1, 20, 20)])
    q8 = (randn(g, 60, 4, D) * 30).to(torch.float8_e4m3fn)
    w = randn(g, 60, 4)
    full = score_pools(q8, w, index_k, index_scale, positions, row_seq, table, page_size, 10)
    for r in (0, 39, 45, 59):
        one = score_pools(q8[r : r + 1], w[r : r + 1], index_k, index_scale, positions[r : r + 1],
                          row_seq[r : r + 1], table, page_size, 10)  # fmt: skip
        assert_same_bits(one, full[r : r + 1])


def test_score_pools_one_sequence_block_same_bits_as_mixed_blocks() -> None:
    """A prefill chunk's rows (one sequence: the keys gathered once per block) score the same bits as the same
    rows inside blocks that span two sequences (the keys gathered per row), for both key formats."""
    g = gen(13)
    page_size, num_pages = 8, 24
    k8, s8 = random_index_cache(g, num_pages, page_size)
    kb = (randn(g, num_pages, page_size // 4, D) * 3).to(torch.bfloat16)
    table = random_slot_table(g, [11, 11], num_pages, width=11)
    positions, row_seq = layout([(0, 3, 83), (1, 0, 30)])  # 83 rows: a 64-row block and a 19-row one
    q = randn(g, 113, 4, D) * 30
    w = randn(g, 113, 4)
    mixed = torch.cat([torch.arange(60, 83), torch.arange(83, 113), torch.arange(0, 60)])  # blocks span both
    for qk, k, s in ((q.to(torch.float8_e4m3fn), k8, s8), (q.to(torch.bfloat16), kb, None)):
        chunk = score_pools(qk[:83], w[:83], k, s, positions[:83], row_seq[:83], table, page_size, 24)
        both = score_pools(qk[mixed], w[mixed], k, s, positions[mixed], row_seq[mixed], table, page_size, 24)
        assert torch.isfinite(chunk[:, 0]).all()
        assert_same_bits(chunk, both[torch.argsort(mixed)][:83])


def brute_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32)
    for r in range(scores.shape[0]):
        n_c = (int(positions[r]) + 1) // 4
        ranked = sorted(range(n_c), key=lambda p: (-float(scores[r, p]), p))[:topk]
        out[r, : len(ranked)] = torch.tensor(sorted(ranked), dtype=torch.int32)
    return out


def test_select_topk_equals_stable_sort_brute_force() -> None:
    g = gen(13)
    n, max_pools = 50, 12
    positions = torch.randint(0, 4 * max_pools, (n,), generator=g)
    scores = torch.randint(0, 4, (n, max_pools), generator=g).float()  # many ties
    scores[:10] = randn(g, 10, max_pools)
    # Garbage beyond the complete pools must never be chosen.
    beyond = torch.arange(max_pools)[None, :] >= ((positions + 1) // 4)[:, None]
    scores = torch.where(beyond, 1e30, scores)
    for topk in (1, 3, 4, 12, 15):
        got = select_topk_pools(scores, positions, topk)
        assert got.dtype == torch.int32 and got.shape == (n, topk)
        assert torch.equal(got, brute_topk(scores, positions, topk))
    with pytest.raises(ValueError):
        select_topk_pools(scores[:, :5], positions.clamp(min=40), 3)


@settings(max_examples=80, deadline=None)
@given(
    positions=st.lists(st.integers(0, 90), min_size=1, max_size=12),
    topk=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    tie_levels=st.sampled_from([2, 5, 1000]),
)
def test_selection_never_reaches_past_own_position(positions: list[int], topk: int, seed: int, tie_levels: int) -> None:
    g = gen(seed)
    pos = torch.tensor(positions, dtype=torch.int64)
    max_pools = 23
    scores = torch.randint(0, tie_levels, (len(positions), max_pools), generator=g).float()
    width = 4 * topk + 3
    pools = select_topk_pools(scores, pos, topk)
    sel = select_tokens(scores, pos, topk, width)
    assert torch.equal(sel, expand_selection(pools, pos, width))
    assert torch.equal(pools, brute_topk(scores, pos, topk))
    for r, p in enumerate(positions):
        n_c = (p + 1) // 4
        ids = [int(i) for i in pools[r] if i >= 0]
        assert len(ids) == min(topk, n_c) and len(set(ids)) == len(ids)
        assert all(i < n_c for i in ids)  # only pools that completed at or before this row
        toks = [int(t) for t in sel[r] if t >= 0]
        assert toks == [int(t) for t in sel[r, : len(toks)]]  # -1 only as trailing padding
        assert toks == sorted(set(toks)) and all(t <= p for t in toks)
        assert len(toks) == 4 * min(topk, n_c) + (p + 1) % 4
        assert set(range(4 * n_c, p + 1)) <= set(toks)  # the open pool's tail is always there


def test_expand_selection_content() -> None:
    positions = torch.tensor([10, 3, 2, 13, 0, 15])
    pool_ids = torch.tensor([[1, 0, -1], [0, -1, -1], [-1, -1, -1], [2, -1, 0], [-1, -1, -1], [3, -1, 1]])
    out = expand_selection(pool_ids, positions, 14)
    rows = [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        [0, 1, 2, 3],
        [0, 1, 2],
        [0, 1, 2, 3, 8, 9, 10, 11, 12, 13],
        [0],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]
    ref = torch.full((6, 14), -1, dtype=torch.int32)
    for r, toks in enumerate(rows):
        ref[r, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
    assert out.dtype == torch.int32 and torch.equal(out, ref)
    # A narrower buffer that still fits is fine; a wider one is padded.
    assert torch.equal(expand_selection(pool_ids, positions, 11), ref[:, :11])
    with pytest.raises(TableWidthError):
        expand_selection(pool_ids, positions, 10)
    with pytest.raises(ValueError, match="complete pool"):
        expand_selection(torch.tensor([[2]]), torch.tensor([10]), 8)  # pool 2 completes at position 11
    with pytest.raises(ValueError, match="twice"):
        expand_selection(torch.tensor([[1, 1]]), torch.tensor([10]), 12)


# ------------------------------------------------------------------------------------------------
# Cache writes


def test_write_latent_rows_places_rows_only() -> None:
    g = gen(14)
    cache = poisoned_cache(num_pages=6, page_size=4, num_slots=2)
    table = random_slot_table(g, [3, 2], 6, width=4)
    positions, row_seq = layout([(0, 2, 7), (1, 0, 3)])
    rows = randn(g, 10, 16)
    write_latent_rows(cache.latent, rows, positions, row_seq, table, 4)
    written = torch.zeros(6, 4, dtype=torch.bool)
    for r in range(10):
        pg, off = int(table[row_seq[r], positions[r] // 4]), int(positions[r] % 4)
        assert_same_bits(cache.latent[pg, off], rows[r])
        written[pg, off] = True
    assert bool(torch.isnan(cache.latent[~written]).all())


def test_prefill_tail_writes_only_surviving_rows() -> None:
    g = gen(15)
    ring = torch.full((3, 2, 4, D), float("nan"))
    key, gate = randn(g, 8, D), randn(g, 8, D)
    positions, row_seq = layout([(0, 5, 6), (1, 9, 2)])
    write_prefill_tail(ring, key, gate, positions, row_seq, torch.tensor([2, 0]))
    for r in range(2, 6):  # seq 0 keeps positions 7..10
        assert_same_bits(ring[2, 0, int(positions[r]) % 4], key[r])
        assert_same_bits(ring[2, 1, int(positions[r]) % 4], gate[r])
    for r in (6, 7):  # seq 1 keeps positions 9, 10; entries 3 and 0 stay as they were
        assert_same_bits(ring[0, 0, int(positions[r]) % 4], key[r])
    assert bool(torch.isnan(ring[0, :, [0, 3]]).all()) and bool(torch.isnan(ring[1]).all())


def check_against_pure(cache: KpoolLayerCache, prompts: Prompts, table: torch.Tensor, slots: torch.Tensor) -> None:
    """Pools equal the pure pool+quantise of the whole prompt; rings hold the last rows; the rest is poison."""
    for b, n in enumerate(prompts.lengths):
        n_c = n // 4
        if n_c:
            k, s = gather_pools(cache, table[b], n_c)
            ek, es = expected_pools(prompts.key[b], prompts.gate[b], prompts.ape)
            assert_same_bits(k, ek)
            assert_same_bits(s, es)
        ppp = cache.page_size // 4
        if (4 * n_c) // cache.page_size < int((table[b] >= 0).sum()):  # the open pool's slot is still poison
            page = int(table[b, (4 * n_c) // cache.page_size])
            assert bool((bits(cache.index_k[page, n_c % ppp]) == E4M3_NAN_BYTE).all())
            assert bool(torch.isnan(cache.index_scale[page, n_c % ppp]))
        ring = cache.tail_ring[int(slots[b])]
        for pos in range(max(0, n - 4), n):
            assert_same_bits(ring[0, pos % 4], prompts.key[b][pos])
            assert_same_bits(ring[1, pos % 4], prompts.gate[b][pos])
        if n < 4:
            assert bool(torch.isnan(ring[:, n:]).all())


@pytest.fixture(scope="module")
def prefill_setup() -> tuple[Prompts, torch.Tensor, torch.Tensor, KpoolLayerCache]:
    prompts = Prompts(seed=16, lengths=[37, 22, 3])
    table = random_slot_table(gen(17), [5, 3, 1], num_pages=12, width=6)
    slots = torch.tensor([3, 0, 1])
    whole = poisoned_cache(12, 8, 4)
    run_steps(whole, prompts, [[(b, 0, n) for b, n in enumerate(prompts.lengths)]], table, slots, "prefill")
    check_against_pure(whole, prompts, table, slots)
    return prompts, table, slots, whole


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 17])
def test_chunked_prefill_is_bit_identical_to_whole(chunk: int, prefill_setup) -> None:
    prompts, table, slots, whole = prefill_setup
    cache = poisoned_cache(12, 8, 4)
    chunks = [chunk, max(1, chunk - 2), chunk + 1]  # different alignments per sequence in one batch
    steps = chunk_steps([0, 0, 0], prompts.lengths, chunks)
    run_steps(cache, prompts, steps, table, slots, "prefill")
    assert_caches_equal(cache, whole)


@pytest.mark.parametrize("prefix", [0, 1, 4, 7, 13])
def test_decode_after_prefill_matches_whole_prefill(prefix: int, prefill_setup) -> None:
    prompts, table, slots, whole = prefill_setup
    cache = poisoned_cache(12, 8, 4)
    starts = [min(prefix, n) for n in prompts.lengths]
    if prefix:
        run_steps(cache, prompts, [[(b, 0, s) for b, s in enumerate(starts)]], table, slots, "prefill")
    run_steps(cache, prompts, chunk_steps(starts, prompts.lengths, [1, 1, 1]), table, slots, "decode")
    assert_caches_equal(cache, whole)


def test_verify_multirow_decode_equals_rows_one_at_a_time(prefill_setup) -> None:
    prompts, table, slots, whole = prefill_setup
    widths = [8, 3, 2]  # verify widths 1 + K per sequence, mixed in one batch
    multi = poisoned_cache(12, 8, 4)
    single = poisoned_cache(12, 8, 4)
    run_steps(multi, prompts, chunk_steps([0, 0, 0], prompts.lengths, widths), table, slots, "decode")
    run_steps(single, prompts, chunk_steps([0, 0, 0], prompts.lengths, [1, 1, 1]), table, slots, "decode")
    assert_caches_equal(multi, single)
    assert_caches_equal(multi, whole)


def test_decode_and_prefill_agree_on_one_chunk(prefill_setup) -> None:
    prompts, table, slots, _ = prefill_setup
    base = poisoned_cache(12, 8, 4)
    run_steps(base, prompts, [[(0, 0, 6), (1, 0, 2)]], table, slots, "prefill")
    a = KpoolLayerCache(base.latent.clone(), base.index_k.clone(), base.index_scale.clone(), base.tail_ring.clone(), 8)
    b = KpoolLayerCache(base.latent.clone(), base.index_k.clone(), base.index_scale.clone(), base.tail_ring.clone(), 8)
    rows = [[(0, 6, 11), (1, 2, 9), (2, 0, 3)]]
    run_steps(a, prompts, rows, table, slots, "prefill")
    run_steps(b, prompts, rows, table, slots, "decode")
    assert_caches_equal(a, b)
    # The pool-only update leaves the ring alone.
    c = KpoolLayerCache(base.latent.clone(), base.index_k.clone(), base.index_scale.clone(), base.tail_ring.clone(), 8)
    key, gate, _, positions, row_seq = prompts.batch(rows[0])
    update_prefill_pools(c, key, gate, prompts.ape, positions, row_seq, table, slots)
    assert_same_bits(c.tail_ring, base.tail_ring)
    assert_same_bits(c.index_k, a.index_k)


def test_empty_batch_is_a_no_op() -> None:
    cache = poisoned_cache(4, 8, 2)
    before = poisoned_cache(4, 8, 2)
    empty_i, empty_f = torch.empty(0, dtype=torch.int64), torch.empty(0, D)
    table, slots, ape = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.ones(4, D)
    write_latent_rows(cache.latent, torch.empty(0, 16), empty_i, empty_i, table, 8)
    update_decode_pools(cache, empty_f, empty_f, ape, empty_i, empty_i, table, slots)
    update_prefill(cache, empty_f, empty_f, ape, empty_i, empty_i, table, slots)
    assert_caches_equal(cache, before)
    scores = score_pools(torch.empty(0, 2, D).to(torch.float8_e4m3fn), torch.empty(0, 2), cache.index_k,
                         cache.index_scale, empty_i, empty_i, table, 8, 4)  # fmt: skip
    assert scores.shape == (0, 4)
    assert select_tokens(scores, empty_i, 2, 11).shape == (0, 11)


# ------------------------------------------------------------------------------------------------
# Page shuffling and table errors


def test_shuffled_pages_give_identical_gathers() -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    lengths = [30, 21]
    prompts = Prompts(seed=18, lengths=lengths, rank=cfg.kv_lora_rank)

    def manager(fillers_first: bool) -> tuple[Glm5NextCacheManager, torch.Tensor, torch.Tensor]:
        m = Glm5NextCacheManager(cfg, num_pages=16, tokens_per_block=8, max_num_requests=4)
        for plane in (m.latent, m.index_scale, m.tail_ring):
            plane.fill_(float("nan"))
        m.index_k.view(torch.uint8).fill_(E4M3_NAN_BYTE)
        if fillers_first:
            m.add_request(100, 16)
            m.add_request(1, 8)
            m.add_request(101, 9)
            m.add_request(0, 30)
            m.ensure_capacity(1, 21)
            m.free_request(100)
            m.free_request(101)
        else:
            m.add_request(0, 30)
            m.add_request(1, 21)
        rows = m.get_batch_slot_tables([0, 1])
        table = torch.full((2, 5), -1, dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return m, table, torch.tensor(m.get_batch_state_slots([0, 1]))

    (ma, ta, sa), (mb, tb, sb) = manager(False), manager(True)
    assert not torch.equal(ta, tb) and not torch.equal(sa, sb)
    g = gen(19)
    n_rows = sum(lengths)
    q_abs = randn(g, n_rows, 4, cfg.kv_lora_rank)
    q8 = (randn(g, n_rows, cfg.index_n_heads, D) * 40).to(torch.float8_e4m3fn)
    w = randn(g, n_rows, cfg.index_n_heads)
    results = []
    for m, table, slots in ((ma, ta, sa), (mb, tb, sb)):
        cache = m.kpool_layer_cache(0)
        run_steps(cache, prompts, chunk_steps([0, 0], lengths, [7, 5]), table, slots, "prefill")
        _, _, _, positions, row_seq = prompts.batch([(0, 0, 30), (1, 0, 21)])
        scores = score_pools(q8, w, cache.index_k, cache.index_scale, positions, row_seq, table, 8, 8)
        sel = select_tokens(scores, positions, cfg.index_topk_pools, cfg.index_select_width)
        o = sparse_mla_attention(q_abs, cache.latent, sel, row_seq, table, 8, cfg.softmax_scale)
        pools = [gather_pools(cache, table[b], n // 4) for b, n in enumerate(lengths)]
        rings = cache.tail_ring[slots]
        results.append((scores, sel, o, pools, rings))
    (s1, sel1, o1, p1, r1), (s2, sel2, o2, p2, r2) = results
    assert_same_bits(s1, s2)
    assert torch.equal(sel1, sel2)
    assert_same_bits(o1, o2)
    assert_same_bits(r1, r2)
    for (k1, c1), (k2, c2) in zip(p1, p2):
        assert_same_bits(k1, k2)
        assert_same_bits(c1, c2)
    assert bool(torch.isfinite(o1).all()) and bool((sel1 >= 0).sum(1).gt(0).all())


def test_page_outside_slot_table_raises_and_writes_nothing() -> None:
    g = gen(20)
    cache = poisoned_cache(num_pages=6, page_size=8, num_slots=2)
    before = KpoolLayerCache(cache.latent.clone(), cache.index_k.clone(), cache.index_scale.clone(),
                             cache.tail_ring.clone(), 8)  # fmt: skip
    key, gate, ape, lat = randn(g, 6, D), randn(g, 6, D), randn(g, 4, D), randn(g, 6, 16)
    slots = torch.tensor([0, 1])
    positions, row_seq = layout([(0, 12, 2), (1, 4, 4)])
    # Seq 0's rows (positions 12, 13) need its logical page 1, which each table gets wrong.
    bad_tables = [
        torch.tensor([[0], [2]], dtype=torch.int32),  # the row is too short
        torch.tensor([[0, -1], [2, 3]], dtype=torch.int32),  # the entry is unset
        torch.tensor([[0, 9], [2, 3]], dtype=torch.int32),  # the id is beyond the page pool
    ]
    for table in bad_tables:
        calls = [
            lambda t=table: write_latent_rows(cache.latent, lat, positions, row_seq, t, 8),
            lambda t=table: update_decode_pools(cache, key, gate, ape, positions, row_seq, t, slots),
            lambda t=table: update_prefill_pools(cache, key, gate, ape, positions, row_seq, t, slots),
            lambda t=table: update_prefill(cache, key, gate, ape, positions, row_seq, t, slots),
        ]
        for call in calls:
            with pytest.raises(ValueError, match="slot table"):
                call()
        assert_caches_equal(cache, before)
        sel = torch.tensor([[13, 0], [4, -1]])
        with pytest.raises(ValueError, match="slot table"):
            sparse_mla_attention(randn(g, 2, 2, 16), cache.latent, sel, torch.tensor([0, 1]), table, 8, 0.25)
        q8 = randn(g, 1, 2, D).to(torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="slot table"):
            # Position 15 sees pools 0..3; pools 2, 3 live on seq 0's logical page 1.
            score_pools(q8, randn(g, 1, 2), cache.index_k, cache.index_scale, torch.tensor([15]),
                        torch.tensor([0]), table, 8, 4)  # fmt: skip
    # Bad state slots and broken batch layouts are rejected too.
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="state slot"):
        update_decode_pools(cache, key, gate, ape, positions, row_seq, good, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="consecutive"):
        update_prefill(cache, key, gate, ape, positions.flip(0), row_seq.flip(0), good, slots)
    with pytest.raises(ValueError, match="contiguous"):
        p2, s2 = layout([(0, 0, 2), (1, 0, 2), (0, 2, 2)])
        update_prefill(cache, key, gate, ape, p2, s2, good, slots)
    assert_caches_equal(cache, before)


# ------------------------------------------------------------------------------------------------
# Sparse MLA


def dense_attention(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Brute force over a list of latent rows: ``q [H, R]``, ``rows [T, R]`` -> ``[H, R]`` (fp64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        logits = [float(q[h].double() @ rows[j].double()) * scale for j in range(rows.shape[0])]
        mx = max(logits)
        e = [math.exp(v - mx) for v in logits]
        for j in range(rows.shape[0]):
            out[h] += e[j] / sum(e) * rows[j].double()
    return out


def mla_setup(seed: int):
    g = gen(seed)
    lengths = [19, 9]
    cache = poisoned_cache(num_pages=9, page_size=4, num_slots=2, rank=16)
    # Page 0 stays unused (poisoned): skipped entries must not leak whatever a placeholder index reads.
    table = random_slot_table(g, [5, 3], 8, width=6)
    table = torch.where(table >= 0, table + 1, table)
    latent = [randn(g, n, 16) for n in lengths]
    positions, row_seq = layout([(0, 0, 19), (1, 0, 9)])
    write_latent_rows(cache.latent, torch.cat(latent), positions, row_seq, table, 4)
    q_rows, q_seq = layout([(0, 14, 5), (1, 6, 3)])  # the last few rows of each sequence
    q = randn(g, 8, 3, 16, scale=2.0)
    return g, cache, table, latent, q, q_rows, q_seq


def test_sparse_mla_full_selection_equals_dense_attention() -> None:
    g, cache, table, latent, q, q_rows, q_seq = mla_setup(21)
    width = 24
    sel = torch.full((8, width), -1, dtype=torch.int32)
    for r in range(8):
        pos = int(q_rows[r])
        toks = torch.arange(pos + 1)[torch.randperm(pos + 1, generator=g)]  # any order, -1 interleaved
        cols = torch.randperm(width, generator=g)[: pos + 1].sort().values
        sel[r, cols] = toks.to(torch.int32)
    out = sparse_mla_attention(q, cache.latent, sel, q_seq, table, 4, 0.3)
    assert out.shape == q.shape and out.dtype == torch.float32
    for r in range(8):
        b, pos = int(q_seq[r]), int(q_rows[r])
        ref = dense_attention(q[r], latent[b][: pos + 1], 0.3)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-6)
    # Output follows the query dtype.
    out16 = sparse_mla_attention(q.to(torch.bfloat16), cache.latent, sel, q_seq, table, 4, 0.3)
    assert out16.dtype == torch.bfloat16


def test_sparse_mla_subset_and_minus_one_entries() -> None:
    g, cache, table, latent, q, q_rows, q_seq = mla_setup(22)
    picks = [sorted(torch.randperm(int(p) + 1, generator=g)[:5].tolist()) for p in q_rows]
    compact = torch.tensor(picks, dtype=torch.int32)
    padded = torch.full((8, 12), -1, dtype=torch.int32)
    for r, toks in enumerate(picks):
        cols = torch.randperm(12, generator=g)[:5]
        padded[r, cols] = torch.tensor(toks[::-1], dtype=torch.int32)
    a = sparse_mla_attention(q, cache.latent, compact, q_seq, table, 4, 0.25)
    b = sparse_mla_attention(q, cache.latent, padded, q_seq, table, 4, 0.25)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for r in range(8):
        ref = dense_attention(q[r], latent[int(q_seq[r])][picks[r]], 0.25)
        torch.testing.assert_close(a[r].double(), ref, rtol=1e-5, atol=1e-6)
    # A row with nothing selected gives zeros, not NaN from the poisoned cache.
    empty = padded.clone()
    empty[3] = -1
    c = sparse_mla_attention(q, cache.latent, empty, q_seq, table, 4, 0.25)
    assert torch.equal(c[3], torch.zeros_like(c[3]))
    assert_same_bits(c[:3], b[:3])


def test_wider_score_matrix_selects_the_same_pools() -> None:
    """`GlmKpoolMetadata.score_columns` pads the score matrix to a power of two: the extra columns score -inf and
    the selection (ties included) is the one of the exact width."""
    g = gen(31)
    page_size, num_pages, heads = 8, 40, 4
    index_k, index_scale = random_index_cache(g, num_pages, page_size)
    table = random_slot_table(g, [20, 13], num_pages, width=24)
    positions, row_seq = layout([(0, 70, 9), (1, 3, 47)])  # rows with 0 .. 17 complete pools
    n = positions.shape[0]
    q8 = (randn(g, n, heads, D) * 50).to(torch.float8_e4m3fn)
    w = randn(g, n, heads)
    exact = int(((positions + 1) // 4).max())
    assert exact & (exact - 1)  # not a power of two already
    base = score_pools(q8, w, index_k, index_scale, positions, row_seq, table, page_size, exact)
    wide = score_pools(q8, w, index_k, index_scale, positions, row_seq, table, page_size, 32)
    assert torch.equal(wide[:, :exact], base) and (wide[:, exact:] == -math.inf).all()
    for topk in (1, 5, 16, 20):
        assert torch.equal(select_topk_pools(wide, positions, topk), select_topk_pools(base, positions, topk))

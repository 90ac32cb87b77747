"""The FP8 latent cache format (``latent_dtype="fp8"``, docs/fp8.md "FP8 latent cache") on the CPU: its quantise /
dequantise helpers against an independent torch reference, its writer (the latent kernel, interpreted) against the
torch reference op, and the sparse MLA reader (kernel and reference) against attention over the dequantised rows.

Inputs are fresh seeded random draws (never zeros, except the all-zero rows that pin the scale floor); outputs are
poisoned first (random e4m3 bytes with NaN codes, NaN scales, NaN outputs) and the geometry is adversarial (a pool
larger than used, pages handed out in random order, sequences of decode / verify / prefill-chunk lengths in one
batch), so that a slot written that should not be, or one left unwritten, shows in the bitwise comparisons.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.attention.sparse.glm_kpool.cache_layout import LATENT_SCALE_BLOCK, latent_scale_blocks

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only

E4M3 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(n: int, r: int, g: torch.Generator) -> torch.Tensor:
    """``[n, r]`` fp32 rows of very different magnitudes: each row and each column scaled by ``2**U(-20, 20)``."""
    row_mag = torch.exp2(torch.randint(-20, 21, (n, 1), generator=g).float())
    col_mag = torch.exp2(torch.rand(1, r, generator=g) * 8 - 4)
    return torch.randn(n, r, generator=g) * row_mag * col_mag


def _reference_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: float64 block amax, ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` by ``math``,
    codes by torch's own (correct on the CPU) fp32 -> e4m3 cast."""
    n, r = x.shape
    nb = -(-r // LATENT_SCALE_BLOCK)
    codes = torch.empty(n, r, dtype=E4M3)
    scale = torch.empty(n, nb)
    for b in range(nb):
        cols = slice(b * LATENT_SCALE_BLOCK, min(r, (b + 1) * LATENT_SCALE_BLOCK))
        amax = x[:, cols].double().abs().amax(dim=1).clamp(min=1e-4)
        # ceil(log2(amax / 448)) in float64 (exact for powers of two), then 2**k exactly.
        k = torch.ceil(torch.log2(amax.float().double() / 448.0))
        s = torch.exp2(k).float()
        scale[:, b] = s
        codes[:, cols] = (x[:, cols] / s[:, None]).to(E4M3)
    return codes, scale


def _poisoned_latent(num_pages: int, page_size: int, r: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 plane of random bytes (NaN codes 0x7F / 0xFF included) and a NaN scale plane."""
    codes = torch.randint(0, 256, (num_pages, page_size, r), generator=g, dtype=torch.uint8)
    codes.view(-1)[::7] = 0x7F
    scale = torch.full((num_pages, page_size, latent_scale_blocks(r)), float("nan"))
    return codes.view(E4M3), scale


def _batch(past: list[int], qlen: list[int], page_size: int, num_pages: int, g: torch.Generator):
    """A flat batch: positions, row_seq and a slot table of distinct random pages drawn from a larger pool."""
    width = max(-(-(p + q) // page_size) for p, q in zip(past, qlen)) + 1
    assert len(past) * width < num_pages  # the pool is larger than what the batch uses
    table = torch.randperm(num_pages, generator=g)[: len(past) * width].view(len(past), width).to(torch.int32)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(past, qlen)])
    row_seq = torch.cat([torch.full((q,), b) for b, q in enumerate(qlen)])
    return positions, row_seq, table


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ------------------------------------------------------------------------------------------------
# Quantise / dequantise
@pytest.mark.parametrize("r", [64, 200, 512])
def test_quant_latent_matches_an_independent_reference(r: int) -> None:
    x = _rows(300, r, _gen(r))
    q, scale = R.quant_latent(x)
    want_q, want_scale = _reference_quant(x)
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (300, latent_scale_blocks(r))
    assert torch.equal(_bits(q), _bits(want_q))
    assert torch.equal(scale, want_scale)
    # Round trip: within half an e4m3 step of each value (3 mantissa bits: 2**-4 relative), or of the block's
    # subnormal step (2**-10 of the scale) for values far below the block's largest.
    back = R.dequant_latent(q, scale)
    step = scale.repeat_interleave(LATENT_SCALE_BLOCK, dim=1)[:, :r] * 2.0**-10
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0**-4, step)).all()
    # Never saturates: the block's largest value keeps its size within the rounding.
    big = x.abs().amax(dim=1)
    assert torch.allclose(back.abs().amax(dim=1), big, rtol=2.0**-4)


def test_quant_latent_zero_and_extreme_rows() -> None:
    """All-zero rows (and a zero block beside a live one) get a finite non-zero scale and decode to zero; huge and
    tiny rows keep their relative precision (the scale follows them over the fp32 range)."""
    g = _gen(3)
    x = torch.randn(6, 200, generator=g)
    x[0] = 0.0
    x[1, :128] = 0.0
    x[2] *= 1e30
    x[3] *= 1e-30  # below the amax floor: the floor's scale, values flush towards its subnormal step
    x[4, 5] = -0.0
    q, scale = R.quant_latent(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[0, 0] == scale[1, 0] == 2.0**-22  # the 1e-4 amax floor
    back = R.dequant_latent(q, scale)
    assert torch.equal(back[0], torch.zeros(200)) and torch.equal(back[1, :128], torch.zeros(128))
    rel = (back[[1, 2, 4]] - x[[1, 2, 4]]).abs() / x[[1, 2, 4]].abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 2.0**-4
    assert back[3].abs().max() <= 2.0**-22 * 2.0**-9  # flushed: at most the floor's smallest step
    # The kernel's quantiser agrees on every one of them (written through a one-page plane).
    lat, sc = _poisoned_latent(1, 8, 200, g)
    K.write_latent_rows(lat, x, torch.arange(6), torch.zeros(6, dtype=torch.int64),
                        torch.zeros(1, 1, dtype=torch.int32), 8, latent_scale=sc)  # fmt: skip
    assert torch.equal(_bits(lat[0, :6]), _bits(q)) and torch.equal(sc[0, :6], scale)


# ------------------------------------------------------------------------------------------------
# Writers: prefill chunks, decode rows and verify rows in one batch (the layer writes every row of a step with
# one `write_latent_rows`; `update_decode_pools` writes pools and rings only, never the latent plane)
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [64, 200])
def test_write_latent_rows_fp8_kernel_equals_reference(rows_dtype: torch.dtype, r: int) -> None:
    g = _gen(10 + r)
    page_size, num_pages = 8, 23
    ref_lat, ref_sc = _poisoned_latent(num_pages, page_size, r, g)
    ker_lat, ker_sc = ref_lat.clone(), ref_sc.clone()
    # One decode row (position 13), a verify of 4 rows (positions 30..33, across a page), a prefill chunk of 19.
    positions, row_seq, table = _batch([13, 30, 5], [1, 4, 19], page_size, num_pages, g)
    rows = _rows(positions.numel(), r, g).to(rows_dtype)
    R.write_latent_rows(ref_lat, rows, positions, row_seq, table, page_size, latent_scale=ref_sc)
    K.write_latent_rows(ker_lat, rows, positions, row_seq, table, page_size, latent_scale=ker_sc)
    assert torch.equal(_bits(ref_lat), _bits(ker_lat))
    assert torch.equal(_bits(ref_sc), _bits(ker_sc))  # NaN poison compared as bits: untouched slots stay
    # What was written is the rows' quantisation, at the right slots; nothing else changed.
    pages = table[row_seq, positions // page_size].long()
    slot = positions % page_size
    q, s = R.quant_latent(rows)
    assert torch.equal(_bits(ker_lat[pages, slot]), _bits(q)) and torch.equal(ker_sc[pages, slot], s)
    touched = torch.zeros(num_pages, page_size, dtype=torch.bool)
    touched[pages, slot] = True
    assert ker_sc[~touched].isnan().all()


def test_write_latent_rows_kernel_skips_padding_rows() -> None:
    """Padding rows (``row_seq = -1``, graph padding) write nothing in the FP8 plane or its scales."""
    g = _gen(20)
    lat, sc = _poisoned_latent(6, 8, 64, g)
    before, before_sc = lat.clone(), sc.clone()
    positions, row_seq = torch.tensor([0, 1, 2]), torch.tensor([0, -1, -1])
    table = torch.tensor([[4]], dtype=torch.int32)
    K.write_latent_rows(lat, _rows(3, 64, g), positions, row_seq, table, 8, latent_scale=sc)
    changed = (_bits(lat) != _bits(before)).any(-1)
    assert changed.nonzero().tolist() == [[4, 0]]
    assert torch.equal(_bits(sc)[~changed], _bits(before_sc)[~changed])


@pytest.mark.parametrize("ops", [R, K], ids=["reference", "kernel"])
def test_latent_format_mismatches_refused(ops) -> None:  # noqa: ANN001
    g = _gen(30)
    lat, sc = _poisoned_latent(2, 8, 64, g)
    pos, seq, table = torch.tensor([0]), torch.tensor([0]), torch.tensor([[1]], dtype=torch.int32)
    rows = _rows(1, 64, g)
    with pytest.raises(ValueError, match="FP8 latent plane needs latent_scale"):
        ops.write_latent_rows(lat, rows, pos, seq, table, 8)
    with pytest.raises(ValueError, match="FP8 latent plane needs latent_scale"):
        ops.write_latent_rows(lat, rows, pos, seq, table, 8, latent_scale=sc[..., :0])
    with pytest.raises(ValueError, match="takes no latent_scale"):
        ops.write_latent_rows(torch.zeros(2, 8, 64), rows, pos, seq, table, 8, latent_scale=sc)
    q = torch.randn(1, 4, 64, generator=g)
    sel = torch.tensor([[0]])
    with pytest.raises(ValueError, match="FP8 latent plane needs latent_scale"):
        ops.sparse_mla_attention(q, lat, sel, seq, table, 8, 0.1)
    with pytest.raises(ValueError, match="takes no latent_scale"):
        ops.sparse_mla_attention(q, torch.zeros(2, 8, 64), sel, seq, table, 8, 0.1, latent_scale=sc)


# ------------------------------------------------------------------------------------------------
# Reader: sparse MLA decode / verify / prefill rows over FP8 latent rows
def _valid_fp8_plane(num_pages: int, page_size: int, r: int, g: torch.Generator):
    """Random finite codes (NaN codes replaced) and power-of-two scales over a wide range."""
    lat, _ = _poisoned_latent(num_pages, page_size, r, g)
    codes = _bits(lat)
    codes[(codes & 0x7F) == 0x7F] = 0x35
    scale = torch.exp2(torch.randint(-14, 2, (num_pages, page_size, latent_scale_blocks(r)), generator=g).float())
    return lat, scale


def _selection(positions: torch.Tensor, width: int, g: torch.Generator) -> torch.Tensor:
    """Per row, ``width`` distinct causal token positions in random order with some ``-1`` (skipped) entries."""
    sel = torch.full((positions.numel(), width), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        k = min(width, p + 1)
        pick = torch.randperm(p + 1, generator=g)[:k].to(torch.int32)
        pick[torch.rand(k, generator=g) < 0.2] = -1
        sel[i, torch.randperm(width, generator=g)[:k]] = pick
    return sel


@pytest.mark.parametrize("r,width,splits", [(64, 24, 1), (200, 70, 3), (512, 40, 2)])
def test_sparse_mla_over_fp8_latent(r: int, width: int, splits: int) -> None:
    g = _gen(40 + r)
    page_size, num_pages, heads = 8, 29, 4
    lat, scale = _valid_fp8_plane(num_pages, page_size, r, g)
    positions, row_seq, table = _batch([40, 51, 9], [1, 4, 6], page_size, num_pages, g)
    # Pages nobody's table names hold NaN codes and NaN scales: a gather from them would poison the output.
    unused = torch.ones(num_pages, dtype=torch.bool)
    unused[table.flatten().long()] = False
    _bits(lat)[unused] = 0x7F
    scale[unused] = float("nan")
    q = torch.randn(positions.numel(), heads, r, generator=g)
    sel = _selection(positions, width, g)
    sel[0] = -1  # a row with nothing selected outputs zeros
    ref = R.sparse_mla_attention(q, lat, sel, row_seq, table, page_size, 0.125, latent_scale=scale)
    # The reference reads exactly the dequantised rows: the same op over an fp32 plane holding them.
    dense = R.dequant_latent(lat, scale)
    assert torch.equal(ref, R.sparse_mla_attention(q, dense, sel, row_seq, table, page_size, 0.125))
    out = torch.full_like(q, float("nan"))
    # Split-K over several 16-entry tiles, then the combine (the interpreted module takes the tuning knobs).
    mod = K.kernel_module("sparse_mla", "cpu")
    got = mod.sparse_mla_attention(q, lat, sel, row_seq, table, page_size, 0.125, latent_scale=scale, out=out,
                                   splits=splits, block_w=16)  # fmt: skip
    assert got is out and torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(heads, r))
    # fp32 online softmax against the reference's plain softmax: fp32 rounding of values of the rows' size.
    bound = dense[table[row_seq].long()].abs().amax(dim=(1, 2, 3))[:, None, None]
    assert ((got - ref).abs() <= 1e-5 * bound + 1e-30).all()
    # bf16 queries: the kernel's output rounds to bf16; the reference on the same bf16 queries agrees to that.
    qb = q.to(torch.bfloat16)
    ref_b = R.sparse_mla_attention(qb, lat, sel, row_seq, table, page_size, 0.125, latent_scale=scale)
    got_b = K.sparse_mla_attention(qb, lat, sel, row_seq, table, page_size, 0.125, latent_scale=scale)
    assert got_b.dtype == torch.bfloat16
    assert ((got_b.float() - ref_b.float()).abs() <= 2.0**-7 * bound + 1e-30).all()

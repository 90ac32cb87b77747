"""Triton sparse MLA and pool top-k kernels against the torch reference ops, on the CPU interpreter.

Like ``test_kpool_kernels.py`` this module does not set ``TRITON_INTERPRET``: the kernels package runs CPU
tensors through an interpreted copy of its kernels by itself, and setting the variable process-wide would
also turn the GPU tests of the same pytest run into interpreter runs. The interpreter's bf16 arithmetic is
not IEEE, so the kernels upcast right after loading there and the numerics are checked in fp32 / fp16
(bf16 inputs are exercised too, for the loads and the output cast).

Inputs are fresh seeded random values; outputs are poisoned (NaN / garbage ids) before each call, and
every latent row that no live token owns is NaN, so a gather from a wrong row, an element left unwritten or
one written out of place shows. Geometry is adversarial: permuted, non-contiguous pages; slot tables wider
than needed; ``-1`` scattered through the selection; rows with nothing selected; ties in the scores; rows
with fewer complete pools than ``topk_pools``; positions below 3.
"""

from __future__ import annotations

import pytest
import torch

from tests.topk_checks import check_topk, special_scores, topk_scores
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.attention.sparse.glm_kpool.backend import kpool_ops

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.cpu_only,
    # The interpreter passes scalars as 1-element arrays; a run-time loop bound converts one with int(),
    # which numpy >= 1.25 flags as deprecated. Harmless here (numpy is pinned below 2.4).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# Sparse MLA
class _MlaCase:
    """A paged latent cache, a few sequences on permuted pages and an adversarial selection."""

    def __init__(
        self,
        seed: int,
        *,
        n_heads: int,
        rank: int,
        page_size: int,
        lens: list[int],
        row_seq: list[int],
        width: int,
        empty_rows: tuple[int, ...] = (),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        g = _gen(seed)
        self.page_size = page_size
        pages_per_seq = [-(-n // page_size) for n in lens]
        table_width = max(pages_per_seq) + 3  # wider than any sequence needs
        num_pages = sum(pages_per_seq) + 7  # spare pages nobody owns
        perm = torch.randperm(num_pages, generator=g)
        # Unused table columns hold real page ids of other sequences: reading one would be a bug that the
        # NaN poison below would not catch, but the values there would be wrong.
        self.table = perm[torch.randint(0, num_pages, (len(lens), table_width), generator=g)].to(torch.int32)
        cache = torch.full((num_pages, page_size, rank), float("nan"))
        used = 0
        for b, n in enumerate(lens):
            ids = perm[used : used + pages_per_seq[b]]
            used += pages_per_seq[b]
            self.table[b, : pages_per_seq[b]] = ids.to(torch.int32)
            rows = torch.randn(n, rank, generator=g) * 2
            for t in range(n):
                cache[ids[t // page_size], t % page_size] = rows[t]
        self.cache = cache.to(dtype)
        n_rows = len(row_seq)
        self.row_seq = torch.tensor(row_seq, dtype=torch.int64)
        self.sel = torch.full((n_rows, width), -1, dtype=torch.int32)
        for i, b in enumerate(row_seq):
            if i in empty_rows:
                continue
            n = lens[b]
            m = int(torch.randint(1, min(n, width) + 1, (1,), generator=g))
            toks = torch.randperm(n, generator=g)[:m]
            cols = torch.randperm(width, generator=g)[:m]  # -1 left scattered between selected entries
            self.sel[i, cols] = toks.to(torch.int32)
        self.q = (torch.randn(n_rows, n_heads, rank, generator=g) * 0.5).to(dtype)
        self.scale = rank**-0.5

    def args(self) -> tuple:
        return (self.q, self.cache, self.sel, self.row_seq, self.table, self.page_size, self.scale)


def _reference(case: _MlaCase) -> torch.Tensor:
    """The torch reference on the same values, in fp32 (no final rounding to the input dtype)."""
    return R.sparse_mla_attention(
        case.q.float(), case.cache.float(), case.sel, case.row_seq, case.table, case.page_size, case.scale
    )


def _poisoned_out(case: _MlaCase) -> torch.Tensor:
    return torch.full(case.q.shape, float("nan"), dtype=case.q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sparse_mla_matches_reference(dtype: torch.dtype) -> None:
    case = _MlaCase(
        1,
        n_heads=5,
        rank=48,
        page_size=8,
        lens=[37, 61, 9],
        row_seq=[1, 0, 2, 1, 1, 0],
        width=40,
        empty_rows=(3,),
        dtype=dtype,
    )
    ref = _reference(case)
    out = K.sparse_mla_attention(*case.args(), out=_poisoned_out(case))
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a row with nothing selected must output zeros"
    # fp32: rounding only; fp16 / bf16: the output cast (the kernel computes in fp32 on the interpreter).
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"relative error {err:.2e}"
    # The reference's own dtype path agrees too (it rounds its fp32 result once at the end).
    ref_native = R.sparse_mla_attention(*case.args())
    assert ((out.float() - ref_native.float()).abs().max() / ref.abs().max()).item() < 2 * tol


@pytest.mark.parametrize(("splits", "block_w"), [(1, 16), (2, 16), (3, 32), (64, 16), (2, 64)])
def test_sparse_mla_split_counts_agree(splits: int, block_w: int) -> None:
    """Split-K with any split count (including more splits than tiles) and the single-split path."""
    case = _MlaCase(2, n_heads=4, rank=32, page_size=16, lens=[70, 45], row_seq=[0, 1, 0, 1], width=67)
    ref = _reference(case)
    mod = K.kernel_module("sparse_mla", "cpu")
    out = mod.sparse_mla_attention(*case.args(), out=_poisoned_out(case), splits=splits, block_w=block_w)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-6, f"splits={splits} block_w={block_w}: relative error {err:.2e}"


@pytest.mark.parametrize("combine_block_h", [1, 2, 4])
def test_sparse_mla_combine_head_blocks_agree(combine_block_h: int) -> None:
    """The combine gives the same output whatever heads per program (4 heads: 4, 2 or 1 head blocks)."""
    case = _MlaCase(7, n_heads=4, rank=32, page_size=16, lens=[70, 45], row_seq=[1, 0, 1], width=67)
    ref = _reference(case)
    mod = K.kernel_module("sparse_mla", "cpu")
    out = mod.sparse_mla_attention(
        *case.args(), out=_poisoned_out(case), splits=3, block_w=16, combine_block_h=combine_block_h
    )
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-6, f"combine_block_h={combine_block_h}: relative error {err:.2e}"


@pytest.mark.parametrize("slab", [1, 2, 4])
def test_sparse_mla_row_slabs_keep_bits(monkeypatch: pytest.MonkeyPatch, slab: int) -> None:
    """More rows than `PARTIAL_SLAB_ROWS` at several splits (the batch-invariant mode's prefill chunks) run in
    slabs of rows: the same bits as one launch of every row, every row written (a tail slab shorter than the
    others included)."""
    case = _MlaCase(
        11, n_heads=4, rank=32, page_size=16, lens=[70, 45, 9], row_seq=[0, 1, 2, 1, 0, 2, 1], width=67,
        empty_rows=(5,), dtype=torch.bfloat16,
    )  # fmt: skip
    mod = K.kernel_module("sparse_mla", "cpu")
    whole = mod.sparse_mla_attention(*case.args(), out=_poisoned_out(case), splits=3, block_w=16)
    monkeypatch.setattr(mod._module, "PARTIAL_SLAB_ROWS", slab)
    calls: list[int] = []
    launch = mod._module._combine_kernel

    class _Count:
        def __getitem__(self, grid: tuple) -> object:
            calls.append(grid[1])
            return launch[grid]

    monkeypatch.setattr(mod._module, "_combine_kernel", _Count())
    sliced = mod.sparse_mla_attention(*case.args(), out=_poisoned_out(case), splits=3, block_w=16)
    assert calls == [min(slab, 7 - r0) for r0 in range(0, 7, slab)], "one launch per slab of rows"
    assert torch.equal(sliced.view(torch.int16), whole.view(torch.int16))
    err = ((sliced.float() - _reference(case)).abs().max() / _reference(case).abs().max()).item()
    assert err < 8e-3


def test_sparse_mla_launch_choices_fill_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split count and combine head block at the GLM geometry on a 132-SM device (the H200's count)."""
    # The imported module (pure-Python choices; the interpreted copy's callables are wrappers).
    from trtllm_glm.attention.sparse.glm_kpool.kernels import sparse_mla as mod

    monkeypatch.setattr(mod, "_num_programs_target", lambda device: 132)
    dev = torch.device("cpu")
    # One-tile splits (33 tiles of 2051 entries) while every row's fit in half the SMs; beyond that one wave of
    # programs, at most W / (2 H) = 16 splits (split_layout makes 16 requested splits 11 of three tiles).
    assert [mod.choose_splits(n, 64, 2051, dev, 64, 64) for n in (1, 2, 3, 4, 8, 16, 64, 128, 200)] == [
        33, 33, 16, 16, 16, 8, 2, 1, 1
    ]  # fmt: skip
    assert mod.split_layout(2051, 64, 16) == (192, 11)
    # The widest combine head block whose grid still covers the 132 SMs; one head per program below that.
    assert [mod.choose_combine_block_h(n, 64, dev) for n in (1, 2, 4, 8, 16, 17, 64)] == [1, 1, 1, 2, 4, 8, 8]


def test_sparse_mla_rows_with_nothing_selected_and_padding_rows() -> None:
    """Empty rows output zeros in every split layout; a padding row (row_seq < 0) is skipped, not read."""
    case = _MlaCase(3, n_heads=3, rank=16, page_size=4, lens=[11, 30], row_seq=[0, 1, 1], width=20, empty_rows=(0, 2))
    ref = _reference(case)
    mod = K.kernel_module("sparse_mla", "cpu")
    for splits in (1, 2, 5):
        out = mod.sparse_mla_attention(*case.args(), out=_poisoned_out(case), splits=splits, block_w=16)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
        assert ((out[1] - ref[1]).abs().max() / ref[1].abs().max()).item() < 2e-6
    padded_seq = case.row_seq.clone()
    padded_seq[1] = -1
    out = K.sparse_mla_attention(case.q, case.cache, case.sel, padded_seq, case.table, case.page_size, case.scale)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_sparse_mla_int64_metadata_and_strided_queries() -> None:
    case = _MlaCase(4, n_heads=6, rank=32, page_size=8, lens=[50, 21], row_seq=[0, 1, 0], width=33)
    ref = _reference(case)
    # Queries as a head-major view (non-contiguous rows), int64 selection and table.
    q_t = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    out = K.sparse_mla_attention(
        q_t, case.cache, case.sel.long(), case.row_seq.int(), case.table.long(), case.page_size, case.scale
    )
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-6


def test_sparse_mla_order_of_selection_is_irrelevant() -> None:
    case = _MlaCase(5, n_heads=4, rank=16, page_size=8, lens=[40], row_seq=[0, 0], width=32)
    out = K.sparse_mla_attention(*case.args())
    perm = torch.randperm(case.sel.shape[1], generator=_gen(6))
    shuffled = K.sparse_mla_attention(
        case.q, case.cache, case.sel[:, perm].contiguous(), case.row_seq, case.table, case.page_size, case.scale
    )
    assert ((out - shuffled).abs().max() / out.abs().max()).item() < 2e-6


def test_sparse_mla_gluon_kernel_is_gpu_only() -> None:
    """Off sm_90 (here: the interpreter) the Triton kernel serves every call; asking for the Gluon one fails."""
    case = _MlaCase(6, n_heads=4, rank=16, page_size=8, lens=[20], row_seq=[0], width=16)
    mod = K.kernel_module("sparse_mla", "cpu")
    assert not mod.gluon_eligible(case.q, case.cache)
    with pytest.raises(ValueError, match="Gluon"):
        mod.sparse_mla_attention(*case.args(), impl="gluon")
    with pytest.raises(ValueError, match="impl"):
        mod.sparse_mla_attention(*case.args(), impl="cuda")


# ------------------------------------------------------------------------------------------------
# Pool top-k
@pytest.mark.parametrize(("max_pools", "topk", "ties"), [(64, 8, False), (200, 16, True), (512, 64, True)])
def test_select_topk_pools_matches_reference(max_pools: int, topk: int, ties: bool) -> None:
    g = _gen(10 + max_pools)
    # pos < 3 (no complete pool), exactly topk pools, fewer than topk, every alignment mod 4, all pools.
    positions = torch.tensor([0, 2, 3, 4 * topk - 1, 4 * topk + 1, 4 * (topk // 2) + 2, 4 * max_pools - 1, 4 * 37])
    scores = topk_scores(positions.numel(), max_pools, g, ties=ties)
    check_topk(scores, positions, topk)


def test_select_topk_pools_all_equal_and_special_values() -> None:
    """All-equal rows (ties decided by id alone), +-0.0, +-inf, huge and tiny magnitudes, NaN (first, as in
    ``torch.sort``)."""
    g = _gen(20)
    max_pools, topk = 96, 24
    scores = special_scores(max_pools, g)
    positions = torch.full((7,), 4 * max_pools - 1)
    check_topk(scores, positions, topk)


def test_select_topk_pools_ignores_scores_beyond_complete_pools() -> None:
    """Huge scores on incomplete pools (and garbage in the padding columns) must never be chosen."""
    g = _gen(21)
    scores = topk_scores(4, 128, g, ties=True)
    positions = torch.tensor([4 * 50 + 2, 4 * 10 + 3, 1, 4 * 127 + 3])
    for i, p in enumerate(positions.tolist()):
        scores[i, (p + 1) // 4 :] = 1e9
    check_topk(scores, positions, 32)


@pytest.mark.parametrize(("block", "sub"), [(64, 16), (128, 128)])
def test_select_topk_pools_chunked_rows(block: int, sub: int) -> None:
    """Rows longer than one register block (re-read per probe) and emit passes over several sub-blocks."""
    g = _gen(22 + block)
    max_pools = 300  # not a multiple of the block: masked loads
    positions = torch.tensor([4 * max_pools - 1, 4 * 170 + 1, 4 * 40, 2, 4 * 260 + 3])
    scores = topk_scores(positions.numel(), max_pools, g, ties=True)
    check_topk(scores, positions, 48, block=block, sub=sub, num_warps=2)


def test_select_topk_pools_topk_wider_thantopk_scores() -> None:
    g = _gen(23)
    scores = topk_scores(3, 20, g, ties=False)
    check_topk(scores, torch.tensor([79, 30, 5]), 32)


# ------------------------------------------------------------------------------------------------
# Dispatch
def test_backend_dispatch_exposes_both_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "auto")
    ops = kpool_ops(torch.device("cpu"))
    assert ops.sparse_mla_attention is R.sparse_mla_attention
    assert ops.select_topk_pools is R.select_topk_pools
    monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "triton")
    ops = kpool_ops(torch.device("cpu"))
    assert ops.sparse_mla_attention is K.sparse_mla_attention
    assert ops.select_topk_pools is K.select_topk_pools

"""Triton sparse MLA and pool top-k kernels (compiled, CUDA) against the torch reference at GLM geometry.

Sparse MLA: 64 heads x kv_lora 512, page size 64, selection width 2051 (2048 pool tokens + 3 tail), bf16
latent cache and queries, up to 128 query rows; the default kernel (the Gluon one on sm_90) and each kernel
explicitly. The cache starts as NaN everywhere except the rows of live
tokens, pages are permuted and the slot table is wider than needed, ``-1`` is scattered through the
selection and some rows select nothing. Outputs are poisoned before each call. Tolerance: the kernel rounds
the probabilities to bf16 for the second product (FlashAttention-style) and the output to bf16, so it is
compared with the fp32 reference on the same bf16 inputs to a few bf16 units in the last place.

Top-k: 64 rows over 32768 and 8192 pools, topk 512, with ties and short rows; ids must match exactly.
Both ops are also captured in a CUDA graph and replayed on new inputs. Needs CUDA (tests/conftest.py skips
``gpu`` tests without it); run with ``-s`` to see the error figures.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.attention.sparse.glm_kpool.backend import kpool_ops

pytestmark = pytest.mark.gpu

H, RANK, P, WIDTH, TOPK_POOLS = 64, 512, 64, 2051, 512
SCALE = 192**-0.5  # qk_nope_head_dim ** -0.5 of the model


class _MlaScene:
    """Sequences on permuted pages of a NaN-poisoned bf16 latent cache, and selections over them."""

    def __init__(self, seed: int, lens: list[int], dtype: torch.dtype = torch.bfloat16) -> None:
        dev = torch.device("cuda")
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.lens = lens
        pages = [-(-n // P) for n in lens]
        width = max(pages) + 5
        num_pages = sum(pages) + 32
        perm = torch.randperm(num_pages, generator=g)
        table = perm[torch.randint(0, num_pages, (len(lens), width), generator=g)]
        cache = torch.full((num_pages, P, RANK), float("nan"), dtype=dtype)
        used = 0
        for b, n in enumerate(lens):
            ids = perm[used : used + pages[b]]
            used += pages[b]
            table[b, : pages[b]] = ids
            rows = torch.randn(pages[b] * P, RANK, generator=g).to(dtype)
            rows[n:] = float("nan")  # past the sequence's end: not a live token
            cache[ids] = rows.view(pages[b], P, RANK)
        self.cache = cache.to(dev)
        self.table = table.to(torch.int32).to(dev)

    def batch(self, row_seq: list[int], empty: tuple[int, ...] = (), holes: float = 0.05):
        """Queries, selections and row_seq: rows select up to WIDTH random live tokens, in random order."""
        g = self.g
        n_rows = len(row_seq)
        sel = torch.full((n_rows, WIDTH), -1, dtype=torch.int32)
        for i, b in enumerate(row_seq):
            if i in empty:
                continue
            n = min(self.lens[b], WIDTH)
            toks = torch.randperm(self.lens[b], generator=g)[:n].to(torch.int32)
            toks[torch.rand(n, generator=g) < holes] = -1  # -1 scattered among the selected entries
            sel[i, torch.randperm(WIDTH, generator=g)[:n]] = toks
        q = (torch.randn(n_rows, H, RANK, generator=g) * 0.3).to(self.cache.dtype)
        dev = self.cache.device
        return q.to(dev), sel.to(dev), torch.tensor(row_seq, dtype=torch.int64, device=dev)


def _mla_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error / max |ref|, max over rows of ||err|| / ||ref||) for non-empty rows."""
    err = (out.float() - ref).flatten(1)
    nrm = ref.flatten(1).norm(dim=1)
    live = nrm > 0
    rel_rows = (err.norm(dim=1)[live] / nrm[live]).max().item() if live.any() else 0.0
    return (err.abs().max() / ref.abs().max().clamp(min=1e-30)).item(), rel_rows


@pytest.mark.parametrize("n_rows", [1, 16, 128])
def test_sparse_mla_matches_reference_at_glm_geometry(n_rows: int) -> None:
    scene = _MlaScene(7 + n_rows, lens=[5000, 2051, 9000, 700, 3001, 12345, 2100, 64])
    g = torch.Generator().manual_seed(n_rows)
    row_seq = torch.randint(0, len(scene.lens), (n_rows,), generator=g).tolist()
    empty = (n_rows // 2,) if n_rows > 1 else ()
    q, sel, rs = scene.batch(row_seq, empty=empty)
    ref = R.sparse_mla_attention(q.float(), scene.cache.float(), sel, rs, scene.table, P, SCALE)
    out = torch.full_like(q, float("nan"))
    K.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten output or a poisoned cache row was read"
    for i in empty:
        assert torch.equal(out[i], torch.zeros_like(out[i]))
    max_err, row_err = _mla_error(out, ref)
    print(f"[sparse-mla-gpu] N={n_rows}: max abs err / max |ref| {max_err:.2e}, worst row rel {row_err:.2e}")
    assert max_err < 1.5e-2 and row_err < 6e-3


# Launch shapes of kernels.sparse_mla.sparse_mla_attention checked explicitly, whatever the default is.
_MLA_KERNELS = {
    "gluon-bw64": dict(impl="gluon", block_w=64),
    "gluon-bw64-preg": dict(impl="gluon", block_w=64, gluon_p_smem=False),
    "gluon-bw32": dict(impl="gluon", block_w=32),
    "gluon-bw16": dict(impl="gluon", block_w=16),
    "triton": dict(impl="triton"),
}


def _kernel_kwargs(name: str, q: torch.Tensor, cache: torch.Tensor) -> dict:
    kw = _MLA_KERNELS[name]
    if kw["impl"] == "gluon" and not K.kernel_module("sparse_mla", "cuda").gluon_eligible(q, cache):
        pytest.skip("the Gluon kernel needs sm_90")
    return kw


@pytest.mark.parametrize("kernel", list(_MLA_KERNELS))
@pytest.mark.parametrize("n_rows", [16, 128])
def test_sparse_mla_each_kernel_matches_reference(kernel: str, n_rows: int) -> None:
    """Each kernel / launch shape, with padding rows, empty rows and many skipped entries."""
    mod = K.kernel_module("sparse_mla", "cuda")
    scene = _MlaScene(11 + n_rows, lens=[5000, 2051, 9000, 700, 3001, 12345, 2100, 64])
    g = torch.Generator().manual_seed(100 + n_rows)
    row_seq = torch.randint(0, len(scene.lens), (n_rows,), generator=g).tolist()
    row_seq[3] = -1  # a padding row
    q, sel, rs = scene.batch(row_seq, empty=(1,), holes=0.2)
    rs[3] = -1
    kw = _kernel_kwargs(kernel, q, scene.cache)
    ref = R.sparse_mla_attention(q.float(), scene.cache.float(), sel, rs.clamp(min=0), scene.table, P, SCALE)
    ref[3] = 0.0
    out = torch.full_like(q, float("nan"))
    mod.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, out=out, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten output or a poisoned cache row was read"
    for i in (1, 3):
        assert torch.equal(out[i], torch.zeros_like(out[i])), f"row {i} must be zeros"
    max_err, row_err = _mla_error(out, ref)
    print(f"[sparse-mla-gpu] {kernel} N={n_rows}: max abs err / max |ref| {max_err:.2e}, worst row rel {row_err:.2e}")
    assert max_err < 1.5e-2 and row_err < 6e-3


@pytest.mark.parametrize("kernel", ["default", "gluon-bw64", "gluon-bw32"])
def test_sparse_mla_split_layouts_agree(kernel: str) -> None:
    """Any split count (one split: the direct-output path; more splits than tiles) gives the same result."""
    scene = _MlaScene(3, lens=[4000, 2500, 6000])
    q, sel, rs = scene.batch([0, 1, 2, 0, 2, 1], empty=(4,), holes=0.3)
    kw = {} if kernel == "default" else _kernel_kwargs(kernel, q, scene.cache)
    ref = R.sparse_mla_attention(q.float(), scene.cache.float(), sel, rs, scene.table, P, SCALE)
    mod = K.kernel_module("sparse_mla", "cuda")
    for splits in (1, 3, 16, 80):
        out = mod.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, splits=splits, **kw)
        max_err, row_err = _mla_error(out, ref)
        print(f"[sparse-mla-gpu] {kernel} splits={splits}: {max_err:.2e} {row_err:.2e}")
        assert max_err < 1.5e-2 and row_err < 6e-3, f"splits={splits}"


def test_sparse_mla_fp32_path_is_tight() -> None:
    """fp32 inputs take the Triton kernel's IEEE products and match the reference to fp32 rounding."""
    scene = _MlaScene(3, lens=[4000, 2500, 6000], dtype=torch.float32)
    q, sel, rs = scene.batch([0, 1, 2, 0, 2, 1], empty=(4,), holes=0.3)
    ref = R.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE)
    out32 = K.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE)
    max_err, row_err = _mla_error(out32, ref)
    print(f"[sparse-mla-gpu] fp32: {max_err:.2e} {row_err:.2e}")
    assert max_err < 1e-5


@pytest.mark.parametrize("kernel", ["default", "gluon-bw64", "gluon-bw32"])
def test_sparse_mla_cuda_graph_replay(kernel: str) -> None:
    scene = _MlaScene(4, lens=[3000, 8000])
    q, sel, rs = scene.batch([0, 1, 1, 0, 1, 0, 0, 1])
    kw = {} if kernel == "default" else _kernel_kwargs(kernel, q, scene.cache)
    mod = K.kernel_module("sparse_mla", "cuda")
    out = torch.empty_like(q)
    mod.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, out=out, **kw)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, out=out, **kw)
    q2, sel2, rs2 = scene.batch([1, 0, 1, 1, 0, 0, 1, 0], empty=(2,))
    q.copy_(q2)
    sel.copy_(sel2)
    rs.copy_(rs2)
    out.fill_(float("nan"))
    graph.replay()
    eager = mod.sparse_mla_attention(q, scene.cache, sel, rs, scene.table, P, SCALE, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from an eager call on the same inputs"


def _topk_inputs(n_rows: int, max_pools: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_rows, max_pools, generator=g)
    # A third of the rows coarse (many ties, signed zeros), the rest continuous.
    coarse = torch.arange(n_rows) % 3 == 0
    scores[coarse] = torch.round(scores[coarse] * 4) / 4
    scores[coarse, ::9] = -0.0
    positions = torch.full((n_rows,), 4 * max_pools - 1, dtype=torch.int64)
    short = torch.tensor([0, 1, 2, 3, 4 * 100 + 2, 4 * TOPK_POOLS - 1, 4 * TOPK_POOLS + 5, 4 * 3000 + 1])
    positions[: short.numel()] = short
    positions[short.numel() :: 5] = torch.randint(4 * TOPK_POOLS, 4 * max_pools, positions[short.numel() :: 5].shape)
    return scores.cuda(), positions.cuda()


@pytest.mark.parametrize("max_pools", [32768, 8192])
def test_select_topk_pools_matches_reference(max_pools: int) -> None:
    scores, positions = _topk_inputs(64, max_pools, max_pools)
    ref = R.select_topk_pools(scores, positions, TOPK_POOLS)
    out = torch.full((64, TOPK_POOLS), -7, dtype=torch.int32, device="cuda")
    K.select_topk_pools(scores, positions, TOPK_POOLS, out=out)
    bad = (out != ref).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ"


def test_select_topk_pools_cuda_graph_replay() -> None:
    scores, positions = _topk_inputs(16, 32768, 5)
    out = torch.empty(16, TOPK_POOLS, dtype=torch.int32, device="cuda")
    K.select_topk_pools(scores, positions, TOPK_POOLS, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.select_topk_pools(scores, positions, TOPK_POOLS, out=out)
    s2, p2 = _topk_inputs(16, 32768, 6)
    scores.copy_(s2)
    positions.copy_(p2)
    out.fill_(-7)
    graph.replay()
    assert torch.equal(out, R.select_topk_pools(scores, positions, TOPK_POOLS))


def test_backend_dispatches_cuda_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "auto")
    ops = kpool_ops(torch.device("cuda"))
    assert ops.sparse_mla_attention is K.sparse_mla_attention
    assert ops.select_topk_pools is K.select_topk_pools

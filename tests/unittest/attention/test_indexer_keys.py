"""BF16 indexer keys (``KvCacheConfig.indexer_key_dtype="bf16"``, docs/indexer_keys.md) on the CPU.

The Triton kernels (interpreted) against the torch reference with bf16 ``index_k`` and no scale plane:
pools and rings bit-identical, scores to fp32 rounding; the reference against a direct fp64 computation of
the format (pooled key rounded to bf16, unrotated; bf16 queries); the cache manager's layout and byte
accounting; the option's plumbing and its errors. Caches start poisoned (random bf16 bit patterns, NaN
and infinity codes included; random rings), inputs are fresh seeded random, shapes are odd.
"""

from __future__ import annotations

import functools

import pytest
import torch

from trtllm_glm import KvCacheConfig
from trtllm_glm.attention.sparse.glm_kpool import kernels as K
from trtllm_glm.attention.sparse.glm_kpool import ops as R
from trtllm_glm.cache.index_keys import index_key_bytes_per_pool, indexer_key_dtype
from trtllm_glm.cache.manager import Glm5NextCacheManager, KpoolLayerCache
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import StateError

pytest.importorskip("triton")

pytestmark = pytest.mark.cpu_only

D = 128
LATENT = 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _cache(num_pages: int, page_size: int, num_slots: int, g: torch.Generator) -> KpoolLayerCache:
    """BF16-key planes full of garbage: every int16 pattern is possible (NaN / inf codes too)."""
    ik = torch.randint(-(2**15), 2**15, (num_pages, page_size // 4, D), generator=g, dtype=torch.int16)
    ik[0, 0, :4] = torch.tensor([0x7FC0, 0x7F80, -128, -64], dtype=torch.int16)  # NaN, +inf, -inf, NaN
    ring = torch.randn(num_slots, 2, 4, D, generator=g) * 3
    latent = torch.full((num_pages, page_size, LATENT), float("nan"))
    return KpoolLayerCache(latent, ik.view(torch.bfloat16), None, ring, page_size)


def _clone(c: KpoolLayerCache) -> KpoolLayerCache:
    return KpoolLayerCache(c.latent.clone(), c.index_k.clone(), None, c.tail_ring.clone(), c.page_size)


def _assert_equal(ref: KpoolLayerCache, ker: KpoolLayerCache, what: str) -> None:
    assert ref.index_scale is None and ker.index_scale is None
    bad = int((_bits(ref.index_k) != _bits(ker.index_k)).sum())
    assert bad == 0, f"{what}: {bad} bf16 keys differ"
    bad = int((_bits(ref.tail_ring) != _bits(ker.tail_ring)).sum())
    assert bad == 0, f"{what}: {bad} ring values differ"


def _table(num_seqs: int, width: int, num_pages: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_pages, generator=g)[: num_seqs * width].view(num_seqs, width).to(torch.int32)


def _flat(past: list[int], qlen: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(past, qlen)])
    row_seq = torch.cat([torch.full((q,), b) for b, q in enumerate(qlen)])
    return positions, row_seq


def _rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, D, generator=g) * 2, torch.randn(n, D, generator=g) * 2


# ------------------------------------------------------------------------------------------------
# Cache writes
@pytest.mark.parametrize("page_size", [12, 16])
def test_bf16_decode_update_bit_exact_over_steps(page_size: int) -> None:
    """Decode and verify-width steps at every ring alignment (12 = 3 pools a page: pages not a power of 2)."""
    g = _gen(100 + page_size)
    num_pages, num_slots = 40, 5
    past = [0, 1, 2, 7, 13]
    widths = [[1, 3, 8, 2, 5], [7, 1, 2, 4, 1], [2, 5, 1, 3, 8]]
    ref = _cache(num_pages, page_size, num_slots, g)
    ker = _clone(ref)
    before = ref.index_k.clone()
    ape = torch.randn(4, D, generator=g)
    table = _table(len(past), 4, num_pages, g)
    slots = torch.randperm(num_slots, generator=g)[: len(past)]
    for step, qlen in enumerate(widths):
        positions, row_seq = _flat(past, qlen)
        key, gate = _rows(positions.numel(), g)
        R.update_decode_pools(ref, key, gate, ape, positions, row_seq, table, slots)
        K.update_decode_pools(ker, key, gate, ape, positions, row_seq, table, slots)
        _assert_equal(ref, ker, f"step {step}")
        past = [p + q for p, q in zip(past, qlen)]
    written = (_bits(ref.index_k) != _bits(before)).any(-1).sum()
    assert written >= 12  # the steps completed pools: the comparison covered real writes


@pytest.mark.parametrize(
    ("page_size", "past", "qlen"), [(8, [0, 5, 6, 7, 12], [17, 9, 4, 13, 3]), (12, [0, 3], [29, 7])]
)
def test_bf16_prefill_pools_and_tail_bit_exact(page_size: int, past: list[int], qlen: list[int]) -> None:
    g = _gen(200 + sum(qlen))
    num_pages, num_slots = 48, 6
    ref = _cache(num_pages, page_size, num_slots, g)
    ker = _clone(ref)
    ape = torch.randn(4, D, generator=g)
    table = _table(len(past), 6, num_pages, g)
    slots = torch.randperm(num_slots, generator=g)[: len(past)]
    positions, row_seq = _flat(past, qlen)
    key, gate = _rows(positions.numel(), g)
    R.update_prefill(ref, key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill(ker, key, gate, ape, positions, row_seq, table, slots)
    _assert_equal(ref, ker, "first chunk")
    # A second chunk at another alignment reads the first one's tail from the ring.
    positions, row_seq = _flat([p + q for p, q in zip(past, qlen)], [5] * len(past))
    key, gate = _rows(positions.numel(), g)
    R.update_prefill(ref, key, gate, ape, positions, row_seq, table, slots)
    K.update_prefill(ker, key, gate, ape, positions, row_seq, table, slots)
    _assert_equal(ref, ker, "second chunk")


def test_bf16_pools_are_the_rounded_pooled_keys_and_paths_agree() -> None:
    """The stored pool is ``bf16(pool_keys(members))`` (no rotation, no scale) whichever path wrote it:
    one prefill chunk, chunks of 5, decode one by one or verify widths, kernel or reference."""
    g = _gen(300)
    page_size, num_pages, total = 8, 12, 27
    base = _cache(num_pages, page_size, 2, g)
    base.tail_ring.zero_()
    ape = torch.randn(4, D, generator=g)
    key, gate = _rows(total, g)
    table = _table(1, 4, num_pages, g)
    slots = torch.tensor([1])

    def run(ops, chunks: list[int], decode: bool) -> KpoolLayerCache:
        c = _clone(base)
        start = 0
        for n in chunks:
            fn = ops.update_decode_pools if decode else ops.update_prefill
            pos = torch.arange(start, start + n)
            fn(
                c,
                key[start : start + n],
                gate[start : start + n],
                ape,
                pos,
                torch.zeros(n, dtype=torch.long),
                table,
                slots,
            )
            start += n
        return c

    one = run(R, [total], decode=False)
    n_pools = total // 4
    want = R.pool_keys(key[: 4 * n_pools].view(n_pools, 4, D), gate[: 4 * n_pools].view(n_pools, 4, D), ape)
    pools = torch.arange(n_pools)
    got = one.index_k[table[0, (4 * pools) // page_size].long(), pools % (page_size // 4)]
    assert torch.equal(_bits(got), _bits(want.to(torch.bfloat16)))
    for ops in (R, K):
        _assert_equal(one, run(ops, [5, 5, 5, 5, 5, 2], decode=False), f"{ops.__name__} chunks of 5")
        _assert_equal(one, run(ops, [1, 2, 3, 4, 4, 3, 2, 1, 4, 3], decode=True), f"{ops.__name__} verify widths")


# ------------------------------------------------------------------------------------------------
# Scores
def _score_case(g: torch.Generator, n_heads: int, page_size: int):
    num_pages = 96
    c = _cache(num_pages, page_size, 2, g)
    # Keys read by the scores are finite: a wide exponent range, as pooled keys of trained models have.
    c.index_k.copy_(
        torch.randn(c.index_k.shape, generator=g) * torch.exp2(torch.randn(c.index_k.shape, generator=g) * 3)
    )
    past, qlen = [0, 2, 9, 60, 117], [3, 3, 4, 6, 3]
    positions, row_seq = _flat(past, qlen)
    table = _table(len(past), -(-120 // page_size), num_pages, g)
    n = positions.numel()
    q = torch.randn(n, n_heads, D, generator=g).to(torch.bfloat16)
    w = torch.randn(n, n_heads, generator=g)
    return (q, w, c.index_k, None, positions, row_seq, table, page_size, 40)


@pytest.mark.parametrize(
    ("n_heads", "page_size", "launch"),
    [(4, 8, {}), (3, 12, {"block_p": 16, "iters": 2}), (16, 16, {"block_p": 64, "iters": 4})],
)
def test_bf16_score_pools_matches_reference(n_heads: int, page_size: int, launch: dict) -> None:
    args = _score_case(_gen(400 + n_heads), n_heads, page_size)
    ref = R.score_pools(*args)
    score = K.score_pools if not launch else functools.partial(K.kernel_module("score", "cpu").score_pools, **launch)
    out = torch.full_like(ref, 12345.0)
    ker = score(*args, out=out)
    assert ker.data_ptr() == out.data_ptr()
    assert torch.equal(torch.isneginf(ker), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert fin.sum() > 100
    q, w, ik = args[:3]
    bound = R.score_pools(q.abs(), w.abs(), ik.abs(), *args[3:])[fin]
    err = (ker[fin] - ref[fin]).abs()
    assert (err <= 1e-5 * bound + 1e-30).all(), f"max err/bound {(err / bound.clamp(min=1e-30)).max().item():.3e}"


def test_bf16_reference_score_is_the_float_score_of_the_stored_values() -> None:
    """``s[n, p] = sum_h w_h relu(q_h . k_p)`` of the bf16 values, no rotation and no scale (fp64 check)."""
    q, w, ik, _, positions, row_seq, table, page_size, max_pools = _score_case(_gen(450), 4, 8)
    ref = R.score_pools(q, w, ik, None, positions, row_seq, table, page_size, max_pools)
    for n in range(positions.numel()):
        n_c = (int(positions[n]) + 1) // 4
        pool = torch.arange(n_c)
        k = ik[table[row_seq[n], (4 * pool) // page_size].long(), pool % (page_size // 4)].double()
        want = (w[n].double()[:, None] * torch.relu(q[n].double() @ k.T)).sum(0)
        torch.testing.assert_close(ref[n, :n_c].double(), want, rtol=1e-5, atol=1e-6)
        assert torch.isneginf(ref[n, n_c:]).all()


def test_score_refuses_mixed_key_formats() -> None:
    q, w, ik, _, positions, row_seq, table, page_size, max_pools = _score_case(_gen(460), 4, 8)
    q8, _ = R.rotate_quant(q.float())
    scale = torch.ones(ik.shape[:2])
    for ops in (R, K):
        with pytest.raises(ValueError, match="e4m3|bf16|bfloat16"):
            ops.score_pools(q8, w, ik, None, positions, row_seq, table, page_size, max_pools)  # fp8 queries
        with pytest.raises(ValueError, match="scale"):
            ops.score_pools(q, w, ik, scale, positions, row_seq, table, page_size, max_pools)  # a stray scale plane
    with pytest.raises(ValueError, match="scale"):  # FP8 keys without their scales
        R.score_pools(q8, w, ik.float().to(torch.float8_e4m3fn), None, positions, row_seq, table, page_size, 40)


def test_head_weights_without_query_scale() -> None:
    logits = torch.randn(5, 3, generator=_gen(470))
    c = float(torch.tensor((128 * 3) ** -0.5, dtype=torch.float32))
    assert torch.equal(R.indexer_head_weights(logits, None, 3), logits * c)
    assert torch.equal(R.indexer_head_weights(logits, torch.ones(5, 3), 3), logits * c)


# ------------------------------------------------------------------------------------------------
# Cache manager
@pytest.fixture
def cfg() -> Glm5NextConfig:
    return Glm5NextConfig.from_pretrained("tiny")


def test_manager_bf16_layout_and_bytes(cfg) -> None:
    kw = dict(num_pages=7, tokens_per_block=12, max_num_requests=3, include_mtp_layer=True)
    fp8 = Glm5NextCacheManager(cfg, **kw)
    bf16 = Glm5NextCacheManager(cfg, **kw, indexer_key_dtype="bf16")
    Ls = bf16.num_sparse_layers
    assert bf16.index_k.shape == (Ls, 7, 3, 128) and bf16.index_k.dtype == torch.bfloat16
    assert bf16.index_scale is None and bf16.kpool_layer_cache(1).index_scale is None
    assert bf16.kpool_layer_cache(1).index_k.dtype == torch.bfloat16
    planes = bf16.page_planes()
    assert set(planes) == {"latent", "index_k"} and planes["index_k"].shape == (Ls, 7, 3 * 256)
    # 256 bytes a pool instead of 128 + a 4-byte scale.
    assert bf16.bytes_per_page - fp8.bytes_per_page == Ls * 3 * (256 - 132)
    for m, name in ((fp8, "fp8"), (bf16, "bf16")):
        allocated = sum(t.numel() * t.element_size() for t in (m.latent, m.index_k, m.index_scale) if t is not None)
        allocated += sum(t.numel() * t.element_size() for t in (m.tail_ring, m.kda_recurrent, m.kda_conv))
        assert Glm5NextCacheManager.estimate_bytes(cfg, **kw, indexer_key_dtype=name) == allocated
    # Page copies (prefix caching) carry the bf16 keys.
    bf16.add_request(1, 12)
    page = bf16.get_batch_slot_tables([1])[0][0]
    bf16.index_k[:, page].normal_()
    data = bf16.copy_page_out(page)
    bf16.add_request(2, 12)
    other = bf16.get_batch_slot_tables([2])[0][0]
    bf16.copy_page_in(other, data)
    assert torch.equal(_bits(bf16.index_k[:, other]), _bits(bf16.index_k[:, page]))
    # A page of the other format is refused (no silent reinterpretation of key bytes).
    fp8.add_request(1, 12)
    with pytest.raises(StateError, match="page geometry"):
        fp8.copy_page_in(fp8.get_batch_slot_tables([1])[0][0], data)


def test_key_dtype_names_and_errors(cfg) -> None:
    assert indexer_key_dtype("fp8") == torch.float8_e4m3fn and indexer_key_dtype("BF16") == torch.bfloat16
    assert indexer_key_dtype(torch.bfloat16) == torch.bfloat16
    assert index_key_bytes_per_pool(torch.bfloat16) == 256 and index_key_bytes_per_pool("fp8") == 132
    for bad in ("fp16", "float8", torch.float16, None, 8):
        with pytest.raises(ValueError, match=r"indexer_key_dtype must be one of 'fp8', 'bf16', got"):
            indexer_key_dtype(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="indexer_key_dtype"):
        Glm5NextCacheManager(cfg, num_pages=2, tokens_per_block=8, max_num_requests=1, indexer_key_dtype="fp16")
    with pytest.raises(ValueError, match="indexer_key_dtype"):
        Glm5NextCacheManager.estimate_bytes(
            cfg, num_pages=2, tokens_per_block=8, max_num_requests=1, indexer_key_dtype="e5m2"
        )


# ------------------------------------------------------------------------------------------------
# Plumbing
def test_kv_cache_config_option() -> None:
    assert KvCacheConfig().indexer_key_dtype == "fp8"
    assert KvCacheConfig(indexer_key_dtype="bf16").indexer_key_dtype == "bf16"
    with pytest.raises(ValueError, match="indexer_key_dtype must be one of 'fp8', 'bf16', got 'int8'"):
        KvCacheConfig(indexer_key_dtype="int8")


def test_serve_yaml_and_cli_carry_the_option() -> None:
    from trtllm_glm.cli import build_parser
    from trtllm_glm.serve.config import ConfigError, llm_options_from_dict

    opts = llm_options_from_dict({"kv_cache_config": {"indexer_key_dtype": "bf16", "tokens_per_block": 8}})
    assert opts["kv_cache_config"].indexer_key_dtype == "bf16"
    with pytest.raises(ConfigError, match="kv_cache_config.*indexer_key_dtype"):
        llm_options_from_dict({"kv_cache_config": {"indexer_key_dtype": "fp4"}})
    with pytest.raises(ConfigError, match="indexer_key_dtype: expected a string"):
        llm_options_from_dict({"kv_cache_config": {"indexer_key_dtype": 16}})
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).indexer_key_dtype == "fp8"
    assert p.parse_args(["generate", "--prompt", "x", "--indexer-key-dtype", "bf16"]).indexer_key_dtype == "bf16"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--indexer-key-dtype", "fp16"])


def test_bf16_keys_under_emulated_graphs_with_mtp(monkeypatch) -> None:
    """The padded graph path (replayed eagerly on the CPU, Triton kernels interpreted) with BF16 keys and MTP
    drafts on a separate draft manager: both managers hold BF16 keys and the tokens equal the eager run's on
    the torch ops."""
    import dataclasses

    from triton.runtime.interpreter import interpreter_builder

    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
    from trtllm_glm.speculative.config import MTPDecodingConfig

    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    monkeypatch.setattr(
        interpreter_builder, "options", dataclasses.replace(interpreter_builder.options, sanitize_overflow=False)
    )
    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    prompts = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 4, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 1, 2, 3, 8, 8]]

    def run(graphs: bool) -> tuple[SpeculativeExecutor, list[list[int]]]:
        monkeypatch.setenv("TRTLLM_GLM_KPOOL_BACKEND", "triton" if graphs else "torch")
        graph_cfg = CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True) if graphs else None
        cfg = ExecutorConfig(
            tokens_per_block=8, max_tokens=512, max_batch_size=4, max_num_tokens=64, max_seq_len=64,
            cuda_graph_config=graph_cfg, indexer_key_dtype="bf16",
        )  # fmt: skip
        spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2, draft_kv_mode="separate")
        ex = SpeculativeExecutor(model, cfg, spec)
        reqs = [ex.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
        ex.run_until_done()
        return ex, [r.output_ids for r in reqs]

    _, want = run(graphs=False)
    ex, got = run(graphs=True)
    assert ex.graph_runner is not None and ex.graph_runner.stats.replays > 0
    assert ex.draft_manager is not None and ex.draft_manager is not ex.manager
    for m in (ex.manager, ex.draft_manager):
        assert m.index_k.dtype == torch.bfloat16 and m.index_scale is None
    assert got == want
    # The requests' pools were written, and only at the low page ids the requests held (ids are handed out
    # ascending; three requests of at most 3 pages): padding rows wrote nothing elsewhere.
    written = (_bits(ex.manager.index_k) != 0).flatten(2).any(-1).any(0)
    assert written.any() and not written[12:].any()

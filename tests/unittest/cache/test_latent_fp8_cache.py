"""The FP8 latent cache (``KvCacheConfig.latent_dtype="fp8"``, docs/fp8.md "FP8 latent cache") in the cache manager
and end to end on the CPU: its planes and bytes (the memory accounting the executor sizes the pool by), page copies
(prefix caching's partial pages), the option's plumbing and refusals, and greedy decoding of the trained ``small``
preset over prompts longer than its ``index_topk`` (64 tokens: the sparse layers attend a selection), plainly
against the model-dtype cache and with MTP speculation (shared and separate draft caches, prefix-cache restores)
against plain decoding on the same FP8 cache. Token comparisons follow the near-tie rule of docs/design.md §7
(`trtllm_glm.runtime.lossless.compare_greedy`).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, SamplingParams
from trtllm_glm.attention.sparse.glm_kpool.cache_layout import kpool_paged_planes
from trtllm_glm.cache.latent_format import latent_bytes_per_token, latent_dtype
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import StateError
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor

pytestmark = pytest.mark.cpu_only

E4M3 = torch.float8_e4m3fn
# Held-out-style code the small preset continues confidently (wide top-2 gaps); 170+ bytes = tokens > index_topk.
CODE = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
)


@pytest.fixture(scope="module")
def small() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype="float32").eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ------------------------------------------------------------------------------------------------
# Manager: planes, bytes, page copies
def test_manager_fp8_latent_planes_and_bytes() -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")  # kv_lora_rank 64: one (narrower) scale block a row
    kw = dict(num_pages=7, tokens_per_block=12, max_num_requests=3, include_mtp_layer=True)
    auto = Glm5NextCacheManager(cfg, **kw)
    fp8 = Glm5NextCacheManager(cfg, **kw, latent_dtype="fp8")
    Ls = fp8.num_sparse_layers
    assert auto.latent.dtype == torch.float32 and auto.latent_scale is None
    assert fp8.latent.shape == (Ls, 7, 12, 64) and fp8.latent.dtype == E4M3
    assert fp8.latent_scale.shape == (Ls, 7, 12, 1) and fp8.latent_scale.dtype == torch.float32
    lc = fp8.kpool_layer_cache(Ls - 1)
    assert lc.latent.dtype == E4M3 and lc.latent_scale.shape == (7, 12, 1)
    assert auto.kpool_layer_cache(0).latent_scale is None
    # fp32 rows of 64 values (256 bytes) become 64 code bytes plus one 4-byte scale a token and layer.
    assert auto.bytes_per_page - fp8.bytes_per_page == Ls * 12 * (256 - 68)
    for m, name in ((auto, "auto"), (fp8, "fp8")):
        allocated = sum(t.numel() * t.element_size() for t in m.planes.values())
        allocated += sum(t.numel() * t.element_size() for t in (m.tail_ring, m.kda_recurrent, m.kda_conv))
        assert Glm5NextCacheManager.estimate_bytes(cfg, **kw, latent_dtype=name) == allocated
        assert m.bytes_per_page == sum(t[:, 0].numel() * t.element_size() for t in m.planes.values())


def test_real_geometry_bytes_per_token() -> None:
    """GLM-5.3-Flash: 512 latent columns, bf16: 1024 bytes a token and sparse layer; FP8: 512 + 4 x 4 = 528."""
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    assert cfg.kv_lora_rank == 512
    assert latent_bytes_per_token(512, torch.bfloat16) == 1024 and latent_bytes_per_token(512, E4M3) == 528

    def per_token(lat: torch.dtype | None) -> float:
        planes = kpool_paged_planes(
            cfg, tokens_per_block=64, dtype=torch.bfloat16, indexer_key_dtype=E4M3, latent_dtype=lat
        )
        return sum(p.bytes_per_page for p in planes) / 64

    # With the FP8 pooled keys (132 bytes a pool of 4 tokens = 33 a token): 1057 -> 561 bytes.
    assert per_token(None) == 1024 + 33 and per_token(E4M3) == 528 + 33


def test_page_copies_carry_fp8_latent_and_scales() -> None:
    """`copy_page_out` / `copy_page_in` (prefix caching's partial pages, the draft's partial page) move the codes
    and the scales; a page of the other format is refused, never reinterpreted."""
    cfg = Glm5NextConfig.from_pretrained("tiny")
    g = torch.Generator().manual_seed(5)
    m = Glm5NextCacheManager(cfg, num_pages=9, tokens_per_block=8, max_num_requests=2, latent_dtype="fp8")
    m.add_request(1, 20)
    m.add_request(2, 20)
    src, dst = m.get_batch_slot_tables([1])[0][2], m.get_batch_slot_tables([2])[0][1]
    _bits(m.latent)[:, src] = torch.randint(0, 256, m.latent[:, src].shape, generator=g, dtype=torch.uint8)
    m.latent_scale[:, src] = torch.exp2(torch.randint(-10, 3, m.latent_scale[:, src].shape, generator=g).float())
    m.latent_scale[:, dst] = float("nan")
    data = m.copy_page_out(src)
    assert set(data) == {"latent", "latent_scale", "index_k", "index_scale"}
    m.copy_page_in(dst, data)
    assert torch.equal(_bits(m.latent[:, dst]), _bits(m.latent[:, src]))
    assert torch.equal(m.latent_scale[:, dst], m.latent_scale[:, src])
    other = Glm5NextCacheManager(cfg, num_pages=9, tokens_per_block=8, max_num_requests=2)
    other.add_request(1, 8)
    with pytest.raises(StateError, match="page geometry"):
        other.copy_page_in(other.get_batch_slot_tables([1])[0][0], data)


# ------------------------------------------------------------------------------------------------
# The option
def test_option_names_and_refusals() -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    assert latent_dtype("auto", torch.bfloat16) == torch.bfloat16 and latent_dtype("FP8", torch.bfloat16) == E4M3
    assert latent_dtype(E4M3, torch.float32) == E4M3 and latent_dtype(torch.float32, torch.float32) == torch.float32
    for bad in ("bf16", "fp16", "e5m2", "int8", None, 8, torch.float16):
        with pytest.raises(ValueError, match=r"latent_dtype must be one of 'auto', 'fp8', got"):
            latent_dtype(bad, torch.float32)  # type: ignore[arg-type]
    kw = dict(num_pages=2, tokens_per_block=8, max_num_requests=1)
    with pytest.raises(ValueError, match="latent_dtype must be one of"):
        Glm5NextCacheManager(cfg, **kw, latent_dtype="fp4")
    with pytest.raises(ValueError, match="latent_dtype must be one of"):
        Glm5NextCacheManager.estimate_bytes(cfg, **kw, latent_dtype=torch.float16)
    assert KvCacheConfig().latent_dtype == "auto" and KvCacheConfig(latent_dtype="fp8").latent_dtype == "fp8"
    with pytest.raises(ValueError, match="latent_dtype must be one of 'auto', 'fp8', got 'fp16'"):
        KvCacheConfig(latent_dtype="fp16")
    with pytest.raises(ValueError, match="latent_dtype must be one of 'auto', 'fp8', got 'e4m3'"):
        ExecutorConfig(latent_dtype="e4m3")
    # Serve YAML and the CLI.
    from trtllm_glm.cli import build_parser
    from trtllm_glm.serve.config import ConfigError, llm_options_from_dict

    opts = llm_options_from_dict({"kv_cache_config": {"latent_dtype": "fp8", "tokens_per_block": 8}})
    assert opts["kv_cache_config"].latent_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_config.*latent_dtype"):
        llm_options_from_dict({"kv_cache_config": {"latent_dtype": "nvfp4"}})
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).latent_dtype == "auto"
    assert p.parse_args(["generate", "--prompt", "x", "--latent-dtype", "fp8"]).latent_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--latent-dtype", "bf16"])


def test_cli_builds_the_llm_with_the_option(monkeypatch) -> None:
    """``generate --latent-dtype fp8`` reaches the LLM's `KvCacheConfig` (the CLI's own `_make_llm`)."""
    from trtllm_glm import cli

    seen = {}

    class FakeLLM:
        def __init__(self, *a, kv_cache_config, **kw) -> None:  # noqa: ANN002, ANN003
            seen["kv"] = kv_cache_config

    monkeypatch.setattr("trtllm_glm.runtime.llm.LLM", FakeLLM)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--latent-dtype", "fp8", "--preset", "tiny"])
    assert isinstance(args, argparse.Namespace)
    cli._make_llm(args, max_batch_size=1, speculative_config=None)
    assert seen["kv"].latent_dtype == "fp8"


# ------------------------------------------------------------------------------------------------
# End to end: the trained small preset, prompts longer than index_topk
def _plain(model: Glm5NextForCausalLM, latent: str, prompts: list[list[int]], n: int):
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=4, max_num_tokens=256, max_seq_len=320,
                         latent_dtype=latent)  # fmt: skip
    ex = Executor(model, cfg)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    ex.run_until_done()
    assert ex.manager.latent.dtype == (E4M3 if latent == "fp8" else torch.float32)
    return reqs


def test_fp8_latent_greedy_matches_the_model_dtype_cache(small) -> None:
    prompts = [list(CODE.encode()), list(CODE.encode())[40:] + list(b"    return out\n\ndef f(x):\n")]
    assert min(map(len, prompts)) > small.config.index_topk
    ref = _plain(small, "auto", prompts, 24)
    got = _plain(small, "fp8", prompts, 24)
    for r, t in zip(ref, got):
        d = compare_greedy(r.output_ids, r.logit_gaps, t.output_ids)
        assert d is None or d.excused, str(d)


@pytest.mark.parametrize("draft_kv_mode", ["shared", "separate"])
def test_mtp_greedy_equals_plain_greedy_with_fp8_latent(small, draft_kv_mode: str) -> None:
    """Verify rounds write FP8 latent rows for drafts that are then rejected, and the draft layer's cache (shared
    pages or its own manager) is FP8 too: the accepted tokens must still be plain greedy's."""
    prompts = [list(CODE.encode()), list(b"import os\nimport sys\n\n\n") + list(CODE.encode())[:90]]
    plain = _plain(small, "fp8", prompts, 28)
    cfg = ExecutorConfig(tokens_per_block=16, max_tokens=2048, max_batch_size=4, max_num_tokens=256, max_seq_len=320,
                         latent_dtype="fp8")  # fmt: skip
    spec = MTPDecodingConfig(num_nextn_predict_layers=3, adaptive=False, draft_kv_mode=draft_kv_mode)
    ex = SpeculativeExecutor(small, cfg, spec)
    reqs = [ex.add_request(p, SamplingParams(max_tokens=28, ignore_eos=True)) for p in prompts]
    ex.run_until_done()
    assert ex.draft_manager is not None and ex.draft_manager.latent.dtype == E4M3
    assert (ex.draft_manager is ex.manager) == (draft_kv_mode == "shared")
    accepted = sum(r.num_accepted_total - r.num_verify_rounds for r in reqs)
    rejected = sum(sum(r.proposed_per_position) for r in reqs) - accepted
    assert accepted > 5 and rejected > 0  # drafts were accepted and rejected: both paths ran
    for p, t in zip(plain, reqs):
        d = compare_greedy(p.output_ids, p.logit_gaps, t.output_ids)
        assert d is None or d.excused, str(d)


def test_prefix_cache_restores_fp8_latent_pages(small) -> None:
    """Block reuse with the FP8 latent: sealed pages shared, a partial page copied, checkpoints restored; the repeats
    decode plain greedy's tokens (docs/prefix_caching.md)."""
    ids = list(CODE.encode())[:150]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)

    def llm(reuse: bool) -> LLM:
        kv = KvCacheConfig(tokens_per_block=16, enable_block_reuse=reuse, latent_dtype="fp8")
        return LLM(model=small, device="cpu", max_seq_len=256, kv_cache_config=kv)

    plain = llm(False).generate(ids, sp).outputs[0].token_ids
    cached = llm(True)
    assert cached.executor.manager.latent.dtype == E4M3
    outs = [cached.generate(ids, sp) for _ in range(3)]
    assert outs[-1].num_cached_tokens > 0
    for o in outs:
        assert o.outputs[0].token_ids == plain


def test_fp8_latent_under_emulated_graphs_with_mtp(monkeypatch) -> None:
    """The padded graph path (replayed eagerly on the CPU) writes the FP8 latent rows through the interpreted kernel
    (`tests.spec_helpers.kpool_writes_through_kernels`: the only writer that skips padding rows) with MTP drafts on a
    separate draft manager: the tokens are the eager run's on the torch ops, and padding rows wrote no latent row."""
    from tests.spec_helpers import emulate_graphs
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig

    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    # tiny's index_topk is 16 tokens: every prompt here is longer, so the sparse layers select.
    prompts = [[5, 9, 2, 7] * 5 + [4, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5] * 2, [8, 8, 1, 2, 3, 8, 8] * 3]

    def run(graphs: bool) -> tuple[SpeculativeExecutor, list[list[int]]]:
        graph_cfg = CudaGraphConfig(batch_sizes=[1, 4], enable_padding=True) if graphs else None
        cfg = ExecutorConfig(tokens_per_block=8, max_tokens=512, max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                             cuda_graph_config=graph_cfg, latent_dtype="fp8")  # fmt: skip
        spec = MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=2, draft_kv_mode="separate")
        ex = SpeculativeExecutor(model, cfg, spec)
        reqs = [ex.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        ex.run_until_done()
        return ex, [r.output_ids for r in reqs]

    _, want = run(graphs=False)
    with monkeypatch.context() as mp:
        emulate_graphs(mp)
        ex, got = run(graphs=True)
    assert ex.graph_runner is not None and ex.graph_runner.stats.replays > 0
    for m in (ex.manager, ex.draft_manager):
        assert m.latent.dtype == E4M3 and m.latent_scale is not None
    assert got == want
    # Pages are handed out ascending; three requests of at most 4 pages each: the scales of pages past them were
    # never written (zero from allocation), so no padding row wrote a latent row elsewhere.
    written = (ex.manager.latent_scale != 0).flatten(2).any(-1).any(0)
    assert written.any() and not written[12:].any()

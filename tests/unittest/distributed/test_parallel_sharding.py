"""Tensor / expert parallel sharding without processes (docs/parallelism.md): the layout arithmetic, clear
errors for sizes that do not divide, the sharded loader (only local slices read, FP8 scales cut on tiles),
and the MoE's expert block: the pair sort and fused kernels with an expert range, and the partial sums of
every rank's MoE adding up to the whole MoE's output."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from safetensors.torch import save_file

from trtllm_glm import LLM
from trtllm_glm.config import Glm5NextConfig, resolve_preset_dir
from trtllm_glm.distributed import NULL_COMM, Mapping, ParallelConfigError
from trtllm_glm.distributed.sharding import SKIP, Shard, check_shardable, shard_fn, shard_state_dict
from trtllm_glm.models.checkpoint import load_state_dict, quantize_block_fp8
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.modules.ffn import MOE_BACKEND_ENV, MoE
from trtllm_glm.moe import kernels as K
from trtllm_glm.moe import ops as R

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(moe_expert_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2, moe_expert_parallel_size=2),
}


def test_mapping_sizes() -> None:
    m = Mapping.from_sizes(2)
    assert (m.world_size, m.tp_size, m.moe_ep_size, m.moe_tp_size) == (2, 2, 1, 2)
    m = Mapping.from_sizes(2, 2)
    assert (m.world_size, m.tp_size, m.moe_ep_size, m.moe_tp_size) == (2, 2, 2, 1)
    m = Mapping.from_sizes(1, 2, rank=1)
    assert (m.world_size, m.tp_size, m.moe_ep_size, m.moe_tp_size, m.tp_rank, m.moe_ep_rank) == (2, 1, 2, 1, 0, 1)
    m = Mapping.from_sizes(4, 2, rank=3)
    assert (m.moe_ep_rank, m.moe_tp_rank, m.moe_tp_size) == (1, 1, 2)
    assert not Mapping.from_sizes(1).is_parallel
    for bad, msg in [
        (dict(tensor_parallel_size=4, moe_expert_parallel_size=3), "must divide the world size 4"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int"),
        (dict(tensor_parallel_size=2, moe_expert_parallel_size=2, moe_tensor_parallel_size=2), "must equal"),
    ]:
        with pytest.raises(ParallelConfigError, match=msg):
            Mapping.from_sizes(**bad)
    with pytest.raises(ParallelConfigError, match="rank must be in"):
        Mapping.from_sizes(2, rank=2)


def test_presets_divide_by_two_and_indivisible_sizes_are_clear_errors() -> None:
    for preset in ("tiny", "small"):
        cfg = Glm5NextConfig.from_pretrained(preset)
        for kw in LAYOUTS.values():
            check_shardable(cfg, Mapping.from_sizes(**kw))
    cfg = Glm5NextConfig.from_pretrained("small")
    with pytest.raises(
        ParallelConfigError, match=r"^num_attention_heads=4 is not divisible by tensor_parallel_size=3$"
    ):
        check_shardable(cfg, Mapping.from_sizes(3))
    with pytest.raises(ParallelConfigError, match=r"n_routed_experts=8 is not divisible by moe_expert_parallel_size=3"):
        check_shardable(cfg, Mapping.from_sizes(1, 3))
    # Refused before any process is started.
    with pytest.raises(ParallelConfigError, match="not divisible"):
        LLM("small", device="cpu", tensor_parallel_size=3)
    assert not mp.active_children()
    with pytest.raises(ParallelConfigError, match="not a model object"):
        LLM(Glm5NextForCausalLM.from_pretrained("tiny"), tensor_parallel_size=2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_loading_reads_only_local_slices(layout: str) -> None:
    """Each rank reads exactly its plan's bytes (less than the whole file), and the ranks' slices put back
    together are the whole checkpoint."""
    d = resolve_preset_dir("small")
    cfg = Glm5NextConfig.from_pretrained("small")
    full_stats: dict[str, int] = {}
    full = load_state_dict(d, stats=full_stats)
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert full_stats["bytes_read"] == total
    ranks = []
    for r in range(2):
        mapping = Mapping.from_sizes(**LAYOUTS[layout], rank=r)
        stats: dict[str, int] = {}
        part = load_state_dict(d, shard=shard_fn(cfg, mapping), stats=stats)
        want = shard_state_dict(full, cfg, mapping)
        assert part.keys() == want.keys()
        for k, t in part.items():
            assert torch.equal(t, want[k]), k
        assert stats["bytes_read"] == sum(t.numel() * t.element_size() for t in part.values()) < 0.8 * total
        ranks.append((mapping, part))
    # Put back together: cut tensors concatenate, experts renumber, replicated ones are equal.
    fn0, fn1 = (shard_fn(cfg, m) for m, _ in ranks)
    for name, t in full.items():
        got = [fn(name, tuple(t.shape)) for fn in (fn0, fn1)]
        held = [(g, p) for g, (_, p) in zip(got, ranks) if g != SKIP]
        assert held, f"{name} held by no rank"
        (local0, cut0), p0 = held[0]
        if cut0 is None:
            assert all(torch.equal(p[g[0]], t) for g, p in held), name
        else:
            joined = torch.cat([p[g[0]] for g, p in held], dim=cut0.dim)
            assert torch.equal(joined, t), name


def test_sharded_model_loads_and_refuses_to_run_without_collectives() -> None:
    m = Glm5NextForCausalLM.from_pretrained("small", mapping=Mapping.from_sizes(2, 2, rank=1))
    assert m.config.num_attention_heads == 2 and m.full_config.num_attention_heads == 4
    moe = next(x for x in m.modules() if isinstance(x, MoE))
    assert (moe.expert_start, len(moe.experts)) == (4, 4)
    assert m.comm is NULL_COMM
    with pytest.raises(RuntimeError, match="no collectives"):
        m.check_comm()
    with pytest.raises(RuntimeError, match="cannot export"):
        m.hf_state_dict()


def _fp8_checkpoint(tmp_path, rows: int, cols: int) -> tuple[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.1, 3.0, rows)[:, None]  # tile-varying scales
    q, s = quantize_block_fp8(w)
    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.save(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    save_file(
        {name: q, name + "_scale_inv": s, "model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors")
    )
    return name, (q.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols])


def test_fp8_weight_and_scale_cut_on_tiles(tmp_path) -> None:
    name, full = _fp8_checkpoint(tmp_path, 300, 512)
    cut = Shard(1, 256, 512)

    def plan(n: str, shape: tuple[int, ...]):
        return (n, cut) if n == name else (n, None)

    stats: dict[str, int] = {}
    sd = load_state_dict(tmp_path, shard=plan, stats=stats)
    assert torch.equal(sd[name], full[:, 256:]) and name + "_scale_inv" not in sd
    # fp8 bytes of the slice + its 3 x 2 fp32 scales + the replicated norm.
    assert stats["bytes_read"] == 300 * 256 + 3 * 2 * 4 + 4 * 4
    sd = load_state_dict(tmp_path, shard=plan, dequantize=False)  # FP8 kept: codes and scales of the slice
    assert sd[name].dtype == torch.float8_e4m3fn and sd[name + "_scale_inv"].shape == (3, 2)
    # A cut inside a tile (a small matrix split finer than its tiles): read whole, dequantised, then cut, held in
    # float (one scale per tile cannot serve two ranks' halves), with or without dequantize.
    cut = Shard(1, 64, 128)
    for deq in (True, False):
        stats = {}
        sd = load_state_dict(tmp_path, shard=plan, stats=stats, dequantize=deq)
        assert sd[name].dtype == torch.float32 and name + "_scale_inv" not in sd
        assert torch.equal(sd[name], full[:, 64:128])
        assert stats["bytes_read"] == 300 * 512 + 3 * 4 * 4 + 4 * 4
    # The ragged last tile may end a cut.
    cut = Shard(0, 256, 300)
    assert torch.equal(load_state_dict(tmp_path, shard=plan)[name], full[256:])


@pytest.mark.parametrize("e0", [0, 3, 5])
def test_align_and_fused_moe_with_an_expert_range(e0: int) -> None:
    """Pairs of other ranks' experts are left out of the sort and add nothing; two blocks sum to the whole."""
    g = torch.Generator().manual_seed(e0)
    n, h, inter, e_all, k, e_loc = 7, 48, 40, 8, 3, 3
    x = torch.randn(n, h, generator=g)
    ids = torch.stack([torch.randperm(e_all, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g) + 0.1
    w13 = torch.randn(e_all, 2 * inter, h, generator=g) * 0.3
    w2 = torch.randn(e_all, h, inter, generator=g) * 0.2
    live = torch.tensor([1, 1, 0, 1, 1, 1, 0])
    block = slice(e0, e0 + e_loc)
    ref_sorted, ref_blocks = R.moe_align(ids, e_loc, 16, live, expert_start=e0)
    local = (ids >= e0) & (ids < e0 + e_loc) & (live != 0)[:, None]
    assert (ref_sorted < n * k).sum() == local.sum()
    assert torch.equal(torch.sort(ref_sorted[ref_sorted < n * k]).values, local.reshape(-1).nonzero().squeeze(1).int())
    k_sorted, k_blocks = K.moe_align(ids, e_loc, 16, live, expert_start=e0)
    assert torch.equal(k_sorted, ref_sorted) and torch.equal(k_blocks, ref_blocks)
    want = R.fused_moe_ref(x, ids, w, w13[block], w2[block], 10.0, live, expert_start=e0)
    # Poisoned output and pair buffer: the pairs of other experts are never written, so must never be read.
    out = torch.full((n, h), float("nan"))
    scratch = {"pair_out": torch.full((n * k, h), float("nan"))}
    got = K.fused_moe(x, ids, w, w13[block].contiguous(), w2[block].contiguous(), 10.0, out=out, row_live=live,
                      expert_start=e0, scratch=scratch)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The complementary experts make up the rest of the whole layer's sum.
    whole = R.fused_moe_ref(x, ids, w, w13, w2, 10.0, live)
    rest = torch.zeros_like(whole)
    for s in (slice(0, e0), slice(e0 + e_loc, e_all)):
        if s.stop > s.start:
            rest += R.fused_moe_ref(x, ids, w, w13[s], w2[s], 10.0, live, expert_start=s.start)
    torch.testing.assert_close(got + rest, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "tp2_ep2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_partials_sum_to_the_whole(layout: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MOE_BACKEND_ENV, backend)
    cfg = Glm5NextConfig.from_pretrained("tiny")
    g = torch.Generator().manual_seed(1)
    whole = MoE(cfg)
    whole.reset_parameters(g, 0.2)
    prefix = "model.layers.1.mlp."
    sd = {prefix + k: v for k, v in whole.state_dict().items()}
    x = torch.randn(9, cfg.hidden_size, generator=g)
    live = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1])
    with torch.no_grad():
        want = whole(x, row_live=live)
        total = torch.zeros_like(want)
        for r in range(2):
            mapping = Mapping.from_sizes(**LAYOUTS[layout], rank=r)
            part = MoE(cfg, mapping)
            local = {k[len(prefix) :]: v for k, v in shard_state_dict(sd, cfg, mapping).items()}
            part.load_state_dict(local)
            total += part(x, row_live=live)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)

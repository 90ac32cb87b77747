"""Glm5NextForCausalLM on paged caches: chunking invariance, decode equivalence, MTP, checkpoints."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.checkpoint import dequantize_block_fp8, quantize_block_fp8, save_checkpoint
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

pytestmark = pytest.mark.cpu_only

ATOL = 2e-4


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    """Tiny preset with an index_topk that covers every pool at these lengths.

    Logit-level equality across batch shapes is only meaningful where the indexer selects the same
    columns: a 1e-6 rounding difference from an earlier KDA layer can flip a pool's FP8 byte and so a
    near-tied top-k choice (a legitimate near tie, see docs/design.md §7). Token-level tests with real sparse
    selection live in tests/integration/test_generation.py.
    """
    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.index_topk = 64
    return Glm5NextForCausalLM.from_config(cfg, seed=1)


@pytest.fixture(scope="module")
def sparse_model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=1)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_schedule_and_parameters(model) -> None:
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds == model.config.layer_types
    names = dict(model.hf_state_dict())
    L = model.config.num_hidden_layers
    pre = "model.language_model."
    assert f"{pre}layers.{L}.eh_proj.weight" in names and f"{pre}layers.{L}.shared_head.norm.weight" in names
    assert f"{pre}layers.3.self_attn.indexer.wk.weight" in names
    assert f"{pre}layers.0.self_attn.A_log" in names and f"{pre}layers.1.mlp.gate.e_score_correction_bias" in names
    assert f"{pre}layers.0.hc_attn_fn" in names and f"{pre}layers.7.hc_ffn_scale" in names
    assert f"{pre}layers.3.self_attn.indexer.index_kpool_compress_gate" in names
    assert not any(k.startswith(f"{pre}layers.{L}.hc_") for k in names)  # the MTP block has no mHC
    assert "lm_head.weight" in names


@pytest.mark.parametrize("chunks", [[1], [3], [4, 5], [17], [7, 1, 13]])
def test_chunked_prefill_equals_one_pass(model, chunks) -> None:
    toks = prompt(45)
    whole = ModelHarness(model).prefill_logits(0, toks)
    chunked = ModelHarness(model).prefill_logits(0, toks, chunks)
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)


def test_prefill_then_decode_equals_prefill(model) -> None:
    toks = prompt(40, seed=3)
    whole = ModelHarness(model).prefill_logits(0, toks)
    h = ModelHarness(model)
    a = h.prefill_logits(0, toks[:21])
    b = [model.compute_logits(h.step([(0, [t])], num_decode_seqs=1)) for t in toks[21:]]
    torch.testing.assert_close(torch.cat([a, *b]), whole, atol=ATOL, rtol=0)


def test_mixed_batch_rows_equal_solo(model) -> None:
    """Decode rows of one request next to a prefill chunk of another equal each run alone."""
    p0, p1 = prompt(30, 5), prompt(26, 6)
    solo0 = ModelHarness(model).prefill_logits(0, p0)
    solo1 = ModelHarness(model).prefill_logits(1, p1)
    h = ModelHarness(model)
    h.step([(0, p0[:20])])
    out0, out1 = [], []
    i1 = 0
    for t in range(20, 30):
        rows = [(0, [p0[t]])]
        if i1 < len(p1):
            rows.append((1, p1[i1 : i1 + 9]))
        hid = h.step(rows, num_decode_seqs=1)
        out0.append(model.compute_logits(hid[:1]))
        if len(rows) > 1:
            out1.append(model.compute_logits(hid[1:]))
            i1 += len(rows[1][1])
    torch.testing.assert_close(torch.cat(out0), solo0[20:], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(out1), solo1, atol=ATOL, rtol=0)


def test_shuffled_pages_identical(sparse_model) -> None:
    model = sparse_model
    toks = prompt(50, 9)
    a = ModelHarness(model).prefill_logits(0, toks, [11])
    n_pages = ModelHarness(model).manager.num_pages
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(2)).tolist()
    h = ModelHarness(model, page_order=order)
    b = h.prefill_logits(0, toks, [11])
    assert h.manager.get_batch_slot_tables([0])[0] != list(range(len(h.manager.get_batch_slot_tables([0])[0])))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_mtp_forward(model) -> None:
    toks = prompt(24, 4)
    h = ModelHarness(model, include_mtp_layer=True)
    hidden = h.step([(0, toks)])
    mtp_idx = h.manager.num_sparse_layers - 1
    # Row i pairs token i+1 with target hidden i; positions are the target's (0..T-2).
    h.meta.prepare([0], past_lens=[0], q_lens=[len(toks) - 1], num_decode_seqs=0)
    nxt = torch.tensor(toks[1:])
    with torch.no_grad():
        d_whole = model.mtp_forward(nxt, hidden[:-1], h.meta, h.manager, mtp_idx)
    assert d_whole.shape == (len(toks) - 1, model.config.hidden_size) and torch.isfinite(d_whole).all()
    logits = model.compute_logits(d_whole)
    assert logits.shape[-1] == model.config.vocab_size
    # The same MTP rows fed in two chunks on a fresh cache agree (its own cache plane and tail ring work).
    h2 = ModelHarness(model, include_mtp_layer=True)
    h2.step([(0, toks)])
    outs = []
    for s, e in [(0, 10), (10, len(toks) - 1)]:
        h2.meta.prepare([0], past_lens=[s], q_lens=[e - s], num_decode_seqs=0)
        with torch.no_grad():
            outs.append(model.mtp_forward(nxt[s:e], hidden[s:e], h2.meta, h2.manager, mtp_idx))
    torch.testing.assert_close(torch.cat(outs), d_whole, atol=ATOL, rtol=0)


def test_save_load_identical_logits(sparse_model, tmp_path) -> None:
    model = sparse_model
    save_checkpoint(model.hf_state_dict(), model.config, tmp_path, max_shard_bytes=2_000_000)
    m2 = Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    toks = prompt(30, 8)
    a = ModelHarness(model).prefill_logits(0, toks)
    b = ModelHarness(m2).prefill_logits(0, toks)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_layer_subset_loading(model, tmp_path) -> None:
    save_checkpoint(model.hf_state_dict(), model.config, tmp_path)
    keep = [0, 1, 2, 3]
    sub = Glm5NextForCausalLM.from_pretrained(str(tmp_path), layers=keep)
    assert sub.config.num_hidden_layers == 4 and sub.config.layer_types == model.config.layer_types[:4]
    for j, i in enumerate(keep):
        a = dict(model.model.layers[i].named_parameters())
        b = dict(sub.model.layers[j].named_parameters())
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(sub.mtp.eh_proj.weight, model.mtp.eh_proj.weight)
    toks = prompt(12)
    assert torch.isfinite(ModelHarness(sub).prefill_logits(0, toks)).all()
    with pytest.raises(ValueError, match="outside"):
        Glm5NextForCausalLM.from_pretrained(str(tmp_path), layers=[99])


def test_block_fp8_checkpoint_dequantised_on_load(model, tmp_path) -> None:
    sd = model.hf_state_dict()
    q = {}
    expect = {}
    for k, v in sd.items():
        if v.dim() == 2 and "embed" not in k and "norm" not in k and v.shape[0] >= 16:
            w8, s = quantize_block_fp8(v)
            q[k], q[k + "_scale_inv"] = w8, s
            expect[k] = dequantize_block_fp8(w8, s)
        else:
            q[k] = v
            expect[k] = v
    save_checkpoint(q, model.config, tmp_path)
    m2 = Glm5NextForCausalLM.from_pretrained(str(tmp_path))
    got = m2.hf_state_dict()
    assert got.keys() == expect.keys()
    for k in expect:
        torch.testing.assert_close(got[k], expect[k].to(got[k].dtype), atol=0, rtol=0)


def test_load_errors(model, tmp_path) -> None:
    sd = model.hf_state_dict()
    sd.pop("model.language_model.norm.weight")
    save_checkpoint(sd, model.config, tmp_path)
    with pytest.raises(ValueError, match="missing tensor 'model.language_model.norm.weight'"):
        Glm5NextForCausalLM.from_pretrained(str(tmp_path))


def test_real_geometry_builds_on_meta() -> None:
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    n = sum(p.numel() for p in m.parameters())
    assert n > 1e10  # hundreds of experts per MoE layer
    assert sum(1 for layer in m.model.layers if layer.is_sparse) == 11


def test_bf16_model_keeps_fp32_router_and_gate_constants(tmp_path) -> None:
    m = Glm5NextForCausalLM.from_pretrained("tiny", dtype="bfloat16")
    params = dict(m.named_parameters())
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert params["model.layers.3.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert params["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert params["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    save_checkpoint(m.hf_state_dict(), m.config, tmp_path)
    m2 = Glm5NextForCausalLM.from_pretrained(str(tmp_path), dtype="bfloat16")
    p2 = dict(m2.named_parameters())
    assert p2["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert all(torch.equal(params[k], p2[k]) for k in params)


def _prefill_then_decode(m: Glm5NextForCausalLM, toks: list[int]) -> torch.Tensor:
    h = ModelHarness(m)
    pre = h.prefill_logits(0, toks[:-2], [5, 20])
    dec = [m.compute_logits(h.step([(0, [t])], num_decode_seqs=1)) for t in toks[-2:]]
    return torch.cat([pre, *dec])


def test_fuse_weights_keeps_outputs_names_and_loads() -> None:
    """`Glm5NextForCausalLM.fuse_weights` fuses every layer that can (the KDA layers' and the sparse layers'
    input projections, the MTP layer's included): outputs, names and state_dict are unchanged, in-place loads
    write through, and a replaced parameter makes that layer fall back to its separate GEMMs."""
    from trtllm_glm.attention.sparse.glm_kpool.layer import GlmKpoolSparseMLA

    cfg = Glm5NextConfig.from_pretrained("tiny")
    cfg.index_topk = 64  # every pool selected: equal logits need equal selections (see `model`)
    ref = Glm5NextForCausalLM.from_config(cfg, seed=1)
    fused = Glm5NextForCausalLM.from_config(cfg, seed=1)
    fused.fuse_weights()
    sparse = [m for m in fused.modules() if isinstance(m, GlmKpoolSparseMLA)]
    assert len(sparse) >= 2 and all(m._in_fused is not None and m._in_fused.intact() for m in sparse)
    with_indexer = next(m for m in sparse if m.indexer is not None)
    storage = with_indexer._in_fused.weight
    assert with_indexer.q_a_proj.weight.data_ptr() == storage.data_ptr()
    gate = with_indexer.indexer.index_kpool_compress_gate
    assert gate.data_ptr() == storage[-gate.shape[0] :].data_ptr()
    sd_ref, sd_fused = ref.state_dict(), fused.state_dict()
    assert sd_ref.keys() == sd_fused.keys() and all(torch.equal(sd_fused[k], v) for k, v in sd_ref.items())
    toks = prompt(30, seed=4)
    torch.testing.assert_close(_prefill_then_decode(fused, toks), _prefill_then_decode(ref, toks), rtol=0, atol=ATOL)
    fused.fuse_weights()  # idempotent: the same storage
    assert with_indexer._in_fused.weight.data_ptr() == storage.data_ptr()
    # Where gradients are wanted, the separate GEMMs run (the fused tensor is no parameter).
    with torch.enable_grad():
        qa, _, _ = with_indexer._input_projections(torch.randn(3, cfg.hidden_size))
        qa.sum().backward()
    assert with_indexer.q_a_proj.weight.grad is not None
    with_indexer.q_a_proj.weight.grad = None

    # In-place loads reach the fused storage.
    other = Glm5NextForCausalLM.from_config(cfg, seed=2)
    fused.load_state_dict(other.state_dict())
    assert with_indexer._in_fused.intact() and with_indexer._in_fused.weight.data_ptr() == storage.data_ptr()
    torch.testing.assert_close(_prefill_then_decode(fused, toks), _prefill_then_decode(other, toks), rtol=0, atol=ATOL)
    # A replaced parameter: that layer computes with the new one through its separate GEMMs.
    # (q_a_proj, perturbed: a rescale would vanish in its RMSNorm, and with every pool selected the indexer
    # weights do not reach the logits.)
    w = with_indexer.q_a_proj.weight.detach()
    new_w = torch.nn.Parameter(w + torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * w.std())
    with_indexer.q_a_proj.weight = new_w
    assert not with_indexer._in_fused.intact()
    name = next(n for n, m in fused.named_modules() if m is with_indexer)
    other.get_submodule(name).q_a_proj.weight = torch.nn.Parameter(new_w.detach().clone())
    torch.testing.assert_close(_prefill_then_decode(fused, toks), _prefill_then_decode(other, toks), rtol=0, atol=ATOL)
    # A conversion that changes nothing keeps every fused storage (graphs captured on it stay valid) ...
    from trtllm_glm.kda.layer import KimiDeltaAttention

    kda = next(m for m in fused.modules() if isinstance(m, KimiDeltaAttention))
    fused.fuse_weights()

    def addresses() -> tuple[int, ...]:
        return tuple(f.weight.data_ptr() for f in (with_indexer._in_fused, kda._in_fused, kda._conv_fused))

    kept = addresses()
    fused.to(torch.float32)
    assert addresses() == kept
    # ... and a cast re-fuses.
    fused.to(torch.float64)
    assert all(m._in_fused is not None and m._in_fused.intact() for m in sparse)
    assert with_indexer._in_fused.weight.dtype == torch.float64

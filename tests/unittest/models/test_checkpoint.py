"""Checkpoint save/load: round trips, layer-subset reads, block-FP8 dequantisation, errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import CheckpointError
from trtllm_glm.models import checkpoint as ckpt
from trtllm_glm.models.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    dequantize_block_fp8,
    load_state_dict,
    quantize_block_fp8,
    save_checkpoint,
)

pytestmark = pytest.mark.cpu_only


@pytest.fixture
def cfg() -> Glm5NextConfig:
    d = Glm5NextConfig.from_pretrained("tiny").text_dict()
    d["num_hidden_layers"] = 4
    for k in ("layer_types", "mlp_layer_types", "indexer_types"):
        d.pop(k)
    return Glm5NextConfig.from_dict(d)


def _state(cfg: Glm5NextConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fake HF-named weights: non-layer weights, trunk layers 0..L-1 and one MTP layer L (mixed dtypes)."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }
    for i in range(cfg.num_hidden_layers + 1):
        sd[f"model.layers.{i}.mlp.gate_proj.weight"] = torch.randn(12, 8, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(8, generator=g).half()
        sd[f"model.layers.{i}.some_index"] = torch.randint(0, 100, (5,), generator=g)
    return sd


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def _assert_bitexact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def test_single_file_round_trip(tmp_path, cfg) -> None:
    sd = _state(cfg)
    files = save_checkpoint(sd, cfg, tmp_path)
    assert files == [SINGLE_FILE]
    assert (tmp_path / "config.json").exists() and not (tmp_path / INDEX_FILE).exists()
    _assert_bitexact(load_state_dict(tmp_path), sd)


def test_sharded_round_trip_and_index(tmp_path, cfg) -> None:
    sd = _state(cfg)
    files = save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=900)
    n = len(files)
    assert n > 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(sd)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert not (tmp_path / SINGLE_FILE).exists()
    _assert_bitexact(load_state_dict(tmp_path), sd)
    # Re-saving as a single file removes the stale shards and index.
    save_checkpoint(sd, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE_FILE]


def test_save_handles_tied_and_noncontiguous(tmp_path, cfg) -> None:
    w = torch.randn(16, 8)
    sd = {"model.embed_tokens.weight": w, "lm_head.weight": w, "model.norm.weight": torch.randn(8, 4).T}
    save_checkpoint(sd, cfg, tmp_path)
    _assert_bitexact(load_state_dict(tmp_path), {k: v.contiguous() for k, v in sd.items()})


@pytest.mark.parametrize("sharded", [False, True])
def test_layer_subset_reads_only_needed(tmp_path, cfg, monkeypatch, sharded) -> None:
    sd = _state(cfg)
    save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=400 if sharded else None)
    L = cfg.num_hidden_layers
    read: list[str] = []
    real_open = ckpt.safe_open

    class Spy:
        def __init__(self, *a, **kw) -> None:
            self._f = real_open(*a, **kw)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, k):
            read.append(k)
            return self._f.get_tensor(k)

    monkeypatch.setattr(ckpt, "safe_open", Spy)
    out = load_state_dict(tmp_path, layers=[1, 3])
    expected = {k for k in sd if _layer(k) in (None, 1, 3, L)}
    assert set(out) == expected
    assert sorted(read) == sorted(expected)
    _assert_bitexact(out, {k: sd[k] for k in expected})

    read.clear()
    out = load_state_dict(tmp_path, layers=[0], include_mtp=False)
    assert {_layer(k) for k in out} == {None, 0}
    assert not any(k.startswith(f"model.layers.{L}.") for k in read)
    # include_mtp=False without a subset drops only the MTP layer.
    out = load_state_dict(tmp_path, include_mtp=False)
    assert set(out) == {k for k in sd if not k.startswith(f"model.layers.{L}.")}


def test_layer_subset_skips_corrupt_unneeded_shard(tmp_path, cfg) -> None:
    sd = _state(cfg)
    save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=400)
    wmap = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    f2 = wmap["model.layers.2.mlp.gate_proj.weight"]
    assert all(k.startswith("model.layers.2.") for k, f in wmap.items() if f == f2)
    (tmp_path / f2).write_bytes(b"not a safetensors file")
    out = load_state_dict(tmp_path, layers=[0, 1, 3])
    assert not any(k.startswith("model.layers.2.") for k in out)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own parse error type
        load_state_dict(tmp_path)


def _fp8_ref(fp8: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(fp8.shape)
    rows, cols = fp8.shape
    for bi in range(math.ceil(rows / block)):
        for bj in range(math.ceil(cols / block)):
            r, c = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[r, c] = fp8[r, c].float() * scale[bi, bj]
    return out


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (5, 130)])
def test_dequant_matches_block_loop(shape) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    fp8 = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=g) + 0.01
    deq = dequantize_block_fp8(fp8, scale)
    assert deq.dtype == torch.float32 and deq.shape == shape
    assert torch.equal(deq, _fp8_ref(fp8, scale, 128))


def test_quantize_dequantize_error_within_fp8_precision() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # columns span four decades
    w[:128, :128] *= 100.0  # one block with a very different range
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    # Every block's absmax maps onto 448 exactly.
    for bi in range(3):
        for bj in range(2):
            blk = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            assert s[bi, bj] == pytest.approx(blk.abs().max().item() / 448.0, rel=1e-6)
    deq = dequantize_block_fp8(q, s)
    se = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2**-4; subnormal step 2**-9 -> absolute 2**-10 * scale.
    bound = w.abs() * 2.0**-4 + se * 2.0**-10
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()
    assert (deq - w).abs().max() > 0  # really quantised


def test_quantize_zero_block_and_bad_scale_shape() -> None:
    w = torch.randn(130, 10, generator=torch.Generator().manual_seed(1))
    w[128:] = 0.0
    q, s = quantize_block_fp8(w)
    assert s[1, 0] == 1.0 and torch.isfinite(s).all()
    assert torch.equal(dequantize_block_fp8(q, s)[128:], torch.zeros(2, 10))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_block_fp8(q, torch.ones(1, 1))


def test_load_fp8_checkpoint_dequantises_and_casts(tmp_path, cfg) -> None:
    sd = _state(cfg)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=g)
    q, s = quantize_block_fp8(w)
    sd["model.layers.1.mlp.experts.0.down_proj.weight"] = q
    sd["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] = s
    save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=20000)
    out = load_state_dict(tmp_path)
    k = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert k + "_scale_inv" not in out
    assert out[k].dtype == torch.float32
    assert torch.equal(out[k], _fp8_ref(q, s, 128))
    out16 = load_state_dict(tmp_path, layers=[1], dtype=torch.bfloat16)
    assert out16[k].dtype == torch.bfloat16
    assert torch.equal(out16[k], _fp8_ref(q, s, 128).bfloat16())
    # dtype casts floating tensors only.
    assert out16["model.norm.weight"].dtype == torch.bfloat16
    assert out16["model.layers.1.input_layernorm.weight"].dtype == torch.bfloat16
    assert torch.equal(out16["model.embed_tokens.weight"], sd["model.embed_tokens.weight"].bfloat16())
    assert out16["model.layers.1.some_index"].dtype == torch.int64
    assert torch.equal(out16["model.layers.1.some_index"], sd["model.layers.1.some_index"])


def test_load_errors(tmp_path, cfg) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_state_dict(tmp_path)
    cfg.save(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_state_dict(tmp_path)

    sd = _state(cfg)
    save_checkpoint(sd, cfg, tmp_path, max_shard_bytes=400)
    index_path = tmp_path / INDEX_FILE
    good_text = index_path.read_text()
    good = json.loads(good_text)
    index = json.loads(good_text)
    index["weight_map"]["model.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        load_state_dict(tmp_path)
    index_path.write_text(good_text)
    os.remove(tmp_path / good["weight_map"]["lm_head.weight"])
    with pytest.raises(CheckpointError, match="shard missing"):
        load_state_dict(tmp_path)

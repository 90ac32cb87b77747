"""Glm5NextCacheManager: allocation, slot tables, capacity errors, byte accounting."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import CapacityError, StateError

pytestmark = pytest.mark.cpu_only


@pytest.fixture
def cfg() -> Glm5NextConfig:
    return Glm5NextConfig.from_pretrained("tiny")


def make(cfg, **kw) -> Glm5NextCacheManager:
    args = dict(num_pages=8, tokens_per_block=8, max_num_requests=3)
    args.update(kw)
    return Glm5NextCacheManager(cfg, **args)


def test_planes_shapes(cfg) -> None:
    m = make(cfg, include_mtp_layer=True)
    assert m.num_sparse_layers == len(cfg.sparse_layer_ids) + 1
    c = m.kpool_layer_cache(0)
    assert c.latent.shape == (8, 8, cfg.kv_lora_rank)
    assert c.index_k.shape == (8, 2, 128) and c.index_k.dtype == torch.float8_e4m3fn
    assert c.index_scale.shape == (8, 2)
    assert c.tail_ring.shape == (3, 2, 4, 128)
    s = m.kda_layer_state(0)
    assert s.recurrent.shape == (3, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    assert s.conv.shape == (3, cfg.kda_num_heads * 3 * cfg.kda_head_dim, cfg.kda_short_conv_kernel_size - 1)
    # Views alias the pool (writes through a view land in the manager's plane).
    c.latent[2, 3].fill_(7.0)
    assert m.latent[0, 2, 3, 0] == 7.0


def test_allocation_grows_and_frees(cfg) -> None:
    m = make(cfg)
    m.add_request(10, num_tokens=9)
    m.add_request(11, num_tokens=1)
    t = m.get_batch_slot_tables([10, 11])
    assert len(t[0]) == 2 and len(t[1]) == 1
    assert not set(t[0]) & set(t[1])
    new = m.ensure_capacity(11, 17)
    assert len(new) == 2 and len(m.get_batch_slot_tables([11])[0]) == 3
    assert m.num_free_pages == 8 - 5
    m.free_request(10)
    assert m.num_free_pages == 8 - 3 and m.num_free_slots == 2
    with pytest.raises(StateError):
        m.get_batch_slot_tables([10])


def test_state_slot_zeroed_on_add(cfg) -> None:
    m = make(cfg)
    slot = m.add_request(1)
    m.tail_ring[:, slot].fill_(3.0)
    m.kda_recurrent[:, slot].fill_(3.0)
    m.free_request(1)
    slot2 = m.add_request(2)
    assert slot2 == slot
    assert m.tail_ring[:, slot].abs().sum() == 0 and m.kda_recurrent[:, slot].abs().sum() == 0


def test_capacity_errors_take_nothing(cfg) -> None:
    m = make(cfg, num_pages=3, max_num_requests=2)
    m.add_request(1, num_tokens=16)
    with pytest.raises(CapacityError, match="needs 2 more pages"):
        m.ensure_capacity(1, 32)
    assert m.num_free_pages == 1 and len(m.get_batch_slot_tables([1])[0]) == 2
    with pytest.raises(CapacityError, match="needs 2 pages"):
        m.add_request(2, num_tokens=9)
    assert not m.has_request(2) and m.num_free_slots == 1
    m.add_request(2)
    with pytest.raises(CapacityError, match="no free state slot"):
        m.add_request(3)
    with pytest.raises(StateError):
        m.add_request(2)


def test_bytes(cfg) -> None:
    m = make(cfg)
    Ls = len(cfg.sparse_layer_ids)
    per_layer_page = 8 * cfg.kv_lora_rank * 4 + 2 * 132
    assert m.bytes_per_page == per_layer_page * Ls
    assert m.bytes_per_token == pytest.approx(per_layer_page * Ls / 8)
    assert m.bytes_per_request(9) == 2 * m.bytes_per_page + m.state_bytes_per_request
    m.add_request(1, 9)
    assert m.used_bytes() == m.bytes_per_request(9)


def test_real_geometry_fp8_index_bytes_per_token() -> None:
    cfg = Glm5NextConfig.from_pretrained("glm-5.3-flash")
    m = Glm5NextCacheManager(
        cfg, num_pages=1, tokens_per_block=64, max_num_requests=1, num_kda_layers=0, dtype=torch.bfloat16
    )
    # 132 bytes per pool of 4 tokens = 33 bytes per token per layer for the index, plus the bf16 latent.
    assert m.bytes_per_token == pytest.approx((33 + 512 * 2) * 11)


def test_bad_geometry(cfg) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        make(cfg, tokens_per_block=6)

"""The indexer's FP32 ``k_norm`` copies (`GlmKpoolIndexer._k_norm_fp32`): the keys of the plain casts, no cast per
call in a 16-bit model, refreshed when the weights change (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_glm.attention.sparse.glm_kpool.indexer import GlmKpoolIndexer
from trtllm_glm.config import INDEX_HEAD_DIM, Glm5NextConfig

pytestmark = pytest.mark.cpu_only


class _Casts(TorchDispatchMode):
    """Counts dtype casts that copy (``aten.to`` returning a new tensor, or ``aten._to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.n += func.overloadpacket.__name__ in ("to", "_to_copy") and out is not args[0]
        return out


def _indexer(dtype: torch.dtype) -> GlmKpoolIndexer:
    ix = GlmKpoolIndexer(Glm5NextConfig.from_pretrained("tiny"))
    ix.reset_parameters(torch.Generator().manual_seed(0), 0.05)
    with torch.no_grad():
        ix.k_norm.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(1))
        ix.k_norm.bias.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(2))
    return ix.to(dtype)


def _plain_keys(ix: GlmKpoolIndexer, raw_k: torch.Tensor) -> torch.Tensor:
    w, b = ix.k_norm.weight.float(), ix.k_norm.bias.float()
    return F.layer_norm(raw_k.float(), (INDEX_HEAD_DIM,), w, b, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_equal_plain_casts_and_cast_once(dtype: torch.dtype) -> None:
    ix = _indexer(dtype)
    raw_k = torch.randn(5, INDEX_HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    gate = torch.randn(5, INDEX_HEAD_DIM).to(dtype)
    with torch.inference_mode():
        ix.keys(raw_k, (raw_k, gate))  # the first call may make the copies
        mode = _Casts()
        with mode:
            k, g = ix.keys(raw_k, (raw_k, gate))
    assert torch.equal(k, _plain_keys(ix, raw_k)) and torch.equal(g, gate.float())
    # Only the activations are cast (raw keys and gate, 16-bit); the weights' copies are reused.
    assert mode.n == (2 if dtype == torch.bfloat16 else 0)


def test_copies_follow_in_place_updates_and_new_storage() -> None:
    ix = _indexer(torch.bfloat16)
    raw_k = torch.randn(3, INDEX_HEAD_DIM).to(torch.bfloat16)
    with torch.inference_mode():
        ix.keys(raw_k, (raw_k, raw_k))
    kept = ix._k_norm_fp32()[0]
    with torch.no_grad():
        ix.k_norm.weight.mul_(2.0)  # a load into the same storage bumps the version
    with torch.inference_mode():
        assert torch.equal(ix.keys(raw_k, (raw_k, raw_k))[0], _plain_keys(ix, raw_k))
    assert ix._k_norm_fp32()[0] is kept  # refreshed in place: a captured graph reads the same address
    ix.k_norm.bias = torch.nn.Parameter(ix.k_norm.bias.detach() + 1.0)  # another storage
    with torch.inference_mode():
        assert torch.equal(ix.keys(raw_k, (raw_k, raw_k))[0], _plain_keys(ix, raw_k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_query_rotation_reads_a_16_bit_projection_exactly(dtype: torch.dtype) -> None:
    """The indexer hands `rotate_quant` its 16-bit query projection without an fp32 copy: the reference and the kernel
    (the CPU interpreter) give the bits of the fp32 copy's."""
    pytest.importorskip("triton")
    from trtllm_glm.attention.sparse.glm_kpool import kernels as K
    from trtllm_glm.attention.sparse.glm_kpool import ops as R

    x = (torch.randn(6, 2, INDEX_HEAD_DIM, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    want_q, want_s = R.rotate_quant(x.float())
    for got_q, got_s in (R.rotate_quant(x), K.rotate_quant(x)):
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
    assert torch.equal(x.to(torch.bfloat16), x.float().to(torch.bfloat16))  # the bf16-key branch's rounding

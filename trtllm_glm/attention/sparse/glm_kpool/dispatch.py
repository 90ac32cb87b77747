"""The k-pool backend's dispatch: chooses between the torch reference ops and the Triton kernels for the k-pool
cache writes, scoring, top-k selection, expansion and sparse MLA attention.

``TRTLLM_GLM_KPOOL_BACKEND`` = ``auto`` (default: Triton on CUDA when it imports, torch elsewhere),
``torch`` or ``triton`` (also on CPU tensors under ``TRITON_INTERPRET=1``). Both sides expose the same
function names and signatures, so layers call ``kpool_ops(device).update_decode_pools(...)``.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from trtllm_glm import envs

from . import ops as _torch_ops

__all__ = ["kpool_ops", "backend_name"]

_OP_NAMES = (
    "write_latent_rows",
    "update_decode_pools",
    "update_prefill_pools",
    "write_prefill_tail",
    "score_pools",
    "expand_selection",
    "rotate_quant",
    "select_topk_pools",
    "sparse_mla_attention",
)


def backend_name(device: torch.device) -> str:
    """The backend ``kpool_ops`` picks for tensors on ``device``."""
    want = envs.KPOOL_BACKEND.get()
    if want == "auto":
        return "triton" if device.type == "cuda" and _triton_kernels() is not None else "torch"
    if want == "triton" and _triton_kernels() is None:
        raise RuntimeError("TRTLLM_GLM_KPOOL_BACKEND=triton but the Triton kernels could not be imported")
    return want


@functools.cache
def _triton_kernels() -> ModuleType | None:
    try:
        from . import kernels
    except ImportError:
        return None
    if not all(hasattr(kernels, n) for n in _OP_NAMES):
        return None
    return kernels


def kpool_ops(device: torch.device) -> ModuleType:
    """The module (``ops`` or ``kernels``) implementing the k-pool ops for ``device``."""
    if backend_name(device) == "triton":
        mod = _triton_kernels()
        assert mod is not None
        return mod
    return _torch_ops

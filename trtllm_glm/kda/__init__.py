"""Kimi Delta Attention: ops (torch references + fla-core on CUDA) and the KDA layer.

See `layer.py` for the weight names and numerics, `ops/` for the references (recurrent, chunked, short
convolution, verify/commit records) and `ops/backend.py` for the CUDA dispatch.
"""

from __future__ import annotations

from .batch import KdaBatch, KdaBatchLike
from .layer import GatedRMSNorm, KdaLayerRecords, KimiDeltaAttention

__all__ = ["GatedRMSNorm", "KdaBatch", "KdaBatchLike", "KdaLayerRecords", "KimiDeltaAttention"]

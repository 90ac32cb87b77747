"""Kimi Delta Attention: ops (torch references + fla-core on CUDA) and the KDA layer.

See `layer.py` for the weight names and numerics, `ops/` for the references (recurrent, chunked, short
convolution, verify/commit records), `ops/backend.py` for the CUDA dispatch and `backend.py` (`KdaBackend`) for the
slot planes, layer-state view and dispatch the cache manager and the model ask for.
"""

from __future__ import annotations

from .backend import KdaBackend
from .batch import KdaBatch, KdaBatchLike
from .layer import GatedRMSNorm, KdaLayerRecords, KimiDeltaAttention

__all__ = ["GatedRMSNorm", "KdaBackend", "KdaBatch", "KdaBatchLike", "KdaLayerRecords", "KimiDeltaAttention"]

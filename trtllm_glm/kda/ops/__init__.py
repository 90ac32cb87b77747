"""KDA ops: torch references (any device) and the fla-core dispatch used on CUDA."""

from __future__ import annotations

from .backend import fla_kda_available, kda_decode, kda_decode_inplace, kda_prefill, resolve_backend
from .chunk import chunk_kda
from .conv import (
    causal_conv1d_ref,
    causal_conv1d_update,
    conv_commit,
    conv_commit_slots,
    conv_commit_slots_reference,
    conv_decode,
    conv_decode_reference,
    conv_prefill,
    conv_prefill_reference,
    conv_verify,
    conv_verify_qkv,
    conv_verify_qkv_reference,
)
from .decode_fused import fused_decode_enabled, kda_decode_fused, kda_decode_fused_reference
from .gate import kda_gate, kda_gate_beta, kda_gate_beta_reference, l2_normalize
from .recurrent import recurrent_kda, recurrent_kda_step
from .verify import KdaRecords, kda_commit, kda_verify

__all__ = [
    "KdaRecords",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "chunk_kda",
    "conv_commit",
    "conv_commit_slots",
    "conv_commit_slots_reference",
    "conv_decode",
    "conv_decode_reference",
    "conv_prefill",
    "conv_prefill_reference",
    "conv_verify",
    "conv_verify_qkv",
    "conv_verify_qkv_reference",
    "fla_kda_available",
    "fused_decode_enabled",
    "kda_commit",
    "kda_decode",
    "kda_decode_fused",
    "kda_decode_fused_reference",
    "kda_decode_inplace",
    "kda_gate",
    "kda_gate_beta",
    "kda_gate_beta_reference",
    "kda_prefill",
    "kda_verify",
    "l2_normalize",
    "recurrent_kda",
    "recurrent_kda_step",
    "resolve_backend",
]

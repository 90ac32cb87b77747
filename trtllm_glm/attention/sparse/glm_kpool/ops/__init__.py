"""Plain-torch reference ops of the pooled (C4) FP8 lightning indexer and sparse MLA.

Each Triton kernel in ``../kernels`` is tested against the function of the same role here.
"""

from trtllm_glm.state.tail_ring import DecodeTailRing

from .cache_update import (
    lookup_pages,
    update_decode_pools,
    update_prefill,
    update_prefill_pools,
    write_latent_rows,
    write_prefill_tail,
)
from .fp8 import AMAX_FLOOR, E4M3_MAX, dequant, dequant_latent, pow2_scale, quant_latent, rotate_quant, round_to_e4m3
from .fwht import fwht, hadamard_matrix
from .pooling import KPOOL, pool_keys
from .score import (
    expand_selection,
    expand_selection_window,
    indexer_head_weights,
    score_pools,
    select_tokens,
    select_topk_pools,
)
from .sparse_mla import sparse_mla_attention

__all__ = [
    "AMAX_FLOOR",
    "DecodeTailRing",
    "E4M3_MAX",
    "KPOOL",
    "dequant",
    "dequant_latent",
    "expand_selection",
    "expand_selection_window",
    "fwht",
    "hadamard_matrix",
    "indexer_head_weights",
    "lookup_pages",
    "pool_keys",
    "pow2_scale",
    "quant_latent",
    "rotate_quant",
    "round_to_e4m3",
    "score_pools",
    "select_tokens",
    "select_topk_pools",
    "sparse_mla_attention",
    "update_decode_pools",
    "update_prefill",
    "update_prefill_pools",
    "write_latent_rows",
    "write_prefill_tail",
]

"""Transient device memory of one prefill chunk, estimated from the config and the executor's sizes alone.

The executor adds this to the cache estimate it checks before allocating anything (`Executor._make_manager`), so
that a configuration whose long prompts cannot run (a 1M-token context's score matrix, a large chunk's MoE pair
buffer) is refused at start-up with the numbers, not by an out-of-memory error in the middle of a prompt. Upper
bounds rather than exact peaks (allocator rounding and fragmentation are not modelled). What each part counts:
docs/prefill.md, "Memory at long contexts".
"""

from __future__ import annotations

import torch

from ..config import Glm5NextConfig
from ..modules.ffn import FUSED_MAX_ROWS
from ..numerics import batch_invariant as _mode_on

__all__ = ["MAX_STEP_ROWS_CUDA", "check_step_rows", "prefill_workspace", "prefill_workspace_bytes"]

MAX_STEP_ROWS_CUDA = 65535
"""Rows one step may hold on CUDA: the top-k chunk kernel and the sparse-MLA kernels put the rows on a grid axis
other than the first, whose size CUDA caps at 65,535."""

_TOPK_MAX_CANDIDATES = 32768  # the top-k kernels' largest per-row candidate block (`kernels.topk._MAX_BLOCK`)
_KDA_CHUNK = 64


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def prefill_workspace(
    config: Glm5NextConfig,
    max_num_tokens: int,
    max_seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool | None = None,
) -> dict[str, int]:
    """Bytes of each part of a chunk's transient buffers (see the module docstring) and their ``total``.

    Args:
        config: the model's config (only its layer kinds and widths are read).
        max_num_tokens: rows of the largest step (the prefill chunk).
        max_seq_len: longest context a row of the chunk can attend to.
        dtype: the activations' dtype.
        batch_invariant: the numerics mode the chunk runs in (default: the process's, `trtllm_glm.numerics`).

    Returns:
        ``{"hidden", "kda", "sparse_mla", "ffn", "total"}`` in bytes; ``total`` is ``hidden`` plus the largest of
        the three layer parts (layers run one after the other).
    """
    n, s = max_num_tokens, max_seq_len
    el = torch.empty(0, dtype=dtype).element_size()
    h = config.hidden_size
    hidden = 2 * config.hc_mult * n * h * 4 + 2 * n * h * el
    kda = 0
    if config.kda_layer_ids:
        width = config.kda_num_heads * config.kda_head_dim
        rows = 6 * n * width * 4  # q, k, v, gate (fp32) plus w, u
        chunk_mat = n * config.kda_num_heads * _KDA_CHUNK * 4
        states = -(-n // _KDA_CHUNK) * config.kda_num_heads * config.kda_head_dim**2 * 4
        kda = rows + chunk_mat + states + 2 * n * width * el  # + projections' outputs in the model dtype
    mla = 0
    if config.sparse_layer_ids:
        cols = _pow2_ceil(s // 4)
        scores = n * cols * 4
        topk = n * min(cols, _TOPK_MAX_CANDIDATES) * 8 + n * 64 * 4
        q8 = n * config.index_n_heads * (config.index_head_dim + 4 + 4)
        heads, r = config.num_attention_heads, config.kv_lora_rank + config.qk_rope_head_dim
        attn = n * heads * (config.qk_nope_head_dim * el + r * el + r * 4 + config.v_head_dim * el)
        mla = scores + topk + q8 + attn
        if _mode_on() if batch_invariant is None else batch_invariant:
            # Imported here: the kernel module imports Triton, which nothing else of this module needs.
            from ..attention.sparse.glm_kpool.kernels import sparse_mla as sm

            width = config.index_select_width
            # The mode's split count depends on the width and the heads only (not the device, not the rows).
            splits = sm.choose_splits(n, heads, width, torch.device("cpu"), 64, 64, invariant=True)
            mla += sm.partial_bytes(n, heads, width, r, splits)
    rows = min(n, FUSED_MAX_ROWS)
    k, inter, experts = config.num_experts_per_tok, config.moe_intermediate_size, config.n_routed_experts
    pairs = rows * k
    slots = pairs + min(experts, pairs) * 63  # 64-row blocks at prefill sizes (`kernels.large_m_launch`)
    moe = pairs * h * 4 + slots * inter * el + n * h * 4 + 2 * n * config.moe_intermediate_size * el
    dense = 3 * n * config.intermediate_size * el
    ffn = max(moe, dense)
    return {"hidden": hidden, "kda": kda, "sparse_mla": mla, "ffn": ffn, "total": hidden + max(kda, mla, ffn)}


def prefill_workspace_bytes(
    config: Glm5NextConfig,
    max_num_tokens: int,
    max_seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool | None = None,
) -> int:
    """``prefill_workspace(...)["total"]``: the bytes the executor reserves for a chunk's transient buffers."""
    return prefill_workspace(config, max_num_tokens, max_seq_len, dtype, batch_invariant)["total"]


def check_step_rows(max_num_tokens: int, device: torch.device | str) -> None:
    """Refuse a step size the CUDA kernels cannot launch (`MAX_STEP_ROWS_CUDA`), before anything is allocated.

    Raises:
        ValueError: ``max_num_tokens`` is above the limit and ``device`` is a CUDA device.
    """
    if torch.device(device).type == "cuda" and max_num_tokens > MAX_STEP_ROWS_CUDA:
        raise ValueError(
            f"max_num_tokens={max_num_tokens} exceeds {MAX_STEP_ROWS_CUDA}, the most rows one step's top-k and "
            f"sparse-MLA kernels can launch on CUDA (use a smaller max_num_tokens or prefill_chunk_size)"
        )

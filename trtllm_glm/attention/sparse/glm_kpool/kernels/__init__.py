"""Triton kernels of the pooled (C4) FP8 lightning indexer and of sparse MLA, drop-in for the torch reference
ops in ``../ops`` (same names and signatures).

The kernels do no host synchronisation and no validation: tables, slots and positions must describe a valid batch
(rows of a sequence contiguous, positions consecutive); bad ids are masked, not read. CPU: an interpreted copy
(`trtllm_glm.triton_interp`). Contract and numerics: docs/kernels.md, "Indexer and sparse MLA kernels"; floors:
NOTES.md beside this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import KpoolLayerCache
from trtllm_glm.triton_interp import InterpretedModule, KernelPackage, interpreting

if TYPE_CHECKING:
    from trtllm_glm.state.tail_ring import DecodeTailRing

__all__ = [
    "fwht",
    "pool_keys",
    "rotate_quant",
    "round_to_e4m3",
    "pow2_scale",
    "write_latent_rows",
    "update_decode_pools",
    "update_prefill_pools",
    "write_prefill_tail",
    "update_prefill",
    "score_pools",
    "expand_selection",
    "select_topk_pools",
    "sparse_mla_attention",
    "kernel_module",
]

# CPU tensors run an interpreted copy of the same modules (trtllm_glm/triton_interp.py).
_PACKAGE = KernelPackage(__name__, __path__)
# Older names, kept for the modules and tests that use them.
_interpreting = interpreting
_InterpretedModule = InterpretedModule


def kernel_module(name: str, device: torch.device | str) -> Any:
    """The kernel module ``name`` (e.g. ``"score"``) built for ``device``, for tuning knobs and tests.

    CUDA devices get the normally imported module (compiled kernels, unless the process itself runs with
    ``TRITON_INTERPRET=1``). Other devices get the interpreted copy, whose callables run inside
    `trtllm_glm.triton_interp.interpreting`.
    """
    return _PACKAGE.module(name, device)


def _run(module: str, device: torch.device | str, fn: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` of kernel module ``module`` built for ``device`` (interpreted off CUDA)."""
    return getattr(kernel_module(module, device), fn)(*args, **kwargs)


def rotate_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of `ops.rotate_quant` (bit-identical).

    Args:
        x: ``[..., 128]`` float tensor.

    Returns:
        ``(q [..., 128] float8_e4m3fn, scale [...] fp32)``.
    """
    return _run("quant", x.device, "rotate_quant", x)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.fwht` for width 128 (bit-identical fp32, the reference's butterfly order).

    Args:
        x: ``[..., 128]`` float tensor.

    Returns:
        ``[..., 128]`` fp32 normalised Walsh-Hadamard transform.
    """
    return _run("quant", x.device, "fwht", x)


def pool_keys(key: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.pool_keys` (bit-identical fp32).

    Args:
        key: ``[..., 4, 128]`` member keys.
        gate: ``[..., 4, 128]`` member gate logits.
        ape: ``[4, 128]`` position bias.

    Returns:
        ``[..., 128]`` fp32 pooled keys.
    """
    return _run("pooling", key.device, "pool_keys", key, gate, ape)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.round_to_e4m3` (bit-identical; NaN inputs unsupported).

    Args:
        x: any-shape float tensor.

    Returns:
        fp32 tensor of ``x``'s shape on the e4m3fn grid.
    """
    return _run("quant", x.device, "round_to_e4m3", x)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Kernel version of `ops.pow2_scale` (bit-identical).

    Args:
        amax: any-shape non-negative float tensor.

    Returns:
        fp32 powers of two of ``amax``'s shape.
    """
    return _run("quant", amax.device, "pow2_scale", amax)


def write_latent_rows(
    latent_cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    *,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Kernel version of `ops.write_latent_rows`: ``latent[slot_table[b, pos // P], pos % P] = rows[n]``.

    Args:
        latent_cache: ``[num_pages, P, R]`` latent plane (fp32, bf16, fp16 or float8_e4m3fn; written in place).
        rows: ``[N, R]`` latent rows (any float dtype; rounded to the cache dtype, to nearest even; an FP8 plane
            gets `ops.quant_latent`'s codes, bit-identical).
        positions: ``[N]`` int token positions.
        row_seq: ``[N]`` int sequence index of each row (``< 0``: padding, skipped).
        slot_table: ``[B, max_pages]`` int raw page ids.
        page_size: tokens per page ``P``.
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales, written beside FP8 codes (required
            with an FP8 plane, refused without).
    """
    _run(
        "latent",
        latent_cache.device,
        "write_latent_rows",
        latent_cache,
        rows,
        positions,
        row_seq,
        slot_table,
        page_size,
        latent_scale=latent_scale,
    )


def update_decode_pools(
    cache: KpoolLayerCache,
    key: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    tail_ring: DecodeTailRing | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
) -> None:
    """Kernel version of `ops.update_decode_pools` (bit-identical pools, scales and rings).

    One program per sequence applies its rows in batch order: each row goes into
    ``tail_ring[slot, :, pos % 4]``; a row with ``pos % 4 == 3`` completes pool ``pos // 4`` from the ring.
    With ``tail_ring``, its sync-free `DecodeTailRing.prepare_step` (one Triton launch on CUDA) runs first.

    Args:
        cache: the layer's planes (``index_k``, ``index_scale``, ``tail_ring`` updated in place).
        key: ``[N, 128]`` fp32 keys.
        gate: ``[N, 128]`` fp32 gate logits.
        ape: ``[4, 128]`` pooling position bias.
        positions: ``[N]`` int token positions (consecutive within a sequence).
        row_seq: ``[N]`` int sequence index per row (rows of a sequence contiguous; ``< 0``: padding).
        slot_table: ``[B, max_pages]`` int raw page ids.
        state_slots: ``[B]`` int state slot per sequence.
        tail_ring: optional `DecodeTailRing` of this layer's ring (decode rows only).
        num_accepted_tokens: optional ``[B]`` int scheduler accepted counts (cross-check only).
    """
    if tail_ring is not None:
        tail_ring.prepare_step(cache.tail_ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens)
    _run(
        "decode_update",
        key.device,
        "update_decode_pools",
        cache,
        key,
        gate,
        ape,
        positions,
        row_seq,
        slot_table,
        state_slots,
    )


def update_prefill_pools(
    cache: KpoolLayerCache,
    key: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Kernel version of `ops.update_prefill_pools` (bit-identical pools and scales; the ring is only read).

    Args: as `update_decode_pools`.
    """
    _run(
        "prefill_pools",
        key.device,
        "update_prefill_pools",
        cache,
        key,
        gate,
        ape,
        positions,
        row_seq,
        slot_table,
        state_slots,
    )


def write_prefill_tail(
    tail_ring: torch.Tensor,
    key: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Kernel version of `ops.write_prefill_tail`: each sequence's last (up to) 4 rows into its ring.

    Args:
        tail_ring: ``[num_state_slots, 2, 4, 128]`` fp32 rings (written in place).
        key: ``[N, 128]`` fp32 keys.
        gate: ``[N, 128]`` fp32 gate logits.
        positions: ``[N]`` int token positions.
        row_seq: ``[N]`` int sequence index per row.
        state_slots: ``[B]`` int state slot per sequence.
    """
    _run("prefill_tail", key.device, "write_prefill_tail", tail_ring, key, gate, positions, row_seq, state_slots)


def update_prefill(
    cache: KpoolLayerCache,
    key: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Kernel version of `ops.update_prefill`: pools first (they read the ring), then the tail.

    Args: as `update_decode_pools`.
    """
    update_prefill_pools(cache, key, gate, ape, positions, row_seq, slot_table, state_slots)
    write_prefill_tail(cache.tail_ring, key, gate, positions, row_seq, state_slots)


def score_pools(
    q8: torch.Tensor,
    w: torch.Tensor,
    index_k: torch.Tensor,
    index_scale: torch.Tensor | None,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    max_pools: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of `ops.score_pools`: ``s[n, p] = sum_h w_h * relu(q8_h . k8_p) * kscale_p``.

    Args:
        q8: ``[N, H, 128]`` float8_e4m3fn rotated query heads (bf16 unrotated ones for BF16 keys).
        w: ``[N, H]`` fp32 head weights.
        index_k: ``[num_pages, P // 4, 128]`` float8_e4m3fn (or bfloat16) pooled keys.
        index_scale: ``[num_pages, P // 4]`` fp32 pool scales (``None`` for BF16 keys).
        positions: ``[N]`` int token positions.
        row_seq: ``[N]`` int sequence index per row.
        slot_table: ``[B, max_pages]`` int raw page ids.
        page_size: tokens per page ``P``.
        max_pools: score columns (pools at or beyond ``min((pos + 1) // 4, max_pools)`` get ``-inf``).
        out: optional ``[N, max_pools]`` fp32 buffer to write into (fixed address for graph capture).

    Returns:
        ``[N, max_pools]`` fp32 scores.
    """
    return _run(
        "score",
        q8.device,
        "score_pools",
        q8,
        w,
        index_k,
        index_scale,
        positions,
        row_seq,
        slot_table,
        page_size,
        max_pools,
        out=out,
    )


def expand_selection(
    pool_ids: torch.Tensor, positions: torch.Tensor, width: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Kernel version of `ops.expand_selection`: selected pools -> ascending token positions, tail, ``-1``.

    Args:
        pool_ids: ``[N, K]`` int pool ids in any order, ``-1`` = none (ids ``>= (pos + 1) // 4`` are
            ignored rather than raised on).
        positions: ``[N]`` int token positions.
        width: output columns (``index_topk + 3``); a longer selection is truncated (the reference raises).
        out: optional ``[N, width]`` int32 buffer to write into; every column is written.

    Returns:
        ``[N, width]`` int32 token positions.
    """
    return _run("expand", pool_ids.device, "expand_selection", pool_ids, positions, width, out=out)


def select_topk_pools(
    scores: torch.Tensor, positions: torch.Tensor, topk_pools: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Kernel version of `ops.select_topk_pools` (identical ids): top ``min(topk_pools, (pos + 1) // 4)`` pools.

    Ties go to the lower pool id and ids come out ascending, then ``-1``, exactly as the reference
    (``-0.0`` ties ``+0.0`` and NaN ranks first, as in ``torch.sort``). Rows longer than one chunk (4096
    pools) take two passes: one program per (row, chunk) keeps a candidate superset of the chunk's top-k,
    then one program per row selects exactly; shorter rows one program per row. See ``topk.py``.

    Args:
        scores: ``[N, max_pools]`` fp32 scores.
        positions: ``[N]`` int token positions.
        topk_pools: pools to keep per row.
        out: optional ``[N, topk_pools]`` int32 buffer to write into; every column is written.

    Returns:
        ``[N, topk_pools]`` int32 selected pool ids in ascending order, then ``-1`` padding.
    """
    return _run("topk", scores.device, "select_topk_pools", scores, positions, topk_pools, out=out)


def sparse_mla_attention(
    q_abs: torch.Tensor,
    latent_cache: torch.Tensor,
    sel: torch.Tensor,
    row_seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    latent_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel version of `ops.sparse_mla_attention`: absorbed queries over selected latent rows (MQA).

    Split-K over the selected entries plus a combine step (``sparse_mla.py``); fp32 online softmax. On CUDA
    with bf16/fp16 inputs the two products run on the tensor cores (probabilities rounded to the input
    dtype), so outputs agree with the fp32 reference to about one unit in the last place of the output
    dtype; with fp32 inputs (and on the CPU interpreter) everything is fp32. On sm_90 with bf16/fp16 and
    ``R = 512`` a Gluon kernel (explicit ``cp.async`` ring, copies a whole tile ahead) runs instead of the
    Triton one (``TRTLLM_GLM_SPARSE_MLA_IMPL=triton`` at import keeps the Triton kernel); ``NOTES.md``.

    Args:
        q_abs: ``[N, H, R]`` absorbed queries.
        latent_cache: ``[num_pages, P, R]`` latent plane.
        sel: ``[N, W]`` int token positions to attend to, ``-1`` = skip, any order.
        row_seq: ``[N]`` int sequence index of each row.
        slot_table: ``[B, max_pages]`` int raw page ids.
        page_size: tokens per page ``P``.
        softmax_scale: logit scale.
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales of an FP8 plane: its rows are decoded
            from the codes' bits and scaled right after loading, then multiplied as fp32 (interpreter, fp32
            queries) or in the queries' bf16/fp16 on the tensor cores (exact: a power-of-two multiple of an e4m3
            value fits their mantissa); the Gluon kernel is not used.
        out: optional ``[N, H, R]`` buffer of ``q_abs``'s dtype to write into.

    Returns:
        ``[N, H, R]`` latent outputs in ``q_abs``'s dtype (zeros for a row with nothing selected).
    """
    return _run(
        "sparse_mla",
        q_abs.device,
        "sparse_mla_attention",
        q_abs,
        latent_cache,
        sel,
        row_seq,
        slot_table,
        page_size,
        softmax_scale,
        latent_scale=latent_scale,
        out=out,
    )

"""Sparse MLA over selected latent rows of the paged cache (torch reference, absorbed-query form)."""

from __future__ import annotations

import torch

from .cache_update import check_latent_planes, lookup_pages
from .fp8 import dequant_latent

__all__ = ["sparse_mla_attention"]


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
) -> torch.Tensor:
    """Attention of absorbed queries over the selected latent rows (one shared latent KV head, MQA).

    For row ``n`` and head ``h``: ``s_j = (q_abs[n, h] . c_j) * softmax_scale`` over the selected tokens
    ``j`` (``sel[n, :] >= 0``), ``p = softmax(s)``, ``o_lat[n, h] = sum_j p_j c_j``, all in fp32; ``c_j``
    is the latent row of token ``j`` of the row's sequence, read from its page (an FP8 row dequantised with its
    block scales, `dequant_latent`). The order of ``sel``
    does not matter; a row with no selected token outputs zeros, and so does a padding row (``row_seq < 0``, as the
    kernel: a captured graph's padding rows then add nothing but zeros downstream).

    Args:
        q_abs: ``[N, H, R]`` absorbed queries.
        latent_cache: ``[num_pages, P, R]`` latent plane (model dtype, or float8_e4m3fn codes).
        sel: ``[N, W]`` int token positions to attend to, ``-1`` = skip.
        row_seq: ``[N]`` int64 sequence index of each row (``< 0``: padding, outputs zeros).
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids.
        page_size: tokens per page ``P``.
        softmax_scale: logit scale (``qk_nope_head_dim ** -0.5``).
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales of an FP8 plane (required with one,
            refused without).

    Returns:
        ``[N, H, R]`` latent outputs in ``q_abs``'s dtype.

    Raises:
        ValueError: a selected token's page is not in the slot table, or shapes disagree.
    """
    n_rows, _, rank = q_abs.shape
    if latent_cache.dim() != 3 or latent_cache.shape[1:] != (page_size, rank):
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} is not [num_pages, {page_size}, {rank}]")
    check_latent_planes(latent_cache, latent_scale, page_size)
    if sel.dim() != 2 or sel.shape[0] != n_rows or row_seq.shape != (n_rows,):
        raise ValueError(
            f"expected sel [N={n_rows}, W] and row_seq [N], got {tuple(sel.shape)}, {tuple(row_seq.shape)}"
        )
    tok = sel.to(torch.int64)
    valid = (tok >= 0) & (row_seq >= 0)[:, None]
    # (A padding row's entries are looked up as sequence 0's: in range, and masked out below.)
    seq = row_seq.to(torch.int64).clamp(min=0)[:, None].expand_as(tok)
    # Every entry is looked up (skipped ones at position 0, which every live sequence has): no
    # data-dependent shapes, so the op can be captured in a CUDA graph.
    pages = torch.where(valid, lookup_pages(tok.clamp(min=0), seq, slot_table, page_size, latent_cache.shape[0]), 0)
    row = tok.clamp(min=0) % page_size
    if latent_scale is None:
        c = latent_cache[pages, row].to(torch.float32)  # [N, W, R]
    else:
        c = dequant_latent(latent_cache[pages, row], latent_scale[pages, row])
    # Skipped entries gathered a placeholder row that may hold anything (even NaN); zero it so that it
    # cannot leak through 0 * NaN.
    c = c.masked_fill(~valid[:, :, None], 0.0)
    logits = torch.einsum("nhr,nwr->nhw", q_abs.to(torch.float32), c) * softmax_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    # A row with nothing selected would softmax to NaN; give it zero weights instead.
    probs = torch.softmax(logits, dim=-1).masked_fill(~valid.any(dim=1)[:, None, None], 0.0)
    o = torch.einsum("nhw,nwr->nhr", probs, c)
    return o.to(q_abs.dtype)

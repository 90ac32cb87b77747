"""Indexer scores over complete pools, top-k pool selection and expansion to token positions."""

from __future__ import annotations

import functools

import torch

from trtllm_glm.errors import TableWidthError

from .cache_update import host_checks_allowed, lookup_pages
from .pooling import KPOOL

__all__ = [
    "indexer_head_weights",
    "score_pools",
    "select_topk_pools",
    "expand_selection",
    "select_tokens",
]

_INDEX_DIM = 128
# Rows scored at once; bounds the gathered [rows, max_pools, 128] key block of this reference.
_ROW_BLOCK = 64


def _complete_pools(positions: torch.Tensor) -> torch.Tensor:
    """Complete pools visible to a row at ``pos``: ``(pos + 1) // 4``."""
    return (positions.to(torch.int64) + 1) // KPOOL


@functools.cache
def _head_scale(n_heads: int) -> float:
    """``(128 * n_heads) ** -0.5`` rounded to fp32, as a Python float. A Python scalar is applied in the tensor's fp32
    (same bits as an fp32 constant tensor) and needs no host-to-device copy, so the op can be captured; cached
    because making it (a CPU tensor and its read-back) cost more host time than the multiply's launch."""
    return float(torch.tensor((_INDEX_DIM * n_heads) ** -0.5, dtype=torch.float32))


def indexer_head_weights(weights_logits: torch.Tensor, qscale: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """Fold the query FP8 scale and ``(128 * n_heads) ** -0.5`` into the per-head weights.

    Computed in fp32 as ``(weights_logits * qscale) * c`` with ``c = float32((128 * n_heads) ** -0.5)``;
    BF16 queries have no scale (``qscale=None``): ``weights_logits * c``.

    Args:
        weights_logits: ``[N, H]`` head weight logits (``h @ weights_proj^T``, fp32).
        qscale: ``[N, H]`` fp32 power-of-two scales of the quantised query heads, or ``None``.
        n_heads: ``H``, the indexer head count.

    Returns:
        ``[N, H]`` fp32 head weights.
    """
    c = _head_scale(n_heads)
    w = weights_logits.to(torch.float32)
    if qscale is not None:
        w = w * qscale.to(torch.float32)
    return w * c


def check_score_operands(q: torch.Tensor, index_k: torch.Tensor, index_scale: torch.Tensor | None) -> None:
    """The two key formats of `score_pools`: e4m3 queries and keys with an fp32 scale plane, or bf16 queries
    and keys without one.

    Raises:
        ValueError: any other combination.
    """
    fp8 = torch.float8_e4m3fn
    if q.dtype == fp8 and index_k.dtype == fp8 and index_scale is not None:
        return
    if q.dtype == torch.bfloat16 and index_k.dtype == torch.bfloat16 and index_scale is None:
        return
    raise ValueError(
        "score_pools takes e4m3 queries and keys with an index_scale plane, or bf16 queries and keys without one; "
        f"got queries {q.dtype}, keys {index_k.dtype}, index_scale {'None' if index_scale is None else 'given'}"
    )


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
) -> torch.Tensor:
    """Score every complete pool of each row's sequence: ``sum_h w_h * relu(q8_h . k8_p) * kscale_p``.

    Numerics: each dot product of e4m3 values is exact in fp64 (every term is a multiple of ``2**-18``
    below ``2**18``, so all partial sums fit in 53 bits) and is rounded once to fp32; then
    ``t_h = w_h * relu(dot_h)`` in fp32, summed over heads in order ``h = 0 .. H-1`` in fp32, then
    multiplied by the power-of-two ``kscale`` (exact). The result does not depend on batch composition.

    BF16 keys (docs/indexer_keys.md): ``q8`` holds bf16 query heads, ``index_k`` bf16 pooled keys and
    ``index_scale`` is ``None`` (``kscale = 1``); each bf16 product is exact in fp64 and the dot is summed
    in fp64 (exact unless the terms span more than ~37 binades), then rounded once to fp32, as above.

    Args:
        q8: ``[N, H, 128]`` ``torch.float8_e4m3fn`` rotated query heads (bf16 unrotated ones for BF16 keys).
        w: ``[N, H]`` fp32 head weights (`indexer_head_weights`).
        index_k: ``[num_pages, P // 4, 128]`` FP8 (or BF16) pooled keys.
        index_scale: ``[num_pages, P // 4]`` fp32 pool scales (``None`` for BF16 keys).
        positions: ``[N]`` int64 token positions.
        row_seq: ``[N]`` int64 sequence index of each row.
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids.
        page_size: tokens per page ``P``.
        max_pools: score columns; must be at least every row's complete-pool count.

    Returns:
        ``[N, max_pools]`` fp32 scores, ``-inf`` for pools ``p >= (pos + 1) // 4``.

    Raises:
        ValueError: a row sees more than ``max_pools`` pools, a complete pool's page is not in the slot
            table, or the query / key / scale formats do not match.
    """
    check_score_operands(q8, index_k, index_scale)
    n_rows, n_heads, dim = q8.shape
    if dim != _INDEX_DIM or w.shape != (n_rows, n_heads):
        raise ValueError(f"expected q8 [N, H, {_INDEX_DIM}] and w [N, H], got {tuple(q8.shape)}, {tuple(w.shape)}")
    positions, row_seq = positions.to(torch.int64), row_seq.to(torch.int64)
    n_c = _complete_pools(positions)
    if n_rows and host_checks_allowed(q8) and int(n_c.max()) > max_pools:
        raise ValueError(f"a row sees {int(n_c.max())} complete pools but max_pools is {max_pools}")
    device = q8.device
    out = torch.full((n_rows, max_pools), float("-inf"), dtype=torch.float32, device=device)
    pool = torch.arange(max_pools, device=device)
    for r0 in range(0, n_rows, _ROW_BLOCK):
        rows = slice(r0, min(r0 + _ROW_BLOCK, n_rows))
        valid = pool[None, :] < n_c[rows, None]
        if not valid.any():
            continue
        shared = _one_sequence_keys(index_k, index_scale, row_seq[rows], n_c[rows], slot_table, page_size)
        if shared is not None:
            # A prefill chunk's rows: one key block for all of them (exact fp64 dots: the same bits).
            k1, kscale1 = shared
            width = k1.shape[0]
            dots = torch.einsum("nhd,md->nhm", q8[rows].to(torch.float64), k1).to(torch.float32)
            out[rows, :width] = torch.where(valid[:, :width], _head_sum(w[rows], dots) * kscale1, float("-inf"))
            continue
        seq = row_seq[rows, None].expand_as(valid)
        first_tok = (KPOOL * pool)[None, :].expand_as(valid)
        # Look up only complete pools: later ones may lie on pages the table does not have yet.
        pages = torch.zeros_like(valid, dtype=torch.int64)
        pages[valid] = lookup_pages(first_tok[valid], seq[valid], slot_table, page_size, index_k.shape[0])
        within = pool % (page_size // KPOOL)
        k = index_k[pages, within[None, :]].to(torch.float64)
        kscale = 1.0 if index_scale is None else index_scale[pages, within[None, :]].to(torch.float32)
        dots = torch.einsum("nhd,nmd->nhm", q8[rows].to(torch.float64), k).to(torch.float32)
        out[rows] = torch.where(valid, _head_sum(w[rows], dots) * kscale, out[rows])
    return out


def _head_sum(w: torch.Tensor, dots: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h * relu(dots_h)`` in fp32, heads added in order: ``w [n, H]``, ``dots [n, H, m]`` -> ``[n, m]``."""
    terms = w.to(torch.float32)[:, :, None] * torch.relu(dots)
    acc = terms[:, 0]
    for h in range(1, terms.shape[1]):
        acc = acc + terms[:, h]
    return acc


def _one_sequence_keys(
    index_k: torch.Tensor,
    index_scale: torch.Tensor | None,
    seqs: torch.Tensor,
    n_c: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor | float] | None:
    """The keys of a row block whose rows all belong to one sequence (a prefill chunk), gathered once
    (``[pools, 128]`` fp64) instead of once per row (``[rows, pools, 128]``: what made a long-context chunk's
    reference scoring slow on the CPU). ``None`` when the rows span several sequences, or where a host check
    is not allowed (a CUDA graph capture: the per-row path needs no sync).

    Args:
        seqs: ``[n]`` int64 sequence of each row; ``n_c``: ``[n]`` their complete-pool counts.
        index_k / index_scale / slot_table / page_size: as in `score_pools`.

    Returns:
        ``(k [width, 128] fp64, kscale [1, width] fp32 or 1.0)`` over the ``width`` pools of the block's longest row.
    """
    if not host_checks_allowed(index_k) or not bool((seqs == seqs[0]).all()):
        return None
    pool = torch.arange(int(n_c.max()), device=index_k.device)
    pages = lookup_pages(KPOOL * pool, seqs[:1].expand_as(pool), slot_table, page_size, index_k.shape[0])
    within = pool % (page_size // KPOOL)
    k = index_k[pages, within].to(torch.float64)
    kscale = 1.0 if index_scale is None else index_scale[pages, within][None, :].to(torch.float32)
    return k, kscale


def select_topk_pools(scores: torch.Tensor, positions: torch.Tensor, topk_pools: int) -> torch.Tensor:
    """Top ``min(topk_pools, (pos + 1) // 4)`` complete pools per row; ties go to the lower pool id.

    Pools beyond the row's complete-pool count are never chosen, whatever their score. Scores are
    expected finite.

    Args:
        scores: ``[N, max_pools]`` fp32 scores (`score_pools`).
        positions: ``[N]`` int64 token positions.
        topk_pools: pools to keep per row.

    Returns:
        ``[N, topk_pools]`` int32 selected pool ids in ascending order, then ``-1`` padding.

    Raises:
        ValueError: a row sees more complete pools than ``scores`` has columns.
    """
    n_rows, max_pools = scores.shape
    device = scores.device
    n_c = _complete_pools(positions)
    if n_rows and host_checks_allowed(scores) and int(n_c.max()) > max_pools:
        raise ValueError(f"a row sees {int(n_c.max())} complete pools but scores have {max_pools} columns")
    valid = torch.arange(max_pools, device=device)[None, :] < n_c[:, None]
    masked = torch.where(valid, scores.to(torch.float32), float("-inf"))
    # A stable descending sort keeps equal scores in id order; masked pools tie at -inf after the valid ones.
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    take = min(topk_pools, max_pools)
    rank = torch.arange(take, device=device)[None, :]
    chosen = torch.where(rank < n_c[:, None], order[:, :take], max_pools)
    chosen = torch.sort(chosen, dim=1).values
    out = torch.full((n_rows, topk_pools), -1, dtype=torch.int32, device=device)
    out[:, :take] = torch.where(chosen < max_pools, chosen, -1).to(torch.int32)
    return out


def expand_selection(
    pool_ids: torch.Tensor, positions: torch.Tensor, width: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Expand selected pools to token positions and append the open pool's tail.

    Per row: the tokens ``4p .. 4p+3`` of the selected pools in ascending order, then the open pool's
    tokens ``4 * n_c .. pos`` (``n_c = (pos + 1) // 4``), then ``-1`` up to ``width``.

    Args:
        pool_ids: ``[N, K]`` int pool ids, any order, ``-1`` = none.
        positions: ``[N]`` int64 token positions.
        width: output columns (``index_topk + 3`` for the model).
        out: optional ``[N, width]`` int32 buffer written whole (as the kernel's ``out``).

    Returns:
        ``[N, width]`` int32 token positions (``out`` when given).

    Raises:
        ValueError: a pool id is not a complete pool of its row (``>= n_c``) or is repeated.
        TableWidthError: a row's selection needs more than ``width`` columns.
    """
    n_rows, k = pool_ids.shape
    device = pool_ids.device
    ids = pool_ids.to(torch.int64)
    n_c = _complete_pools(positions)
    valid = ids >= 0
    if (valid & (ids >= n_c[:, None])).any():
        raise ValueError("a selected pool id is not a complete pool of its row (id >= (pos + 1) // 4)")
    big = torch.iinfo(torch.int64).max // 8
    srt = torch.sort(torch.where(valid, ids, big), dim=1).values
    if ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != big)).any():
        raise ValueError("a row selects the same pool twice")
    n_sel = valid.sum(dim=1)
    n_tail = positions.to(torch.int64) + 1 - KPOOL * n_c
    total = KPOOL * n_sel + n_tail
    if n_rows and int(total.max()) > width:
        raise TableWidthError(f"a row selects {int(total.max())} tokens but the selection width is {width}")
    cols = KPOOL * k + KPOOL  # pool tokens, up to 3 tail tokens, one discard column
    buf = torch.full((n_rows, cols), -1, dtype=torch.int64, device=device)
    member = torch.arange(KPOOL, device=device)
    tok = (KPOOL * srt[:, :, None] + member).reshape(n_rows, KPOOL * k)
    tok_valid = torch.arange(KPOOL * k, device=device)[None, :] < KPOOL * n_sel[:, None]
    buf[:, : KPOOL * k] = torch.where(tok_valid, tok, -1)
    j = torch.arange(KPOOL - 1, device=device)[None, :]
    tail_valid = j < n_tail[:, None]
    tail_col = torch.where(tail_valid, KPOOL * n_sel[:, None] + j, cols - 1)
    buf.scatter_(1, tail_col, torch.where(tail_valid, KPOOL * n_c[:, None] + j, -1))
    res = torch.full((n_rows, width), -1, dtype=torch.int32, device=device)
    keep = min(width, cols - 1)
    res[:, :keep] = buf[:, :keep].to(torch.int32)
    if out is None:
        return res
    if out.shape != (n_rows, width) or out.dtype != torch.int32:
        raise ValueError(f"out must be [N={n_rows}, width={width}] int32, got {tuple(out.shape)} {out.dtype}")
    return out.copy_(res)


def select_tokens(scores: torch.Tensor, positions: torch.Tensor, topk_pools: int, width: int) -> torch.Tensor:
    """`select_topk_pools` then `expand_selection`.

    Args:
        scores: ``[N, max_pools]`` fp32 scores.
        positions: ``[N]`` int64 token positions.
        topk_pools: pools to keep per row (``index_topk // 4``).
        width: selection width (``index_topk + 3``).

    Returns:
        ``[N, width]`` int32 token positions, ``-1`` padded.
    """
    return expand_selection(select_topk_pools(scores, positions, topk_pools), positions, width)


def expand_selection_window(
    pool_ids: torch.Tensor, window_start: torch.Tensor, positions: torch.Tensor, width: int
) -> torch.Tensor:
    """Selection of a chained MTP step that reuses step 0's pools (``index_share_for_mtp_iteration``).

    Per row: the tokens of the given pools in ascending order, then every token from ``window_start``
    to the row's position (the open pool of step 0 and everything written since), then ``-1``.

    Args:
        pool_ids: ``[N, K]`` int pool ids (step 0's top-k), ``-1`` = none; each must end before
            ``window_start``.
        window_start: ``[N]`` int64 first position of the window (a multiple of 4).
        positions: ``[N]`` int64 token positions (``>= window_start``).
        width: output columns.

    Returns:
        ``[N, width]`` int32 token positions.

    Raises:
        ValueError: a pool overlaps the window, or the window starts after the position.
        TableWidthError: a row needs more than ``width`` columns.
    """
    n_rows, k = pool_ids.shape
    device = pool_ids.device
    ids = pool_ids.to(torch.int64)
    ws = window_start.to(torch.int64)
    pos = positions.to(torch.int64)
    valid = ids >= 0
    if host_checks_allowed(ids):
        if (valid & (KPOOL * ids + KPOOL > ws[:, None])).any():
            raise ValueError("a reused pool overlaps the attention window")
        if (ws > pos).any():
            raise ValueError("the attention window starts after the row's position")
    n_win = pos - ws + 1
    if n_rows and host_checks_allowed(ids) and int((KPOOL * k + n_win).max()) > width:
        raise TableWidthError(f"a row selects {int((KPOOL * k + n_win).max())} tokens but the width is {width}")
    big = torch.iinfo(torch.int64).max // 8
    srt = torch.sort(torch.where(valid, ids, big), dim=1).values
    n_sel = valid.sum(dim=1)
    member = torch.arange(KPOOL, device=device)
    tok = (KPOOL * srt[:, :, None] + member).reshape(n_rows, KPOOL * k)
    col = torch.arange(width, device=device)[None, :]
    out = torch.full((n_rows, width), -1, dtype=torch.int64, device=device)
    n_pool_tok = KPOOL * n_sel[:, None]
    take = min(width, KPOOL * k)
    out[:, :take] = torch.where(col[:, :take] < n_pool_tok, tok[:, :take], -1)
    win = ws[:, None] + (col - n_pool_tok)
    in_win = (col >= n_pool_tok) & (col < n_pool_tok + n_win[:, None])
    out = torch.where(in_win, win, out)
    return out.to(torch.int32)

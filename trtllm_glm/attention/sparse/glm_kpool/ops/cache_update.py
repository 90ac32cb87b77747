"""Cache writes of the sparse layers (torch reference): latent rows, completed pools and tail rings.

Flat batch (docs/architecture.md, "Batch layout"); the rows of one sequence must be contiguous in the batch, with
consecutive positions. Rows with ``row_seq < 0`` (CUDA-graph padding) are skipped by the latent, decode and prefill
writes, as by the kernels (outside a capture: they are dropped before anything is validated). Every page a row needs is
looked up and validated before anything is written, so a bad table raises `ValueError` and leaves the cache
untouched. Decode and prefill produce bit-identical pools and rings for the
same rows: both complete a pool from the same ``[4, 128]`` member tensors with the same `pool_keys` and
`rotate_quant` (FP8 keys) or bf16 rounding (BF16 keys, docs/indexer_keys.md). docs/architecture.md, "Cache writes".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch

from trtllm_glm.attention.sparse.glm_kpool.cache_layout import KpoolLayerCache, check_latent_planes

from .fp8 import quant_latent, rotate_quant
from .pooling import KPOOL, pool_keys

if TYPE_CHECKING:
    from trtllm_glm.state.tail_ring import DecodeTailRing

__all__ = [
    "check_latent_planes",
    "lookup_pages",
    "write_latent_rows",
    "update_decode_pools",
    "update_prefill_pools",
    "write_prefill_tail",
    "update_prefill",
]


def host_checks_allowed(t: torch.Tensor) -> bool:
    """Whether validation that syncs with the host may run: not while a CUDA graph is being captured
    (a sync would invalidate the capture; captured replays rely on the eager run's checks)."""
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def drop_padding_rows(row_seq: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(row_seq, *rows)`` without the padding rows (``row_seq < 0``, which the kernels skip): their first dimension
    indexed by ``row_seq >= 0``. Unchanged when there is none, and under a capture (no sync; the clamped lookups
    apply there)."""
    if not host_checks_allowed(row_seq) or row_seq.numel() == 0:
        return (row_seq, *rows)
    keep = row_seq >= 0
    if bool(keep.all()):
        return (row_seq, *rows)
    return tuple(t[keep] for t in (row_seq, *rows))


def lookup_pages(
    positions: torch.Tensor,
    seq: torch.Tensor,
    slot_table: torch.Tensor,
    page_size: int,
    num_pages: int,
) -> torch.Tensor:
    """Raw page id holding each ``(sequence, token position)``, validated against the slot table.

    Args:
        positions: ``[...]`` int token positions.
        seq: ``[...]`` int sequence index of each position (same shape as ``positions``).
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids per sequence.
        page_size: tokens per page ``P``.
        num_pages: pages in the cache plane the ids will index.

    Returns:
        ``[...]`` int64 page ids.

    Raises:
        ValueError: a position is negative, a sequence index is outside the table, a position's logical
            page is beyond its table row, or the table holds a page id outside ``[0, num_pages)``.
    """
    positions = positions.to(torch.int64)
    seq = seq.to(torch.int64)
    if positions.shape != seq.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and sequence ids {tuple(seq.shape)} differ in shape")
    if positions.numel() == 0:
        return torch.empty_like(positions)
    num_seqs, width = slot_table.shape
    flat_pos, flat_seq = positions.reshape(-1), seq.reshape(-1)

    def fail(mask: torch.Tensor, what: str) -> NoReturn:
        i = int(mask.nonzero()[0, 0])
        raise ValueError(
            f"entry {i} (sequence {int(flat_seq[i])}, position {int(flat_pos[i])}, page size {page_size}): {what}"
        )

    if not host_checks_allowed(slot_table):
        # Under capture: no validation (it would sync); clamp so that nothing reads out of bounds.
        seq_c = flat_seq.clamp(0, num_seqs - 1)
        logical = (flat_pos.clamp(min=0) // page_size).clamp(max=width - 1)
        pages = slot_table.to(torch.int64)[seq_c, logical].clamp(0, num_pages - 1)
        return pages.reshape(positions.shape)
    if (flat_pos < 0).any():
        fail(flat_pos < 0, "negative position")
    bad_seq = (flat_seq < 0) | (flat_seq >= num_seqs)
    if bad_seq.any():
        fail(bad_seq, f"sequence index outside the slot table's {num_seqs} rows")
    logical = flat_pos // page_size
    if (logical >= width).any():
        fail(logical >= width, f"logical page beyond the slot table row ({width} entries)")
    pages = slot_table.to(torch.int64)[flat_seq, logical]
    bad_page = (pages < 0) | (pages >= num_pages)
    if bad_page.any():
        bad_id = int(pages[bad_page][0])
        fail(bad_page, f"slot table holds page id {bad_id}, outside [0, {num_pages})")
    return pages.reshape(positions.shape)


def _seq_bounds(positions: torch.Tensor, row_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last position of each row's sequence in this batch; checks the batch layout.

    Returns:
        ``(first_pos [N], last_pos [N])`` int64.
    """
    n = positions.numel()
    if row_seq.shape != positions.shape or positions.dim() != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and row_seq {tuple(row_seq.shape)} must be [N]")
    if n == 0:
        return positions.clone(), positions.clone()
    same = row_seq[1:] == row_seq[:-1]
    if (same & (positions[1:] != positions[:-1] + 1)).any():
        raise ValueError("rows of one sequence must have consecutive positions in batch order")
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=positions.device), ~same])
    if int(starts.sum()) != torch.unique(row_seq).numel():
        raise ValueError("rows of one sequence must be contiguous in the batch")
    run = torch.cumsum(starts.to(torch.int64), 0) - 1
    ends = torch.cat([~same, torch.ones(1, dtype=torch.bool, device=positions.device)])
    return positions[starts][run], positions[ends][run]


def _row_slots(state_slots: torch.Tensor, row_seq: torch.Tensor, num_slots: int) -> torch.Tensor:
    slots = state_slots.to(torch.int64)[row_seq]
    bad = (slots < 0) | (slots >= num_slots)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"row {i}: state slot {int(slots[i])} outside [0, {num_slots})")
    return slots


def _check_rows(key: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, row_seq: torch.Tensor) -> None:
    n = positions.shape[0]
    if key.dim() != 2 or key.shape[0] != n or gate.shape != key.shape or row_seq.shape != positions.shape:
        raise ValueError(
            f"expected key/gate [N, D] and positions/row_seq [N], got key {tuple(key.shape)}, gate "
            f"{tuple(gate.shape)}, positions {tuple(positions.shape)}, row_seq {tuple(row_seq.shape)}"
        )


def _write_pools(
    cache: KpoolLayerCache,
    member_key: torch.Tensor,
    member_gate: torch.Tensor,
    ape: torch.Tensor,
    pages: torch.Tensor,
    pool_in_page: torch.Tensor,
) -> None:
    """Pool ``[n, 4, 128]`` members and store them at ``index_k[pages, pool_in_page]``: rotated and
    quantised with their scale for FP8 keys, rounded to bfloat16 (no rotation, no scale) for BF16 keys."""
    pooled = pool_keys(member_key, member_gate, ape)
    if cache.index_k.dtype == torch.bfloat16:
        cache.index_k[pages, pool_in_page] = pooled.to(torch.bfloat16)
        return
    if cache.index_scale is None:
        raise ValueError(f"FP8 index keys need an index_scale plane (index_k is {cache.index_k.dtype})")
    q, scale = rotate_quant(pooled)
    cache.index_k[pages, pool_in_page] = q
    cache.index_scale[pages, pool_in_page] = scale


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
    """Store each row's latent vector at its token slot: ``latent[slot_table[b, pos // P], pos % P]``.

    Args:
        latent_cache: ``[num_pages, P, R]`` latent plane (written in place, in its own dtype; float8_e4m3fn: the
            rows' `quant_latent` codes).
        rows: ``[N, R]`` latent rows (the model dtype; quantised from their fp32 values for an FP8 plane).
        positions: ``[N]`` int64 token positions.
        row_seq: ``[N]`` int64 sequence index of each row (``< 0``: padding, skipped).
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids.
        page_size: tokens per page ``P``.
        latent_scale: ``[num_pages, P, ceil(R / 128)]`` fp32 block scales, written beside the codes; required
            with (and only with) an FP8 plane.

    Raises:
        ValueError: a position's page is not in the slot table, or shapes or formats disagree.
    """
    check_latent_planes(latent_cache, latent_scale, page_size)
    if rows.dim() != 2 or rows.shape[0] != positions.shape[0] or rows.shape[1] != latent_cache.shape[2]:
        raise ValueError(f"rows {tuple(rows.shape)} do not match [N={positions.shape[0]}, {latent_cache.shape[2]}]")
    row_seq, rows, positions = drop_padding_rows(row_seq, rows, positions)
    pages = lookup_pages(positions, row_seq, slot_table, page_size, latent_cache.shape[0])
    tok = positions.to(torch.int64) % page_size
    if latent_scale is None:
        latent_cache[pages, tok] = rows.to(latent_cache.dtype)
        return
    q, scale = quant_latent(rows)
    latent_cache[pages, tok] = q
    latent_scale[pages, tok] = scale


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
    """Decode/verify update: apply rows one by one to the tail ring, completing pools as they fill.

    Rows of a sequence (several for a verify) are applied in position order, so later rows see the ring entries
    of earlier ones (docs/architecture.md, "Cache writes"). With ``tail_ring`` (docs/design.md §6.2),
    `DecodeTailRing.prepare_step` first rolls the ring back to the previous step's accepted rows.

    Args:
        cache: the layer's cache planes (``index_k``, ``index_scale`` and ``tail_ring`` are updated).
        key: ``[N, 128]`` fp32 normalised indexer keys.
        gate: ``[N, 128]`` fp32 gate logits.
        ape: ``[4, 128]`` pooling position bias.
        positions: ``[N]`` int64 token positions.
        row_seq: ``[N]`` int64 sequence index of each row.
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids.
        state_slots: ``[B]`` int state slot of each sequence.
        tail_ring: optional `DecodeTailRing` of this layer's ring (decode rows only).
        num_accepted_tokens: optional ``[B]`` int, the scheduler's accepted count of each sequence's
            previous step, cross-checked by ``tail_ring`` against positions.

    Raises:
        ValueError: a row's page is not in the slot table, a state slot is out of range, or the batch
            layout is broken.
    """
    _check_rows(key, gate, positions, row_seq)
    positions, row_seq = positions.to(torch.int64), row_seq.to(torch.int64)
    row_seq, key, gate, positions = drop_padding_rows(row_seq, key, gate, positions)
    _seq_bounds(positions, row_seq)
    pages = lookup_pages(positions, row_seq, slot_table, cache.tokens_per_block, cache.index_k.shape[0])
    slots = _row_slots(state_slots, row_seq, cache.tail_ring.shape[0])
    if tail_ring is not None:
        # After validation, so that a bad batch still leaves the cache (and the backups) untouched.
        tail_ring.prepare_step(cache.tail_ring, key, gate, positions, row_seq, state_slots, num_accepted_tokens)
    ring = cache.tail_ring
    pools_per_page = cache.tokens_per_block // KPOOL
    for n in range(positions.shape[0]):
        pos, slot = int(positions[n]), int(slots[n])
        ring[slot, 0, pos % KPOOL] = key[n].to(torch.float32)
        ring[slot, 1, pos % KPOOL] = gate[n].to(torch.float32)
        if pos % KPOOL == KPOOL - 1:
            within = torch.tensor([(pos // KPOOL) % pools_per_page], device=pages.device)
            _write_pools(cache, ring[slot, 0][None].clone(), ring[slot, 1][None].clone(), ape, pages[n : n + 1], within)


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
    """Prefill update of the pools: complete every pool whose last member lies in the chunk (vectorised).

    A pool's members that precede the sequence's first row in this batch are read from the tail ring
    (written by earlier chunks or decode steps); the rest come from ``key``/``gate``. The ring itself is
    not modified; call `write_prefill_tail` afterwards (or use `update_prefill`).

    Args:
        cache: the layer's cache planes (``index_k`` and ``index_scale`` are updated).
        key: ``[N, 128]`` fp32 normalised indexer keys.
        gate: ``[N, 128]`` fp32 gate logits.
        ape: ``[4, 128]`` pooling position bias.
        positions: ``[N]`` int64 token positions.
        row_seq: ``[N]`` int64 sequence index of each row (``< 0``: padding, skipped).
        slot_table: ``[B, max_pages]`` int32/int64 raw page ids.
        state_slots: ``[B]`` int state slot of each sequence.

    Raises:
        ValueError: a row's page is not in the slot table, a state slot is out of range, or the batch
            layout is broken.
    """
    _check_rows(key, gate, positions, row_seq)
    positions, row_seq = positions.to(torch.int64), row_seq.to(torch.int64)
    row_seq, key, gate, positions = drop_padding_rows(row_seq, key, gate, positions)
    first_pos, _ = _seq_bounds(positions, row_seq)
    pages = lookup_pages(positions, row_seq, slot_table, cache.tokens_per_block, cache.index_k.shape[0])
    slots = _row_slots(state_slots, row_seq, cache.tail_ring.shape[0])
    done = (positions % KPOOL == KPOOL - 1).nonzero().squeeze(1)
    if done.numel() == 0:
        return
    member = torch.arange(KPOOL, device=positions.device)
    # Member m of the pool completed by row n sits at position pos - 3 + m and, if in this batch, at row
    # n - 3 + m (consecutive rows); its ring entry is m because (4p + m) % 4 == m.
    in_batch = (positions[done, None] - (KPOOL - 1) + member) >= first_pos[done, None]
    src = (done[:, None] - (KPOOL - 1) + member).clamp(min=0)
    ring = cache.tail_ring[slots[done]]
    member_key = torch.where(in_batch[..., None], key.to(torch.float32)[src], ring[:, 0])
    member_gate = torch.where(in_batch[..., None], gate.to(torch.float32)[src], ring[:, 1])
    within = (positions[done] // KPOOL) % (cache.tokens_per_block // KPOOL)
    _write_pools(cache, member_key, member_gate, ape, pages[done], within)


def write_prefill_tail(
    tail_ring: torch.Tensor,
    key: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    state_slots: torch.Tensor,
) -> None:
    """Store each sequence's last (up to 4) rows of the batch into its tail ring at ``pos % 4``.

    Only the rows that survive "last write wins" are written, so every ring entry is written at most
    once and the result is deterministic; older entries (positions before the batch) are kept.

    Args:
        tail_ring: ``[num_state_slots, 2, 4, 128]`` fp32 rings (written in place).
        key: ``[N, 128]`` fp32 keys.
        gate: ``[N, 128]`` fp32 gate logits.
        positions: ``[N]`` int64 token positions.
        row_seq: ``[N]`` int64 sequence index of each row (``< 0``: padding, skipped).
        state_slots: ``[B]`` int state slot of each sequence.
    """
    _check_rows(key, gate, positions, row_seq)
    positions, row_seq = positions.to(torch.int64), row_seq.to(torch.int64)
    row_seq, key, gate, positions = drop_padding_rows(row_seq, key, gate, positions)
    _, last_pos = _seq_bounds(positions, row_seq)
    slots = _row_slots(state_slots, row_seq, tail_ring.shape[0])
    keep = (positions > last_pos - KPOOL).nonzero().squeeze(1)
    tail_ring[slots[keep], 0, positions[keep] % KPOOL] = key[keep].to(torch.float32)
    tail_ring[slots[keep], 1, positions[keep] % KPOOL] = gate[keep].to(torch.float32)


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
    """`update_prefill_pools` then `write_prefill_tail` (pools must read the ring before the tail lands).

    Args: as `update_prefill_pools`.
    """
    update_prefill_pools(cache, key, gate, ape, positions, row_seq, slot_table, state_slots)
    write_prefill_tail(cache.tail_ring, key, gate, positions, row_seq, state_slots)

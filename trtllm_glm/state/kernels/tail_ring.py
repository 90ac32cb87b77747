"""Triton kernel of `DecodeTailRing.prepare_step`: the tail ring's rollback and backup in one launch.

Bit for bit `prepare_step_reference` (pure data movement), one program per sequence; only a slot's owner (the
sequence of its first row) touches it, so the launch is race-free in any program order. No allocation, no host
sync. The five phases and the barrier between restore and backup: docs/kernels.md, "Tail-ring rollback and backup".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["prepare_step"]

# Rows scanned per iteration of the geometry loop (fixed: the step's row count does not pick a block size).
_BLOCK_N = 128
_INT64_MAX = 2**63 - 1


@triton.jit
def _prepare_step_kernel(
    ring_ptr,
    key_ptr,
    gate_ptr,
    pos_ptr,
    row_seq_ptr,
    slots_ptr,
    nat_ptr,
    snap_ptr,
    rows_ptr,
    saved_pos_ptr,
    saved_count_ptr,
    counter_ptr,
    N,
    B,
    S,
    R,
    stride_ring_s,
    stride_ring_c,
    stride_ring_m,
    stride_snap_s,
    stride_snap_c,
    stride_snap_m,
    stride_rows_s,
    stride_rows_r,
    stride_rows_c,
    stride_key,
    stride_key_d,
    stride_gate,
    stride_gate_d,
    stride_pos,
    stride_row_seq,
    stride_slots,
    stride_nat,
    HAS_NAT: tl.constexpr,
    KP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INT64_MAX: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + b * stride_slots).to(tl.int64)

    # 1. Geometry of slot s from the rows (vector accumulators keep the loop-carried types fixed).
    width_v = tl.zeros([BLOCK_N], dtype=tl.int64)
    first_pos_v = tl.full([BLOCK_N], INT64_MAX, dtype=tl.int64)
    first_row_v = tl.full([BLOCK_N], N, dtype=tl.int64)
    for start in range(0, N, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        in_n = n < N
        rs = tl.load(row_seq_ptr + n * stride_row_seq, mask=in_n, other=-1).to(tl.int64)
        ok = in_n & (rs >= 0) & (rs < B)
        row_slot = tl.load(slots_ptr + rs * stride_slots, mask=ok, other=-1).to(tl.int64)
        # s itself may be out of range; a row only counts for an in-range slot, so such a program sees W = 0.
        ok = ok & (row_slot >= 0) & (row_slot < S) & (row_slot == s)
        pos = tl.load(pos_ptr + n * stride_pos, mask=ok, other=0).to(tl.int64)
        width_v += ok.to(tl.int64)
        first_pos_v = tl.minimum(first_pos_v, tl.where(ok, pos, INT64_MAX))
        first_row_v = tl.minimum(first_row_v, tl.where(ok, n, N))
    W = tl.sum(width_v, axis=0)
    p0 = tl.min(first_pos_v, axis=0)
    r0 = tl.min(first_row_v, axis=0)

    # 2. Ownership: the sequence of the slot's first row, and nobody else, reads and writes the slot.
    touched = W > 0
    first_seq = tl.load(row_seq_ptr + tl.minimum(r0, N - 1) * stride_row_seq, mask=touched, other=-1).to(tl.int64)
    owner = touched & (first_seq == b)

    # 3. Restore. Block element j of [2 * KP, D] is (kind c = j // KP, ring entry m = j % KP).
    count = tl.load(saved_count_ptr + s, mask=owner, other=0)
    saved_pos = tl.load(saved_pos_ptr + s, mask=owner, other=0)
    restore = owner & (count > 0)
    a_raw = p0 - saved_pos
    a = tl.minimum(tl.maximum(a_raw, 0), count)
    j = tl.arange(0, 2 * KP)
    c = (j // KP).to(tl.int64)
    m = (j % KP).to(tl.int64)
    d = tl.arange(0, D)
    # Entry m was last written by saved row a - 1 - ((saved_pos + a - 1 - m) mod KP); the double modulo is the
    # floor modulo of the reference whatever the sign.
    back = ((saved_pos + a - 1 - m) % KP + KP) % KP
    i_m = a - 1 - back
    replay = restore & (i_m >= 0)
    i_m = tl.minimum(tl.maximum(i_m, 0), R - 1)

    ring_off = s * stride_ring_s + c * stride_ring_c + m * stride_ring_m
    snap_off = s * stride_snap_s + c * stride_snap_c + m * stride_snap_m
    saved_off = s * stride_rows_s + i_m * stride_rows_r + c * stride_rows_c
    ring_v = tl.load(ring_ptr + ring_off[:, None] + d[None, :], mask=owner, other=0.0)
    snap_v = tl.load(snap_ptr + snap_off[:, None] + d[None, :], mask=restore, other=0.0)
    saved_v = tl.load(rows_ptr + saved_off[:, None] + d[None, :], mask=replay[:, None], other=0.0)
    restored = tl.where(replay[:, None], saved_v, tl.where(restore, snap_v, ring_v))
    tl.store(ring_ptr + ring_off[:, None] + d[None, :], restored, mask=restore)

    # The backup below overwrites saved rows that other threads of this program read just above.
    tl.debug_barrier()

    # 4. Backup of this step.
    backup = owner & (W > 1) & (W <= R)
    tl.store(snap_ptr + snap_off[:, None] + d[None, :], restored, mask=backup)
    i = tl.arange(0, BLOCK_R).to(tl.int64)
    take = backup & (i < W)
    src = tl.minimum(r0 + i, N - 1)
    k_off = src[:, None] * stride_key + d[None, :] * stride_key_d
    g_off = src[:, None] * stride_gate + d[None, :] * stride_gate_d
    k = tl.load(key_ptr + k_off, mask=take[:, None], other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + g_off, mask=take[:, None], other=0.0).to(tl.float32)
    dst = rows_ptr + s * stride_rows_s + i * stride_rows_r
    tl.store(dst[:, None] + d[None, :], k, mask=take[:, None])
    tl.store(dst[:, None] + stride_rows_c + d[None, :], g, mask=take[:, None])
    tl.store(saved_pos_ptr + s, p0, mask=backup)
    tl.store(saved_count_ptr + s, tl.where(backup, W, 0), mask=owner)

    # 5. Disagreements, counted once per owning sequence.
    odd = (restore & (a != a_raw)) | (W > R)
    if HAS_NAT:
        nat = tl.load(nat_ptr + b * stride_nat, mask=restore, other=0).to(tl.int64)
        odd = odd | (restore & (nat != a_raw))
    tl.atomic_add(counter_ptr, odd.to(tl.int64), mask=owner & odd)


def _unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"tail ring prepare_step: {name} needs a unit last stride, got strides {t.stride()}")


def prepare_step(
    ring: torch.Tensor,
    key: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    row_seq: torch.Tensor,
    state_slots: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    snapshot: torch.Tensor,
    saved_rows: torch.Tensor,
    saved_pos: torch.Tensor,
    saved_count: torch.Tensor,
    num_disagreements: torch.Tensor,
    *,
    num_warps: int = 4,
) -> None:
    """Triton `DecodeTailRing.prepare_step` on the instance's buffers (one launch, in place, no allocation).

    The caller validates the shapes (`DecodeTailRing.prepare_step` does); this only checks strides.

    Args:
        ring: ``[S, 2, 4, 128]`` fp32 tail ring, updated in place.
        key: ``[N, 128]`` this step's keys (any float dtype).
        gate: ``[N, 128]`` this step's gate logits (any float dtype).
        positions: ``[N]`` int32/int64 token positions.
        row_seq: ``[N]`` int32/int64 sequence index per row (``< 0``: padding).
        state_slots: ``[B]`` int32/int64 state slot per sequence.
        num_accepted_tokens: optional ``[B]`` int32/int64 scheduler counts (cross-check only).
        snapshot: ``[S, 2, 4, 128]`` fp32 backup ring.
        saved_rows: ``[S, R, 2, 128]`` fp32 saved ``(key, gate)`` rows.
        saved_pos: ``[S]`` int64 first position of the backed-up step.
        saved_count: ``[S]`` int64 saved row counts (0: nothing to restore).
        num_disagreements: ``[]`` int64 counter, incremented atomically.
        num_warps: warps per program (tuning only).
    """
    N, B = positions.shape[0], state_slots.shape[0]
    S, R = ring.shape[0], saved_rows.shape[1]
    KP, D = ring.shape[2], ring.shape[3]
    if N == 0 or B == 0:
        return
    for name, t in (("ring", ring), ("snapshot", snapshot), ("saved_rows", saved_rows)):
        _unit_last_stride(name, t)
    if saved_pos.dtype != torch.int64 or saved_count.dtype != torch.int64 or num_disagreements.dtype != torch.int64:
        raise ValueError("tail ring prepare_step: saved_pos, saved_count and the counter must be int64")
    nat = num_accepted_tokens if num_accepted_tokens is not None else state_slots  # a dummy when absent
    _prepare_step_kernel[(B,)](
        ring, key, gate, positions, row_seq, state_slots, nat,
        snapshot, saved_rows, saved_pos, saved_count, num_disagreements,
        N, B, S, R,
        ring.stride(0), ring.stride(1), ring.stride(2),
        snapshot.stride(0), snapshot.stride(1), snapshot.stride(2),
        saved_rows.stride(0), saved_rows.stride(1), saved_rows.stride(2),
        key.stride(0), key.stride(1), gate.stride(0), gate.stride(1),
        positions.stride(0), row_seq.stride(0), state_slots.stride(0), nat.stride(0),
        HAS_NAT=num_accepted_tokens is not None, KP=KP, D=D, BLOCK_N=_BLOCK_N, BLOCK_R=triton.next_power_of_2(R),
        INT64_MAX=_INT64_MAX, num_warps=num_warps,
    )  # fmt: skip

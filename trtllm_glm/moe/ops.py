"""Torch reference of the routed-experts computation and the device-side pair sorting the kernels use.

``out[n] = sum_j topk_w[n, j] * W2[e] @ clamped_swiglu(W1g[e] @ x[n], W1u[e] @ x[n])``, ``e = topk_ids[n, j]``, with
``w_gate_up[e] = cat(W1g[e], W1u[e])`` ``[2I, H]`` (gate rows, then up rows) and ``w_down[e] = W2[e]`` ``[H, I]``.
`fused_moe_ref` is the fp32 reference of `trtllm_glm.moe.kernels.fused_moe`; `moe_align` sorts pairs by expert on
fixed-size device buffers (graph-safe), `padded_pairs_bound` their length. Block-FP8 experts: stacked row ``r`` of
``gate_up`` takes scale row ``r // 128`` if ``r < I`` else ``ceil(I/128) + (r - I) // 128``, column ``c`` takes
``c // 128`` (`dequantize_experts`; shapes: docs/architecture.md, "Package map", ``moe/``). docs/kernels.md, "Fused
MoE".
"""

from __future__ import annotations

import math

import torch

from ..act.reference import clamped_swiglu

__all__ = [
    "FP8_BLOCK",
    "padded_pairs_bound",
    "moe_align",
    "fused_moe_ref",
    "check_fused_moe_args",
    "dequantize_experts",
    "expert_scale_shapes",
]

FP8_BLOCK = 128
"""Edge of a block-FP8 weight's scale tile (``weight_block_size`` of the GLM-5.3-Flash checkpoint)."""


def expert_scale_shapes(
    num_experts: int, hidden: int, inter: int, block: int = FP8_BLOCK
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(gate_up, down)`` shapes of the stacked FP8 scales: ``[E, 2 ceil(I/b), ceil(H/b)]``,
    ``[E, ceil(H/b), ceil(I/b)]`` for scale tiles of edge ``b = block``."""
    ti, th = math.ceil(inter / block), math.ceil(hidden / block)
    return (num_experts, 2 * ti, th), (num_experts, th, ti)


def _scale_row_index(rows: int, split: int | None, device: torch.device, block: int) -> torch.Tensor:
    """Scale row of each of ``rows`` weight rows; rows from ``split`` on start a new tile grid (the up half)."""
    r = torch.arange(rows, device=device)
    if split is None:
        return r // block
    return torch.where(r < split, r // block, math.ceil(split / block) + (r - split) // block)


def dequantize_experts(
    w: torch.Tensor, scale: torch.Tensor, split: int | None = None, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Block-FP8 expert weights in fp32: ``w.float() * scale`` expanded over each ``block x block`` tile.

    Args:
        w: ``[..., R, C]`` (``float8_e4m3fn``; any dtype is upcast).
        scale: ``[..., R', C']`` fp32 tile scales (the leading dims as ``w``'s).
        split: ``I`` for a stacked ``gate_up`` ``[..., 2I, H]`` (rows ``>= I`` are the up rows, whose tiles start
            a new scale row), ``None`` for a plain matrix (``down``, or one linear's weight).
        block: the scale tile's edge (``weight_block_size``; 128 in the GLM-5.3-Flash checkpoint).

    Returns:
        ``[..., R, C]`` fp32 on ``w``'s device.

    Raises:
        ValueError: ``scale`` is not the tile grid of ``w``.
    """
    rows, cols = w.shape[-2:]
    tiles = math.ceil(cols / block)
    grid = math.ceil(rows / block) if split is None else math.ceil(split / block) * 2
    if scale.shape != (*w.shape[:-2], grid, tiles):
        raise ValueError(
            f"scale must be {[*w.shape[:-2], grid, tiles]} for weight {list(w.shape)}, got {list(scale.shape)}"
        )
    s = scale.to(device=w.device, dtype=torch.float32)
    if rows % block == 0 and cols % block == 0 and (split is None or split % block == 0):
        # Whole tiles (the real geometry): broadcast each scale over its tile, no [R, C] scale tensor.
        lead = w.shape[:-2]
        tiles = w.float().reshape(*lead, rows // block, block, cols // block, block)
        return (tiles * s[..., :, None, :, None]).reshape(w.shape)
    rix = _scale_row_index(rows, split, w.device, block)
    cix = torch.arange(cols, device=w.device) // block
    return w.float() * s.index_select(-2, rix).index_select(-1, cix)


def padded_pairs_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots of `moe_align`'s sorted buffer: an upper bound on ``sum_e ceil(c_e / M) * M`` from shapes alone.

    Args:
        num_pairs: ``P = N * k`` (token, slot) pairs.
        num_experts: ``E``.
        block_m: row block ``M`` of the grouped GEMMs.

    Returns:
        A multiple of ``block_m``, at least every expert's padded run summed, whatever the routing.
    """
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    row_live: torch.Tensor | None = None,
    expert_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Pair ``p = n * k + j`` is token ``n``'s slot ``j``. Within an expert, pairs keep ascending ``p`` (a stable
    sort), so the layout is a deterministic function of ``topk_ids`` (and ``row_live``). Only device ops on
    buffers whose sizes follow from the shapes: no host synchronisation, capturable in a CUDA graph. Ids must
    lie in ``[0, num_experts)`` (not checked: that would need a sync).

    Args:
        topk_ids: ``[N, k]`` int expert ids.
        num_experts: ``E``.
        block_m: row block ``M``.
        row_live: optional ``[N]`` int or bool flags; the pairs of a row whose flag is 0 are left out (no slot,
            no expert run), so a step's padding rows make no expert's weights be read.
        expert_start: expert parallelism: this rank holds experts ``[expert_start, expert_start + E)``; pairs
            routed elsewhere are left out like dead rows' and the ids are taken relative to ``expert_start``.

    Returns:
        ``(sorted_pairs, block_expert)``: ``[L]`` int32 pair ids in expert order, ``P`` (= ``N * k``) in
        padding slots, with ``L = padded_pairs_bound(P, E, M)``; and ``[L // M]`` int32 expert of each row
        block, ``-1`` for blocks past the last expert's run (the kernels skip them).
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    length = padded_pairs_bound(p, num_experts, block_m)
    n_blocks = length // block_m
    # Another rank's experts (ids outside [expert_start, expert_start + E)): the same virtual expert E as a dead
    # row's pairs (no slot, no run). Also for expert_start 0: rank 0's block ends before the router's last expert.
    flat = flat - expert_start
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    if row_live is not None:
        if row_live.shape != (topk_ids.shape[0],):
            raise ValueError(f"row_live must be [N={topk_ids.shape[0]}], got {tuple(row_live.shape)}")
        # Dead pairs become a virtual expert E: sorted after every real run, counted nowhere, stored nowhere.
        live = (row_live != 0).repeat_interleave(topk_ids.shape[1])
        flat = torch.where(live, flat, num_experts)
    # scatter_add_ rather than bincount: CUDA bincount reads the maximum back to size its output (a sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    counts[num_experts:].zero_()  # the dead pairs' virtual expert has no run (an in-place op: graph-capturable)
    padded = (counts + (block_m - 1)) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(p, device=dev) - run_start[e_sorted]
    # A dead pair's slot is the spare one past the buffer (dropped below).
    dest = torch.where(e_sorted < num_experts, pad_start[e_sorted] + rank, length)
    sorted_pairs = torch.full((length + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:length]
    pad_end = pad_end[:num_experts]
    # Block b starts at slot b * M; its expert is the first one whose padded run ends after that slot
    # (runs of padded length zero are never found: their end equals their start).
    starts = torch.arange(n_blocks, device=dev, dtype=torch.int64) * block_m
    owner = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_pairs, block_expert


def check_fused_moe_args(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    row_live: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    fp8_block: int = FP8_BLOCK,
) -> tuple[int, int, int, int, int]:
    """Validate shapes and, for block-FP8 weights (scale tiles of edge ``fp8_block``), dtypes and scale shapes
    (host-side metadata only, no sync).

    FP8 weights (``float8_e4m3fn``) need both scales; scales need FP8 weights.

    Returns:
        ``(N, H, k, E, I)``.

    Raises:
        ValueError: naming the first inconsistent argument.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H], got {tuple(x.shape)}")
    n, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be [N={n}, k] int, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if topk_w.shape != topk_ids.shape:
        raise ValueError(f"topk_w must be [N={n}, k={k}], got {tuple(topk_w.shape)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H={h}], got {tuple(w_gate_up.shape)}")
    e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    if w_down.shape != (e, h, inter):
        raise ValueError(f"w_down must be [E={e}, H={h}, I={inter}], got {tuple(w_down.shape)}")
    if row_live is not None and (row_live.shape != (n,) or row_live.dtype.is_floating_point):
        raise ValueError(f"row_live must be [N={n}] int or bool, got {tuple(row_live.shape)} {row_live.dtype}")
    fp8 = torch.float8_e4m3fn
    quantized = w_gate_up_scale is not None or w_down_scale is not None
    if quantized or w_gate_up.dtype == fp8 or w_down.dtype == fp8:
        if w_gate_up.dtype != fp8 or w_down.dtype != fp8:
            raise ValueError(
                f"block-FP8 experts need float8_e4m3fn w_gate_up and w_down, got {w_gate_up.dtype} / {w_down.dtype}"
            )
        for name, scale, want in zip(
            ("w_gate_up_scale", "w_down_scale"),
            (w_gate_up_scale, w_down_scale),
            expert_scale_shapes(e, h, inter, fp8_block),
        ):
            if scale is None:
                raise ValueError(f"{name} is required with float8_e4m3fn expert weights")
            if scale.dtype != torch.float32 or tuple(scale.shape) != want:
                raise ValueError(f"{name} must be fp32 {list(want)}, got {tuple(scale.shape)} {scale.dtype}")
    return n, h, k, e, inter


def fused_moe_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float | None = None,
    row_live: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    expert_start: int | None = None,
    fp8_block: int = FP8_BLOCK,
) -> torch.Tensor:
    """Routed experts in fp32, one expert at a time (the reference of `kernels.fused_moe`).

    Inputs are upcast to fp32; each expert's tokens go through ``gate_up``, the clamped SwiGLU and ``down`` in
    fp32, and are weighted and accumulated into ``out`` in expert order. Syncs with the host (the loop runs
    over the experts present), so it is not graph-capturable.

    Args:
        x: ``[N, H]`` activations.
        topk_ids: ``[N, k]`` int expert ids in ``[0, E)``.
        topk_w: ``[N, k]`` combine weights.
        w_gate_up: ``[E, 2I, H]`` stacked ``gate_proj`` then ``up_proj`` weights.
        w_down: ``[E, H, I]`` stacked ``down_proj`` weights.
        swiglu_limit: the clamp ``L`` of `clamped_swiglu` (``None``: plain SwiGLU).
        row_live: optional ``[N]`` int or bool flags; rows flagged 0 get no expert (their output is 0).
        w_gate_up_scale: with ``float8_e4m3fn`` weights, ``[E, 2 ceil(I/128), ceil(H/128)]`` fp32 tile scales
            (gate tile rows, then up tile rows); each used expert's weights are dequantised per tile in fp32.
        w_down_scale: with FP8 weights, ``[E, ceil(H/128), ceil(I/128)]`` fp32.
        expert_start: expert parallelism: the weights are experts ``[expert_start, expert_start + E)`` and pairs
            routed to other experts contribute nothing (``None``: ids must lie in ``[0, E)``).
        fp8_block: the FP8 scale tile's edge (``weight_block_size``).

    Returns:
        ``[N, H]`` fp32.

    Raises:
        ValueError: bad shapes / dtypes, or an expert id out of range.
    """
    n, h, k, e, inter = check_fused_moe_args(
        x, topk_ids, topk_w, w_gate_up, w_down, row_live, w_gate_up_scale, w_down_scale, fp8_block
    )
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    if n == 0 or k == 0:
        return out
    flat = topk_ids.reshape(-1).to(torch.int64)
    if expert_start is not None:
        flat = flat - expert_start
        flat = torch.where((flat >= 0) & (flat < e), flat, -1)
    elif bool((flat < 0).any()) or bool((flat >= e).any()):
        raise ValueError(f"topk_ids must lie in [0, {e})")
    tok = torch.arange(n, device=x.device).repeat_interleave(k)
    wts = topk_w.reshape(-1).float()
    xf = x.float()
    if row_live is not None:
        flat = torch.where((row_live != 0)[tok], flat, -1)
    for ex in torch.unique(flat).tolist():
        if ex < 0:
            continue
        sel = (flat == ex).nonzero().squeeze(1)
        rows = tok[sel]
        if w_gate_up_scale is not None and w_down_scale is not None:
            w13 = dequantize_experts(w_gate_up[ex], w_gate_up_scale[ex], inter, fp8_block)
            w2 = dequantize_experts(w_down[ex], w_down_scale[ex], block=fp8_block)
        else:
            w13, w2 = w_gate_up[ex].float(), w_down[ex].float()
        gu = xf.index_select(0, rows) @ w13.T
        y = clamped_swiglu(gu[:, :inter], gu[:, inter:], swiglu_limit) @ w2.T
        out.index_add_(0, rows, y * wts[sel, None])
    return out

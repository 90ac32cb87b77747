"""Kimi Delta Attention (KDA) layer over per-request state slots.

Everything between the projections runs in FP32; the projections run in the parameters' dtype. The conv state's
channel order is ``q | k | v`` (``C = H*(2K+V)``). The weights (names, shapes, roles) and the per-token
computation: docs/model.md, "KDA layer weights"; the recurrence, verify and commit: docs/design.md §4; prefill:
docs/prefill.md, "KDA layer prefill".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import envs
from ..config import Glm5NextConfig
from ..modules.weight_views import FusedWeights, refuse_stale
from ..norm import norm_backend, row_norm
from ..state import KdaLayerState
from ..transfer import to_device
from .batch import KdaBatch, KdaBatchLike
from .ops import (
    KdaRecords,
    conv_commit_slots,
    conv_decode,
    conv_prefill,
    conv_verify_qkv,
    kda_commit,
    kda_decode_inplace,
    kda_gate_beta,
    kda_prefill,
    kda_verify,
)
from .ops.conv import verify_rows
from .ops.decode_fused import fused_decode_enabled, kda_decode_fused

if TYPE_CHECKING:
    from .static_layout import StaticKdaStep

__all__ = [
    "KimiDeltaAttention",
    "KdaLayerRecords",
    "GatedRMSNorm",
    "ShortConvWeight",
    "ragged_destinations",
    "short_prefill_rows",
    "decode_ride_rows",
]

# Prefill chunks of at most this many rows take the verify kernels' recurrence (verify every row from the slot,
# then commit them all: four launches a layer) instead of the chunked path (fla's chunk kernels: a dozen launches
# and their host work). An admission step is host-bound (issue 42: ~17-24 ms eager against ~6 ms of GPU work on
# the 4-layer slice), and a served prompt's chunk is often a few dozen tokens: on an H100 it cut admitting 1 / 16
# prompts of 30 tokens into 15 decoding requests from 16.5 / 27.9 to 14.0 / 21.3 ms
# (`benchmarks/results/serve/mixed_short_prefill_ab_real4_h100_2026-12-06.log`). ``0``: off (the chunked path for every
# prefill). The rows' recurrence is the verify pass's, so its rounding differs from the chunked path's; which path a
# chunk takes depends only on its own length, never on the batch.
SHORT_PREFILL_ENV = envs.KDA_SHORT_PREFILL.name
SHORT_PREFILL_CUDA = 64


def short_prefill_rows(device: torch.device) -> int:
    """The largest prefill chunk the verify recurrence takes on ``device`` (`SHORT_PREFILL_ENV`; unset:
    `SHORT_PREFILL_CUDA` on CUDA, where the chunked path's host work is the cost, else 0: off)."""
    v = envs.KDA_SHORT_PREFILL.get()
    if v is None:
        return SHORT_PREFILL_CUDA if device.type == "cuda" else 0
    return v


def decode_ride_rows() -> int:
    """The most padding rows decode rows may add to a step's short-prefill verify grid by riding it
    (``TRTLLM_GLM_KDA_DECODE_RIDE``; 0: they never ride).

    A riding decode row is one more sequence of the grid ``[n, Wm]``: ``Wm - 1`` padding rows that the conv and
    gather kernels fill and the verify kernel steps through (in parallel with the other sequences' programs, so
    a longer kernel only when the grid outgrows a wave), in exchange for the decode path's own launches and host
    work (`KimiDeltaAttention._decode`). The bound keeps that padding traffic small next to the host time saved.
    """
    return envs.KDA_DECODE_RIDE.get()


class ShortConvWeight(nn.Module):
    """Holds one depthwise conv's taps as ``weight [channels, 1, W]`` (the HF ``nn.Conv1d`` name and shape)."""

    def __init__(self, channels: int, kernel_size: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * sigmoid(gate)`` over the last dimension, FP32 math.

    Args:
        dim: normalised width (the head dim ``V``).
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x, gate [..., dim]`` -> ``[..., dim]`` in ``out_dtype`` (one fused kernel for CUDA inference:
        `trtllm_glm.norm`). The math is FP32 either way; another ``out_dtype`` is one rounding of that result,
        in the kernel's store rather than a separate cast."""
        if norm_backend(x, gate, self.weight) == "triton":
            return row_norm(x, self.eps, weight=self.weight, gate=gate, out_dtype=out_dtype)
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float() * torch.sigmoid(gate.float())).to(out_dtype)


@dataclass
class KdaLayerRecords:
    """What `KimiDeltaAttention.commit` needs from a verify pass (one layer).

    Verified sequences are padded to the widest one (``Wm`` rows); rows past a sequence's width are never
    committed.

    Attributes:
        seq_ids: batch indices of the verified sequences (those with ``q_len >= 1``).
        widths: rows verified per sequence.
        state_slots: their state slots (host).
        slots_t: ``[n]`` int64 the same slots on the device.
        fresh: ``[n]`` bool, sequences with ``past_len == 0`` (start from zero state, not the slot's); ``None``
            when none is (a uniform verify step).
        x: ``[N, C]`` the verify step's flat conv inputs (the projection's dtype; for the convolution shift).
        row0: ``[n]`` int64 first row of each sequence in ``x`` on the device; ``None`` for a uniform verify step
            (sequence ``j`` at rows ``j * Wm .. j * Wm + Wm - 1``).
        kda: per-row decay, key and correction (`KdaRecords`, ``[n, Wm, ...]``).
        num_seqs: ``num_seqs`` of the verify batch (``num_accepted`` is indexed by batch sequence).
    """

    seq_ids: list[int]
    widths: list[int]
    state_slots: list[int]
    slots_t: torch.Tensor
    fresh: torch.Tensor | None
    x: torch.Tensor
    row0: torch.Tensor | None
    kda: KdaRecords
    num_seqs: int

    @property
    def width_max(self) -> int:
        """``Wm``, the widest verified sequence."""
        return max(self.widths, default=0)

    @property
    def x_rows(self) -> torch.Tensor:
        """``[n, Wm, C]`` FP32 conv inputs of the verified rows, padding rows zero (gathered on each call; for
        tests and inspection, the commit reads ``x`` directly)."""
        widths = None if self.row0 is None else torch.tensor(self.widths, device=self.x.device)
        return verify_rows(self.x, len(self.seq_ids), self.width_max, self.row0, widths)

    @torch.no_grad()
    def commit(
        self, num_accepted: Sequence[int] | torch.Tensor, state: KdaLayerState, accepted_t: torch.Tensor | None = None
    ) -> None:
        """Fold the first ``a`` verified rows of each sequence into its slot and shift its conv window.

        ``state`` must be unchanged since the verify pass that made these records. ``a = 0`` leaves the
        slot as committed (zeroed for a fresh sequence). The state owner calls this from
        `RequestStateOwner.commit_verified`.

        Args:
            num_accepted: ``[num_seqs]`` accepted rows per batch sequence (root + accepted drafts), host list
                preferred; entries of sequences that were not verified are ignored.
            state: this layer's state planes, updated in place (only the verified sequences' slots).
            accepted_t: optional ``[n]`` int64 on the device, the counts of the verified sequences themselves
                (checked by the caller); replaces ``num_accepted`` (a short prefill commits every row).
        """
        records = self
        if not records.seq_ids:
            return
        if accepted_t is not None:
            a: Sequence[int] | torch.Tensor = accepted_t
        elif isinstance(num_accepted, torch.Tensor):
            a = num_accepted.reshape(-1)
            if a.numel() != records.num_seqs:
                raise ValueError(f"num_accepted has {a.numel()} entries for {records.num_seqs} sequences")
            if records.seq_ids != list(range(records.num_seqs)):
                # (A verify graph verifies every sequence: no index copy there, so the commit captures.)
                a = a[to_device(records.seq_ids, a.device, torch.int64)]
        else:
            if len(num_accepted) != records.num_seqs:
                raise ValueError(f"num_accepted has {len(num_accepted)} entries for {records.num_seqs} sequences")
            a = [int(num_accepted[b]) for b in records.seq_ids]
            bad = [(b, n, w) for b, n, w in zip(records.seq_ids, a, records.widths) if not 0 <= n <= w]
            if bad:
                raise ValueError(f"num_accepted out of range (seq, accepted, width): {bad}")
            if records.slots_t.device.type != "cpu":
                # Checked on the host above; on the device through pinned memory, without a stream sync
                # (the ops would otherwise build the tensor synchronously, twice per layer and round).
                a = to_device(a, records.slots_t.device, torch.int64)
        slots, fresh = records.slots_t, records.fresh
        # Slot-indexed: the Triton commits update the pools in place (no gather/scatter copies), one launch each
        # (`ops.conv.conv_commit_slots`, `ops.verify.kda_commit`).
        conv_commit_slots(state.conv, records.x, slots, a, records.width_max, row0=records.row0, fresh=fresh)
        kda_commit(state.recurrent, records.kda, a, state_slots=slots, fresh=fresh)


def _step_cached(batch: KdaBatchLike, key: tuple, build: Callable[[], Any]) -> Any:
    """``build()``, made once per step for every KDA layer of it: the row indices, slots and flags a mixed step's
    layers share depend only on the batch, so the first layer builds them (host lists and one copy to the device)
    and the others reuse them (the full model has 45 KDA layers). ``key`` holds every host value ``build`` reads;
    the cache (``AttentionMetadata.kda_scratch``) is emptied whenever the step is described anew. A batch without
    one (`KdaBatch`) builds every time."""
    scratch = getattr(batch, "kda_scratch", None)
    if scratch is None:
        return build()
    hit = scratch.get(key)
    if hit is None:
        hit = scratch[key] = build()
    return hit


def _step_host(batch: KdaBatchLike, key: tuple, build: Callable[[], Any]) -> Any:
    """``build()``, a host-only description derived from the batch's host lists, made once per step for every KDA
    layer of it (the full model's 45 layers otherwise re-derive the same lists and keys, tens of µs a layer for a
    few dozen sequences). Cached in the batch's per-step scratch like `_step_cached`, and taken only while the
    batch still holds the very lists it was built from (``AttentionMetadata.prepare`` assigns new ones and empties
    the scratch; a batch's lists are never changed in place while its scratch lives). ``key`` names what is built
    and the arguments ``build`` reads besides the batch. A batch without a scratch builds every time."""
    scratch = getattr(batch, "kda_scratch", None)
    if scratch is None:
        return build()
    lists = (batch.q_lens, batch.past_lens, batch.cu_seqlens, batch.state_slots)
    extra = (batch.num_seqs, getattr(batch, "num_padding_seqs", 0))
    hit = scratch.get(key)
    if hit is not None and hit[1] == extra and all(a is b for a, b in zip(hit[0], lists)):
        return hit[2]
    value = build()
    scratch[key] = (lists, extra, value)
    return value


@dataclass(frozen=True)
class _StepPlan:
    """How a step's sequences split between the KDA paths (host lists; the same for every KDA layer of a step).

    Decode rows ride the short prefills' verify grid (`decode_ride_rows`): a step with short prefills then runs one
    recurrent path instead of two (no decode conv / recurrence launches, index copy or host plan of its own).

    Attributes:
        seqs: sequences with rows (``q_len >= 1``), slots checked distinct.
        dec: width-one rows of sequences with a past that take the recurrent step (none when they ride).
        pre: chunks over the short-prefill limit (the chunked path).
        short: chunks up to it (the verify recurrence, `short_prefill_rows`), with the riding decode rows, in
            batch order.
        decode_only: every row of the step is one decode row, in order.
        tiled: the sequences' rows cover all ``N`` rows (no padding rows to zero).
        sink: padding rows of the short prefills' verify grid (`_ragged_padding`).
    """

    seqs: list[int]
    dec: list[int]
    pre: list[int]
    short: list[int]
    decode_only: bool
    tiled: bool
    sink: int

    @classmethod
    def build(cls, batch: KdaBatchLike, N: int, dev: torch.device) -> _StepPlan:
        """The plan of ``batch`` over ``N`` rows on ``dev`` (raises as `_check_slots` for repeated slots)."""
        q, p = batch.q_lens, batch.past_lens
        seqs = [b for b in range(batch.num_seqs) if q[b] > 0]
        _check_slots(batch, seqs)
        dec = [b for b in seqs if q[b] == 1 and p[b] > 0]
        pre = [b for b in seqs if not (q[b] == 1 and p[b] > 0)]
        short: list[int] = []
        limit = short_prefill_rows(dev) if pre else 0
        if limit:
            short = [b for b in pre if q[b] <= limit]
            pre = [b for b in pre if q[b] > limit]
        ride = decode_ride_rows() if short and dec else 0
        if ride and len(dec) * (max(q[b] for b in short) - 1) <= ride:
            # A decode row is a width-one verify + commit (the same step: bit for bit in the batch-invariant mode),
            # padded to the grid's widest row: bounded padding buys dropping the decode path's launches.
            short, dec = sorted(short + dec), []
        decode_only = (
            not pre and not short and len(dec) == N and all(batch.cu_seqlens[b] == j for j, b in enumerate(dec))
        )
        tiled = sum(q[b] for b in seqs) == N
        return cls(seqs, dec, pre, short, decode_only, tiled, _ragged_padding(batch, short))


def _check_slots(batch: KdaBatchLike, seqs: Sequence[int]) -> None:
    # CUDA-graph padding sequences (trailing, `AttentionMetadata.num_padding_seqs`) all share the executor's
    # reserved padding slot on purpose: whatever they write there is never read by a real request.
    n_real = batch.num_seqs - getattr(batch, "num_padding_seqs", 0)
    slots = [batch.state_slots[b] for b in seqs if b < n_real]
    if len(set(slots)) != len(slots):
        raise ValueError(f"state slots repeat within one KDA batch: {slots}")


def _ragged_padding(batch: KdaBatchLike, seqs: Sequence[int]) -> int:
    """Padding rows of the verify grid of ``seqs`` (each padded to the widest): ``n * Wm - sum(widths)``."""
    widths = [batch.q_lens[b] for b in seqs]
    return len(widths) * max(widths, default=0) - sum(widths)


def _decode_host(batch: KdaBatchLike, seqs: list[int]) -> tuple[list[int], bool, tuple]:
    """`KimiDeltaAttention._decode`'s host description of ``seqs``: their first rows, whether they are every sequence
    at rows ``0 .. n-1`` (slices, no index tensor) and the key of their index tensors (`_step_cached`)."""
    first = [batch.cu_seqlens[b] for b in seqs]
    every_seq = first == list(range(len(first))) and seqs == list(range(batch.num_seqs))
    return first, every_seq, ("decode", tuple(first), tuple(batch.state_slots[b] for b in seqs))


def _ragged_host(batch: KdaBatchLike, seqs: list[int], rows: int) -> tuple[list[int], list[int], list[int], int, tuple]:
    """`KimiDeltaAttention._ragged_verify`'s host description of ``seqs`` written into an output of ``rows`` rows:
    widths, first rows, fresh flags, the first sink row (``rows`` less the grid's padding rows) and the key of the
    index tensors (`_step_cached`)."""
    widths = [batch.q_lens[b] for b in seqs]
    firsts = [batch.cu_seqlens[b] for b in seqs]
    fresh_h = [int(batch.past_lens[b] == 0) for b in seqs]
    sink = rows - _ragged_padding(batch, seqs)  # the first sink row (N)
    key = ("ragged", tuple(seqs), tuple(widths), tuple(firsts), tuple(fresh_h),
           tuple(batch.state_slots[b] for b in seqs), sink)  # fmt: skip
    return widths, firsts, fresh_h, sink, key


def ragged_destinations(firsts: Sequence[int], widths: Sequence[int], sink: int) -> list[int]:
    """Where each row of a verify grid goes (sequence ``i``'s ``Wm`` rows, ``Wm = max(widths)``): real row ``j`` of
    sequence ``i`` to ``firsts[i] + j``; the ``k``-th padding row of the grid to ``sink + k``, a row of its own (no
    index repeats, so one ``index_copy_`` places every output and stays deterministic).

    Args:
        firsts: ``[n]`` first row of each sequence in the step.
        widths: ``[n]`` its rows (``>= 1``).
        sink: the first sink row (the step's row count ``N``).

    Returns:
        ``n * Wm`` destination rows.
    """
    Wm = max(widths, default=0)
    out: list[int] = []
    for f, w in zip(firsts, widths):
        out.extend(range(f, f + w))
        out.extend(range(sink, sink + Wm - w))
        sink += Wm - w
    return out


# Parameter groups `KimiDeltaAttention.fuse_weights` puts into one storage each (modules with ``.weight``).
_FUSED_IN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")
# Block-FP8 weights fuse along `out` in whole scale tiles except the last part: b_proj (H rows) goes last.
_FUSED_IN_B_LAST = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
_FUSED_IN_NO_B = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj")
_FUSED_CONV = ("q_conv1d", "k_conv1d", "v_conv1d")


def _low_rank_weight(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """``(weight, scale_inv or None, block)`` of a low-rank ``f_b`` / ``g_b`` projection as the fused decode kernel
    reads it (a float weight, or block FP8 with its scales), else ``None``."""
    w = linear.weight
    if w.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return w, None, 128
    scale = getattr(linear, "weight_scale_inv", None)
    if w.dtype == torch.float8_e4m3fn and scale is not None:
        return w, scale, int(getattr(linear, "block", 128))
    return None


def _act_dtype(linear: nn.Module, hidden: torch.Tensor) -> torch.dtype:
    """The dtype ``linear`` multiplies in: its weight's, or the activations' for a block-FP8 weight."""
    w = linear.weight
    return hidden.dtype if w.dtype == torch.float8_e4m3fn else w.dtype


class KimiDeltaAttention(nn.Module):
    """KDA token mixer of one layer (see the module docstring for the weights and numerics).

    Args:
        config: model geometry (``kda_*`` fields, ``hidden_size``, ``rms_norm_eps``).
        kda_idx: index of this layer among the KDA layers (``manager.kda_layer_state(kda_idx)``).
        device: parameter device.
        dtype: parameter dtype of the projections (``A_log``/``dt_bias`` are always FP32).

    Attributes:
        backend: ``None``/``"auto"``, ``"torch"`` or ``"fla"`` (see `ops.resolve_backend`).
        chunk_size: chunk of the torch prefill reference.
    """

    def __init__(
        self,
        config: Glm5NextConfig,
        kda_idx: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.kda_idx = kda_idx
        self.num_heads = H = config.kda_num_heads
        self.head_k_dim = K = config.kda_head_dim
        self.head_v_dim = V = config.kda_head_dim
        self.conv_size = W = config.kda_short_conv_kernel_size
        self.lower_bound = float(config.kda_gate_lower_bound)
        self.scale = K**-0.5
        self.backend: str | None = None
        self.chunk_size = 64
        D, R = config.hidden_size, config.kda_gate_low_rank
        fk = {"device": device, "dtype": dtype}

        self.q_proj = nn.Linear(D, H * K, bias=False, **fk)
        self.k_proj = nn.Linear(D, H * K, bias=False, **fk)
        self.v_proj = nn.Linear(D, H * V, bias=False, **fk)
        self.q_conv1d = ShortConvWeight(H * K, W, **fk)
        self.k_conv1d = ShortConvWeight(H * K, W, **fk)
        self.v_conv1d = ShortConvWeight(H * V, W, **fk)
        self.f_a_proj = nn.Linear(D, R, bias=False, **fk)
        self.f_b_proj = nn.Linear(R, H * K, bias=False, **fk)
        self.A_log = nn.Parameter(torch.empty(H, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H * K, device=device, dtype=torch.float32))
        self.b_proj = nn.Linear(D, H, bias=False, **fk)
        self.g_a_proj = nn.Linear(D, R, bias=False, **fk)
        self.g_b_proj = nn.Linear(R, H * V, bias=False, **fk)
        self.o_norm = GatedRMSNorm(V, config.rms_norm_eps, **fk)
        self.o_proj = nn.Linear(H * V, D, bias=False, **fk)
        # `fuse_weights`: one storage for the weights that read `hidden` (one GEMM) and one for the conv taps.
        self._in_fused: FusedWeights | None = None
        self._conv_fused: FusedWeights | None = None
        self.reset_parameters(torch.Generator().manual_seed(0), config.initializer_range)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv state, ``H * (2K + V)``."""
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Deterministic init from ``generator`` (a CPU generator; values are copied to the parameters).

        Linears ``N(0, std)``; conv taps ``N(0, 1/W)``; ``A_log = log(U(1, 16))``; ``dt_bias = N(0, 0.1)``;
        ``o_norm.weight = 1``. Parameters are filled in registration order, so a seed fixes the layer.
        """

        def fill(p: torch.Tensor, t: torch.Tensor) -> None:
            p.copy_(t.to(device=p.device, dtype=p.dtype))

        def randn(shape: torch.Size, s: float) -> torch.Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float32) * s

        for name, p in self.named_parameters():
            if name == "A_log":
                fill(p, torch.empty(p.shape).uniform_(1.0, 16.0, generator=generator).log())
            elif name == "dt_bias":
                fill(p, randn(p.shape, 0.1))
            elif name == "o_norm.weight":
                p.fill_(1.0)
            elif name.endswith("conv1d.weight"):
                fill(p, randn(p.shape, 1.0 / math.sqrt(self.conv_size)))
            else:
                fill(p, randn(p.shape, std))

    # ----------------------------------------------------------------------------------------------
    # Weight layout
    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Give the weights that multiply ``hidden`` (``q/k/v_proj``, ``f_a_proj``, ``b_proj``, ``g_a_proj``)
        one storage, and the three conv tap tensors another, the parameters becoming views into them.

        A decode step then runs one GEMM instead of six (and no concatenation) and reads the taps without a
        copy: at batch 1 each launch of a small GEMM costs about as much as the bytes it reads. Names,
        shapes and ``state_dict`` are unchanged, and in-place loads write through the views. A parameter
        replaced later (``load_state_dict(assign=True)``, ``p.data = ...``) is noticed and that group falls
        back to separate GEMMs; ``module.to(...)`` and other ``_apply`` casts re-fuse. Numerics: the same
        products, possibly in another GEMM kernel (last-bit differences in low precision).
        """
        # Idempotent (`FusedWeights.ensure`): a group still fused keeps its storage.
        # Block-FP8 weights fuse along `out` in whole scale tiles but for the last part: b_proj (H rows) last,
        # or apart.
        groups = (_FUSED_IN, _FUSED_IN_B_LAST, _FUSED_IN_NO_B)
        self._in_fused = FusedWeights.ensure_first(
            self._in_fused, [([getattr(self, n) for n in group], None) for group in groups]
        )
        self._conv_fused = FusedWeights.ensure(self._conv_fused, [getattr(self, n) for n in _FUSED_CONV])

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        refuse_stale(self, ("_in_fused", "_conv_fused"))
        return out

    # ----------------------------------------------------------------------------------------------
    # Pieces shared by every path
    def _conv_weight(self) -> torch.Tensor:
        """``[C, W]`` taps in conv-state channel order (q, k, v), in the weights' dtype: every conv kernel and
        reference upcasts them to FP32 itself (a cast here would be one more launch per layer and step)."""
        f = self._conv_fused
        if f is not None and f.usable():
            w = f.weight
        else:
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        return w.squeeze(1)

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``hidden [N, D]`` -> conv inputs ``x [N, C]`` (FP32, or the projection's dtype with fused weights),
        log decay ``g [N, H, K]``, ``beta [N, H]`` (FP32) and, with fused weights, the output gate's low-rank
        input ``g_a_proj(hidden)`` (else ``None``)."""
        x, fa, b, ga = self._in_proj(hidden)
        # One launch on CUDA (`ops.gate.kda_gate_beta`), ten small ones in torch.
        g, beta = kda_gate_beta(self.f_b_proj(fa), b, self.A_log, self.dt_bias, self.lower_bound)
        return x, g, beta, ga

    def _in_proj(
        self, hidden: torch.Tensor, *, with_ga: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The projections of `_inputs`: ``hidden [N, D]`` -> ``(x [N, C], fa [N, R], b [N, H], ga [N, R] | None)``
        (``ga`` is computed by the fused GEMM, or here with ``with_ga``; ``x`` is FP32 without fused weights)."""
        f = self._in_fused
        if f is not None and f.usable():
            # Columns q | k | v (the conv channels, already in order), f_a, b, g_a.
            # x stays in the GEMM's dtype: the decode kernel upcasts as it loads, the other paths where they
            # gather their rows (exact either way; one cast launch less per decode step).
            y = f.linear(hidden)
            if f.modules[4] is self.b_proj:  # _FUSED_IN
                x, fa, b, ga = y.split([sum(f.sizes[:3]), *f.sizes[3:]], dim=-1)
            elif len(f.sizes) == len(_FUSED_IN_B_LAST):
                x, fa, ga, b = y.split([sum(f.sizes[:3]), *f.sizes[3:]], dim=-1)
            else:  # _FUSED_IN_NO_B
                x, fa, ga = y.split([sum(f.sizes[:3]), *f.sizes[3:]], dim=-1)
                b = self.b_proj(hidden)
            return x, fa, b, ga
        x = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1).float()
        return x, self.f_a_proj(hidden), self.b_proj(hidden), self.g_a_proj(hidden) if with_ga else None

    def _output(self, hidden: torch.Tensor, o: torch.Tensor, ga: torch.Tensor | None = None) -> torch.Tensor:
        """``o [N, H, V]`` FP32 -> gated RMSNorm -> ``o_proj`` -> ``[N, D]`` in ``hidden``'s dtype (``ga``:
        ``g_a_proj(hidden)`` when the fused input GEMM computed it already)."""
        N = hidden.shape[0]
        if ga is None:
            ga = self.g_a_proj(hidden)
        gate = self.g_b_proj(ga).view(N, self.num_heads, self.head_v_dim)
        y = self.o_norm(o, gate, _act_dtype(self.o_proj, hidden)).reshape(N, -1)
        return self.o_proj(y).to(hidden.dtype)

    # The forward in its three parts, for the piecewise CUDA graphs (`trtllm_glm.runtime.piecewise`): `project` and
    # `project_out` are token-wise (graph-safe on padded rows), `mix` reads the batch layout and the state.
    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Token-wise input side: ``hidden [N, D]`` -> ``(x [N, C], g [N, H, K], beta [N, H], ga [N, R] | None)``
        (see `_inputs`)."""
        return self._inputs(hidden)

    def mix(self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState, inputs: tuple) -> torch.Tensor:
        """The sequence-dependent core of `forward` on `project`'s ``inputs``: ``o [N, H, V]`` FP32 (slots updated
        in place; ``hidden`` gives only the row count and device)."""
        return self._forward_o(hidden, batch, state, inputs)

    @torch.no_grad()
    def mix_static(self, inputs: tuple, step: StaticKdaStep, state: KdaLayerState) -> torch.Tensor:
        """`mix` of a decode / short-prefill step described on the device (`trtllm_glm.kda.static_step`), graph-safe:
        no host list, no host sync, every shape from ``step.caps`` (the bucket). The same kernels on the same rows
        as `_forward_o` for that step's plan, so the real rows' outputs and the slots are its bits.

        Args:
            inputs: `project`'s ``(x [T, C], g [T, H, K], beta [T, H], ga)`` on the bucket's ``T`` rows.
            step: the bucket's step description (refreshed for this step).
            state: this layer's state planes, updated in place at the real entries' slots (and the padding slot).

        Returns:
            ``o [T, H, V]`` FP32: the real rows' mixer outputs; rows no entry names are zero.
        """
        x, g, beta, _ = inputs
        c = step.caps
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        weight = self._conv_weight()
        # Sink rows past T take the padding entries' outputs (distinct rows: deterministic index copies) and are
        # never read: only the T rows are zeroed (the bucket's padding rows, which no entry names, read 0), not the
        # sinks (up to twice T more rows of H x V fp32 a layer and step, inside the graph).
        o = torch.empty(c.out_rows, H, V, dtype=torch.float32, device=x.device)
        o[: c.rows].zero_()
        if c.dec:
            # `_decode` on Dc entries: a padding entry steps the padding slot from row 0 into its sink row.
            rows, slots = step.dec_rows, step.dec_slots
            q, k, v = conv_decode(x.index_select(0, rows), state.conv, weight, slots, H, K, V)
            od = kda_decode_inplace(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), self.scale,
                                    state.recurrent, slots, backend=self.backend)  # fmt: skip
            o.index_copy_(0, step.dec_dst, od)
        if c.seqs:
            # `_short_prefill` on an Ns x Wc grid: a padding sequence has width 0 (nothing verified, stored or
            # committed), a real one its own rows (the kernels skip the rest, as in the eager grid's padding).
            n, Wm, widths, fresh, slots = c.seqs, c.width, step.widths, step.fresh, step.slots
            gr = g.index_select(0, step.grid).view(n, Wm, *g.shape[1:])
            br = beta.index_select(0, step.grid).view(n, Wm, *beta.shape[1:])
            q, k, v = conv_verify_qkv(x, state.conv, weight, slots, H, K, V, Wm, row0=step.row0, widths=widths,
                                      fresh=fresh, zero_padding=False)  # fmt: skip
            ov, rec = kda_verify(q, k, v, gr, br, self.scale, state.recurrent, state_slots=slots, fresh=fresh,
                                 widths=widths)  # fmt: skip
            o.index_copy_(0, step.dst, ov.reshape(n * Wm, H, V))
            # Every row committed: the counts are the widths (`KdaLayerRecords.commit` with ``accepted_t``).
            conv_commit_slots(state.conv, x, slots, widths, Wm, row0=step.row0, fresh=fresh)
            kda_commit(state.recurrent, rec, widths, state_slots=slots, fresh=fresh)
        return o[: c.rows]

    def project_out(self, hidden: torch.Tensor, o: torch.Tensor, ga: torch.Tensor | None) -> torch.Tensor:
        """Token-wise output side: ``o [N, H, V]`` -> ``[N, D]`` in ``hidden``'s dtype (see `_output`)."""
        return self._output(hidden, o, ga)

    @staticmethod
    def _slots(batch: KdaBatchLike, seqs: list[int], device: torch.device) -> torch.Tensor:
        if seqs == list(range(batch.num_seqs)):
            return batch.state_slots_t.to(device=device, dtype=torch.int64)
        return to_device([batch.state_slots[b] for b in seqs], device, torch.int64)

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState) -> torch.Tensor:
        """One step: decode rows update their slots in place, prefill chunks run the chunked path.

        Sequences with ``q_len == 1`` and ``past_len > 0`` take the recurrent step (also the width-one
        speculative round); the rest (``q_len >= 1``) the chunked path, from zero state when
        ``past_len == 0`` (the slot's old contents are never read then). Only the batch's slots are read or
        written. Rows not covered by ``cu_seqlens`` (padding) produce ``o_proj`` of zeros.

        Args:
            hidden: ``[N, D]`` flat token batch.
            batch: layout (`KdaBatchLike`).
            state: this layer's state planes (``recurrent [S, H, K, V]``, ``conv [S, C, W-1]``), updated in place.

        Returns:
            ``[N, D]``.
        """
        # (A layer whose backend is forced to the torch reference keeps the reference recurrence.)
        if fused_decode_enabled(hidden) and (self.backend or "auto").lower() != "torch":
            out = self._fused_decode(hidden, batch, state)
            if out is not None:
                return out
        inputs = self._inputs(hidden)
        return self._output(hidden, self._forward_o(hidden, batch, state, inputs), inputs[3])

    def _fused_decode(self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState) -> torch.Tensor | None:
        """`forward` of a pure decode step (every row one decode row, in order) as the input GEMM, one kernel
        (`ops.decode_fused.kda_decode_fused`: conv, gates, recurrence, output gate and norm) and ``o_proj``;
        ``None`` for any other step, or low-rank weights the kernel does not read (then the unfused path runs).
        Same slots, no host sync and no index tensor from a host list (graph-capturable)."""
        N, dev = hidden.shape[0], hidden.device
        plan = _step_host(batch, ("plan", N, dev), lambda: _StepPlan.build(batch, N, dev))
        if not plan.decode_only or N == 0:
            return None
        low_rank = [_low_rank_weight(self.f_b_proj), _low_rank_weight(self.g_b_proj)]
        if low_rank[0] is None or low_rank[1] is None:
            return None
        (f_b, f_s, f_blk), (g_b, g_s, g_blk) = low_rank  # type: ignore[misc]
        if f_s is not None and g_s is not None and f_blk != g_blk:
            return None
        seqs = plan.dec
        first, every_seq, key = _step_host(batch, ("decode-host", tuple(seqs)), lambda: _decode_host(batch, seqs))
        if every_seq:
            slots = self._slots(batch, seqs, dev)
        else:  # sequences without rows in the batch: the slots of those with one (rows 0 .. N-1 all the same)
            slots = _step_cached(batch, key, lambda: self._decode_index(batch, seqs, first, dev))[1]
        x, fa, b, ga = self._in_proj(hidden, with_ga=True)
        assert ga is not None
        y, _ = kda_decode_fused(
            x, fa, b, ga, state.conv, self._conv_weight(), slots, f_b, self.A_log, self.dt_bias, self.lower_bound,
            state.recurrent, g_b, self.o_norm.weight, self.o_norm.eps, self.scale, _act_dtype(self.o_proj, hidden),
            backend="triton", f_b_scale=f_s, g_b_scale=g_s, quant_block=f_blk if f_s is not None else g_blk,
        )  # fmt: skip
        return self.o_proj(y).to(hidden.dtype)

    def _forward_o(
        self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState, inputs: tuple
    ) -> torch.Tensor:
        """`forward` up to the mixer output ``o [N, H, V]`` (rows of other sequences stay zero)."""
        N, dev = hidden.shape[0], hidden.device
        x, g, beta, _ = inputs
        plan = _step_host(batch, ("plan", N, dev), lambda: _StepPlan.build(batch, N, dev))
        dec, pre, short = plan.dec, plan.pre, plan.short
        weight = self._conv_weight()
        if plan.decode_only:
            # Every row is one decode row, in order: the decode output is o (no zero fill, no copy).
            return self._decode(x, g, beta, None, batch, dec, state, weight)
        op, rows = self._prefill(x, g, beta, batch, pre, state, weight) if pre else (None, None)
        if not dec and not short and isinstance(rows, slice) and rows == slice(0, N):
            # Every row is a prefill row, in order: the chunk output is o (no zero fill, no copy).
            return op
        # The short prefills' padding rows land in sink rows past N (`_ragged_verify`); o is the first N rows.
        sink = plan.sink
        shape = (N + sink, self.num_heads, self.head_v_dim)
        if plan.tiled:
            # The sequences' rows tile all N rows and each path writes every one of its rows: no zero fill
            # (a launch per layer on CUDA).
            o = torch.empty(shape, dtype=torch.float32, device=dev)
        else:  # padding rows (a piecewise bucket) read as zeros
            o = torch.zeros(shape, dtype=torch.float32, device=dev)
        if dec:
            self._decode(x, g, beta, o, batch, dec, state, weight)
        if short:
            self._short_prefill(x, g, beta, o, batch, short, state, weight)
        if isinstance(rows, slice):
            o[rows] = op
        elif rows is not None:
            o.index_copy_(0, rows, op)
        return o[:N] if sink else o

    def _decode(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        o: torch.Tensor | None,
        batch: KdaBatchLike,
        seqs: list[int],
        state: KdaLayerState,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The recurrent step of the decode rows of ``seqs``: written into their rows of ``o``, or, with
        ``o`` None (every row of the batch is one of them, in order), returned as ``o [N, H, V]`` FP32."""
        dev = x.device
        first, every_seq, key = _step_host(batch, ("decode-host", tuple(seqs)), lambda: _decode_host(batch, seqs))
        n = len(first)
        # A pure decode step (rows 0..n-1 in order) takes slices: no index tensor built from a host list, so
        # the step has no host-to-device copy and can be captured in a CUDA graph.
        rows: torch.Tensor | slice
        if every_seq:
            rows, slots = slice(0, n), self._slots(batch, seqs, dev)
        else:
            rows, slots = _step_cached(batch, key, lambda: self._decode_index(batch, seqs, first, dev))
        # Conv update, SiLU and the q/k norms: one kernel on CUDA (`ops.conv.conv_decode`).
        q, k, v = conv_decode(x[rows], state.conv, weight, slots, self.num_heads, self.head_k_dim, self.head_v_dim)
        od = kda_decode_inplace(q, k, v, g[rows], beta[rows], self.scale, state.recurrent, slots, backend=self.backend)
        if o is None:
            return od
        if isinstance(rows, slice):
            o[rows] = od
        else:
            o.index_copy_(0, rows, od)
        return o

    def _decode_index(
        self, batch: KdaBatchLike, seqs: list[int], first: list[int], dev: torch.device
    ) -> tuple[slice | torch.Tensor, torch.Tensor]:
        """The decode rows of ``seqs`` (a slice when they are rows ``0 .. n-1``, else ``[n]`` int64) and their
        ``[n]`` slots, in one copy to the device (no stream sync)."""
        n = len(first)
        if first == list(range(n)):
            return slice(0, n), self._slots(batch, seqs, dev)
        both = to_device(first + [batch.state_slots[b] for b in seqs], dev, torch.int64)
        return both[:n], both[n:]

    def _prefill(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: KdaBatchLike,
        seqs: list[int],
        state: KdaLayerState,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """The chunked path of the prefill sequences ``seqs``: their conv windows and recurrent slots updated in
        place. Returns ``(o [T, H, V] FP32, rows)``, the rows of the step they fill, in order: a slice when the
        sequences lie back to back (then no gathers: ``x``, ``g``, ``beta`` are read as views), else an index."""
        dev, n = x.device, len(seqs)
        starts = [batch.cu_seqlens[b] for b in seqs]
        sub_cu = [0]
        for b in seqs:
            sub_cu.append(sub_cu[-1] + batch.q_lens[b])
        T = sub_cu[-1]
        back_to_back = all(s == starts[0] + c for s, c in zip(starts, sub_cu))
        fresh_h = [int(batch.past_lens[b] == 0) for b in seqs]
        # One host-to-device copy (no stream sync): packed offsets, first rows, fresh flags.
        meta = to_device(sub_cu + starts + fresh_h, dev, torch.int64)
        cu_t, row0_t, fresh = meta[: n + 1], meta[n + 1 : 2 * n + 1], meta[2 * n + 1 :]
        fresh_t = fresh if any(fresh_h) else None
        slots = self._slots(batch, seqs, dev)
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        rows: slice | torch.Tensor
        # The short convolution, SiLU, the q/k norms and the new windows: two launches on CUDA
        # (`ops.conv.conv_prefill`), q / k / v contiguous FP32 as the chunk kernels read them.
        if back_to_back:
            rows = slice(starts[0], starts[0] + T)
            q, k, v = conv_prefill(x[rows], state.conv, weight, slots, cu_t, H, K, V, fresh=fresh_t)
            gr, br = g[rows], beta[rows]
        else:
            # Made on the device: a host index list would be a blocking copy (a stream sync) per layer and chunk.
            rows = torch.cat([torch.arange(s, s + batch.q_lens[b], dtype=torch.int64, device=dev)
                              for s, b in zip(starts, seqs)])  # fmt: skip
            q, k, v = conv_prefill(x, state.conv, weight, slots, cu_t, H, K, V, row0=row0_t, num_rows=T,
                                   fresh=fresh_t)  # fmt: skip
            gr, br = g[rows], beta[rows]
        S0 = state.recurrent.index_select(0, slots)
        if fresh_t is not None:
            # torch.where, not a multiply: a never-zeroed slot may hold NaN/inf and must not leak in.
            S0 = torch.where(fresh_t.view(-1, 1, 1, 1) != 0, 0.0, S0)
        op, S_end = kda_prefill(
            q, k, v, gr, br, self.scale, S0, sub_cu,
            lower_bound=self.lower_bound, backend=self.backend, chunk_size=self.chunk_size,
        )  # fmt: skip
        state.recurrent.index_copy_(0, slots, S_end.to(state.recurrent.dtype))
        return op, rows

    def _short_prefill(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        o: torch.Tensor,
        batch: KdaBatchLike,
        seqs: list[int],
        state: KdaLayerState,
        weight: torch.Tensor,
    ) -> None:
        """Short prefill chunks of ``seqs`` through the verify kernels (`short_prefill_rows`): every row verified from
        the slot (zeros for a fresh sequence), then all of them committed; their outputs written into ``o``'s rows
        (``o [N + P, H, V]``, P = `_ragged_padding`: sink rows for the padding rows)."""
        # Every row is committed, so the padding rows' decay and beta are never folded into a slot: they need no
        # zeroing (the verify runs each sequence's rows in order, so they cannot reach its real rows either).
        records = self._ragged_verify(x, g, beta, o, batch, seqs, state, weight, mask_padding=False)
        # Every row is committed: the counts are the widths, the same for every KDA layer of the step.
        dev, widths = x.device, records.widths
        every = _step_cached(batch, ("commit", tuple(seqs), tuple(widths)), lambda: to_device(widths, dev, torch.int64))
        records.commit((), state, accepted_t=every)  # (the host counts are not read with ``accepted_t``)

    def _ragged_verify(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        o: torch.Tensor,
        batch: KdaBatchLike,
        seqs: list[int],
        state: KdaLayerState,
        weight: torch.Tensor,
        *,
        mask_padding: bool = True,
    ) -> KdaLayerRecords:
        """The verify pass of ``seqs`` at any widths and positions, fresh or not (the state is only read): their rows'
        outputs written into ``o [N + P, H, V]`` (``P`` = `_ragged_padding` of ``seqs``; the padding rows' outputs
        land in the sink rows ``N ..``, so one copy places every output); returns the commit records. No stream
        sync: every index is built on the host and copied once per step (`_step_cached`).

        ``mask_padding``: zero the padding rows' decay and beta, so that their records fold as no-ops even under a
        count past a sequence's width (a speculative commit takes counts from elsewhere); a caller that commits
        exactly the widths (`_short_prefill`) skips those two launches (the outputs and the committed state do not
        change: the padding rows come after each sequence's real rows and are never committed)."""
        dev, n = x.device, len(seqs)
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        widths, firsts, fresh_h, sink, key = _step_host(
            batch, ("ragged-host", tuple(seqs), o.shape[0]), lambda: _ragged_host(batch, seqs, o.shape[0])
        )
        Wm = max(widths, default=0)
        ridx, fresh, row0, widths_t, dst_t, slots = _step_cached(
            batch, key, lambda: self._ragged_index(batch, seqs, widths, firsts, fresh_h, sink, dev)
        )
        # index_select, not advanced indexing: the same gather for less host work per launch.
        gr = g.index_select(0, ridx).view(n, Wm, *g.shape[1:])
        br = beta.index_select(0, ridx).view(n, Wm, *beta.shape[1:])
        if mask_padding and any(w < Wm for w in widths):
            # Built only where it is read (two launches, once per step): a short prefill, whose grid has padding
            # rows whenever decode rows ride it, never masks.
            valid = _step_cached(
                batch, (*key, "valid"), lambda: torch.arange(Wm, device=dev).view(1, Wm) < widths_t.view(n, 1)
            )
            gr = torch.where(valid.view(n, Wm, 1, 1), gr, 0.0)
            br = torch.where(valid.view(n, Wm, 1), br, 0.0)
        # Unmasked (every row committed), the kernels touch each sequence's own rows only: the conv leaves the padding
        # rows unwritten and the verify never reads them, so a decode row riding a wider prompt's grid costs one row
        # there, not Wm (its padding rows' outputs go to sink rows, their records are never read).
        q, k, v = conv_verify_qkv(x, state.conv, weight, slots, H, K, V, Wm, row0=row0, widths=widths_t, fresh=fresh,
                                  zero_padding=mask_padding)  # fmt: skip
        ov, rec = kda_verify(q, k, v, gr, br, self.scale, state.recurrent, state_slots=slots, fresh=fresh,
                             widths=None if mask_padding else widths_t)  # fmt: skip
        o.index_copy_(0, dst_t, ov.reshape(n * Wm, H, V))
        return KdaLayerRecords(
            seq_ids=seqs,
            widths=widths,
            state_slots=[batch.state_slots[b] for b in seqs],
            slots_t=slots,
            fresh=fresh,
            x=x,
            row0=row0,
            kda=rec,
            num_seqs=batch.num_seqs,
        )

    def _ragged_index(
        self,
        batch: KdaBatchLike,
        seqs: list[int],
        widths: list[int],
        firsts: list[int],
        fresh_h: list[int],
        sink: int,
        dev: torch.device,
    ) -> tuple[torch.Tensor | None, ...]:
        """`_ragged_verify`'s indices, in one host-to-device copy: ``ridx [n * Wm]`` the row grid (padding entries
        repeat a sequence's last row), ``fresh [n]`` bool, ``row0 [n]`` first rows, ``widths [n]``, ``dst [n * Wm]``
        where each grid row's output goes (a real row to its own row, the ``k``-th padding row to the sink row
        ``sink + k``) and the ``[n]`` slots."""
        n, Wm = len(seqs), max(widths, default=0)
        grid: list[int] = []
        for f, w in zip(firsts, widths):  # each sequence's rows, then its last row repeated to Wm
            grid.extend(range(f, f + w))
            grid.extend([f + w - 1] * (Wm - w))
        dst = ragged_destinations(firsts, widths, sink)
        meta = to_device(grid + fresh_h + firsts + widths + dst, dev, torch.int64)
        cut = list(itertools.accumulate([n * Wm, n, n, n]))
        return (meta[: cut[0]], meta[cut[0] : cut[1]] != 0, meta[cut[1] : cut[2]], meta[cut[2] : cut[3]],
                meta[cut[3] :], self._slots(batch, seqs, dev))  # fmt: skip

    # ----------------------------------------------------------------------------------------------
    # Speculative verify / commit
    @torch.no_grad()
    def forward_verify(
        self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState
    ) -> tuple[torch.Tensor, KdaLayerRecords]:
        """Verify pass: every sequence's ``q_len`` rows run from its committed state, which is NOT changed.

        Args:
            hidden: ``[N, D]`` flat token batch (root + drafts per sequence).
            batch: layout (`KdaBatchLike`); ``past_lens[b]`` is the committed length.
            state: this layer's state planes; only read.

        Returns:
            ``(out [N, D], records)``; pass the records to `commit` once acceptance is known.
        """
        inputs = self._inputs(hidden)
        o, records = self._verify_o(hidden, batch, state, inputs)
        return self._output(hidden, o, inputs[3]), records

    def _verify_o(
        self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState, inputs: tuple
    ) -> tuple[torch.Tensor, KdaLayerRecords]:
        """`forward_verify` up to the mixer output ``o [N, H, V]`` (rows of other sequences stay zero)."""
        N, dev = hidden.shape[0], hidden.device
        x, g, beta, _ = inputs
        seqs = [b for b in range(batch.num_seqs) if batch.q_lens[b] > 0]
        _check_slots(batch, seqs)
        widths = [batch.q_lens[b] for b in seqs]
        slots = self._slots(batch, seqs, dev)
        Wm = max(widths, default=0)
        n = len(seqs)
        # A uniform verify step (every sequence Wm rows, back to back from row 0, none fresh) takes its rows as
        # views: no index tensors, gathers or masks (each a launch), no host list copies, so it can be captured.
        uniform = (
            n > 0
            and all(batch.cu_seqlens[b] == j * Wm and w == Wm for j, (b, w) in enumerate(zip(seqs, widths)))
            and all(batch.past_lens[b] > 0 for b in seqs)
        )
        if not uniform:
            sink = _ragged_padding(batch, seqs)
            o = torch.zeros(N + sink, self.num_heads, self.head_v_dim, dtype=torch.float32, device=dev)
            records = self._ragged_verify(x, g, beta, o, batch, seqs, state, self._conv_weight())
            return (o[:N] if sink else o), records
        R = n * Wm
        gr, br = g[:R].reshape(n, Wm, *g.shape[1:]), beta[:R].reshape(n, Wm, *beta.shape[1:])
        # The short convolution from the committed windows, SiLU and the q/k norms: one kernel on CUDA
        # (`ops.conv.conv_verify_qkv`); the windows are not written. Nobody starts from zero: slots read as they are.
        q, k, v = conv_verify_qkv(x, state.conv, self._conv_weight(), slots, self.num_heads, self.head_k_dim,
                                  self.head_v_dim, Wm)  # fmt: skip
        ov, rec = kda_verify(q, k, v, gr, br, self.scale, state.recurrent, state_slots=slots)
        if R == N:  # the verify output is o (no zero fill, no copy)
            o = ov.reshape(N, *ov.shape[2:])
        else:
            o = torch.zeros(N, self.num_heads, self.head_v_dim, dtype=torch.float32, device=dev)
            o[:R] = ov.reshape(R, *ov.shape[2:])
        records = KdaLayerRecords(
            seq_ids=seqs,
            widths=widths,
            state_slots=[batch.state_slots[b] for b in seqs],
            slots_t=slots,
            fresh=None,
            x=x,
            row0=None,
            kda=rec,
            num_seqs=batch.num_seqs,
        )
        return o, records

    @torch.no_grad()
    def commit(
        self,
        records: KdaLayerRecords,
        num_accepted: Sequence[int] | torch.Tensor,
        state: KdaLayerState,
    ) -> None:
        """Fold the first ``a`` verified rows of each sequence into its slot (`KdaLayerRecords.commit`)."""
        records.commit(num_accepted, state)

    @torch.no_grad()
    def forward_spec(
        self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState, verify_seqs: Sequence[int]
    ) -> tuple[torch.Tensor, KdaLayerRecords | None]:
        """A mixed step: ``verify_seqs`` run the record-based verify (state untouched until `commit`), every
        other sequence (width-one decodes, prefill chunks) the ordinary in-place `forward`.

        Args:
            hidden: ``[N, D]`` flat token batch.
            batch: layout of the whole step.
            state: this layer's state planes.
            verify_seqs: batch indices of the speculative verify sequences (width > 1).

        Returns:
            ``(out [N, D], records)``; ``records`` is ``None`` when nothing was verified. Its
            ``num_seqs`` is the whole batch's, so `commit` takes one accepted count per batch sequence.
        """
        if not verify_seqs:
            return self.forward(hidden, batch, state), None
        # Projections and the output gate/norm/projection run once for all rows; only the mixers differ.
        inputs = self._inputs(hidden)
        o, records = self.mix_spec(hidden, batch, state, inputs, verify_seqs)
        return self._output(hidden, o, inputs[3]), records

    @torch.no_grad()
    def mix_spec(
        self, hidden: torch.Tensor, batch: KdaBatchLike, state: KdaLayerState, inputs: tuple, verify_seqs: Sequence[int]
    ) -> tuple[torch.Tensor, KdaLayerRecords]:
        """`forward_spec`'s mixers on `project`'s ``inputs`` (the piecewise graphs' core of a step with verify rows):
        ``(o [N, H, V] FP32, records)``. The records keep ``inputs``' conv input ``x`` and decay ``g`` until the
        commit, so nothing may overwrite those before it (the piecewise runner passes copies of its carry rows).

        Args:
            hidden: ``[N, D]``: only the row count and device are read.
            batch: layout of the whole step.
            state: this layer's state planes (the verified sequences' slots untouched until `commit`).
            inputs: ``(x [N, C], g [N, H, K], beta [N, H], ga)`` from `project`.
            verify_seqs: batch indices of the speculative verify sequences (width > 1; at least one).
        """
        verify = set(verify_seqs)
        # All sequences verify (e.g. a captured verify step): the batch itself, padding marks included.
        vbatch = batch if len(verify) == batch.num_seqs else _only(batch, verify)
        o, records = self._verify_o(hidden, vbatch, state, inputs)
        rest = set(range(batch.num_seqs)) - verify
        if rest:
            o_rest = self._forward_o(hidden, _only(batch, rest), state, inputs)
            is_v = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
            for b in verify:
                is_v[batch.cu_seqlens[b] : batch.cu_seqlens[b] + batch.q_lens[b]] = True
            o = torch.where(is_v[:, None, None], o, o_rest)
        return o, records


def _only(batch: KdaBatchLike, keep: set[int]) -> KdaBatch:
    """``batch`` with every sequence outside ``keep`` given zero rows (the layer then skips it)."""
    return KdaBatch(
        num_seqs=batch.num_seqs,
        q_lens=[q if b in keep else 0 for b, q in enumerate(batch.q_lens)],
        past_lens=list(batch.past_lens),
        cu_seqlens=list(batch.cu_seqlens),
        state_slots=list(batch.state_slots),
        state_slots_t=batch.state_slots_t,
    )

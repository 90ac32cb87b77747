"""Triton device helpers shared by the indexer kernels: bf16/e4m3 rounding, the 128-wide FWHT, pooling.

fp32 and integer bit arithmetic only, never a float->bf16 or float->fp8 cast (the interpreter gets those wrong);
each helper mirrors its reference op operation by operation (bit-identical). Kernels calling ``pool4`` must launch
with ``enable_fp_fusion=False``. Per helper: docs/kernels.md, "Indexer device helpers".
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Fixed when this module is imported: the loader in ``__init__`` imports an interpreted copy of the kernel
# modules for CPU tensors and a compiled copy for CUDA tensors.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

INDEX_DIM: int = 128
KPOOL: int = 4

# fp32 bit patterns used below.
_F32_448_BITS = tl.constexpr(0x43E00000)  # 448.0 = 1.75 * 2**8, the largest finite e4m3fn value
_F32_2M6_BITS = tl.constexpr(0x3C800000)  # 2**-6, the smallest normal e4m3fn value


@triton.jit
def bf16_round(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), returned as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    # Adding 0x7FFF + lsb then truncating the low half is round-half-to-even on the dropped 16 bits; a carry
    # into the exponent is the correct rounding up to the next binade (or to inf).
    bits = (bits + (0x7FFF + lsb)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """The bfloat16 bit pattern of fp32 ``x`` rounded to nearest even, as int32 in the int16 range (store it
    through an int16 view of a bfloat16 tensor: no float->bf16 cast, which the interpreter gets wrong)."""
    return bf16_round(x).to(tl.int32, bitcast=True) >> 16


@triton.jit
def bf16_bits_to_f32(b):
    """Exact fp32 value of bfloat16 bit patterns ``b`` (any int type; the low 16 bits are used)."""
    return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _butterfly(x, R: tl.constexpr, H: tl.constexpr):
    """One FWHT stage on ``[R, 128]``: ``(x[i], x[i + H]) <- (x[i] + x[i + H], x[i] - x[i + H])``."""
    # Index i = (block, bit H, low bits): move the bit-H axis last so that split/join pair (i, i + H).
    y = tl.permute(tl.reshape(x, (R, 128 // (2 * H), 2, H)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.join(a + b, a - b)
    return tl.reshape(tl.permute(y, (0, 1, 3, 2)), (R, 128))


@triton.jit
def fwht128(x, R: tl.constexpr):
    """Normalised Walsh-Hadamard transform of each row of fp32 ``x [R, 128]`` in the reference order."""
    x = _butterfly(x, R, 1)
    x = _butterfly(x, R, 2)
    x = _butterfly(x, R, 4)
    x = _butterfly(x, R, 8)
    x = _butterfly(x, R, 16)
    x = _butterfly(x, R, 32)
    x = _butterfly(x, R, 64)
    # float32(1 / sqrt(128)) = 0x3DB504F3, the constant of ops.fwht.
    return x * 0.08838834764831845


@triton.jit
def pow2_scale(amax):
    """``2 ** ceil(log2(max(amax, 1e-4) / 448))`` in fp32 and its exact reciprocal, from the fp32 bits.

    Returns:
        ``(scale, inv_scale)``, both the shape of ``amax``. Non-finite ``amax`` passes through as ``scale``.
    """
    r = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    rb = r.to(tl.int32, bitcast=True)
    biased = (rb >> 23) & 0xFF
    # r >= 1e-4 / 448 is a normal fp32: ceil(log2 r) is its exponent, plus one unless r is a power of two.
    k = biased - 127 + ((rb & 0x7FFFFF) != 0).to(tl.int32)
    k = tl.where(biased == 255, 0, k)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return tl.where(biased == 255, r, scale), inv


@triton.jit
def e4m3_codes(v):
    """float8_e4m3fn bit patterns (int32 in ``[0, 255]``) of fp32 ``v`` rounded to nearest, ties to even.

    Saturates at +-448 like the reference (``|v| <= 448`` in the indexer, so this never triggers there);
    keeps the sign of zero (``-0.0`` and small negatives that round to zero give ``0x80``, as torch's cast).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 range (|v| >= 2**-6): keep 3 mantissa bits, round half to even on the dropped 20.
    lsb = (mag >> 20) & 1
    rn = (mag + (0x7FFFF + lsb)) & -1048576
    rn = tl.minimum(rn, _F32_448_BITS)
    code_n = (((rn >> 23) - 120) << 3) | ((rn >> 20) & 7)
    # Subnormal range (|v| < 2**-6): multiples of 2**-9, i.e. round |v| * 512 (exact, < 8) to an integer.
    # (The clamp only touches lanes of the normal path, whose int conversion would otherwise overflow.)
    a = tl.minimum(mag.to(tl.float32, bitcast=True), 1.0) * 512.0
    fl = a.to(tl.int32)
    frac = a - fl.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    # Code 8 (= 2**-6, exponent field 1) is what a round-up from 7.5 * 2**-9 must produce: it is fl + 1.
    code_s = fl + up.to(tl.int32)
    return tl.where(mag < _F32_2M6_BITS, code_s, code_n) | sign


@triton.jit
def rotate_quant_rows(x, R: tl.constexpr):
    """The indexer's rotate-quantise chain on fp32 ``x [R, 128]``.

    Returns:
        ``(codes [R, 128] int32 e4m3 bit patterns, scale [R] fp32)``.
    """
    y = bf16_round(x)
    y = bf16_round(fwht128(y, R))
    amax = tl.max(tl.abs(y), axis=1)
    scale, inv = pow2_scale(amax)
    # Multiplying by the exact reciprocal of a power of two equals the reference's division.
    return e4m3_codes(y * inv[:, None]), scale


@triton.jit
def e4m3_to_f16_scaled(b):
    """Decode e4m3 codes (int32 ``[0, 255]``) to fp16 holding ``value * 2**-8``, exactly.

    Placing the 7 magnitude bits ``eeeemmm`` at fp16 bits 13..7 gives exponent field ``0eeee`` and mantissa
    ``mmm0000000``: the same value with the exponent bias 15 instead of 7, i.e. scaled by ``2**-8``; e4m3
    subnormals become fp16 subnormals the same way. Callers fold the ``2**8`` back in with an exact
    power-of-two multiply.
    """
    h = ((b & 0x7F) << 7) - ((b & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _exp_f32_via_f64(x, USE_LIBDEVICE: tl.constexpr):
    x64 = x.to(tl.float64)
    if USE_LIBDEVICE:
        e = libdevice.exp(x64)
    else:
        # The interpreter evaluates tl.exp with numpy; libdevice is GPU-only.
        e = tl.exp(x64)
    return e.to(tl.float32)


@triton.jit
def pool4(k0, k1, k2, k3, g0, g1, g2, g3, a0, a1, a2, a3, USE_LIBDEVICE: tl.constexpr):
    """C4 pooling of member keys ``k*`` with softmax weights over ``g* + a*`` (elementwise, any shape).

    Mirrors `ops.pool_keys` operation by operation: ``mx = max_m l[m]``, ``e = fp32(exp64(l - mx))``,
    ``den = ((e0 + e1) + e2) + e3``, ``w = e / den`` (correctly rounded), ``((w0 k0 + w1 k1) + w2 k2) + w3 k3``.
    """
    l0 = g0 + a0
    l1 = g1 + a1
    l2 = g2 + a2
    l3 = g3 + a3
    mx = tl.maximum(tl.maximum(tl.maximum(l0, l1), l2), l3)
    e0 = _exp_f32_via_f64(l0 - mx, USE_LIBDEVICE)
    e1 = _exp_f32_via_f64(l1 - mx, USE_LIBDEVICE)
    e2 = _exp_f32_via_f64(l2 - mx, USE_LIBDEVICE)
    e3 = _exp_f32_via_f64(l3 - mx, USE_LIBDEVICE)
    den = ((e0 + e1) + e2) + e3
    # Triton's "/" on fp32 is an approximate divide on the GPU; div_rn is the IEEE one torch uses.
    wk0 = tl.math.div_rn(e0, den) * k0
    wk1 = tl.math.div_rn(e1, den) * k1
    wk2 = tl.math.div_rn(e2, den) * k2
    wk3 = tl.math.div_rn(e3, den) * k3
    return ((wk0 + wk1) + wk2) + wk3

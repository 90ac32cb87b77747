"""Ceilings measured in the run itself: device-to-device copy bandwidth and dense matmul rate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from benchmarks.harness.timing import bench_us, loop_us


def copy_ceiling_gbs(device: str | torch.device = "cuda", quick: bool = False) -> float:
    """Device-to-device copy bandwidth of 1 GiB in GB/s, counting bytes read plus bytes written (`bench_us`
    median); ``nan`` off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench_us(partial(dst.copy_, src), quick)
    del src, dst
    return 2 * n / (t * 1e-6) / 1e9


def matmul_tflops(device: str, kind: str = "bf16", n: int = 8192) -> float:
    """Dense ``n x n x n`` matmul rate measured now (TFLOP/s): ``bf16`` (``torch.mm``) or ``fp8``
    (``torch._scaled_mm``, e4m3 with tensor-wise scales); ``nan`` off CUDA or where FP8 GEMMs are missing."""
    if device != "cuda":
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if kind == "bf16":
        step: Callable[[], object] = lambda: torch.mm(a, b)  # noqa: E731
    else:
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device="cuda")
            step = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)  # noqa: E731
            step()
        except (RuntimeError, AttributeError):
            return float("nan")
    return 2 * n**3 / (loop_us(step, 20, warmup=3) * 1e-6) / 1e12

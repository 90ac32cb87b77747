"""Programmatic dependent launch (PDL, ``griddepcontrol``): which devices have it, and Triton helpers for kernels
that use it.

A kernel launched with PDL (Triton's ``launch_pdl=True``) may start while the kernel before it on the stream still
runs: as soon as every program of that kernel has executed ``griddepcontrol.launch_dependents`` (or exited). It
must then wait (``griddepcontrol.wait``: the previous grids completed and their memory visible) before it reads
anything a previous kernel wrote and before it writes anything a previous kernel may still read. What it may do
before the wait is read constants (weights) and compute on them, which is the point: a weight-streaming kernel
starts moving its weight while the kernel before it finishes, instead of paying its launch and its first DRAM
round trips after it. Stream capture keeps the dependency as a programmatic edge, so it holds inside CUDA graphs.

No kernel here relies on PDL for correctness: every early start is followed by a wait before the first dependent
access, and a kernel launched without the attribute simply starts late.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["has_pdl", "prefetch_l2"]


@functools.cache
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def has_pdl(device: torch.device) -> bool:
    """Whether ``device`` can launch with PDL (``griddepcontrol`` exists from compute capability 9.0 on)."""
    return device.type == "cuda" and _capability_major(device.index) >= 9


@triton.jit
def prefetch_l2(addr, nbytes):
    """Start copying ``nbytes [i]`` bytes at ``addr [i]`` into L2 (``cp.async.bulk.prefetch.L2``, sm_90+), per
    element; nothing waits for it and nothing is written. ``addr``: int64 addresses, 16-byte aligned; ``nbytes``:
    int32 multiples of 16, > 0. Returns a dummy int32 tensor (the asm must have an output to be kept)."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [addr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )

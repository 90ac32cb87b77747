"""Programmatic dependent launch (PDL, ``griddepcontrol``): which devices have it, and Triton helpers for kernels
that use it.

A kernel launched with PDL may start while the one before it on the stream still runs; it must
``griddepcontrol.wait`` before it reads anything a previous kernel wrote or writes anything one may still read, and
before that only read constants (weights). Capture keeps the edge, so it holds inside CUDA graphs. No kernel relies
on PDL for correctness: launched without it, a kernel simply starts late. `PDL_ENV` (``TRTLLM_GLM_PDL``, read per
call): ``1`` on sm_90+, ``0`` never, unset off except FP8 launches whose tuned knobs ask for it. Which kernels and
what it measured: docs/fp8.md, "Launch overhead".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from trtllm_glm import envs

__all__ = ["PDL_ENV", "has_pdl", "launch_kwargs", "pdl_enter", "pdl_from_env", "prefetch_l2", "use_pdl"]

PDL_ENV = envs.PDL.name


def pdl_from_env() -> bool | None:
    """`PDL_ENV` as a bool (``None``: unset).

    Raises:
        ValueError: a value other than ``0`` / ``1``.
    """
    return envs.PDL.get()


@functools.cache
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def has_pdl(device: torch.device) -> bool:
    """Whether ``device`` can launch with PDL (``griddepcontrol`` exists from compute capability 9.0 on)."""
    return device.type == "cuda" and _capability_major(device.index) >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether a decode kernel on ``device`` launches with PDL now (`PDL_ENV` is ``1`` and `has_pdl`)."""
    # The device first: off CUDA (the CPU's interpreted kernels) no environment lookup per launch.
    return device.type == "cuda" and pdl_from_env() is True and has_pdl(device)


def launch_kwargs(pdl: bool) -> dict[str, Any]:
    """Triton launch options for a kernel launched with (``pdl``) or without PDL."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: let the next kernel launch, then wait for the previous one (its
    writes visible). Without ``PDL`` nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


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

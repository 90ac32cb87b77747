"""Programmatic dependent launch (PDL, ``griddepcontrol``): which devices have it, and Triton helpers for kernels
that use it.

A kernel launched with PDL may start while the one before it on the stream still runs; it must
``griddepcontrol.wait`` before it reads anything a previous kernel wrote or writes anything one may still read, and
before that only read constants (weights). Capture keeps the edge, so it holds inside CUDA graphs. No kernel relies
on PDL for correctness: launched without it, a kernel simply starts late. `PDL_ENV` (``TRTLLM_GLM_PDL``, read per
call): ``1`` on sm_90+, ``0`` never, unset off except FP8 launches whose tuned knobs ask for it. Which kernels and
what it measured: docs/fp8.md, "Launch overhead".

Where a kernel lets the next one launch (`PDL_TRIGGER_ENV`, ``TRTLLM_GLM_PDL_TRIGGER``, read per call; the
``PDL_LATE`` constexpr of every PDL kernel): ``start`` (the default) triggers before the wait (`pdl_enter`), ``end``
after the program's main loop (`pdl_leave`). The PTX ISA ("griddepcontrol", PTX ISA 9.0; the same text in the
ptx-90-parser crate's docs/instructions/griddepcontrol.md on docs.rs): ``.launch_dependents`` lets the dependents
"be scheduled as soon as all other CTAs in the grid issue the same instruction or have completed" (a program that
exits has triggered; repeated invocations by a CTA have no further effect), and ``.wait`` waits "until all
prerequisite grids in flight have completed and all the memory operations from the prerequisite grids are
performed and made visible to the current grid". The trigger is only a scheduling hint: it makes nothing visible
(cuTile's ``grid_dependency_control_launch_dependents``: it "does not imply that the producer has completed or
that its memory writes are visible"), so a dependent's reads are safe after its own wait wherever the kernel before
it triggered, before or after its last stores. A late trigger changes when the next grid's programs take SM slots,
never what any kernel computes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from trtllm_glm import envs

__all__ = [
    "PDL_ENV",
    "PDL_TRIGGER_ENV",
    "has_pdl",
    "late_trigger",
    "launch_kwargs",
    "pdl_enter",
    "pdl_from_env",
    "pdl_leave",
    "pdl_trigger",
    "pdl_wait",
    "prefetch_l2",
    "use_pdl",
]

PDL_ENV = envs.PDL.name
PDL_TRIGGER_ENV = envs.PDL_TRIGGER.name


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


def late_trigger(pdl: bool) -> bool:
    """The ``PDL_LATE`` constexpr of a launch with (``pdl``) or without PDL: whether it lets the next kernel launch
    after its main loop (`PDL_TRIGGER_ENV` is ``end``) instead of at its start. ``False`` without PDL, where the
    variable is not read (one compiled variant, and no lookup per CPU launch).

    Raises:
        ValueError: with ``pdl``, a `PDL_TRIGGER_ENV` other than ``start`` / ``end``.
    """
    return pdl and envs.PDL_TRIGGER.get() == "end"


# Every griddepcontrol instruction of the package goes through these two (the kernels never import Triton's gdc
# functions themselves): an interpreted test replaces the module's two names and sees every trigger and wait.
@triton.jit
def pdl_trigger():
    """``griddepcontrol.launch_dependents``: the next kernel may launch once every program has done this or exited."""
    gdc_launch_dependents()


@triton.jit
def pdl_wait():
    """``griddepcontrol.wait``: the kernels before this one have completed and their writes are visible."""
    gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr, LATE: tl.constexpr = False):
    """A PDL-launched kernel's first statement: let the next kernel launch (unless ``LATE``: then `pdl_leave` does,
    after the main loop), then wait for the previous one (its writes visible). Without ``PDL`` nothing."""
    if PDL:
        if not LATE:
            pdl_trigger()
        pdl_wait()


@triton.jit
def pdl_leave(PDL: tl.constexpr, LATE: tl.constexpr = False):
    """With ``PDL`` and ``LATE``: let the next kernel launch now. Called once per program after its main loop, on a
    path every program takes (a program that exits without it triggers at its exit, later). Else nothing."""
    if PDL and LATE:
        pdl_trigger()


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

"""Process-group set-up and tear-down of one rank (torch.distributed: NCCL for CUDA, gloo for the CPU).

Two groups per rank: the model's collectives (NCCL on CUDA, gloo on the CPU) and a gloo control group on
host tensors for the lockstep checks (`Comm.check_lockstep`). Both carry the same timeout, so a peer that
stops answering turns into an error on the others instead of a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import socket

import torch

from .. import envs
from .comm import Comm
from .mapping import Mapping

__all__ = [
    "init_rank",
    "init_world_of_one",
    "shutdown_rank",
    "torchrun_env",
    "free_port",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
]

TIMEOUT_ENV = envs.DIST_TIMEOUT.name
DEFAULT_TIMEOUT_S = 120.0
"""Seconds a collective may wait for a peer (``TRTLLM_GLM_DIST_TIMEOUT`` overrides): long enough for the first
step's kernel compilation on every rank, short enough that a wedged peer is reported."""


def timeout_s() -> float:
    value = envs.DIST_TIMEOUT.get()
    return DEFAULT_TIMEOUT_S if value is None else value


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when this process was started by torchrun (``WORLD_SIZE`` > 1 and
    ``RANK`` set), else ``None``."""
    world, rank = envs.WORLD_SIZE.get(), envs.RANK.get()
    if world is None or rank is None or world <= 1:
        return None
    local = envs.LOCAL_RANK.get()
    return rank, world, rank if local is None else local


def free_port() -> int:
    """A TCP port free on the loopback right now (for the driver's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(mapping: Mapping, device: torch.device, init_method: str | None = None) -> Comm:
    """Join the world as ``mapping.rank`` and return its `Comm`.

    Args:
        mapping: the layout and this rank.
        device: this rank's device (CUDA: NCCL bound to it; else gloo).
        init_method: ``tcp://host:port`` (the LLM's own workers) or ``None`` (``env://``, torchrun).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != mapping.world_size or dist.get_rank() != mapping.rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"not as {mapping.describe()}"
            )
    else:
        timeout = datetime.timedelta(seconds=timeout_s())
        kw = {}
        if device.type == "cuda":
            if device.index is None:  # "cuda" alone (bench_e2e --device cuda): NCCL binds to one numbered device
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            kw["device_id"] = device
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=init_method or "env://",
            rank=mapping.rank,
            world_size=mapping.world_size,
            timeout=timeout,
            **kw,
        )
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s()))
    return Comm(mapping, group=None, control_group=control)


def init_world_of_one(device: torch.device) -> Comm:
    """A 1-rank world (NCCL on CUDA) whose `Comm` issues every collective anyway (``force``): the parallel code
    path at world size 1, for the GPU checks and ``benchmarks/bench_e2e.py --collectives-at-one``."""
    comm = init_rank(Mapping(), device, f"tcp://127.0.0.1:{free_port()}")
    return Comm(comm.mapping, comm.group, comm.control_group, force=True)


def shutdown_rank() -> None:
    """Leave the world (idempotent)."""
    import torch.distributed as dist

    if dist.is_initialized():
        # A broken group (a dead peer) cannot always be torn down cleanly.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

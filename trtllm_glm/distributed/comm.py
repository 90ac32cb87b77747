"""The collectives the sharded model and the lockstep checks use (torch.distributed; NCCL on CUDA, gloo on CPU).

`Comm.all_reduce` is called *inside* the forward, so a CUDA graph captures the NCCL kernel with the step (nothing
here allocates or syncs with the host); at world size 1 (`NULL_COMM`) every call returns its input. In the
batch-invariant mode it is an all-gather and a sum in rank order (NCCL picks algorithm and chunking by message size,
so a row's sum would depend on the step's rows). Control traffic (lockstep fingerprints, worker errors) goes over a
separate gloo group on host tensors, never into a captured graph or behind device work. docs/parallelism.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..numerics import batch_invariant
from .mapping import Mapping

__all__ = ["Comm", "NULL_COMM", "LockstepError", "sum_in_rank_order"]


def sum_in_rank_order(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = parts[0] + parts[1] + ..`` in that order, in fp32, rounded once to ``out``'s dtype (elementwise:
    each element's result depends on its own values only).

    Args:
        parts: ``[world, *shape]``, one slice per rank.
        out: ``shape``; written and returned.
    """
    acc = parts[0].float()
    if acc.data_ptr() == parts[0].data_ptr():  # fp32 input: float() is a view, do not add into the gathered slice
        acc = acc.clone()
    for r in range(1, parts.shape[0]):
        acc += parts[r]
    return out.copy_(acc)


class LockstepError(RuntimeError):
    """Ranks that must run the same step disagree (a different plan or different tokens)."""


class Comm:
    """Collectives of one rank.

    Args:
        mapping: the layout (`Mapping`).
        group: the process group of the model's collectives (``None``: the default group).
        control_group: a gloo group for host-side checks (``None``: ``group``).
        force: issue the model's collectives even at world size 1 (a 1-rank NCCL world: measures what the
            collective path costs, `process_group.init_world_of_one`).
    """

    def __init__(self, mapping: Mapping, group: Any = None, control_group: Any = None, *, force: bool = False) -> None:
        self.mapping = mapping
        self.force = force
        self.group = group
        self.control_group = control_group if control_group is not None else group
        # Collectives issued by this rank (tests count them; an int add costs nothing next to the collective).
        self.num_all_reduces = 0

    @property
    def world_size(self) -> int:
        return self.mapping.world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over every rank, in place; returns ``t``. A no-op at world size 1 (unless ``force``). In the
        batch-invariant mode: all-gather, then `sum_in_rank_order` (the same order for any message size)."""
        if self.mapping.world_size == 1 and not self.force:
            return t
        import torch.distributed as dist

        self.num_all_reduces += 1
        if batch_invariant():
            world = dist.get_world_size(self.group)
            src = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)
            # Flat (rank-major): gloo takes only the concatenation along dim 0.
            parts = torch.empty(world * src.numel(), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(parts, src, group=self.group)
            sum_in_rank_order(parts.view(world, *t.shape), t)
            return t
        dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor:
        """The row-parallel sum of attention / dense-MLP partials (a no-op when they are replicated)."""
        if self.mapping.tp_size == 1 and not self.force:
            return t
        return self.all_reduce(t)

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), over the control group; rank order."""
        if self.mapping.world_size == 1:
            return [list(values)]
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.mapping.world_size)]
        dist.all_gather(out, mine, group=self.control_group)
        return [o.tolist() for o in out]

    def check_lockstep(self, what: str, fingerprint: int) -> None:
        """Raise `LockstepError` on every rank when the ranks' ``fingerprint`` of ``what`` differ."""
        if self.mapping.world_size == 1:
            return
        got = [v[0] for v in self.gather_ints([fingerprint])]
        if len(set(got)) > 1:
            odd = [r for r, v in enumerate(got) if v != got[0]]
            raise LockstepError(
                f"ranks diverged at {what}: ranks {odd} disagree with rank 0 (fingerprints {got}); "
                "every rank must run the same plan and emit the same tokens"
            )


NULL_COMM = Comm(Mapping())
"""World size 1: every collective is a no-op."""

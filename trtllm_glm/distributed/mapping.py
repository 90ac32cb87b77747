"""`Mapping`: which share of the model one rank holds (TensorRT-LLM's names and conventions).

Attention and dense MLPs are tensor parallel over ``tp_size`` (``W`` or 1); routed experts split over
``moe_ep_size`` blocks of contiguous experts times ``moe_tp_size`` slices of the intermediate dimension
(``moe_ep_size * moe_tp_size == W``); shared experts over all ``W`` ranks; the rest replicated. Rank ``r`` holds
expert block ``moe_ep_rank = r % moe_ep_size`` and slice ``moe_tp_rank = r // moe_ep_size`` (TensorRT-LLM's order).
The sharding plan: docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mapping", "ParallelConfigError"]


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run (sizes that do not divide, a rank out of range); one line."""


def _positive(name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ParallelConfigError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class Mapping:
    """One rank's place in the parallel layout.

    Attributes:
        world_size: ranks running the model.
        rank: this rank, in ``[0, world_size)``.
        tp_size: attention / dense tensor-parallel size (``world_size`` or 1).
        moe_ep_size: expert-parallel blocks.
        moe_tp_size: slices of each routed expert's intermediate dimension.
    """

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    moe_ep_size: int = 1
    moe_tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "moe_ep_size", "moe_tp_size"):
            _positive(name, getattr(self, name))
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if self.tp_size not in (1, self.world_size):
            raise ParallelConfigError(
                f"tensor_parallel_size={self.tp_size} must be 1 or the world size {self.world_size}"
            )
        if self.moe_ep_size * self.moe_tp_size != self.world_size:
            raise ParallelConfigError(
                f"moe_expert_parallel_size={self.moe_ep_size} x moe_tensor_parallel_size={self.moe_tp_size} "
                f"must equal the world size {self.world_size}"
            )

    @classmethod
    def from_sizes(
        cls,
        tensor_parallel_size: int = 1,
        moe_expert_parallel_size: int | None = None,
        moe_tensor_parallel_size: int | None = None,
        rank: int = 0,
    ) -> Mapping:
        """The layout the LLM API's three sizes describe (TensorRT-LLM's defaults).

        The world size is ``tensor_parallel_size`` when it is above 1, else the MoE's
        ``moe_expert_parallel_size * moe_tensor_parallel_size`` (attention then replicated). An unset MoE size
        is the world size divided by the other one (``tp=2`` alone: the experts' intermediate dimension split
        in two; ``tp=2, ep=2``: two blocks of whole experts).
        """
        tp = _positive("tensor_parallel_size", tensor_parallel_size)
        ep = (
            None
            if moe_expert_parallel_size is None
            else _positive("moe_expert_parallel_size", moe_expert_parallel_size)
        )
        mtp = (
            None
            if moe_tensor_parallel_size is None
            else _positive("moe_tensor_parallel_size", moe_tensor_parallel_size)
        )
        if tp > 1:
            world = tp
        else:
            world = (ep or 1) * (mtp or 1)
        if ep is None and mtp is None:
            ep, mtp = 1, world
        elif ep is None:
            assert mtp is not None
            if world % mtp:
                raise ParallelConfigError(f"moe_tensor_parallel_size={mtp} must divide the world size {world}")
            ep = world // mtp
        elif mtp is None:
            if world % ep:
                raise ParallelConfigError(f"moe_expert_parallel_size={ep} must divide the world size {world}")
            mtp = world // ep
        return cls(world_size=world, rank=rank, tp_size=tp, moe_ep_size=ep, moe_tp_size=mtp)

    def with_rank(self, rank: int) -> Mapping:
        return Mapping(self.world_size, rank, self.tp_size, self.moe_ep_size, self.moe_tp_size)

    # ------------------------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        """This rank's attention / dense share (0 when replicated)."""
        return self.rank if self.tp_size > 1 else 0

    @property
    def moe_ep_rank(self) -> int:
        return self.rank % self.moe_ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank // self.moe_ep_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (tp {self.tp_size}, moe_ep {self.moe_ep_size}, "
            f"moe_tp {self.moe_tp_size})"
        )

    @staticmethod
    def split(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
        """``[start, stop)`` of share ``index`` of ``total`` items cut in ``parts`` equal shares.

        Raises:
            ParallelConfigError: ``total`` is not a multiple of ``parts`` (naming ``what``).
        """
        if total % parts:
            raise ParallelConfigError(f"{what}={total} is not divisible by {parts} ranks")
        n = total // parts
        return index * n, (index + 1) * n

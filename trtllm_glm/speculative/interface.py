"""Speculative-decoding interface to attention metadata: draft-domain swaps around draft forwards.

With a separate draft KV manager a draft forward (eager or a graph replay) must read the draft manager's slot tables,
never the target's (docs/design.md §5, hazard §6.1). Callers bracket it with
`prepare_attn_metadata_for_draft_replay` and, in a ``finally``, `restore_attn_metadata_after_draft_replay`, or use
`draft_replay` (a ``with`` block). Prepare is exception-atomic: if it raises, every metadata attribute is back to the
exact object it held (``is``). With no draft manager (or the shared-manager mode) the swap is a no-op.
`GraphAddressGuard` is the strict opt-in check that graph-visible tensors kept their addresses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..attention.graph_check import GraphAddressError, GraphAddressGuard

__all__ = [
    "DraftReplaySaved",
    "GraphAddressError",
    "GraphAddressGuard",
    "draft_replay",
    "prepare_attn_metadata_for_draft_replay",
    "restore_attn_metadata_after_draft_replay",
]


@dataclass(frozen=True)
class DraftReplaySaved:
    """What `prepare_attn_metadata_for_draft_replay` saved; pass it to the restore.

    Attributes:
        backend_saved: the backend hook's own token (e.g. a `DraftBinding`), None when no hook ran.
    """

    backend_saved: Any


def _after_backend_hook(attn_metadata: Any, draft_kv_cache_manager: Any) -> None:
    """Post-condition of the backend hook: a separate draft manager is now the bound one.

    A module-level function so that tests can inject a failure *after* the hook has swapped everything.
    """
    if draft_kv_cache_manager is None or draft_kv_cache_manager is getattr(
        attn_metadata, "target_kv_cache_manager", draft_kv_cache_manager
    ):
        return
    if getattr(attn_metadata, "kv_cache_manager", None) is not draft_kv_cache_manager:
        raise RuntimeError("the draft-forward hook did not bind the draft KV cache manager")


def prepare_attn_metadata_for_draft_replay(
    attn_metadata: Any,
    draft_kv_cache_manager: Any,
    *,
    past_lens: Sequence[int] | None = None,
    q_lens: Sequence[int] | None = None,
    num_decode_seqs: int | None = None,
) -> DraftReplaySaved:
    """Swap manager, slot-table binding, state slots and (if given) lengths to the draft domain.

    Calls the backend hook ``attn_metadata.prepare_for_draft_forward``. Exception-atomic: whatever raises
    in here (the hook, a width error, a failure after the hook), every attribute of ``attn_metadata`` is
    restored to the exact object it held before (and batch buffers the hook refilled are refilled with the
    target's values) before the exception propagates.

    Args:
        attn_metadata: the step's metadata (after its ``prepare()``).
        draft_kv_cache_manager: the draft's own manager; None or the target's manager (shared mode) swaps
            no table.
        past_lens: optional ``[B]`` cached tokens of the draft forward.
        q_lens: optional ``[B]`` rows of the draft forward.
        num_decode_seqs: optional leading decode sequences of the draft forward.

    Returns:
        The saved state for `restore_attn_metadata_after_draft_replay`.

    Raises:
        TypeError: a separate draft manager (or draft lengths) but the metadata has no draft-forward hook.
    """
    hook = getattr(attn_metadata, "prepare_for_draft_forward", None)
    lengths = {"past_lens": past_lens, "q_lens": q_lens, "num_decode_seqs": num_decode_seqs}
    swap_lengths = any(v is not None for v in lengths.values())
    if hook is None:
        if draft_kv_cache_manager is None and not swap_lengths:
            return DraftReplaySaved(backend_saved=None)
        raise TypeError(f"{type(attn_metadata).__name__} has no prepare_for_draft_forward hook")
    # Identity snapshot of every attribute (bindings, manager, page size, host batch lists): cheap, and it
    # covers fields the hook may swap now or in the future.
    before = dict(vars(attn_metadata))
    backend_saved = None
    try:
        backend_saved = hook(draft_kv_cache_manager, **{k: v for k, v in lengths.items() if v is not None})
        _after_backend_hook(attn_metadata, draft_kv_cache_manager)
    except BaseException:
        try:
            if backend_saved is not None:
                # Also refills the batch buffers when the hook swapped lengths.
                attn_metadata.restore_after_draft_forward(backend_saved)
        finally:
            for k in [k for k in vars(attn_metadata) if k not in before]:
                delattr(attn_metadata, k)
            attn_metadata.__dict__.update(before)
        raise
    return DraftReplaySaved(backend_saved=backend_saved)


def restore_attn_metadata_after_draft_replay(attn_metadata: Any, saved: DraftReplaySaved) -> None:
    """Undo `prepare_attn_metadata_for_draft_replay`: rebind the target table, state slots, manager, lengths."""
    if saved.backend_saved is not None:
        attn_metadata.restore_after_draft_forward(saved.backend_saved)


@contextmanager
def draft_replay(
    attn_metadata: Any,
    draft_kv_cache_manager: Any,
    *,
    past_lens: Sequence[int] | None = None,
    q_lens: Sequence[int] | None = None,
    num_decode_seqs: int | None = None,
) -> Iterator[Any]:
    """``with draft_replay(meta, draft_mgr): ...`` runs the block in the draft domain; restores in ``finally``.

    Yields:
        ``attn_metadata`` (now bound to the draft domain).
    """
    saved = prepare_attn_metadata_for_draft_replay(
        attn_metadata, draft_kv_cache_manager, past_lens=past_lens, q_lens=q_lens, num_decode_seqs=num_decode_seqs
    )
    try:
        yield attn_metadata
    finally:
        restore_attn_metadata_after_draft_replay(attn_metadata, saved)

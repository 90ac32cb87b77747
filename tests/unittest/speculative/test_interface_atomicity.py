"""Exception-atomicity of `prepare_attn_metadata_for_draft_replay` with backend hooks that are NOT atomic.

tests/unittest/speculative/test_draft_tables.py injects failures into `GlmKpoolMetadata.prepare_for_draft_forward`,
which validates everything before it writes, so the interface's own rollback (the identity snapshot of every
attribute) is never needed there. Here the hook rebinds, adds and deletes attributes and then raises, or returns a
token whose restore is incomplete before a failure after the hook: every attribute must still be back to the exact
object it held (``is``), with nothing added or missing, when the exception propagates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trtllm_glm.attention.sparse.glm_kpool.metadata import GlmKpoolMetadata
from trtllm_glm.cache.manager import Glm5NextCacheManager
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.speculative import interface
from trtllm_glm.speculative.interface import draft_replay, prepare_attn_metadata_for_draft_replay

pytestmark = pytest.mark.cpu_only


class HookFailed(RuntimeError):
    pass


class SloppyMeta:
    """Metadata whose draft-forward hook swaps state piecemeal (no validation first, no cleanup on failure).

    Args:
        fail_in_hook: raise from inside the hook after it has changed attributes (no token is returned).
    """

    def __init__(self, target_mgr: object, fail_in_hook: bool) -> None:
        self.kv_cache_manager = target_mgr
        self.target_kv_cache_manager = target_mgr
        self.slot_table = torch.arange(6, dtype=torch.int32).view(2, 3)
        self.state_slots_buf = torch.tensor([0, 1])
        self.page_size = 8
        self.request_ids = [4, 5]
        self.past_lens = [12, 3]
        self.scratch = "target-only field"
        self.fail_in_hook = fail_in_hook

    def prepare_for_draft_forward(self, draft_mgr: object, **lengths: Any) -> dict[str, Any]:
        token = {"slot_table": self.slot_table, "kv_cache_manager": self.kv_cache_manager}
        self.kv_cache_manager = draft_mgr
        self.slot_table = torch.full((2, 3), 7, dtype=torch.int32)
        self.state_slots_buf = torch.tensor([5, 2])
        self.page_size = 4
        self.past_lens = list(lengths.get("past_lens", self.past_lens))
        self.draft_only = "added by the hook"
        del self.scratch
        if self.fail_in_hook:
            raise HookFailed("backend hook failed half-way")
        return token

    def restore_after_draft_forward(self, token: dict[str, Any]) -> None:
        # Deliberately incomplete: rebinds the table and the manager only.
        self.slot_table = token["slot_table"]
        self.kv_cache_manager = token["kv_cache_manager"]


def assert_identical(meta: object, before: dict[str, Any]) -> None:
    after = vars(meta)
    assert sorted(after) == sorted(before), f"added {set(after) - set(before)}, missing {set(before) - set(after)}"
    changed = [k for k in before if after[k] is not before[k]]
    assert not changed, f"attributes not restored by identity: {changed}"


@pytest.mark.parametrize("where", ["inside_hook", "after_hook"])
@pytest.mark.parametrize("lengths", [False, True], ids=["tables", "tables_and_lengths"])
def test_non_atomic_hook_is_rolled_back(monkeypatch, where: str, lengths: bool) -> None:
    target, draft = object(), object()
    meta = SloppyMeta(target, fail_in_hook=where == "inside_hook")
    if where == "after_hook":
        # The hook succeeds and returns its token, then the post-condition check fails: the interface hands the
        # token back (an incomplete restore) and must then put every other attribute back itself.
        def fail(*args: Any, **kwargs: Any) -> None:
            raise HookFailed("failure after the hook")

        monkeypatch.setattr(interface, "_after_backend_hook", fail)
    before = dict(vars(meta))
    kw = {"past_lens": [2, 9]} if lengths else {}
    with pytest.raises(HookFailed):
        prepare_attn_metadata_for_draft_replay(meta, draft, **kw)
    assert_identical(meta, before)
    assert meta.kv_cache_manager is target and meta.page_size == 8 and meta.scratch == "target-only field"
    assert not hasattr(meta, "draft_only")


def test_non_atomic_hook_through_draft_replay() -> None:
    """The context-manager form: a hook failure never reaches the block, and nothing leaks out of it."""
    meta = SloppyMeta(object(), fail_in_hook=True)
    before = dict(vars(meta))
    ran = []
    with pytest.raises(HookFailed), draft_replay(meta, object()):
        ran.append(True)
    assert not ran
    assert_identical(meta, before)


# --------------------------------------------------------------------------------------------------
# The real backend's hook, followed by a failure of the backend before it could hand back its token.

CFG = Glm5NextConfig.from_pretrained("tiny")


def make_meta() -> tuple[Glm5NextCacheManager, Glm5NextCacheManager, GlmKpoolMetadata]:
    kw: dict[str, Any] = dict(tokens_per_block=8, max_num_requests=4, num_sparse_layers=1, num_kda_layers=0)
    tgt = Glm5NextCacheManager(CFG, num_pages=24, **kw)
    drf = Glm5NextCacheManager(CFG, num_pages=6, **kw)
    tgt.add_request(100, 12 * 8)  # target ids of the requests start at 12, past the draft pool; slots differ
    drf.add_request(101)
    for rid, n in ((1, 13), (2, 6)):
        for m in (tgt, drf):
            m.add_request(rid)
            m.ensure_capacity(rid, n)
    meta = GlmKpoolMetadata(kv_cache_manager=tgt, max_num_seqs=4, max_num_tokens=32, max_pages_per_seq=4,
                            select_width=CFG.index_select_width)  # fmt: skip
    meta.prepare([1, 2], past_lens=[12, 3], q_lens=[1, 3], num_decode_seqs=2)
    return tgt, drf, meta


@pytest.mark.parametrize("lengths", [False, True], ids=["tables", "tables_and_lengths"])
def test_backend_hook_that_binds_then_raises(monkeypatch, lengths: bool) -> None:
    """`GlmKpoolMetadata.prepare_for_draft_forward` completes (draft table, state slots and manager bound,
    host batch lists replaced) and then the backend raises before returning its token: only the interface's
    attribute snapshot can undo the binding."""
    tgt, drf, meta = make_meta()
    real = GlmKpoolMetadata.prepare_for_draft_forward

    def binds_then_raises(self: GlmKpoolMetadata, draft_mgr: Any, **kw: Any) -> Any:
        real(self, draft_mgr, **kw)
        assert self.draft_binding_active
        raise HookFailed("backend failed after binding the draft domain")

    monkeypatch.setattr(GlmKpoolMetadata, "prepare_for_draft_forward", binds_then_raises)
    kw = {"past_lens": [12, 3], "q_lens": [1, 1], "num_decode_seqs": 2} if lengths else {}
    before = dict(vars(meta))
    with pytest.raises(HookFailed):
        prepare_attn_metadata_for_draft_replay(meta, drf, **kw)
    assert_identical(meta, before)
    assert not meta.draft_binding_active
    assert meta.slot_table is meta.target_slot_table and meta.state_slots_buf is meta.target_state_slots
    assert meta.kv_cache_manager is tgt and meta.q_lens == [1, 3]
    assert int(meta.slot_table_t[0, 0]) >= drf.num_pages  # still the target's ids
    # The metadata keeps working: the next target step prepares (refused while a draft binding is active).
    monkeypatch.undo()
    meta.prepare([1, 2], past_lens=[13, 6], q_lens=[1, 1], num_decode_seqs=2)
    assert meta.state_slots_t.tolist() == tgt.get_batch_state_slots([1, 2])

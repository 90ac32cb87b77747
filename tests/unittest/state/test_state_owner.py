"""`RequestStateOwner`: byte-exact snapshot / restore, validated endpoints, commit bookkeeping, and the
speculative-row guard; plus the executors keeping every slot's committed length equal to the request's."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.errors import StateError
from trtllm_glm.kda.backend import KdaBackend
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.state import RequestStateOwner, StateSnapshot

pytestmark = pytest.mark.cpu_only

S, D = 4, 16
KDA = KdaBackend()


def new_owner(num_kda_layers: int, *, num_state_slots: int = S, num_sparse_layers: int = 3) -> RequestStateOwner:
    """An owner with the KDA backend's slot planes for ``H = 2, K = 8, W = 4``."""
    cfg = Glm5NextConfig(kda_num_heads=2, kda_head_dim=8, kda_short_conv_kernel_size=4)
    return RequestStateOwner(
        num_state_slots=num_state_slots,
        num_sparse_layers=num_sparse_layers,
        num_kda_layers=num_kda_layers,
        slot_planes=KDA.slot_planes(cfg),
        layer_state=KDA.layer_state,
    )


def make_owner(seed: int = 0) -> RequestStateOwner:
    """An owner with every plane enabled and filled with distinct random bytes."""
    own = new_owner(2)
    own.enable_decode_tail_rings(max_rows=4, num_layers=2)
    own.enable_draft_hidden(D, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    for t in own._slot_planes().values():
        if t.dtype == torch.int64:
            t.copy_(torch.randint(0, 9, t.shape, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g))
    assert own.draft_hidden is not None
    own.draft_hidden.copy_(torch.randn(S, D, generator=g))
    own.commit_verified([0, 1, 2, 3], [5, 7, 9, 11])
    return own


def slot_bytes(own: RequestStateOwner, slot: int) -> dict[str, torch.Tensor]:
    out = {k: t[:, slot].contiguous().clone() for k, t in own._slot_planes().items()}
    assert own.draft_hidden is not None
    out["draft_hidden"] = own.draft_hidden[slot].clone()
    return out


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` reinterpreted as integers of its element size (floats compared bit for bit)."""
    if not x.is_floating_point():
        return x
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        # Bitwise (NaN-safe, -0.0 vs 0.0 distinguished): compare the raw bits.
        assert torch.equal(bits(a[k]), bits(b[k])), k


def test_snapshot_restore_is_byte_exact_and_touches_only_its_slot() -> None:
    own = make_owner()
    before = slot_bytes(own, 1)
    snap = own.snapshot(1, endpoint=7)
    assert isinstance(snap, StateSnapshot) and snap.endpoint == 7 and snap.nbytes > 0
    # The whole slot changes (a later step, another request on the slot, a reset) ...
    own.reset(1)
    own.commit_verified([1], [3])
    own.tail_ring[:, 1].fill_(2.5)
    neighbours = {s: slot_bytes(own, s) for s in (0, 2, 3)}
    own.restore(1, snap, endpoint=7)
    assert_same(slot_bytes(own, 1), before)
    assert own.committed_len(1) == 7
    for s, b in neighbours.items():  # a restore never writes a neighbouring slot
        assert_same(slot_bytes(own, s), b)
    # Into another slot (a request resumed elsewhere): same bytes there, the snapshot unchanged.
    own.restore(3, snap)
    assert_same(slot_bytes(own, 3), before)
    assert own.committed_len(3) == 7


@pytest.mark.parametrize("slots", [[2], [3, 0], [1, 3, 2]])
def test_reset_slots_zeroes_what_reset_does_and_nothing_else(slots: list[int]) -> None:
    """The batched reset (a step's admissions) leaves every plane as resetting each slot alone does: the slots
    zeroed (tail rings, KDA planes, decode-ring backups and counts, the draft hidden, committed lengths), every
    other slot's bytes unchanged (the rings' dump entry included)."""
    one, many = make_owner(), make_owner()
    for s in slots:
        one.reset(s)
    many.reset_slots(slots)
    for s in range(S):
        assert_same(slot_bytes(many, s), slot_bytes(one, s))
        assert many.committed_len(s) == one.committed_len(s) == (0 if s in slots else [5, 7, 9, 11][s])
    for a, b in zip(one.decode_tail_rings, many.decode_tail_rings):
        assert torch.equal(a._saved_count, b._saved_count)
    assert torch.count_nonzero(many.tail_ring[:, slots[0]]) == 0
    with pytest.raises(IndexError):
        many.reset_slots([0, S])


def test_admitting_many_requests_zeroes_their_slots_at_once(monkeypatch) -> None:
    """A step admitting several fresh requests zeroes their state slots in one batched reset, not one reset per
    request (each three to ten launches), and the output is unchanged."""
    model = Glm5NextForCausalLM.from_pretrained("tiny", layers=[0, 3], dtype="float32").eval()
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=512, max_batch_size=4, max_num_tokens=128, max_seq_len=64)
    ref = Executor(model, cfg)
    ex = Executor(model, cfg)
    calls: list[tuple[str, int]] = []
    owner = ex.manager.state
    reset, reset_slots = owner.reset, owner.reset_slots
    monkeypatch.setattr(owner, "reset", lambda slot: (calls.append(("one", slot)), reset(slot))[1])
    monkeypatch.setattr(owner, "reset_slots",
                        lambda slots, *a: (calls.append(("many", len(slots))), reset_slots(slots, *a))[1])  # fmt: skip
    prompts = [[5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5], [8, 8, 1, 2, 3, 8]]
    got = {id(e): [e.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts] for e in (ref, ex)}
    # Poison the slots the admissions will take: a reset that misses one shows in the output.
    owner._slot_planes()["tail_ring"].fill_(float("nan"))
    for t in owner.planes.values():
        t.fill_(float("nan"))
    ref.run_until_done()
    ex.run_until_done()
    assert [r.output_ids for r in got[id(ex)]] == [r.output_ids for r in got[id(ref)]]
    assert ("many", 3) in calls and not any(kind == "one" for kind, _ in calls), calls


def test_snapshot_packs_its_planes_into_one_buffer_per_leading_size() -> None:
    """A snapshot copies each leading size's planes in one launch into one buffer (the decode tail rings' per-slot
    counts and positions included; with MTP these were 3 + 4 per sparse layer clones per checkpoint), each plane a
    correctly typed, aligned view; its bytes count the buffers; later writes to the slot do not reach it."""
    own = make_owner(3)
    before = slot_bytes(own, 2)
    snap = own.snapshot(2, endpoint=9)
    storages = {t.untyped_storage().data_ptr() for t in snap.planes.values()}
    leading = {t.shape[0] for t in own._slot_planes().values()}
    assert len(storages) == len(leading) < len(snap.planes)
    for name, t in own._slot_planes().items():
        v = snap.planes[name]
        assert v.dtype == t.dtype and v.shape == t[:, 2].shape and v.data_ptr() % v.element_size() == 0
    assert (
        snap.nbytes
        == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in snap.planes.values()}.values())
        + snap.draft_hidden.untyped_storage().nbytes()
    )
    own.reset(2)
    own.restore(2, snap)
    assert_same(slot_bytes(own, 2), before)


def test_restore_rejects_a_disagreeing_endpoint_and_writes_nothing() -> None:
    own = make_owner()
    snap = own.snapshot(2, endpoint=9)
    own.commit_verified([2], [4])
    after = slot_bytes(own, 2)
    with pytest.raises(StateError, match="endpoint"):
        own.restore(2, snap, endpoint=13)
    assert_same(slot_bytes(own, 2), after)
    assert own.committed_len(2) == 13


def test_snapshot_validates_endpoint_pending_records_and_geometry() -> None:
    own = make_owner()
    with pytest.raises(StateError, match="endpoint"):
        own.snapshot(0, endpoint=6)
    with pytest.raises(IndexError):
        own.snapshot(S, endpoint=0)

    class Rec:
        def commit(self, num_accepted, state) -> None:  # noqa: ANN001
            pass

    own.record_verify(0, Rec())
    with pytest.raises(StateError, match="pending"):
        own.snapshot(0, endpoint=5)
    own.discard_pending()
    snap = own.snapshot(0, endpoint=5)
    other = new_owner(1)
    with pytest.raises(StateError, match="geometry"):
        other.restore(0, snap)


def test_commit_verified_folds_pending_records_and_advances_lengths() -> None:
    own = make_owner()
    seen: list[tuple[int, list[int]]] = []

    class Rec:
        def __init__(self, idx: int) -> None:
            self.idx = idx

        def commit(self, num_accepted, state) -> None:  # noqa: ANN001
            assert state.recurrent.data_ptr() == own.kda_recurrent[self.idx].data_ptr()
            seen.append((self.idx, list(num_accepted)))

    own.record_verify(1, Rec(1))
    own.record_verify(0, Rec(0))
    own.commit_verified([3, 0], [2, 1])
    assert seen == [(0, [2, 1]), (1, [2, 1])]
    assert not own.has_pending
    assert own.committed_len(3) == 13 and own.committed_len(0) == 6
    own.commit_verified([3], [1])  # nothing pending: lengths only
    assert len(seen) == 2 and own.committed_len(3) == 14
    with pytest.raises(ValueError):
        own.commit_verified([0, 1], [1])


def test_speculative_rows_restore_their_slots_also_on_error() -> None:
    own = make_owner()
    ring = own.tail_ring[2]
    before = ring.clone()
    slots = torch.tensor([3, 1])
    with pytest.raises(RuntimeError), own.speculative_rows(2, slots):
        ring[1].fill_(7.0)
        ring[3].fill_(8.0)
        ring[0].fill_(9.0)  # not guarded: stays written
        raise RuntimeError("injected")
    assert torch.equal(ring[[1, 2, 3]], before[[1, 2, 3]])
    assert torch.equal(ring[0], torch.full_like(ring[0], 9.0))


# ------------------------------------------------------------------------------------------------
# With the model


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("tiny", seed=0)


def test_restore_replays_decoding_bit_for_bit(model) -> None:
    """Snapshot after a non-4-aligned prompt, decode, restore, decode the same tokens again: identical logits
    (KDA state, conv window and the open pool's tail ring all come back)."""
    h = ModelHarness(model, tokens_per_block=8)
    own = h.manager.state
    rng = random.Random(0)
    toks = [rng.randrange(256) for _ in range(23)]
    h.step([(0, toks)])
    own.commit_verified(h.meta.state_slots, [len(toks)])
    slot = h.manager.get_state_slot(0)
    snap = own.snapshot(slot, endpoint=23)

    def decode(ids: list[int]) -> torch.Tensor:
        out = []
        for t in ids:
            out.append(model.compute_logits(h.step([(0, [t])], num_decode_seqs=1)))
            own.commit_verified(h.meta.state_slots, [1])
        return torch.cat(out)

    cont = [rng.randrange(256) for _ in range(6)]
    first = decode(cont)
    with pytest.raises(StateError):
        own.restore(slot, snap, endpoint=29)
    own.restore(slot, snap, endpoint=23)
    h.lengths[0] = 23
    again = decode(cont)
    assert torch.equal(first, again)


def _check_lengths(ex: Executor) -> int:
    """Every running request's slot holds exactly its committed tokens (and its MTP history in a separate
    draft manager); returns how many were checked."""
    n = 0
    for r in ex.running:
        if not ex.manager.has_request(r.request_id):
            continue
        assert ex.manager.state.committed_len(ex.manager.get_state_slot(r.request_id)) == r.num_computed
        n += 1
        dm = getattr(ex, "draft_manager", None)
        if dm is not None and dm is not ex.manager and dm.has_request(r.request_id):
            assert dm.state.committed_len(dm.get_state_slot(r.request_id)) == ex.state[r.request_id].mtp_len
    return n


def _round_trip(ex: Executor) -> None:
    """Snapshot every running request's slots at their committed endpoints and restore them in place (the
    target's, and a separate draft manager's at the MTP history length)."""
    pairs = []
    for r in ex.running:
        if ex.manager.has_request(r.request_id):
            pairs.append((ex.manager, r.request_id, r.num_computed))
        dm = getattr(ex, "draft_manager", None)
        if dm is not None and dm is not ex.manager and dm.has_request(r.request_id):
            pairs.append((dm, r.request_id, ex.state[r.request_id].mtp_len))
    for mgr, rid, end in pairs:
        slot = mgr.get_state_slot(rid)
        mgr.state.restore(slot, mgr.state.snapshot(slot, end), endpoint=end)


def _make(model, mode: str) -> Executor:
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=160, max_batch_size=3, max_num_tokens=64, max_seq_len=96)
    if mode == "plain":
        return Executor(model, cfg)
    if mode == "ngram":
        return SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=3))
    kv = "separate" if mode == "mtp_separate" else "shared"
    return SpeculativeExecutor(
        model, cfg, MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=3, draft_kv_mode=kv)
    )


@pytest.mark.parametrize("mode", ["plain", "ngram", "mtp_separate", "mtp_shared"])
def test_executors_keep_committed_lengths(model, mode: str) -> None:
    """Every step leaves each slot's committed length equal to the request's, so a snapshot at that endpoint
    is always accepted; restoring it in place between steps changes no token and no MTP draft."""
    outs = []
    for round_trip in (False, True):
        ex = _make(model, mode)
        rng = random.Random(1)
        for n in (13, 30, 7, 21):
            base = [rng.randrange(256) for _ in range(5)]
            ex.add_request((base * 8)[:n], SamplingParams(max_tokens=20, ignore_eos=True))
        checked, drafts, done = 0, [], []
        while ex.has_work:
            done += ex.step()
            checked += _check_lengths(ex)
            if round_trip:
                _round_trip(ex)
            if isinstance(ex, SpeculativeExecutor):
                drafts.append({rid: list(st.drafts) for rid, st in ex.state.items()})
        assert checked > 0
        outs.append((sorted((r.request_id, r.output_ids) for r in done), drafts))
    assert outs[0] == outs[1]


def test_slots_are_acquired_ascending_and_released_once() -> None:
    from trtllm_glm.errors import CapacityError

    own = new_owner(0, num_state_slots=2, num_sparse_layers=1)
    assert [own.acquire(), own.acquire()] == [0, 1] and own.num_free_slots == 0
    with pytest.raises(CapacityError):
        own.acquire()
    own.release(0)
    with pytest.raises(StateError):
        own.release(0)
    assert own.num_free_slots == 1 and own.acquire() == 0

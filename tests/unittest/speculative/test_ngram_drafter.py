"""The n-gram drafter's per-request index gives the plain scan's proposals, token for token."""

from __future__ import annotations

import random

import pytest

from trtllm_glm.speculative.drafters import DraftSeq, DraftState, NGramDrafter

pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize(("max_n", "min_n"), [(4, 1), (3, 2), (1, 1), (5, 3)])
@pytest.mark.parametrize("vocab", [2, 3, 7, 1000])
def test_index_matches_the_scan_as_tokens_grow(max_n: int, min_n: int, vocab: int) -> None:
    """Small vocabularies make many overlapping matches (repeats, runs of one token); tokens arrive in
    chunks of 1-5 as accepted drafts do; every proposal equals the scan's, for every draft length."""
    rng = random.Random(vocab * 100 + max_n * 10 + min_n)
    d = NGramDrafter(max_draft_len=6, max_n=max_n, min_n=min_n)
    for rid in range(3):
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        matched = 0
        while len(toks) < 120:
            for k in (1, 3, 6, 9):
                want = d.propose(toks, k)
                assert d.propose_indexed(rid, toks, k) == want, (rid, len(toks), k)
                matched += bool(want)
            toks.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 6)))
        assert matched or vocab == 1000


def test_release_and_shrunk_lists_rebuild_the_index() -> None:
    rng = random.Random(5)
    d = NGramDrafter(max_draft_len=4)
    toks = [rng.randrange(4) for _ in range(60)]
    assert d.propose_indexed(0, toks, 4) == d.propose(toks, 4)
    d.release(0)
    assert 0 not in d._index
    # Another request's shorter list under a reused id: indexed afresh, not read from stale entries.
    short = [rng.randrange(4) for _ in range(9)]
    d.propose_indexed(1, toks, 4)
    assert d.propose_indexed(1, short, 4) == d.propose(short, 4)
    assert d.propose_indexed(2, [7], 4) == [] and d.propose_indexed(2, [7, 7], 0) == []


def test_draft_uses_the_index() -> None:
    d = NGramDrafter(max_draft_len=3)
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    seq = DraftSeq(request_id=4, state=DraftState(), tokens=toks, num_output=0, num_computed=len(toks),
                   committed=1, row_offset=0, greedy=True, live=True, want=2)  # fmt: skip
    d.draft([seq], hidden=None)  # type: ignore[arg-type]
    assert seq.state.drafts == [3, 8] == d.propose(toks, 2)
    assert 4 in d._index

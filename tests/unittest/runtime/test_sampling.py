"""SamplingParams validation and the Sampler: greedy, seeded reproducibility, top-k / top-p masks."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.runtime.sampling import Sampler, SamplingParams, make_generator, top2_gap

pytestmark = pytest.mark.cpu_only

V = 50


def _logits(b: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_defaults_are_greedy() -> None:
    p = SamplingParams()
    assert p.greedy and p.max_tokens == 32 and p.top_p == 1.0 and p.top_k == 0 and p.seed is None
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),  # -1 is off, as at the server
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed="7"), "seed"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
        (dict(end_id=-2), "end_id"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_invalid_params_raise(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_ids() -> None:
    assert SamplingParams(stop_token_ids=[5]).stop_ids([9, 10]) == {5, 9, 10}
    assert SamplingParams(stop_token_ids=[5], end_id=3).stop_ids([9]) == {5, 3}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_ids([9]) == {5}


def test_greedy_argmax_with_ties_to_lower_id() -> None:
    logits = _logits(4, 0)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1.0
    params = [SamplingParams()] * 4
    out = Sampler().sample(logits, params, [None] * 4)
    assert out.dtype == torch.int64
    assert out.tolist() == [int(torch.argmax(r)) for r in logits]
    assert out[2].item() == 7


def test_greedy_rows_do_not_consume_draws() -> None:
    logits = _logits(1, 1)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    Sampler().sample(logits, [SamplingParams()], [g])
    assert torch.equal(g.get_state(), state)


def test_seeded_sampling_reproducible_and_batch_independent() -> None:
    s = Sampler()
    target = SamplingParams(temperature=1.3, top_p=0.9, top_k=20, seed=1234)
    row = _logits(1, 2, scale=1.0)

    def run(others: int, pos: int, steps: int = 12) -> list[int]:
        g = make_generator(target)
        other_params = [SamplingParams(temperature=0.8, seed=99 + j) for j in range(others)]
        other_gens = [make_generator(p) for p in other_params]
        toks = []
        for step in range(steps):
            batch = _logits(others + 1, 100 + step + others, scale=1.0)
            batch[pos] = row[0] + 0.1 * step
            params = other_params[:pos] + [target] + other_params[pos:]
            gens = other_gens[:pos] + [g] + other_gens[pos:]
            toks.append(int(s.sample(batch, params, gens)[pos]))
        return toks

    alone = run(0, 0)
    assert run(0, 0) == alone
    assert run(3, 1) == alone
    assert run(5, 5) == alone
    assert len(set(alone)) > 1  # really sampling, not argmax
    other_seed = SamplingParams(temperature=1.3, top_p=0.9, top_k=20, seed=4321)
    g2 = make_generator(other_seed)
    toks2 = [int(s.sample(row + 0.1 * i, [other_seed], [g2])[0]) for i in range(12)]
    assert toks2 != alone


def _brute_keep(row: torch.Tensor, p: SamplingParams) -> tuple[list[int], list[float]] | None:
    """Kept ids (descending prob, ties to lower id) and their probabilities, in float64; ``None`` if the top-p
    boundary is too close to call in fp32."""
    scaled = [float(v) / p.temperature for v in row.double()]
    order = sorted(range(len(scaled)), key=lambda j: (-scaled[j], j))
    if p.top_k:
        order = order[: p.top_k]
    m = max(scaled[j] for j in order)
    e = [torch.tensor(scaled[j] - m, dtype=torch.float64).exp().item() for j in order]
    z = sum(e)
    probs = [x / z for x in e]
    if p.top_p < 1.0:
        acc, n = 0.0, 0
        for q in probs:
            if abs(acc - p.top_p) < 1e-5:
                return None
            if acc >= p.top_p:
                break
            acc += q
            n += 1
        order, probs = order[:n], probs[:n]
        z = sum(probs)
        probs = [q / z for q in probs]
    return order, probs


@pytest.mark.parametrize("top_k", [0, 1, 5, 17])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_filter_matches_brute_force(top_k, top_p, temperature) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(4):
        row = _logits(1, 1000 + seed)[0]
        row[3] = row[11] = row.max() - 0.5  # a tie near the top exercises tie order
        ref = _brute_keep(row, p)
        if ref is None:
            continue
        ids, probs = Sampler.filtered_probs(row, p)
        assert ids.tolist() == ref[0]
        torch.testing.assert_close(probs.double(), torch.tensor(ref[1], dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_top_p_keeps_at_least_one_and_draws_only_kept() -> None:
    row = torch.zeros(V)
    row.normal_(generator=torch.Generator().manual_seed(3))
    row[13] = 30.0  # nearly all mass on 13
    p = SamplingParams(temperature=1.0, top_p=0.01, seed=0)
    ids, probs = Sampler.filtered_probs(row, p)
    assert ids.tolist() == [13] and probs.tolist() == [1.0]
    p2 = SamplingParams(temperature=1.0, top_k=3, seed=0)
    logits = _logits(1, 4).repeat(200, 1)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    g = make_generator(p2)
    out = Sampler().sample(logits, [p2] * 200, [g] * 200)
    assert set(out.tolist()) == allowed  # all three seen in 200 draws, nothing else


def test_sample_frequencies_follow_filtered_distribution() -> None:
    p = SamplingParams(temperature=1.0, top_k=4, seed=11)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0] + [-1.0] * (V - 4))
    g = make_generator(p)
    n = 4000
    out = Sampler().sample(row.repeat(n, 1), [p] * n, [g] * n)
    freq = torch.bincount(out, minlength=V).double() / n
    expect = torch.softmax(row[:4].double(), 0)
    assert freq[4:].sum() == 0
    assert (freq[:4] - expect).abs().max() < 0.03


def test_sample_checks_shapes() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(_logits(2, 0), [SamplingParams()], [None])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler().sample(torch.randn(V), [SamplingParams()], [None])


def test_top2_gap() -> None:
    logits = _logits(3, 6)
    logits[1, 4] = logits[1, 9] = logits[1].max() + 2.0
    gap = top2_gap(logits)
    srt = logits.sort(dim=-1, descending=True).values
    torch.testing.assert_close(gap, srt[:, 0] - srt[:, 1])
    assert gap[1] == 0 and (gap[[0, 2]] > 0).all()
    assert torch.equal(Sampler.top2_gap(logits), gap)
    with pytest.raises(ValueError):
        top2_gap(torch.randn(2, 1))


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(0, 1.0, 1.0), (0, 0.9, 0.7), (17, 1.0, 1.3), (5, 0.5, 1.0), (0, 0.05, 2.0)]
)
def test_draw_inverts_the_filtered_distribution(top_k, top_p, temperature) -> None:
    """The sync-free draw picks, at a uniform ``u``, the kept token whose cumulative interval holds ``u``:
    checked at the middle of each of the first kept tokens' intervals against `filtered_probs` (the
    reference filter), so the top-p mask keeps exactly the reference's prefix in the reference's order."""
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for seed in range(3):
        row = _logits(1, 2000 + seed, scale=3.0)[0]
        row[5] = row[9] = row.max() - 0.25  # a tie near the top: lower id first
        ids, probs = Sampler.filtered_probs(row, p)
        c = torch.cumsum(probs.double(), 0)
        lo = torch.cat([c.new_zeros(1), c[:-1]])
        for k in range(min(len(ids), 40)):
            if probs[k] < 1e-5:
                continue  # an interval too thin to aim at in fp32
            u = float((lo[k] + c[k]) / 2 / c[-1])
            assert int(Sampler._draw(row[None], [p], [u])) == int(ids[k]), (seed, k)
        # The top of the range: the last kept token (never one past it).
        assert int(Sampler._draw(row[None], [p], [1.0 - 1e-12])) == int(ids[-1])


def test_rows_drawn_together_match_rows_drawn_alone() -> None:
    """A batch of differently filtered rows (temperature, top-k, top-p, ties) draws, row for row, what each
    row draws alone at the same uniform: the batched filter lets no row see another's parameters."""
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=17),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=5, top_p=0.5),
        SamplingParams(temperature=0.5, top_p=0.05),
    ]
    rows = _logits(len(params), 77, scale=3.0)
    rows[2, 4] = rows[2, 8] = rows[2].max() + 0.5
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        u = torch.rand(len(params), dtype=torch.float64, generator=g).tolist()
        together = Sampler._draw(rows, params, u).tolist()
        alone = [int(Sampler._draw(rows[i : i + 1], [p], [u[i]])) for i, p in enumerate(params)]
        assert together == alone
    # In a mixed batch the greedy rows keep their argmax and the sampled ones land inside their filters.
    mixed = [SamplingParams(), *params[:2], SamplingParams(top_k=1)]
    out = Sampler().sample(rows[:4], mixed, [make_generator(SamplingParams(seed=i)) for i in range(4)]).tolist()
    assert out[0] == int(rows[0].argmax()) and out[3] == int(rows[3].argmax())
    assert out[1] in Sampler.filtered_probs(rows[1], params[0])[0].tolist()
    assert out[2] in Sampler.filtered_probs(rows[2], params[1])[0].tolist()

"""The fused MoE router kernel (`trtllm_glm.moe.router.fused_route`) under Triton's interpreter against the torch
reference (`route_reference`), the dispatch of `route`, and the tiny model with the router forced to the kernel.

Ids must equal the reference's exactly (same experts, same order: descending biased score, equal scores to the
lower id); weights agree to rtol 1e-6 (the normalising sum runs in another order). Outputs are poisoned first,
so an element the kernel never writes shows.

The interpreter's exponential is numpy's and torch's CPU sigmoid uses its own vectorised one: the two differ by
an ulp for some inputs. Random rows are therefore redrawn until no two of their top ``k + 1`` biased scores lie
within 4e-6 of each other (in float64), which keeps the exact-id comparison meaningful on any CPU; exact ties
come from the adversarial rows instead (quantised logits with a level grid far coarser than an ulp, saturated
sigmoids of exactly 0 or 1, equal biases), where equal inputs give equal scores in both implementations.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from tests.router_checks import count_fused_route_calls
from trtllm_glm.moe.router import ROUTER_BACKEND_ENV, fused_route, route, route_reference, router_backend

pytestmark = [
    pytest.mark.cpu_only,
    # Triton's interpreter itself trips this numpy deprecation.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    # numpy's exp of a large argument under the interpreter: inf is what the sigmoid needs there.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

SENTINEL_ID = -7
NEAR_TIE = 4e-6


def _poisoned(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, k), SENTINEL_ID, dtype=torch.int64), torch.full((n, k), float("nan"))


def _has_near_tie(logits_row: torch.Tensor, bias: torch.Tensor, k: int) -> bool:
    choice = torch.sigmoid(logits_row.double()) + bias.double()
    top = choice.sort(descending=True).values[: k + 1]
    return bool((top[:-1] - top[1:] < NEAR_TIE).any())


def _random_logits(n: int, e: int, k: int, bias: torch.Tensor, g: torch.Generator, scale: float = 2.0):
    """``[N, E]`` fresh normal logits; a row with a near-tie at its top is redrawn (see the module docstring)."""
    rows = []
    for _ in range(n):
        row = torch.randn(e, generator=g) * scale
        while _has_near_tie(row, bias, k):
            row = torch.randn(e, generator=g) * scale
        rows.append(row)
    return torch.stack(rows)


def _check(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    norm: bool,
    scaling: float,
    rows_per_program: int | None = None,
    equal_nan: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    out = _poisoned(n, k)
    ids, w = fused_route(logits, bias, k, norm, scaling, out=out, rows_per_program=rows_per_program)
    assert ids is out[0] and w is out[1]
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (n, k)
    ref_ids, ref_w = route_reference(logits, bias, k, norm, scaling)
    assert (ids != SENTINEL_ID).all()
    assert torch.equal(ids, ref_ids), f"ids differ:\n{ids}\nvs reference\n{ref_ids}"
    if not equal_nan:
        assert not torch.isnan(w).any()
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-12, equal_nan=equal_nan)
    return ids, w


@pytest.mark.parametrize("n", [1, 3, 17])
# top_k > E is rejected (test_bad_args): those pairs are left out.
@pytest.mark.parametrize(("k", "e"), [(k, e) for k in (1, 2, 8) for e in (4, 8, 33, 288) if k <= e])
@pytest.mark.parametrize("norm", [True, False])
def test_random_rows_match_reference(n: int, k: int, e: int, norm: bool) -> None:
    g = torch.Generator().manual_seed(1000 * e + 10 * n + k)
    bias = torch.randn(e, generator=g) * 0.1
    logits = _random_logits(n, e, k, bias, g)
    _check(logits, bias, k, norm, 2.5 if norm else 1.0)


@pytest.mark.parametrize("rows_per_program", [1, 2, 4, 16])
def test_rows_per_program(rows_per_program: int) -> None:
    """Several rows per program, the last program part-filled (17 rows)."""
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(33, generator=g) * 0.3
    logits = _random_logits(17, 33, 8, bias, g, scale=3.0)
    _check(logits, bias, 8, True, 1.7, rows_per_program=rows_per_program)


def test_row_stride() -> None:
    """Rows of a wider buffer (a row stride above E) are read in place."""
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(33, generator=g) * 0.1
    wide = _random_logits(5, 40, 8, torch.cat([bias, torch.zeros(7)]), g)
    logits = wide[:, :33]
    if any(_has_near_tie(r, bias, 8) for r in logits):
        pytest.fail("test data has a near-tie; change the seed")
    assert not logits.is_contiguous()
    _check(logits, bias, 8, True, 2.0)


@pytest.mark.parametrize("e", [8, 33, 288])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("bias_kind", ["zero", "equal", "two_levels"])
@pytest.mark.parametrize("norm", [True, False])
def test_quantised_logits_ties(e: int, k: int, bias_kind: str, norm: bool) -> None:
    """Logits on a few levels: many experts share each biased score, and the kernel must take equal scores in
    ascending id order, as the reference's stable sort does."""
    g = torch.Generator().manual_seed(31 * e + k)
    n = 17
    levels = torch.tensor([-2.75, -0.5, 0.625, 1.25, 3.0])
    logits = levels[torch.randint(0, levels.numel(), (n, e), generator=g)]
    if bias_kind == "zero":
        bias = torch.zeros(e)
    elif bias_kind == "equal":
        bias = torch.full((e,), 0.375)
    else:
        # Two bias levels 2 apart: the high-bias experts all beat the others, ties inside each level.
        bias = torch.where(torch.rand(e, generator=g) < 0.3, 2.0, 0.0)
    ids, _ = _check(logits, bias, k, norm, 2.5)
    # The property itself, not only agreement: within a run of equal biased scores, ids ascend.
    choice = torch.sigmoid(logits) + bias
    picked = choice.gather(1, ids)
    same = picked[:, 1:] == picked[:, :-1]
    if k > 1:
        assert same.any(), "the data should contain ties inside the top-k"
    assert (ids[:, 1:] > ids[:, :-1])[same].all()


def test_all_equal_rows_take_the_first_ids() -> None:
    for e, k in ((8, 8), (33, 2), (288, 8)):
        logits = torch.full((3, e), 0.75)
        ids, w = _check(logits, torch.zeros(e), k, True, 1.0)
        assert ids.tolist() == [list(range(k))] * 3
        torch.testing.assert_close(w, torch.full((3, k), 1.0 / k))


@pytest.mark.parametrize("norm", [True, False])
def test_saturated_sigmoids_tie(norm: bool) -> None:
    """Very large / small logits saturate the sigmoid to exactly 1 or 0 (and +-inf give 1 / 0): ties between
    different logits, broken by id. A row whose every score is 0 gets weights 0 (the 1e-20 epsilon)."""
    g = torch.Generator().manual_seed(11)
    e, n = 288, 17
    values = torch.tensor([-1e4, -200.0, -120.0, 40.0, 1e4, float("inf"), float("-inf"), 0.5])
    logits = values[torch.randint(0, values.numel(), (n, e), generator=g)]
    logits[0] = -1e4  # all scores exactly 0
    logits[1] = float("inf")  # all scores exactly 1
    logits[2, ::2] = 60.0
    for bias in (torch.zeros(e), torch.where(torch.rand(e, generator=g) < 0.5, 0.25, 0.0)):
        for k in (1, 2, 8):
            ids, w = _check(logits, bias, k, norm, 2.5)
            assert (w[0] == 0).all()
            if not bias.any():
                assert ids[0].tolist() == ids[1].tolist() == list(range(k))


def test_nan_logits_sort_first_and_do_not_crash() -> None:
    """A NaN score sorts above every number in the reference (torch.sort, descending), lower id first among
    NaNs; the kernel picks the same ids, and the weights carry the NaN (the whole row's with normalisation)."""
    g = torch.Generator().manual_seed(12)
    e = 33
    bias = torch.randn(e, generator=g) * 0.1
    logits = _random_logits(4, e, 8, bias, g)
    logits[0, [5, 20]] = float("nan")
    logits[1, :] = float("nan")
    logits[2, 7] = float("nan")
    for norm in (True, False):
        ids, w = _check(logits, bias, 8, norm, 2.0, equal_nan=True)
        assert ids[0, :2].tolist() == [5, 20]
        assert ids[1].tolist() == list(range(8))
        assert ids[2, 0] == 7
        assert torch.isnan(w[0]).all() if norm else torch.isnan(w[0]).sum() == 2
        assert not torch.isnan(w[3]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_bias(dtype: torch.dtype) -> None:
    """A bf16 / fp16 model keeps its correction bias in that dtype: the kernel upcasts it on load."""
    g = torch.Generator().manual_seed(13)
    bias = (torch.randn(288, generator=g) * 0.1).to(dtype)
    logits = _random_logits(3, 288, 8, bias.float(), g)
    _check(logits, bias, 8, True, 2.5)


def test_empty_batch() -> None:
    ids, w = fused_route(torch.empty(0, 8), torch.zeros(8), 2, True, 1.0)
    assert ids.shape == w.shape == (0, 2) and ids.dtype == torch.int64 and w.dtype == torch.float32


def test_bad_args() -> None:
    x, b = torch.randn(2, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="float32"):
        fused_route(x.double(), b, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"\[N, E\]"):
        fused_route(x[None], b, 2, True, 1.0)
    with pytest.raises(ValueError, match="unit last stride"):
        fused_route(torch.randn(8, 2).t(), b, 2, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        fused_route(x, torch.zeros(7), 2, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        fused_route(x, torch.zeros(8, dtype=torch.int64), 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        fused_route(x, b, 9, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        fused_route(x, b, 0, True, 1.0)
    with pytest.raises(ValueError, match="rows_per_program"):
        fused_route(x, b, 2, True, 1.0, rows_per_program=3)
    with pytest.raises(ValueError, match="out ids"):
        fused_route(x, b, 2, True, 1.0, out=(torch.empty(2, 2, dtype=torch.int32), torch.empty(2, 2)))
    with pytest.raises(ValueError, match="out weights"):
        fused_route(x, b, 2, True, 1.0, out=(torch.empty(2, 2, dtype=torch.int64), torch.empty(2, 3)))


def test_backend_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the reference on the CPU and under autograd, the kernel for CUDA inference; an explicit 'triton'
    runs the kernel anywhere (interpreted on the CPU), except for group-limited routing; a bad name is an
    error."""
    x = torch.randn(2, 8)
    assert router_backend(x) == "torch"
    assert router_backend(x, backend="triton") == "triton"
    if torch.cuda.is_available():
        assert router_backend(x.cuda()) == "triton"
    with pytest.raises(RuntimeError, match="no backward"):
        router_backend(x.requires_grad_(), backend="triton")
    assert router_backend(x) == "torch"
    with pytest.raises(ValueError, match="backend"):
        router_backend(x, backend="cuda")

    calls = count_fused_route_calls(monkeypatch)
    g = torch.Generator().manual_seed(14)
    bias = torch.randn(16, generator=g) * 0.1
    logits = _random_logits(3, 16, 4, bias, g)
    ref = route_reference(logits, bias, 4, True, 2.0)
    monkeypatch.setenv(ROUTER_BACKEND_ENV, "triton")
    got = route(logits, bias, 4, True, 2.0)
    assert len(calls) == 1
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
    # Group-limited routing has no kernel: the reference, even when the kernel is asked for.
    grouped = route(logits, bias, 4, True, 2.0, n_group=4, topk_group=2)
    assert len(calls) == 1
    ref_g = route_reference(logits, bias, 4, True, 2.0, n_group=4, topk_group=2)
    assert torch.equal(grouped[0], ref_g[0]) and torch.equal(grouped[1], ref_g[1])
    monkeypatch.setenv(ROUTER_BACKEND_ENV, "torch")
    route(logits, bias, 4, True, 2.0)
    assert len(calls) == 1


def test_router_module_uses_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MoEGate.forward` is the fp32 linear then `route`: the same result as the reference on its logits, with
    the backend forced either way (module attribute or environment)."""
    from trtllm_glm.modules.ffn import MoEGate

    gate = MoEGate(32, 33, 8, True, 2.5)
    gate.reset_parameters(torch.Generator().manual_seed(15), 0.2)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.float(), gate.weight.float())
        ref = route_reference(logits, gate.e_score_correction_bias, 8, True, 2.5)
        gate.backend = "triton"
        got = gate(x)
        gate.backend = None
        monkeypatch.setenv(ROUTER_BACKEND_ENV, "torch")
        got_torch = gate(x)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
    assert torch.equal(got_torch[0], ref[0]) and torch.equal(got_torch[1], ref[1])
    # Training: the reference (differentiable) path under auto.
    monkeypatch.delenv(ROUTER_BACKEND_ENV)
    ids, w = gate(x)
    assert w.requires_grad and torch.equal(ids, ref[0])


def test_model_with_the_kernel_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model with every MoE layer's routing on the interpreted kernel: the same prompt logits (up to the
    ulps of the weights' normalising sum) and the same greedy tokens as with the reference."""
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.sampling import SamplingParams

    model = Glm5NextForCausalLM.from_pretrained("tiny", dtype="float32", device="cpu").eval()
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=256, max_batch_size=2, max_num_tokens=64, max_seq_len=64)
    calls = count_fused_route_calls(monkeypatch)
    prompt = [5, 9, 2, 7, 5, 11, 3]

    def run(backend: str):
        monkeypatch.setenv(ROUTER_BACKEND_ENV, backend)
        logits = ModelHarness(model, max_seq_len=64).prefill_logits(0, prompt)
        ex = Executor(model, cfg)
        reqs = [ex.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in (prompt, [3, 1])]
        ex.run_until_done()
        return logits, [r.output_ids for r in reqs]

    ref_logits, ref_tokens = run("torch")
    assert not calls
    logits, tokens = run("triton")
    assert calls
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)

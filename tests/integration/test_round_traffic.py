"""The host <-> device traffic of a steady speculative round (issue 43: the round is host- and sync-bound).

Counted with `trtllm_glm.traffic` and the tensor-read hooks of `benchmarks.harness.host_traffic` (as
``benchmarks/bench_round_host.py`` counts them), on the CPU with CUDA graphs emulated: the calls are the GPU's, so
the counts are too. A steady MTP K = 3 round under the overlap scheduler (early drafts, the LLM API's defaults; and
drafting rounds launched ahead, ``overlap_rounds``) waits for the device once: its results, which also cover the
drafts it verified (their copy was queued before it). Greedy output stays plain greedy's.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.host_traffic import recorded
from tests.spec_helpers import SNIPPETS, emulate_graphs
from trtllm_glm import traffic
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.config import MTPDecodingConfig
from trtllm_glm.transfer import to_device

pytestmark = pytest.mark.cpu_only

K = 3
GEN = 40
WARMUP = 4
ROUNDS = 4


@pytest.fixture(scope="module")
def model() -> Glm5NextForCausalLM:
    return Glm5NextForCausalLM.from_pretrained("small", dtype="float32").eval()


def config(graphs: bool, overlap: bool) -> ExecutorConfig:
    gcfg = CudaGraphConfig(batch_sizes=[1, 2, 3], enable_padding=True) if graphs else None
    return ExecutorConfig(tokens_per_block=8, max_tokens=2048, max_batch_size=3, max_num_tokens=64, max_seq_len=160,
                          cuda_graph_config=gcfg, overlap_scheduler=overlap)  # fmt: skip


def prompts() -> list[list[int]]:
    return [list(t.encode()) for t in SNIPPETS[:3]]


def test_recording_counts_puts_and_reads_only_inside() -> None:
    to_device([1, 2], "cpu")  # not recorded
    with traffic.recording() as rec:
        to_device([1, 2, 3], "cpu")
        traffic.read("here")
        with traffic.recording() as inner:
            to_device([4], "cpu")
        to_device([5], "cpu")
    assert rec.num_puts == 2 and rec.reads == {"here": 1} and inner.num_puts == 1
    # The caller of `to_device` is the site (outside the package: the innermost frame outside the transfer code).
    assert all("test_round_traffic.py" in site for site in rec.puts), rec.puts
    assert traffic.current() is None


def test_tensor_reads_are_counted_inside_the_hooks_only() -> None:
    from trtllm_glm.runtime.cuda_graph import HostResults

    t = torch.arange(3)
    with recorded() as rec:
        t.tolist()  # from the tests, not the package: not a package read
        HostResults(t.clone(), None).wait()  # the package's own read-back: counted once, by its site
    assert rec.reads == {"runtime/cuda_graph.py HostResults.wait": 1}
    assert t.tolist() == [0, 1, 2]  # the hooks are gone


@pytest.mark.parametrize("ahead", [False, True], ids=["early_draft", "overlap_rounds"])
def test_steady_mtp_round_waits_for_the_device_once(model, monkeypatch, ahead) -> None:  # noqa: ANN001
    """After warm-up every step is one steady K = 3 round (an early draft, or a round launched ahead), each with
    exactly one blocking read: its results (``HostResults.wait``). The drafts it verified are read with them,
    not by a wait of their own after the verify's launch (``DeviceDrafts.rows``, the second read before). With early
    drafts the draft's catch-up description is the verify's: copied once (9 puts a round before, 4 or 5 now)."""
    params = SamplingParams(max_tokens=GEN, ignore_eos=True)
    ref = Executor(model, config(graphs=False, overlap=False))
    refs = [ref.add_request(p, params) for p in prompts()]
    ref.run_until_done()

    emulate_graphs(monkeypatch)
    spec = MTPDecodingConfig(num_nextn_predict_layers=K, adaptive=False, overlap_rounds=ahead)
    ex = SpeculativeExecutor(model, config(graphs=True, overlap=True), spec)
    reqs = [ex.add_request(p, params) for p in prompts()]
    for _ in range(WARMUP):
        ex.step()
    steady0 = ex.num_early_drafts + ex.num_overlapped_rounds
    per_round, puts = [], []
    for _ in range(ROUNDS):
        with recorded() as rec:
            ex.step()
        per_round.append(dict(rec.reads))
        puts.append(rec.puts)
    assert ex.num_early_drafts + ex.num_overlapped_rounds - steady0 == ROUNDS, "the rounds were not steady"
    assert per_round == [{"runtime/cuda_graph.py HostResults.wait": 1}] * ROUNDS
    if not ahead:
        # Puts: the verify's description (lengths, rows; its slot table only when a page was added), its accepted
        # counts and its inputs. The draft's catch-up is the verify's rows again: nothing copied for it, nor for its
        # slots (the same every round).
        for p in puts:
            assert sum(n for site, n in p.items() if "metadata.py" in site and "prepare" in site) == 2, p
            assert p.total() - sum(n for site, n in p.items() if "_fill_table" in site) == 4, p
    ex.run_until_done()
    for a, b in zip(refs, reqs):
        assert b.output_ids == a.output_ids

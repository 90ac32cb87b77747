"""A small executor run shared by the piecewise tests: two prompts prefill, then two more join them while they decode
(an admission step)."""

from __future__ import annotations

from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.request import Request
from trtllm_glm.runtime.sampling import SamplingParams

__all__ = ["ADMISSION_PROMPTS", "run_admissions"]

ADMISSION_PROMPTS = [
    [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2],
    [3, 1, 4, 1, 5, 9, 2, 6, 5],
    [8, 8, 1, 2, 3, 8, 8, 1],
    [7, 1, 7],
]


def run_admissions(model: Glm5NextForCausalLM, piecewise: bool) -> tuple[Executor, list[Request]]:
    """Run `ADMISSION_PROMPTS` greedily through an executor of ``model`` (graphs emulated on the CPU: the caller
    patches ``Executor._graphs_supported``), the last two joining after two steps. Returns the executor and its
    requests."""
    cgc = CudaGraphConfig(batch_sizes=[1, 2, 3, 4], piecewise=piecewise)
    cfg = ExecutorConfig(tokens_per_block=8, max_tokens=1024, max_batch_size=4, max_num_tokens=48, max_seq_len=96,
                         cuda_graph_config=cgc)  # fmt: skip
    ex = Executor(model, cfg)
    reqs = [
        ex.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        for p, m in zip(ADMISSION_PROMPTS, [5, 7, 4, 5])
    ]
    late = reqs[2:]
    for r in late:
        ex.waiting.remove(r)
    steps = 0
    while ex.has_work or late:
        if late and steps == 2:  # two prompts join two decoding requests: an admission step
            ex.waiting.extend(late)
            late = []
        ex.step()
        steps += 1
    return ex, reqs

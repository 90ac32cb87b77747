"""`from_config(..., local_init=True)` on the GPU: the draws made on the device, the peak memory about the FP8
share (not the bf16 model), finite greedy decoding. Needs CUDA (tests/conftest.py skips ``gpu`` tests without it).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig, QuantConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def _real_slice() -> Glm5NextConfig:
    """The real geometry cut to 4 trunk layers (3 dense-FFN KDA layers and one sparse MoE layer) plus MTP."""
    cfg = subset_config(Glm5NextConfig.from_pretrained("glm-5.3-flash"), [0, 1, 2, 3])
    cfg.quantization = QuantConfig.block_fp8(128, ["lm_head"])
    return cfg


def test_peak_memory_is_about_the_fp8_share() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = _real_slice()
    with torch.device("meta"):
        meta, plain = Glm5NextForCausalLM(cfg), Glm5NextForCausalLM(cfg)
    meta.quantize_fp8_(cfg.quantization)
    share, bf16 = meta.param_bytes(torch.bfloat16), plain.param_bytes(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    m = Glm5NextForCausalLM.from_config(cfg, dtype="bfloat16", device="cuda", quantization="auto", local_init=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = torch.cuda.memory_allocated() - base
    print(
        f"share {share / 2**30:.2f} GiB, bf16 {bf16 / 2**30:.2f} GiB, held {held / 2**30:.2f}, peak {peak / 2**30:.2f}"
    )
    assert held == pytest.approx(share, rel=0.02)
    # One linear's fp32 draw and its quantisation temporaries on top of the share, far below the bf16 model.
    assert peak < share + 2 * 2**30 and peak < 0.75 * bf16
    for name, p in m.named_parameters():
        assert p.is_cuda and torch.isfinite(p.float()).all(), name
    del m


def test_tiny_local_init_decodes_and_repeats() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = Glm5NextConfig.from_pretrained("tiny")

    def run() -> list[list[int]]:
        m = Glm5NextForCausalLM.from_config(
            cfg, seed=3, dtype="bfloat16", device="cuda", quantization="fp8", local_init=True
        )
        ex = Executor(m, ExecutorConfig(tokens_per_block=16, max_tokens=1024, max_batch_size=2, max_seq_len=128))
        reqs = [ex.add_request(list(b"def fib(n):\n"), SamplingParams(max_tokens=12, ignore_eos=True)),
                ex.add_request(list(b"import os\n"), SamplingParams(max_tokens=12, ignore_eos=True))]  # fmt: skip
        while ex.has_work:
            ex.step()
        return [r.output_ids for r in reqs]

    a, b = run(), run()
    assert a == b and all(len(x) == 12 for x in a)

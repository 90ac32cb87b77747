"""The draft-ahead staging kernel compiled on CUDA against its torch reference (the CPU twin,
test_mtp_staging.py, runs the interpreted copy), on the same adversarial cases moved to the GPU.

Needs CUDA (tests/conftest.py skips it otherwise).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.speculative.mtp.staging import stage_draft_ahead, stage_draft_ahead_reference

from .test_mtp_staging import _case, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "P", "W", "D"), [(1, 1, 4, 128), (3, 4, 4, 200), (5, 8, 2, 6144), (2, 2, 6, 17)])
def test_compiled_kernel_matches_reference(n: int, P: int, W: int, D: int, dtype: torch.dtype) -> None:
    packed, hidden, slots, tok, outs = _case(n * 100 + P * 10 + W, n, P, W, D, S=n + 5, dtype=dtype)
    case = (packed.cuda(), hidden.cuda(), slots.cuda(), tok.cuda(), {k: v.cuda() for k, v in outs.items()})
    ref = _run(stage_draft_ahead_reference, *case, W=W, P=P)
    got = _run(stage_draft_ahead, *case, W=W, P=P)  # auto: the compiled kernel for CUDA tensors
    for k in ref:
        a, b = ref[k].cpu(), got[k].cpu()
        if a.is_floating_point():
            a, b = a.nan_to_num(nan=12345.0), b.nan_to_num(nan=12345.0)
        assert torch.equal(a, b), k

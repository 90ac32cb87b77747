"""The verify-ahead staging kernel compiled on CUDA against its torch reference (the CPU twin, test_verify_staging.py,
runs the interpreted copy), on the same adversarial cases moved to the GPU: the barrier between the rows that read the
old lengths and the sequences that overwrite them only matters compiled.

Needs CUDA (tests/conftest.py skips it otherwise).
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.runtime.verify_staging import stage_verify_ahead, stage_verify_ahead_reference

from .test_verify_staging import _case, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("B", "P", "W"), [(1, 1, 4), (3, 4, 4), (16, 16, 4), (200, 256, 5), (64, 64, 6), (2, 300, 4)])
def test_compiled_kernel_matches_reference(B: int, P: int, W: int) -> None:
    packed, drafts, _, bufs = _case(B * 100 + P * 10 + W, B, P, W)
    packed, drafts, bufs = packed.cuda(), drafts.cuda(), {k: v.cuda() for k, v in bufs.items()}
    want = _run(stage_verify_ahead_reference, packed, drafts, bufs, W, P)
    got = _run(stage_verify_ahead, packed, drafts, bufs, W, P)  # auto: the compiled kernel for CUDA tensors
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k

"""Where the host waits for the GPU: every synchronising call of a step, by source line."""

from __future__ import annotations

import collections
import traceback
import warnings

import torch


def project_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame inside the package (``file:line function``), else the innermost frame."""
    for fr in reversed(stack):
        if "trtllm_glm" in fr.filename and "host_syncs" not in fr.filename:
            return f"{fr.filename.split('trtllm_glm', 1)[1].lstrip('/')}:{fr.lineno} {fr.name}"
    fr = stack[-1]
    return f"{fr.filename}:{fr.lineno} {fr.name}"


def sync_sites(step, steps: int) -> tuple[float, collections.Counter]:
    """Run ``step`` ``steps`` times with sync warnings on; (syncs per step, Counter of sites)."""
    sites: collections.Counter = collections.Counter()
    orig = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        if "synchroniz" in str(message).lower():
            sites[project_frame(traceback.extract_stack()[:-1])] += 1

    warnings.showwarning = record
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(steps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = orig
    return sum(sites.values()) / steps, sites

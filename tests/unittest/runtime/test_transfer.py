"""`to_device`: the index lists the runtime builds every step, copied without a stream sync."""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.transfer import to_device


@pytest.mark.cpu_only
def test_values_and_dtypes_on_the_cpu() -> None:
    t = to_device([3, 1, 2], "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
    assert to_device([], "cpu", torch.int64).shape == (0,)


@pytest.mark.gpu
def test_copy_is_ordered_on_the_stream_and_does_not_sync() -> None:
    """Values land before later work on the stream reads them, and no host sync is issued."""
    dev = torch.device("cuda")
    big = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(20):
            big = big @ big.T * 1e-3  # keep the stream busy
            idx = to_device([i, i + 1, i + 2], dev)
            out = torch.arange(100, device=dev)[idx]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.tolist() == [19, 20, 21]


@pytest.mark.gpu
def test_ring_reuse_waits_for_copies_in_flight(monkeypatch) -> None:
    """A tiny ring (two halves of 32 values) wraps every few lists while the stream is far behind the host:
    each half is refilled only after the copies from it ran, so every list lands as written (without the
    wait, later lists overwrite pinned values before their copies run)."""
    from trtllm_glm import transfer

    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(transfer._rings, dev, transfer._PinnedRing(numel=64))
    big = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    got, want = [], []
    for i in range(60):
        if i % 10 == 0:
            big = big @ big.T * 1e-3  # the copies queue behind this
        vals = [i * 100 + j for j in range(7)]
        got.append(to_device(vals, dev))
        want.append(vals)
    assert [t.tolist() for t in got] == want
    # Lists the ring does not take (too long, floats) still arrive.
    assert to_device(list(range(5000)), dev)[-1].item() == 4999
    assert to_device([0.5, 1.5], dev).dtype == torch.float32

"""The fused KDA conv kernels on CUDA at real GLM-5.3-Flash geometry (64 heads, K = V = 128, W = 4): the decode
update, the speculative verify and its commit.

Needs CUDA (tests/conftest.py skips ``gpu`` tests without it). Against the torch references on the same inputs:
FP32 and bf16 state pools (the bf16 window store rounds as ``.to(bfloat16)`` does: bitwise equal), slots out
of order in a pool larger than the batch whose other slots hold NaN, bf16 verify rows (uniform and ragged with
fresh sequences), and CUDA-graph captures replayed on fresh inputs written into the captured buffers.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.kda import kernels as KK
from trtllm_glm.kda.ops import conv_decode_reference

pytestmark = pytest.mark.gpu

_REAL = Glm5NextConfig.from_pretrained("glm-5.3-flash")
H, K, V, W = _REAL.kda_num_heads, _REAL.kda_head_dim, _REAL.kda_head_dim, _REAL.kda_short_conv_kernel_size
C = H * (2 * K + V)


def _case(seed: int, n: int, dtype: torch.dtype, S: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, C, generator=g, device="cuda") * 2).to(torch.bfloat16).float()
    state = torch.full((S, C, W - 1), float("nan"), dtype=dtype, device="cuda")
    slots = torch.randperm(S, generator=g, device="cuda")[:n]
    state[slots] = (torch.randn(n, C, W - 1, generator=g, device="cuda") * 2).to(dtype)
    weight = torch.randn(C, W, generator=g, device="cuda") / W**0.5
    return x, state, weight, slots


@pytest.mark.parametrize("n", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_matches_reference_at_real_geometry(n, dtype) -> None:
    x, state, weight, slots = _case(n, n, dtype, S=n + 7)
    ref_state = state.clone()
    want = conv_decode_reference(x, ref_state, weight, slots, H, K, V)
    got = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.isnan(), ref_state.isnan())
    torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)


def test_conv_decode_replays_in_a_cuda_graph() -> None:
    n = 16
    x, state, weight, slots = _case(3, n, torch.float32, S=40)
    KK.conv_decode(x, state.clone(), weight, slots, H, K, V, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KK.conv_decode(x, state, weight, slots, H, K, V, 1e-6)
    for seed in (11, 12):
        x2, st2, _, sl2 = _case(seed, n, torch.float32, S=40)
        x.copy_(x2)
        state.copy_(st2)
        slots.copy_(sl2)
        ref_state = st2.clone()
        want = conv_decode_reference(x2, ref_state, weight, sl2, H, K, V)
        graph.replay()
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 16, 64, 2048])
def test_gate_kernel_at_real_sizes(n: int) -> None:
    """`kda_gate_beta` (H = 64, K = 128) on bf16 logits against the FP32 reference, from strided views."""
    from trtllm_glm.kda.ops import kda_gate_beta, kda_gate_beta_reference

    H, K = 64, 128
    gen = torch.Generator(device="cuda").manual_seed(n)
    out = (torch.randn(n, H * K + H + 7, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    g_raw, b = out[:, : H * K], out[:, H * K : H * K + H]
    A_log = torch.randn(H, device="cuda", generator=gen)
    dt_bias = torch.randn(H * K, device="cuda", generator=gen)
    g, beta = kda_gate_beta(g_raw, b, A_log, dt_bias, -5.0, backend="triton")
    rg, rbeta = kda_gate_beta_reference(g_raw, b, A_log, dt_bias, -5.0)
    torch.testing.assert_close(g, rg, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(beta, rbeta, rtol=2e-6, atol=2e-6)


def _verify_case(seed: int, n: int, Wm: int, state_dtype: torch.dtype, S: int, *, ragged: bool):
    """bf16 rows of ``n`` sequences (uniform: ``Wm`` each from row 0; ragged: widths ``1..Wm`` in reverse order
    with gaps, every third sequence fresh, its slot left NaN)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ragged:
        widths = [1 + (3 * j) % Wm for j in range(n)]
        row0, r = [0] * n, 0
        for j in reversed(range(n)):
            row0[j], r = r + 1, r + 1 + widths[j]
        N = r + 1
        fresh = [j % 3 == 1 for j in range(n)]
    else:
        widths, row0, N, fresh = [Wm] * n, [j * Wm for j in range(n)], n * Wm, [False] * n
    x = (torch.randn(N, C, generator=g, device="cuda") * 2).to(torch.bfloat16)
    state = torch.full((S, C, W - 1), float("nan"), dtype=state_dtype, device="cuda")
    slots = torch.randperm(S, generator=g, device="cuda")[:n]
    live = slots[torch.tensor([not f for f in fresh], device="cuda")]
    state[live] = (torch.randn(len(live), C, W - 1, generator=g, device="cuda") * 2).to(state_dtype)
    weight = torch.randn(C, W, generator=g, device="cuda") / W**0.5
    kw = {}
    if ragged:
        kw = {
            "row0": torch.tensor(row0, device="cuda"),
            "widths": torch.tensor(widths, device="cuda"),
            "fresh": torch.tensor(fresh, device="cuda"),
        }
    return x, state, weight, slots, widths, kw


@pytest.mark.parametrize("Wm", [4, 8])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_verify_and_commit_match_reference_at_real_geometry(Wm, ragged, state_dtype) -> None:
    from trtllm_glm.kda.ops import conv_commit_slots_reference, conv_verify_qkv_reference

    n = 16
    x, state, weight, slots, widths, kw = _verify_case(Wm, n, Wm, state_dtype, S=n + 7, ragged=ragged)
    before = state.clone()
    want = conv_verify_qkv_reference(x, state, weight, slots, H, K, V, Wm, **kw)
    got = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for j, w in enumerate(widths):
            assert (a[j, w:] == 0).all()
    torch.testing.assert_close(state, before, equal_nan=True, atol=0, rtol=0)
    ckw = {k: v for k, v in kw.items() if k != "widths"}
    for accepted in ([0] * n, widths, [(j * 5) % (w + 1) for j, w in enumerate(widths)]):
        a = torch.tensor(accepted, device="cuda")
        ref, out = state.clone(), state.clone()
        conv_commit_slots_reference(ref, x, slots, a, Wm, **ckw)
        KK.conv_commit_slots(out, x, slots, a, Wm, **ckw)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0))  # bitwise: data movement only


def test_conv_verify_commit_replay_in_a_cuda_graph() -> None:
    from trtllm_glm.kda.ops import conv_commit_slots_reference, conv_verify_qkv_reference

    n, Wm = 16, 4
    x, state, weight, slots, _, _ = _verify_case(5, n, Wm, torch.float32, S=40, ragged=False)
    accepted = torch.full((n,), 2, dtype=torch.int64, device="cuda")
    KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm)  # compile outside the capture
    KK.conv_commit_slots(state.clone(), x, slots, accepted, Wm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KK.conv_verify_qkv(x, state, weight, slots, H, K, V, Wm)
        KK.conv_commit_slots(state, x, slots, accepted, Wm)
    for seed in (21, 22):
        x2, st2, _, sl2, _, _ = _verify_case(seed, n, Wm, torch.float32, S=40, ragged=False)
        a2 = torch.randint(0, Wm + 1, (n,), device="cuda")
        x.copy_(x2)
        state.copy_(st2)
        slots.copy_(sl2)
        accepted.copy_(a2)
        want = conv_verify_qkv_reference(x2, st2, weight, sl2, H, K, V, Wm)
        ref_state = st2.clone()
        conv_commit_slots_reference(ref_state, x2, sl2, a2, Wm)
        graph.replay()
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------------------------
# Prefill (`conv_prefill`): 8,192 rows in 3 sequences


def _prefill_case(seed: int, lens: list[int], state_dtype: torch.dtype, S: int, *, ragged: bool):
    """bf16 rows of 3 sequences (the middle one shorter than the window and fresh, its slot NaN); ragged: the
    sequences in reverse order in ``x`` with a gap before each."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, cu = len(lens), [0]
    for length in lens:
        cu.append(cu[-1] + length)
    kw: dict = {}
    if ragged:
        row0, r = [0] * n, 0
        for j in reversed(range(n)):
            row0[j], r = r + 3, r + 3 + lens[j]
        N = r + 1
        kw = {"row0": torch.tensor(row0, device="cuda"), "num_rows": cu[-1]}
    else:
        N = cu[-1]
    fresh = [j == 1 for j in range(n)]
    x = (torch.randn(N, C, generator=g, device="cuda") * 2).to(torch.bfloat16)
    state = torch.full((S, C, W - 1), float("nan"), dtype=state_dtype, device="cuda")
    slots = torch.randperm(S, generator=g, device="cuda")[:n]
    live = slots[torch.tensor([not f for f in fresh], device="cuda")]
    state[live] = (torch.randn(len(live), C, W - 1, generator=g, device="cuda") * 2).to(state_dtype)
    weight = (torch.randn(C, W, generator=g, device="cuda") / W**0.5).to(torch.bfloat16)
    kw["fresh"] = torch.tensor(fresh, device="cuda")
    return x, state, weight, slots, torch.tensor(cu, device="cuda"), kw


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_reference_at_real_geometry(ragged, state_dtype) -> None:
    from trtllm_glm.kda.ops import conv_prefill_reference

    lens = [3001, 2, 5189]  # 8,192 rows; the middle sequence shorter than the window
    x, state, weight, slots, cu, kw = _prefill_case(len(lens) + int(ragged), lens, state_dtype, S=9, ragged=ragged)
    ref_state, out_state = state.clone(), state.clone()
    want = conv_prefill_reference(x, ref_state, weight, slots, cu, H, K, V, **kw)
    got = KK.conv_prefill(x, out_state, weight, slots, cu, H, K, V, **kw)
    for a, b in zip(got, want):
        assert a.shape[0] == sum(lens) and a.is_contiguous()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(out_state.isnan(), ref_state.isnan())
    assert torch.equal(out_state.nan_to_num(0.0), ref_state.nan_to_num(0.0))  # bitwise: data movement only


def test_conv_prefill_batch_invariant_at_real_geometry() -> None:
    """Batch-invariant mode: a 1,000-row sequence's q, k, v and window have the same bits alone and behind a
    333-row sequence (other packed offsets and row-block positions)."""
    from trtllm_glm.numerics import batch_invariant_mode

    g = torch.Generator(device="cuda").manual_seed(40)
    L, P = 1000, 333
    x = (torch.randn(P + L, C, generator=g, device="cuda") * 2).to(torch.bfloat16)
    window = torch.randn(C, W - 1, generator=g, device="cuda")
    weight = torch.randn(C, W, generator=g, device="cuda") / W**0.5
    with batch_invariant_mode(True):
        alone = torch.full((4, C, W - 1), float("nan"), device="cuda")
        alone[2] = window
        a = KK.conv_prefill(x[P:], alone, weight, torch.tensor([2], device="cuda"),
                            torch.tensor([0, L], device="cuda"), H, K, V)  # fmt: skip
        batched = torch.full((4, C, W - 1), float("nan"), device="cuda")
        batched[2], batched[0] = window, torch.randn(C, W - 1, generator=g, device="cuda")
        b = KK.conv_prefill(x, batched, weight, torch.tensor([0, 2], device="cuda"),
                            torch.tensor([0, P, P + L], device="cuda"), H, K, V)  # fmt: skip
    for u, w in zip(a, b):
        assert torch.equal(u.view(torch.int32), w[P:].view(torch.int32))
    assert torch.equal(alone[2], batched[2])


def test_conv_prefill_replays_in_a_cuda_graph() -> None:
    """Captured once (3 sequences, 600 rows), replayed on new rows, windows, slots and sequence lengths written
    into the captured buffers: no host value is baked into the launch."""
    from trtllm_glm.kda.ops import conv_prefill_reference

    lens = [250, 3, 347]
    x, state, weight, slots, cu, kw = _prefill_case(50, lens, torch.float32, S=9, ragged=False)
    KK.conv_prefill(x, state.clone(), weight, slots, cu, H, K, V, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = KK.conv_prefill(x, state, weight, slots, cu, H, K, V, **kw)
    for seed, new_lens in ((51, [1, 598, 1]), (52, [300, 200, 100])):
        x2, st2, _, sl2, cu2, kw2 = _prefill_case(seed, new_lens, torch.float32, S=9, ragged=False)
        x.copy_(x2)
        state.copy_(st2)
        slots.copy_(sl2)
        cu.copy_(cu2)
        kw["fresh"].copy_(kw2["fresh"])
        ref_state = st2.clone()
        want = conv_prefill_reference(x2, ref_state, weight, sl2, cu2, H, K, V, **kw2)
        graph.replay()
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, equal_nan=True, atol=0, rtol=0)

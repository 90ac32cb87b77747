"""The greedy / top-2 gap kernels (`trtllm_glm.logits`) under Triton's interpreter against the torch
reference (``torch.argmax`` and ``torch.topk(k=2)``), and their use in the runtime's packed step results.

Rows are fresh random logits with planted hard cases: a repeated maximum (gap 0, the first column wins) in
different partials and in one tile, the maximum in the last column, NaNs (first NaN column, NaN gap),
-inf entries, a row of one value. Outputs are poisoned first where the caller can pass them.
"""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_glm.logits import LOGITS_BACKEND_ENV, greedy_pack, greedy_top2, greedy_top2_reference, logits_backend
from trtllm_glm.runtime.cuda_graph import greedy_and_gap
from trtllm_glm.runtime.sampling import top2_gap


def _logits(n: int, v: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4
    if n > 1:
        x[1, 3] = x[1, v - 2] = 100.0  # a repeated maximum, far apart: two partials hold it
    if n > 2:
        x[2, v - 1] = 100.0  # the maximum in the last column
    if n > 3:
        x[3, 7] = x[3, 8] = 90.0  # a repeated maximum within one tile
    if n > 4:
        x[4, 5] = float("nan")  # NaN: torch's argmax and topk propagate it
        x[4, 2] = float("nan")
    if n > 5:
        x[5, : v // 2] = float("-inf")
    if n > 6:
        x[6] = 1.5  # one value everywhere
    return x.to(dtype)


def _same(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(got[0], ref[0])
    # Exact: the kernel compares and subtracts once, as the reference does.
    assert torch.equal(torch.nan_to_num(got[1], nan=-7.0), torch.nan_to_num(ref[1], nan=-7.0))


@pytest.mark.parametrize("n,v", [(1, 5000), (7, 777), (9, 4099), (2, 20), (16, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_top2_matches_reference(n: int, v: int, dtype: torch.dtype) -> None:
    x = _logits(n, v, seed=n * v, dtype=dtype)
    _same(greedy_top2(x, backend="triton"), greedy_top2_reference(x))


@pytest.mark.parametrize("split", [1, 2, 3, 7, 64])
def test_every_split_gives_the_same_answer(split: int) -> None:
    from trtllm_glm.logits import kernel_module

    x = _logits(8, 3001, seed=split)
    got = kernel_module("cpu").greedy_top2(x, split=split, block=128)
    _same(got, greedy_top2_reference(x))


def test_packed_rows_and_accepted_counts() -> None:
    x = _logits(6, 2000, seed=3)
    acc = torch.tensor([1, 4, 4, 4, 4, 2])
    ids, packed = greedy_pack(x, acc, backend="triton")
    r_ids, r_packed = greedy_pack(x, acc, backend="torch")
    assert packed.dtype == torch.float64 and packed.shape == (6, 3)
    assert torch.equal(ids, r_ids)
    assert torch.equal(torch.nan_to_num(packed, nan=-7.0), torch.nan_to_num(r_packed, nan=-7.0))
    _, ones = greedy_pack(x[:3], backend="triton")
    assert ones[:, 2].tolist() == [1.0, 1.0, 1.0]


def test_two_columns() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 3.0], [5.0, -1.0]])
    _same(greedy_top2(x, backend="triton"), greedy_top2_reference(x))


def test_strided_rows_and_empty_batch() -> None:
    big = _logits(5, 3000, seed=4)
    view = big[:, :2500]  # row stride 3000, columns contiguous
    _same(greedy_top2(view, backend="triton"), greedy_top2_reference(view))
    ids, gap = greedy_top2(torch.randn(0, 50), backend="triton")
    assert ids.shape == (0,) and gap.shape == (0,)


def test_runtime_packing_and_gap_use_the_same_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _logits(7, 1234, seed=5)
    monkeypatch.setenv(LOGITS_BACKEND_ENV, "triton")
    kern_packed, kern_gap = greedy_and_gap(x), top2_gap(x)
    monkeypatch.setenv(LOGITS_BACKEND_ENV, "torch")
    ref_packed, ref_gap = greedy_and_gap(x), top2_gap(x)
    assert torch.equal(torch.nan_to_num(kern_packed, nan=-7.0), torch.nan_to_num(ref_packed, nan=-7.0))
    assert torch.equal(torch.nan_to_num(kern_gap, nan=-7.0), torch.nan_to_num(ref_gap, nan=-7.0))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="V >= 2"):
        greedy_top2(torch.randn(3, 1))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        greedy_top2(torch.randn(10))
    with pytest.raises(ValueError, match="float"):
        greedy_top2(torch.ones(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="accepted"):
        greedy_pack(torch.randn(2, 5), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend"):
        logits_backend(torch.randn(2, 5), "fast")


def test_auto_backend_keeps_the_cpu_on_the_reference() -> None:
    assert logits_backend(torch.randn(2, 5)) == "torch"
    assert logits_backend(torch.randn(2, 5), "triton") == "triton"


def test_kernels_compile_for_sm90() -> None:
    """The compiled path (the interpreter does not compile: a non-constexpr global passed it)."""
    from tests.triton_compile import KernelSpec, compile_sm90

    mod = "trtllm_glm.logits.kernels"
    part = dict(x_ptr="*fp32", val_ptr="*fp32", idx_ptr="*i32", V="i32", cols_per_prog="i32", stride_xn="i32",
                NPART="i32", f_ptr="*fp32", stride_fn="i32", m_ptr="*i32", stride_mn="i32")  # fmt: skip
    fin = dict(val_ptr="*fp32", idx_ptr="*i32", ids_ptr="*i64", gap_ptr="*fp32", packed_ptr="*fp64",
               acc_ptr="*i64", N="i32", NSPLIT="i32", NPART="i32")  # fmt: skip
    # (logits dtype, WRITE_F32, HAS_MASK)
    cases = [("*fp32", False, False), ("*bf16", False, False), ("*bf16", True, False), ("*fp32", False, True)]
    specs = [
        KernelSpec(mod, "_partial_kernel", {**part, "x_ptr": x}, {"BLOCK": 1024, "WRITE_F32": w, "HAS_MASK": m})
        for x, w, m in cases
    ]
    for flags in [(True, True, False, False), (True, False, True, True), (False, True, True, False)]:
        const = dict(zip(["WRITE_IDS", "WRITE_GAP", "WRITE_PACKED", "HAS_ACC"], flags))
        specs.append(KernelSpec(mod, "_finish_kernel", fin, {"BLOCK_N": 4, "SPLIT_PAD": 64, **const}, num_warps=1))
    results = compile_sm90(specs)
    assert all(r["ok"] for r in results), results


@pytest.mark.parametrize("n,v", [(7, 777), (9, 4099), (8, 64), (16, 1500)])
def test_masked_greedy_matches_the_masked_reference(n: int, v: int) -> None:
    """A grammar's token bitmask read by the kernel as it scans (`greedy_pack(bitmask=)`): the same ids and gaps as
    the reference's ``masked_fill`` then argmax / topk, on random masks with planted cases: a disallowed maximum, a
    single allowed token (gap -inf - x: -inf), nothing allowed (column 0, NaN gap), a NaN only in a disallowed column
    (ignored) and one in an allowed column (propagated), words past the vocabulary set."""
    from trtllm_glm.logits import apply_bitmask

    x = _logits(n, v, seed=v + n)
    g = torch.Generator().manual_seed(n)
    words = (v + 31) // 32 + 1  # one word more than needed: its bits must not matter
    bits = torch.randint(0, 2, (n, words * 32), generator=g, dtype=torch.int64)
    bits[0, int(x[0].argmax())] = 0  # the unmasked maximum disallowed
    bits[1] = 0
    bits[1, v // 3] = 1  # one token allowed
    bits[2] = 0  # nothing allowed
    x[5, 11], bits[5, 11] = float("nan"), 0  # a NaN the mask hides
    x[6, 17], bits[6, 17] = float("nan"), 1  # a NaN the mask lets through
    bitmask = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    ref = greedy_top2_reference(apply_bitmask(x.clone(), bitmask))
    acc = torch.arange(n, dtype=torch.int64) % 3 + 1
    ids, packed = greedy_pack(x, acc, backend="triton", bitmask=bitmask)
    _same((ids, packed[:, 1].float()), ref)
    assert torch.equal(packed[:, 0], ref[0].double()) and torch.equal(packed[:, 2], acc.double())
    ids_t, packed_t = greedy_pack(x, acc, backend="torch", bitmask=bitmask)
    assert torch.equal(ids_t, ref[0]) and torch.equal(packed_t.nan_to_num(-7.0), packed.nan_to_num(-7.0))
    assert int(ids[1]) == v // 3 and int(ids[2]) == 0 and int(ids[6]) == 17 and int(ids[5]) != 11
    with pytest.raises(ValueError, match="bitmask"):
        greedy_pack(x, backend="triton", bitmask=bitmask[:, :1])


def test_warm_up_row_counts_reach_every_kernel_variant(monkeypatch) -> None:
    """The start-up warm-up's row counts (`kernels.warm_up_row_counts`) meet every (SPLIT_PAD, warps) variant of the
    finish kernel that any row count up to the limit meets, on an H100-sized grid (132 SMs); row counts themselves
    never specialise (``do_not_specialize``). On the CPU the warm-up launches nothing."""
    from trtllm_glm.logits import kernels as mod
    from trtllm_glm.logits import warm_up_greedy

    monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    dev, v = torch.device("cpu"), 154880

    def variant(n: int) -> tuple[int, int]:
        nsplit = mod.split_for(n, v, dev, 1024)
        cols = math.ceil(math.ceil(v / nsplit) / 1024) * 1024
        nsplit = math.ceil(v / cols)
        return max(2, 1 << (nsplit - 1).bit_length()), 1 if nsplit <= 32 else 4

    counts = mod.warm_up_row_counts(600, v, dev)
    assert {variant(n) for n in counts} == {variant(n) for n in range(1, 601)} and len(counts) >= 6, counts
    assert counts == sorted(set(counts)) and counts[0] == 1
    assert warm_up_greedy(v, 600, dev) == 0
    assert "NPART" in [p.name for p in mod._partial_kernel.params if p.do_not_specialize]
    assert {"N", "NSPLIT", "NPART"} <= {p.name for p in mod._finish_kernel.params if p.do_not_specialize}

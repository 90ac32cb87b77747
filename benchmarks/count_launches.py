"""Count the launches of one batch-1 decode step by module, on the CPU (no GPU needed).

The model is the `tiny` preset cut to the real 4-layer slice's schedule (KDA, KDA, KDA, sparse MLA; dense FFN on
layers 0-2, MoE on layer 3; mHC with 4 streams), its weights fused as executors do on CUDA, every kernel backend
forced to its Triton kernel (the CPU runs them interpreted), so that the step takes the CUDA decode path's
dispatch. One decode step (after a short prompt) is counted: every Triton launch (by kernel name) and every torch
op that is not a view or an allocation (each about one CUDA launch; `bench_e2e.op_sites` counts the same set),
both grouped by the innermost `trtllm_glm` module that issued them. The step is the decode graph's body: the
model's forward, the LM head (`compute_logits`) and `greedy_pack` (with ``TRTLLM_GLM_GREEDY_FUSE_CAST=1`` the LM
head's fp32 cast written by the greedy kernel, as the decode graph then does); the model is in bf16 (``--dtype``).
``--sample`` also counts `Sampler.sample` of one temperature / top-k / top-p row (a sampled request's eager tail).

What this cannot see: the KDA recurrent update runs fla-core's kernel on CUDA (one launch per layer) and the torch
reference here (~11 ops per layer; with ``TRTLLM_GLM_KDA_FUSED_DECODE=1``, which ``TRTLLM_GLM_DECODE_FUSE=1``
implies, it is inside the fused KDA decode kernel on both, `kda/kernels/decode_fused.py`), the FP8 linear is not
used (bf16 weights), and cuBLAS may use more than one kernel per GEMM.

Usage: ``python -m benchmarks.count_launches [--sample] [--json out.json]``. Before:
``TRTLLM_GLM_DECODE_FUSE=0 TRTLLM_GLM_SAMPLING_BACKEND=torch python -m benchmarks.count_launches --sample``; after:
``TRTLLM_GLM_DECODE_FUSE=1 TRTLLM_GLM_SAMPLING_BACKEND=triton python -m benchmarks.count_launches --sample`` (the
sampling backend is forced to the kernel unless set).
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every kernel backend on its Triton kernel (the CUDA path's choice), unless the caller set one.
_FORCE = (
    "TRTLLM_GLM_MHC_BACKEND", "TRTLLM_GLM_NORM_BACKEND", "TRTLLM_GLM_SWIGLU_BACKEND", "TRTLLM_GLM_LOGITS_BACKEND",
    "TRTLLM_GLM_ROUTER_BACKEND", "TRTLLM_GLM_KDA_GATE_BACKEND", "TRTLLM_GLM_KDA_CONV_BACKEND",
    "TRTLLM_GLM_SKINNY_GEMM_BACKEND", "TRTLLM_GLM_MOE_BACKEND", "TRTLLM_GLM_KPOOL_BACKEND",
    "TRTLLM_GLM_TAIL_RING_BACKEND", "TRTLLM_GLM_SAMPLING_BACKEND",
)  # fmt: skip
for _v in _FORCE:
    os.environ.setdefault(_v, "triton")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.harness.model_harness import ModelHarness  # noqa: E402
from benchmarks.harness.profiling import VIEW_OPS  # noqa: E402
from benchmarks.harness.rows import write_json  # noqa: E402
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.logits import greedy_fuse_cast, greedy_pack  # noqa: E402
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config  # noqa: E402
from trtllm_glm.runtime.sampling import Sampler, SamplingParams  # noqa: E402


def _module_of(stack) -> str:
    frames = [f for f in stack if "trtllm_glm/" in f.filename and not f.filename.endswith("triton_interp.py")]
    if not frames:
        return "?"
    path = frames[-1].filename.split("trtllm_glm/")[-1]
    return path


class Counter:
    """Triton launches and torch ops of the calls made inside it, by `trtllm_glm` module."""

    def __init__(self) -> None:
        self.triton: collections.Counter[str] = collections.Counter()
        self.torch: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()
        self._inside = 0

    def __enter__(self) -> Counter:
        from triton.runtime import interpreter as interp

        self._orig = interp.GridExecutor.__call__
        counter = self

        def _call(ex, *args, **kwargs):
            if counter._inside == 0:
                mod = _module_of(traceback.extract_stack()[:-1])
                counter.triton[mod] += 1
                counter.kernels[f"{getattr(ex.fn, '__name__', '?')} ({mod})"] += 1
            counter._inside += 1
            try:
                return counter._orig(ex, *args, **kwargs)
            finally:
                counter._inside -= 1

        interp.GridExecutor.__call__ = _call

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if counter._inside == 0 and func.overloadpacket.__name__ not in VIEW_OPS:
                    counter.torch[_module_of(traceback.extract_stack())] += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Ops()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter as interp

        self._mode.__exit__(*exc)
        interp.GridExecutor.__call__ = self._orig

    def table(self) -> dict:
        mods = sorted(set(self.triton) | set(self.torch), key=lambda m: -(self.triton[m] + self.torch[m]))
        return {
            "total": sum(self.triton.values()) + sum(self.torch.values()),
            "triton": sum(self.triton.values()),
            "torch_ops": sum(self.torch.values()),
            "by_module": {m: {"triton": self.triton[m], "torch": self.torch[m]} for m in mods},
            "kernels": dict(self.kernels.most_common()),
        }


def real4_like_tiny() -> Glm5NextConfig:
    """The tiny preset with the real 4-layer slice's schedule (KDA x3 + sparse MLA; dense x3 + MoE)."""
    cfg = subset_config(Glm5NextConfig.from_pretrained("tiny"), [0, 1, 2, 3])
    cfg.mlp_layer_types = ["dense", "dense", "dense", "sparse"]
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", action="store_true", help="also count one sampled row's Sampler.sample")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (bfloat16: the LM head's cast is a launch)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = real4_like_tiny()
    model = Glm5NextForCausalLM.from_config(cfg, seed=0, dtype="float32").eval()
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
        model.keep_fp32_params_()
    model.fuse_weights()
    h = ModelHarness(model, max_seq_len=64)
    prompt = list(range(1, 13))
    h.step([(0, prompt)])
    with torch.no_grad():
        with Counter() as c:
            hidden = h.step([(0, [5])], num_decode_seqs=1)
            # The decode graph's tail (`runtime.cuda_graph.CudaGraphRunner._body`, width one).
            if greedy_fuse_cast():
                raw = model.compute_logits(hidden, cast=False)
                logits = torch.empty(raw.shape, dtype=torch.float32)
                greedy_pack(raw, f32_out=logits)
            else:
                logits = model.compute_logits(hidden)
                greedy_pack(logits)
        out = {"step": c.table()}
        if args.sample:
            params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=4)]
            gen = [torch.Generator().manual_seed(1)]
            with Counter() as s:
                Sampler().sample(logits, params, gen)
            out["sample"] = s.table()
    for name, t in out.items():
        print(f"== {name}: {t['total']} launches ({t['triton']} Triton, {t['torch_ops']} torch ops)")
        for m, v in t["by_module"].items():
            print(f"  {m:60s} triton {v['triton']:3d}  torch {v['torch']:3d}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()

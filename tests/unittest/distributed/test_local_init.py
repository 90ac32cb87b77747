"""`Glm5NextForCausalLM.from_config(..., local_init=True)`: a rank's share drawn directly on its device.

World size 1 in this process, then a 2-process gloo world (TP=2 with EP=2 on the tiny preset): block FP8
kept, every parameter filled (poisoned first by ``to_empty``'s garbage: NaN checks), replicated tensors equal
on both ranks, cut tensors different, finite logits equal on both ranks, and two builds identical.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback
from typing import Any

import pytest
import torch

from benchmarks.harness.model_harness import ModelHarness
from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, needs_local_init
from trtllm_glm.models.random_init import init_kind
from trtllm_glm.modules.linear import Fp8Linear

pytestmark = pytest.mark.cpu_only

PROMPT = [5, 17, 3, 99, 42, 7, 1, 250, 31, 8, 64]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _build(mapping=None, seed: int = 7) -> Glm5NextForCausalLM:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    return Glm5NextForCausalLM.from_config(
        cfg, seed=seed, dtype="float32", mapping=mapping, quantization="fp8", local_init=True
    )


def _check_filled(m: Glm5NextForCausalLM) -> None:
    assert any(isinstance(mod, Fp8Linear) for mod in m.modules())
    assert m.config.quantization is not None
    for name, p in m.named_parameters():
        assert p.device.type == "cpu", name
        assert torch.isfinite(p.float()).all(), f"{name} not filled"
        kind, c = init_kind(name)
        if kind == "const":
            assert torch.equal(p.float(), torch.full_like(p.float(), c)), name
        elif p.numel() > 8 and p.dtype != torch.float8_e4m3fn and not name.endswith("weight_scale_inv"):
            assert p.float().std() > 0, f"{name} constant"
        if name.endswith(("A_log", "dt_bias", "hc_attn_fn", "mlp.gate.weight")):
            assert p.dtype == torch.float32, name


def test_world_one_fp8_finite_deterministic() -> None:
    a, b = _build(), _build()
    _check_filled(a)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
    c = _build(seed=8)
    assert not torch.equal(c.model.embed_tokens.weight, a.model.embed_tokens.weight)
    logits = ModelHarness(a).prefill_logits(0, PROMPT)
    assert torch.isfinite(logits).all() and logits.std() > 0
    # The same scale as the whole-model draw: the logits' spread within a factor of 3.
    ref = ModelHarness(Glm5NextForCausalLM.from_config(Glm5NextConfig.from_pretrained("tiny"), seed=7)).prefill_logits(
        0, PROMPT
    )
    assert 1 / 3 < float(logits.std() / ref.std()) < 3


def test_auto_choice() -> None:
    assert not needs_local_init(Glm5NextConfig.from_pretrained("tiny"))
    assert needs_local_init(Glm5NextConfig.from_pretrained("glm-5.3-flash"))  # 320 B parameters in fp32


def _rank(rank: int, port: int, q: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    import torch.distributed as dist

    from trtllm_glm.distributed import Mapping
    from trtllm_glm.distributed.comm import Comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        mapping = Mapping.from_sizes(tensor_parallel_size=2, moe_expert_parallel_size=2, rank=rank)
        a, b = _build(mapping), _build(mapping)
        _check_filled(a)
        same = all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a.state_dict().values(), b.state_dict().values())
        )
        a.set_comm(Comm(mapping))
        logits = ModelHarness(a).prefill_logits(0, PROMPT)
        q.put(
            (
                rank,
                {
                    "same": same,
                    "logits": logits.tolist(),
                    "digests": {k: _digest(v) for k, v in a.state_dict().items()},
                },
            )
        )
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_build_their_shares() -> None:
    from trtllm_glm.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert isinstance(got[r], dict), got[r]
        assert got[r]["same"]
    # (sent as lists: a tensor in a queue goes through shared memory, which the exiting rank may take away)
    l0, l1 = torch.tensor(got[0]["logits"]), torch.tensor(got[1]["logits"])
    assert torch.isfinite(l0).all() and l0.std() > 0
    assert torch.equal(l0, l1)  # every rank ends the step with the same hidden state
    d0, d1 = got[0]["digests"], got[1]["digests"]
    assert d0.keys() == d1.keys()
    replicated = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                  "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.hc_attn_fn"]  # fmt: skip
    for k in replicated:
        assert d0[k] == d1[k], k
    cut = ["model.layers.3.self_attn.q_b_proj.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.1.mlp.experts.0.gate_proj.weight",  # global experts 0 and 2
           "model.layers.1.mlp.shared_experts.up_proj.weight"]  # fmt: skip
    for k in cut:
        assert d0[k] != d1[k], k


def test_from_pretrained_preset_takes_the_local_path_when_the_host_is_short(monkeypatch) -> None:
    """The LLM's loader (a preset without a checkpoint) asks `needs_local_init` and then builds the share directly."""
    import trtllm_glm.models.glm5_next as g

    asked = []
    monkeypatch.setattr(g, "needs_local_init", lambda cfg: asked.append(cfg.num_hidden_layers) or True)
    m = Glm5NextForCausalLM.from_pretrained("tiny", seed=7, dtype="float32", quantization="fp8")
    assert asked == [8]
    ref = _build(seed=7).state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(v.view(torch.uint8), ref[k].view(torch.uint8)), k

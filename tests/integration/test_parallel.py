"""Tensor / expert parallelism on the CPU: 2-process gloo worlds against world size 1 (docs/parallelism.md).

One torchrun-style world (``RANK`` / ``WORLD_SIZE`` set, processes started once for the module) runs every
case of tests/parallel_cases.py: the trained ``small`` preset under TP=2, EP=2 and TP=2 + EP=2 for plain
decoding, MTP K=3 (shared and separate draft KV), n-gram, a prefix-cache hit and a preempting batch, and a
random real-layout (sharded) checkpoint. Both ranks must emit identical tokens, equal to world size 1's
under the near-tie rule. Then the spawned form of the LLM API (this process is rank 0): a killed worker
fails the call fast and leaves no process behind, and the serve CLI with ``--tp_size 2`` answers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.parallel_cases import LAYOUTS, PROMPTS, cases, rank_main, run_case
from trtllm_glm import LLM, SamplingParams
from trtllm_glm.distributed.process_group import free_port
from trtllm_glm.runtime.lossless import compare_greedy

pytestmark = pytest.mark.cpu_only

CASE_NAMES = [name for name, _, _ in cases("")]
WORLD_TIMEOUT_S = 400


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny model in the real (VL, sharded) checkpoint layout (``real``), and the same quantised to
    block FP8 with 32-wide tiles, the LM head kept (``fp8``)."""
    from trtllm_glm.config import QuantConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    d = tmp_path_factory.mktemp("checkpoints")
    m = Glm5NextForCausalLM.from_pretrained("tiny", seed=3)
    m.save_pretrained(d / "real", max_shard_bytes=400_000)
    m.quantize_fp8_(QuantConfig.block_fp8(32, ["lm_head"]))
    m.save_pretrained(d / "fp8", max_shard_bytes=400_000)
    return str(d)


@pytest.fixture(scope="module")
def world(ckpt: str) -> dict[tuple[int, str], dict]:
    """Every case's result on both ranks of one 2-process world."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, ckpt, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out: dict[tuple[int, str], dict] = {}
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    try:
        while len(out) < 2 * len(CASE_NAMES):
            rank, name, res = q.get(timeout=max(1.0, deadline - time.monotonic()))
            assert name != "error", f"rank {rank}: {res}"
            out[(rank, name)] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def _model_of(name: str, ckpt: str) -> tuple[str, dict]:
    return next((m, kw) for n, m, kw in cases(ckpt) if n == name)


def _assert_near_equal(ref_ids, ref_gaps, ids, what: str) -> None:
    d = compare_greedy(ref_ids, ref_gaps, ids)
    assert d is None or d.excused, f"{what}: {d}"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_world_of_two_matches_world_of_one(world, ckpt, name: str) -> None:
    r0, r1 = world[(0, name)], world[(1, name)]
    # Every rank emits the same tokens, bit for bit (the lockstep check would have raised otherwise).
    assert r0["tokens"] == r1["tokens"]
    assert (r0["rank"], r1["rank"]) == (0, 1)
    model, kw = _model_of(name, ckpt)
    ref = run_case(model, kw, {})
    for i, (a, g, b) in enumerate(zip(ref["tokens"], ref["gaps"], r0["tokens"])):
        _assert_near_equal(a, g, b, f"{name} prompt {i}")
    # The layout really was split: local KDA heads / experts, and collectives ran.
    lay = LAYOUTS[name]
    heads = ref["kda_heads"] // lay.get("tensor_parallel_size", 1)
    experts = ref["local_experts"] // lay.get("moe_expert_parallel_size", 1)
    assert (r0["kda_heads"], r0["local_experts"]) == (heads, experts)
    assert r0["all_reduces"] > 0 and ref["all_reduces"] == 0
    if name == "fp8_layout":  # FP8 held on each rank, but b_proj (cut inside its tiles) dequantised
        assert r0["fp8_params"] == r1["fp8_params"] > 0 and ref["fp8_params"] > 0
        assert r0["fp8_b_proj"] == 0 < ref["fp8_b_proj"]
    if name == "preempt":
        assert r0["preemptions"] == r1["preemptions"] > 0
    else:  # the second turn hit the prefix cache as on one device (per rank, in lockstep)
        assert r0["cached"] == r1["cached"] == ref["cached"] > 0


def _spawned(pid: int) -> list[int]:
    """Process ids of ``pid``'s multiprocessing-spawned children (not multiprocessing's resource tracker)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                out.append(int(d.name))
    return out


def _rank_workers(pid: int) -> list[int]:
    """Process ids of the rank workers ``pid`` started: its spawned children, or, for a server whose engine runs
    in a process of its own (the default), that engine process's."""
    kids = _spawned(pid)
    return [g for k in kids for g in _spawned(k)] or kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_spawned_llm_and_a_killed_worker(world) -> None:
    """``LLM(..., tensor_parallel_size=2)`` in this process: tokens as the torchrun world's; then a worker
    killed mid-generation fails the call within 30 s naming the rank, and no process is left."""
    from trtllm_glm.runtime.ranks import WorkerError

    sp = SamplingParams(max_tokens=20)
    with LLM("small", device="cpu", max_batch_size=4, max_seq_len=512, tensor_parallel_size=2) as llm:
        (pid,) = llm.worker_pids
        outs = llm.generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in outs] == world[(0, "plain")]["tokens"][: len(PROMPTS)]
        # Sampling draws from per-request generators seeded alike on every rank (the lockstep check would raise).
        sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.9, top_k=20))
        assert all(len(o.outputs[0].token_ids) > 0 for o in sampled)
        assert llm.parallel_error is None
        killed_at: list[float] = []

        def kill(_tokens: int, steps: int) -> None:
            if steps == 3 and not killed_at:
                os.kill(pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), progress=kill)
        assert killed_at and time.monotonic() - killed_at[0] < 30
        assert "rank 1" in (llm.parallel_error or "")
        with pytest.raises(WorkerError, match="failed earlier"):
            llm.generate(PROMPTS[0], sp)
    assert not _alive(pid) and not mp.active_children()


def test_lockstep_divergence_raises_on_every_rank() -> None:
    """Ranks asked for different lengths (rank 1's request finishes first) raise instead of hanging: the
    all-reduces keep their hidden states equal, so only the plan tells them apart."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_diverging_rank, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert [r for r, _ in got] == [0, 1]
    assert all(msg.startswith("LockstepError") and "diverged" in msg for _, msg in got), got


def _diverging_rank(rank: int, port: int, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    try:
        with LLM("small", device="cpu", max_batch_size=2, max_seq_len=256, tensor_parallel_size=2) as llm:
            llm.generate("def f(x):", SamplingParams(max_tokens=8 if rank == 0 else 5, ignore_eos=True))
        q.put((rank, "no error"))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_serve_cli_with_tp_size_2(tmp_path: Path) -> None:
    """``trtllm-glm serve small --tp_size 2`` answers a completion on the loopback; SIGINT leaves nothing."""
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("device: cpu\nmax_batch_size: 2\nmax_seq_len: 256\n")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtllm_glm", "serve", "small", "--tp_size", "2", "--port", str(port),
         "--config", str(cfg), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        workers = _rank_workers(proc.pid)
        assert workers, "the server started no worker process"
        body = json.dumps({"model": "small", "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
        # A worker that dies turns /health unhealthy, naming the rank.
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    pass
            except urllib.error.HTTPError as e:
                assert e.code == 503 and "rank 1" in e.read().decode()
                break
            assert time.monotonic() < deadline, "/health stayed healthy after a worker died"
            time.sleep(0.2)
        # A new request gets 503 with the plain reason (not a 500 with the collective's internals), and the
        # server drains and exits by itself (a supervisor restarts it) instead of lingering with a dead world.
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("a request was served by a dead world")
        except urllib.error.HTTPError as e:
            body_text = e.read().decode()
            assert e.code == 503 and "a model rank failed" in body_text and "gloo" not in body_text.lower()
        except urllib.error.URLError:
            pass  # already closed: it was exiting
        proc.wait(60)
        assert proc.returncode != 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 15
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers)

"""Prefix reuse on serving workloads at the LLM API's settings (issue 34).

Three workloads, each on a fresh executor built as `LLM` builds it (``KvCacheConfig()`` defaults unless
``--legacy``, the settings before issue 34: one checkpoint per prompt, no branch points, no byte bound):

* ``system``: one ``--sys-len``-token system prompt followed by ``--questions`` different ``--q-len``-token
  questions, sent one after another (``system_seq``) and ``--concurrency`` at a time (``system_conc``:
  a closed loop, the next question is sent when one finishes);
* ``chat``: ``--chats`` conversations over one shared ``--chat-sys``-token system prompt, ``--turns`` turns
  each (each turn = the previous turn's prompt + its answer + a new ``--msg-len``-token message), the
  conversations' turns interleaved;
* ``document``: one ``--doc-len``-token document asked ``--doc-questions`` different questions.

Per workload it reports the prompt tokens reused against the ideal (per request: the longest prefix its
prompt shares with an earlier request's prompt, or with all it computed once finished, at most the prompt
less its last token), the
reuse lost (cached pages without a checkpoint), TTFT cold (the first request) and warm (the median of the
requests after the second) against the TTFT of a ``--q-len``-token prompt alone, and checkpoint memory
(peak bytes, the bound).

CPU (``small`` preset, random token ids; ~3 min on one core):
    python -m benchmarks.bench_prefix_workloads --preset small --device cpu --json out.json
H200 (the 4-layer real-geometry slice, random weights drawn on the device as bench_e2e.py does):
    python -m benchmarks.bench_prefix_workloads --preset glm-5.3-flash --layers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness.models import random_model
from benchmarks.harness.rows import emit, write_json
from trtllm_glm import LLM, KvCacheConfig  # noqa: E402
from trtllm_glm.cache.prefix import PrefixStats  # noqa: E402
from trtllm_glm.config import Glm5NextConfig  # noqa: E402
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM, subset_config  # noqa: E402
from trtllm_glm.runtime.executor import Executor  # noqa: E402
from trtllm_glm.runtime.request import Request  # noqa: E402
from trtllm_glm.runtime.sampling import SamplingParams  # noqa: E402


@dataclass
class Tally:
    """Per-workload totals."""

    requests: int = 0
    prompt_tokens: int = 0
    ideal: int = 0
    reused: int = 0
    ttft: list[float] = field(default_factory=list)
    peak_ckpt_bytes: int = 0
    # Token sequences of earlier requests: each one's prompt from its submission (a request sent while another
    # with the same prefix computes could wait for it), its computed tokens once finished.
    computed: dict[int, list[int]] = field(default_factory=dict)

    def ideal_for(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.computed.values():
            n = min(len(seq), len(prompt))
            i = 0
            while i < n and seq[i] == prompt[i]:
                i += 1
            best = max(best, i)
        return min(best, len(prompt) - 1)


def record(t: Tally, r: Request, submitted_ttft: float) -> None:
    t.requests += 1
    t.prompt_tokens += len(r.prompt_ids)
    t.reused += r.num_cached_tokens
    t.ttft.append(submitted_ttft)


class Runner:
    """Drives one executor: submissions, steps, TTFT per request, checkpoint-memory peak."""

    def __init__(self, ex: Executor, sync: Callable[[], None], gen: int) -> None:
        self.ex, self.sync, self.gen = ex, sync, gen

    def params(self, n: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=n or self.gen, ignore_eos=True)

    def run(self, t: Tally, prompts: list[list[int]], concurrency: int = 1, gen: int | None = None) -> list[Request]:
        """Serve ``prompts`` with at most ``concurrency`` in flight (the next one is sent when one finishes)."""
        ex, out = self.ex, []
        todo = list(prompts)
        live: dict[int, tuple[Request, float]] = {}
        seen_first: set[int] = set()
        while todo or live:
            while todo and len(live) < concurrency:
                p = todo.pop(0)
                t.ideal += t.ideal_for(p)
                self.sync()
                r = ex.add_request(p, self.params(gen))
                live[r.request_id] = (r, time.perf_counter())
                t.computed[r.request_id] = p
                out.append(r)
            ex.step()
            now = None
            for rid, (r, t0) in list(live.items()):
                if rid not in seen_first and r.output_ids:
                    if now is None:
                        self.sync()
                        now = time.perf_counter()
                    seen_first.add(rid)
                    record(t, r, now - t0)
                if r.finished:
                    del live[rid]
                    t.computed[r.request_id] = r.tokens[:-1]
            if ex.prefix is not None:
                t.peak_ckpt_bytes = max(t.peak_ckpt_bytes, ex.prefix.store.nbytes)
        while ex.has_work:  # an overlapped step still in flight
            ex.step()
        return out


def fresh_executor(llm: LLM) -> Executor:
    """A new executor with an empty cache, built as the LLM built its own (graphs captured)."""
    llm.executor = None  # type: ignore[assignment]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm.executor = llm._make_executor()
    llm.executor.capture_cuda_graphs()
    return llm.executor


def short_prompt_ttft(run: Runner, rng: random.Random, vocab: int, n: int, reps: int = 5) -> float:
    """Median TTFT of an ``n``-token prompt that shares nothing (the warm request's yardstick), served like the
    workload's requests (the same ``max_tokens``): with the overlap scheduler a request's first token is read back
    while its next step is launched, which a one-token request never has, so ``gen=1`` would favour the yardstick."""
    t = Tally()
    for _ in range(reps):
        run.run(t, [[rng.randrange(vocab) for _ in range(n)]])
    return statistics.median(t.ttft[1:] or t.ttft)


def report(name: str, t: Tally, ex: Executor, short: float, extra: dict) -> dict:
    st = ex.prefix.stats if ex.prefix is not None else None
    warm = t.ttft[2:] or t.ttft[1:]
    row = {
        "workload": name,
        "requests": t.requests,
        "prompt_tokens": t.prompt_tokens,
        "ideal_reused_tokens": t.ideal,
        "reused_tokens": t.reused,
        "reuse_of_ideal": t.reused / t.ideal if t.ideal else 0.0,
        "lost_tokens": st.lost_tokens if st else 0,
        "lost_requests": st.lost_requests if st else 0,
        "held": st.held if st else 0,
        "hits": st.hits if st else 0,
        "branch_checkpoints": st.branch_checkpoints if st else 0,
        "checkpoints_taken": st.checkpoints_taken if st else 0,
        "checkpoints_evicted": st.checkpoints_evicted if st else 0,
        "checkpoints_skipped": st.checkpoints_skipped if st else 0,
        "ttft_cold_ms": 1e3 * t.ttft[0],
        "ttft_warm_median_ms": 1e3 * statistics.median(warm),
        "ttft_short_prompt_ms": 1e3 * short,
        "warm_over_short": statistics.median(warm) / short,
        "checkpoint_peak_bytes": t.peak_ckpt_bytes,
        "checkpoint_max_bytes": ex.prefix.max_bytes if ex.prefix is not None else None,
        **extra,
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N trunk layers (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", nargs="+", default=["system_seq", "system_conc", "chat", "document"])
    ap.add_argument("--sys-len", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--q-len", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--chat-sys", type=int, default=512)
    ap.add_argument("--msg-len", type=int, default=50)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--doc-len", type=int, default=3000)
    ap.add_argument("--doc-questions", type=int, default=16)
    ap.add_argument("--gen", type=int, default=8, help="output tokens per request (system, document)")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument(
        "--legacy",
        action="store_true",
        help="the settings before issue 34 (for comparison): no stride, "
        "no byte bound, no prompt-end / request-end / branch-point checkpoints, no waiting for a leader",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.layers is None:
        model = Glm5NextForCausalLM.from_pretrained(args.preset, device=args.device, dtype=args.dtype)
    else:
        base = Glm5NextConfig.from_pretrained(args.preset)
        cfg = subset_config(base, list(range(min(args.layers, base.num_hidden_layers))))
        model = random_model(cfg, args.device, args.dtype, seed=args.seed)
    vocab = model.config.vocab_size
    kv = KvCacheConfig()
    if args.legacy:
        kv = KvCacheConfig(checkpoint_interval=None, checkpoint_max_bytes=None, checkpoint_prompt_end=False,
                           checkpoint_branch_points=False, checkpoint_request_end=False)  # fmt: skip
    llm = LLM(
        model=model, kv_cache_config=kv, max_seq_len=args.max_seq_len, num_threads=1 if args.device == "cpu" else None
    )
    if args.legacy:
        llm.executor_config.prefix_wait_for_leader = False  # (not a KvCacheConfig knob)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    settings = {"preset": args.preset, "layers": args.layers, "device": args.device, "dtype": args.dtype,
                "legacy": args.legacy, "tokens_per_block": kv.tokens_per_block,
                "checkpoint_interval": llm.executor_config.checkpoint_interval,
                "max_num_tokens": llm.executor_config.max_num_tokens}  # fmt: skip
    print(json.dumps(settings), flush=True)
    rows = []
    for w in args.workloads:
        rng = random.Random(args.seed)

        def rand(n: int, rng: random.Random = rng) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        ex = fresh_executor(llm)
        run = Runner(ex, sync, args.gen)
        # Warm-up (first-use compilation at these shapes), then the short prompt's TTFT; both share nothing.
        run.run(Tally(), [rand(args.sys_len + args.q_len)], gen=2)
        short = short_prompt_ttft(run, rng, vocab, args.q_len)
        if ex.prefix is not None:  # count the workload only
            ex.prefix.stats = PrefixStats()
            for k in ex.prefix.store:
                ex.prefix.store.discard(k)
        t = Tally()
        t0 = time.perf_counter()
        if w in ("system_seq", "system_conc"):
            sysp = rand(args.sys_len)
            prompts = [sysp + rand(args.q_len) for _ in range(args.questions)]
            run.run(t, prompts, concurrency=1 if w == "system_seq" else args.concurrency)
            extra = {"shared_prefix": args.sys_len, "questions": args.questions, "q_len": args.q_len}
        elif w == "chat":
            sysp = rand(args.chat_sys)
            convs = [sysp + rand(args.msg_len) for _ in range(args.chats)]
            for _ in range(args.turns):
                for c in range(args.chats):
                    (r,) = run.run(t, [convs[c]], gen=args.answer_len)
                    convs[c] = convs[c] + r.output_ids + rand(args.msg_len)
            extra = {"chats": args.chats, "turns": args.turns, "answer_len": args.answer_len}
        elif w == "document":
            doc = rand(args.doc_len)
            run.run(t, [doc + rand(args.q_len // 2) for _ in range(args.doc_questions)])
            extra = {"doc_len": args.doc_len, "questions": args.doc_questions}
        else:
            raise SystemExit(f"unknown workload {w!r}")
        extra["wall_s"] = time.perf_counter() - t0
        row = report(w, t, ex, short, {**settings, **extra})
        rows.append(row)
        emit(row)
        del ex, run
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()

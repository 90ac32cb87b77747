"""Randomized differential test of speculative decoding's runtime: `SpeculativeExecutor` against plain greedy.

Each case is drawn from one seed (printed in every failure, with the command that reruns it) and mixes what the
focused tests cover one at a time: MTP (K = 1..4, shared / separate draft caches, a small draft pool, rounds
launched ahead, early drafts, a scripted adaptive policy or the real one on an injected clock, catch-up lags,
``max_concurrency``, ``draft_len_fn``, selection sharing, a restricted draft vocabulary), FP8 or bf16 indexer keys, FP8
or model-dtype latent rows, an FP8 LM head, the n-gram drafter and oracle drafters, emulated CUDA graphs (padded or
not, piecewise or not, captured at start-up or on first use) with or without the overlap scheduler, batch waiting,
KDA short prefills with decode rows riding them, the fused KDA decode step, page pools small enough to preempt,
prefix caching over shared prompt prefixes, repeated prompts and a conversation's next turn, chunked prefill,
requests arriving between steps, stop tokens, ``end_id``, ``max_tokens`` and the context limit inside accepted
drafts, ``ignore_eos``, logprobs and returned logits, sampled requests and aborts. A third of the cases are steady
batches of greedy requests (where rounds are launched ahead and drafts made early), a third mix everything, a
third are harsh (small pools and step budgets, many arrivals, aborts and sampled requests).

What it proves, per case:

- every greedy request's tokens are plain greedy decoding's (or part from them only at a near tie of the
  reference's top-2 logits, docs/design.md §7, or where plain decoding itself flips in another batch:
  `_plain_flips`) and end for the same reason; an aborted request's tokens are a prefix of them; their logprobs,
  generation and context logits and prompt logprobs are the reference's to fp32 rounding;
- sampled requests finish within their budget for a valid reason, drawing once per token from their generator;
- with the MTP drafter, every round's drafts are those the plainest speculative run (eager, synchronous, no lag,
  no cache) makes after the same tokens: draft state (MTP cache, lag, catch-ups, restores) is never corrupted,
  which the output alone would not show; speculation is never turned off short of a full separate draft pool;
- nothing is left behind: no request running or waiting, every page and state slot (target and draft) free again,
  no per-request speculative state or n-gram index, and the device-side acceptance never disagreed with the
  host's (the tail rings' cross-check); no step failed to plan.

The references are one plain run per case (``ignore_eos``, each request's own budget); each request's expected
output is that run's tokens cut where its own stop tokens, EOS, ``max_tokens`` or the context limit end it (greedy
decoding makes those cuts exact). The trained ``small`` preset drafts well (MTP and n-gram drafts are really
accepted, several per round); on the random ``tiny`` preset (two layers) drafts come from an oracle that replays
the reference with corruptions, either as the drafter itself or replacing the MTP layer's drafts
(`OracleAcceptanceDrafter`: the MTP layer still runs).

Emulated graphs are made to behave like captured ones (`_graph_like`): every replay of a graph writes its outputs
into the same buffers, and results and fused drafts reach the host through reused landing buffers, so a read of a
previous replay's outputs after the next one sees the new values. The MTP graphs a device would hold are tracked
(captured at start-up or at first use): a lag flush behind a step in flight, which may not capture, runs eagerly
where a device would.

Environment switches a case draws (`KDA_ENV`) are set per case and restored after it; the package reads them at
each use. The fused KDA decode step runs in the speculative runs only (`_fused_decode`).

``TRTLLM_GLM_SPEC_FUZZ_CASES`` (default 12, the CI suite's share) and ``TRTLLM_GLM_SPEC_FUZZ_SEED`` (default 0)
choose the seeds; a single seed reruns with ``TRTLLM_GLM_SPEC_FUZZ_SEED=<seed> TRTLLM_GLM_SPEC_FUZZ_CASES=1``; a
sweep, e.g.
``TRTLLM_GLM_SPEC_FUZZ_SEED=1000 TRTLLM_GLM_SPEC_FUZZ_CASES=500 pytest -n 2 tests/integration/test_spec_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.spec_helpers import SNIPPETS, Scripted, emulate_graphs
from trtllm_glm.kda.ops import decode_fused as kda_decode_fused_ops
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
from trtllm_glm.runtime.cuda_graph import CudaGraphConfig, CudaGraphRunner, GraphOutputs, HostResults
from trtllm_glm.runtime.executor import Executor, ExecutorConfig
from trtllm_glm.runtime.lossless import compare_greedy
from trtllm_glm.runtime.request import FinishReason, Request
from trtllm_glm.runtime.sampling import SamplingParams
from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor
from trtllm_glm.speculative.adaptive import AdaptiveDraftPolicy
from trtllm_glm.speculative.config import MTPDecodingConfig, NGramDecodingConfig
from trtllm_glm.speculative.drafters import DeviceDrafts, NGramDrafter, OracleAcceptanceDrafter, OracleDrafter
from trtllm_glm.speculative.mtp.graphs import MtpChainGraphs

pytestmark = pytest.mark.cpu_only

KPOOL_BACKEND = "TRTLLM_GLM_KPOOL_BACKEND"
NUM_CASES = int(os.environ.get("TRTLLM_GLM_SPEC_FUZZ_CASES", "12"))
FIRST_SEED = int(os.environ.get("TRTLLM_GLM_SPEC_FUZZ_SEED", "0"))
# The reference's context limit (every case's is at most this).
REF_MAX_SEQ_LEN = 256

HEADERS = ["import os\nimport sys\nimport json\n\n\nclass Config:\n", "def f(x):\n    return x + 1\n\n\n"]


# --------------------------------------------------------------------------------------------------
# Cases
@dataclass
class Req:
    """One request of a case: its prompt, parameters, the step it arrives before, and an optional abort."""

    prompt: list[int]
    params: SamplingParams
    arrive: int = 0
    abort_at: int | None = None  # the step before which it is aborted (if still live)
    # The next turn of a conversation: request ``turn_of``'s prompt, its answer, then ``prompt[-extra:]`` (`references`
    # writes the answer in; until then ``prompt`` holds the longest it can be).
    turn_of: int | None = None
    extra: int = 0
    # Never given a stop token by `_stops` (a scenario's request that must outlive the arrivals).
    no_stop: bool = False


@dataclass
class Case:
    """Everything one seed chose."""

    seed: int
    profile: str  # "steady", "mixed" or "harsh"
    model: str  # "small" (trained) or "tiny" (random, two layers)
    drafter: str  # "mtp", "ngram", "oracle" (parallel), "oracle_mtp" (MTP layer runs, oracle tokens proposed)
    spec: Any
    cfg: ExecutorConfig
    graphs: bool
    policy: list[int] | None  # a scripted adaptive policy's choices, cycled
    corrupt_mod: int  # oracle drafters: a draft at output position j is corrupted when (7 i + j) % corrupt_mod == 0
    reqs: list[Req] = field(default_factory=list)
    # The real adaptive policy on a `_RoundClock` (its arguments; None: none or the scripted one).
    timed: dict[str, Any] | None = None
    # Environment switches set for the whole case, references included (`_case_env`); read per use by the package.
    env: dict[str, str] = field(default_factory=dict)
    fp8_head: bool = False  # the LM head in block FP8 (``fp8_lm_head=True``), for the references too
    capture: bool = False  # with graphs: the executor captures them at start-up (`capture_cuda_graphs`)

    def describe(self) -> str:
        spec = dataclasses.asdict(self.spec)
        cfg = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k != "cuda_graph_config"}
        reqs = [
            dict(prompt_len=len(r.prompt), arrive=r.arrive, abort_at=r.abort_at,
                 **{k: v for k, v in dataclasses.asdict(r.params).items() if v not in (None, False, 0, 1.0)})
            for r in self.reqs
        ]  # fmt: skip
        return (
            f"seed={self.seed} profile={self.profile} model={self.model} drafter={self.drafter} graphs={self.graphs} "
            f"policy={self.policy} timed={self.timed} corrupt_mod={self.corrupt_mod} env={self.env} "
            f"fp8_head={self.fp8_head} capture={self.capture}\n  spec={type(self.spec).__name__}{spec}\n"
            f"  cfg={cfg}, graphs {self.cfg.cuda_graph_config}\n  reqs={reqs}"
        )


def _prompt(rng: random.Random, model: str, header: list[int] | None) -> list[int]:
    if model == "small":
        text = rng.choice(SNIPPETS)
        cut = rng.randrange(max(1, len(text) // 2), len(text) + 1)
        p = list(text[:cut].encode())
    elif rng.random() < 0.5:  # repetitive: the n-gram drafter finds matches
        base = [rng.randrange(256) for _ in range(rng.randrange(2, 5))]
        p = (base * 10)[: rng.randrange(4, 24)]
    else:
        p = [rng.randrange(256) for _ in range(rng.randrange(1, 24))]
    return (header or []) + p


@dataclass
class _DraftCap:
    """A per-request draft cap (``draft_len_fn``) that changes from round to round: 0 .. K + 1."""

    K: int

    def __call__(self, r: Any) -> int:
        return (r.request_id + len(r.tokens)) % (self.K + 2)


def make_case(seed: int) -> Case:
    """The case of ``seed`` (deterministic; its profile: the module docstring)."""
    rng = random.Random(seed)
    profile = rng.choice(["steady", "mixed", "harsh"])
    steady, harsh = profile == "steady", profile == "harsh"
    model = "small" if rng.random() < 0.65 else "tiny"
    if model == "small":
        drafter = rng.choices(["mtp", "ngram"], [0.75, 0.25])[0]
    else:
        drafter = rng.choices(["oracle_mtp", "oracle", "ngram"], [0.45, 0.35, 0.2])[0]
    graphs = rng.random() < (0.85 if steady else 0.6)
    overlap = graphs and rng.random() < (0.75 if steady else 0.5)
    mc = rng.choice([None, None, None, 1, 2, 3])
    policy = None
    if drafter in ("mtp", "oracle_mtp"):
        K = rng.randint(2 if steady else 1, 4)
        separate = rng.random() < 0.5
        # Rounds launched ahead need the overlap scheduler; early drafts apply to the rounds that are not.
        ahead = rng.choice(["rounds", "early", "both", "none"])
        if ahead == "early" and rng.random() < 0.6:
            overlap = False
        spec = MTPDecodingConfig(
            max_draft_len=K,
            draft_kv_mode="separate" if separate else "shared",
            draft_max_tokens=rng.choice([None, None, None, 48, 96]) if separate else None,
            overlap_rounds=ahead in ("rounds", "both"),
            early_draft=ahead in ("early", "both"),
            catchup_lag=rng.choice([0, 0, 2, 5, 64]),
            max_concurrency=None if steady and rng.random() < 0.7 else mc,
            index_share_for_mtp_iteration=rng.choice([None, None, True]),
            draft_vocab_size=rng.choice([None, None, None, 32]) if model == "small" else None,
        )
    else:
        K = rng.randint(1, 5)
        spec = NGramDecodingConfig(max_draft_len=K, max_concurrency=mc)
    if not steady and rng.random() < 0.15:
        spec = dataclasses.replace(spec, draft_len_fn=_DraftCap(K))
    if rng.random() < (0.15 if steady else 0.3):
        policy = [rng.choice([0, K, K, rng.randint(0, K)]) for _ in range(rng.randint(3, 12))]
        spec = dataclasses.replace(spec, adaptive=True)
    P = rng.choice([4, 8, 8, 16])
    block_reuse = rng.random() < (0.2 if steady else 0.4)
    n = rng.randint(2, 6)
    batch = rng.choice([1, 2, 3, 4, 4])
    if steady:  # all at once (one more than the batch sometimes: it waits for a slot)
        n = min(n, batch + int(rng.random() < 0.3))
    header = list(rng.choice(HEADERS).encode()) if model == "small" else [rng.randrange(256) for _ in range(20)]
    reqs: list[Req] = []
    for i in range(n):
        shared = block_reuse and rng.random() < 0.7
        prompt = _prompt(rng, model, header[: rng.randrange(P, len(header) + 1)] if shared else None)
        turn_of = None
        if block_reuse and i and rng.random() < 0.2:
            prompt = list(reqs[rng.randrange(i)].prompt)  # the same prompt again
        elif block_reuse and i and rng.random() < 0.25 and reqs[i - 1].params.greedy:
            turn_of = i - 1  # the next turn: the previous request's prompt and answer, then a few tokens
            prev = reqs[turn_of]
            extra = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
            prompt = prev.prompt + [0] * prev.params.max_tokens + extra
        top = 40 if steady else 28
        kw: dict[str, Any] = dict(max_tokens=rng.randint(12 if steady else 1, top), ignore_eos=rng.random() < 0.7)
        if not steady and rng.random() < (0.3 if harsh else 0.12):
            kw.update(temperature=0.8, top_k=rng.choice([0, 8]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1000))
        if rng.random() < 0.12:  # per-token outputs (greedy ones are compared with the reference's)
            kw.update(rng.choice([dict(logprobs=rng.randint(0, 2)), dict(return_generation_logits=True),
                                  dict(prompt_logprobs=1), dict(return_context_logits=True)]))  # fmt: skip
        arrive = 0 if steady or i < 2 else rng.choice([0, 0, 1, 2, 3, 6, 10])
        if turn_of is not None:
            arrive = max(arrive, reqs[turn_of].arrive + rng.choice([4, 10, 20]))
        reqs.append(
            Req(
                prompt,
                SamplingParams(**kw),
                arrive=arrive,
                turn_of=turn_of,
                extra=len(extra) if turn_of is not None else 0,
            )
        )
        if rng.random() < (0.25 if harsh else 0.1):
            reqs[-1].abort_at = reqs[-1].arrive + rng.randint(0, 16 if steady else 8)
    longest = max(len(r.prompt) + r.params.max_tokens for r in reqs)
    max_seq_len = rng.choice([REF_MAX_SEQ_LEN, REF_MAX_SEQ_LEN, longest + rng.randint(-6, 4)])
    max_seq_len = max(max_seq_len, max(len(r.prompt) for r in reqs) + 2)
    total = sum(len(r.prompt) + r.params.max_tokens + K + 1 for r in reqs)
    if rng.random() < (0.6 if harsh else 0.15):  # preempts: room for about one or two requests
        pool = max(min(max_seq_len, longest + K + 1) + 2 * P, total // 3)
    else:
        pool = 2048
    cfg = ExecutorConfig(
        tokens_per_block=P,
        max_tokens=pool,
        max_batch_size=batch,
        max_num_tokens=rng.choice([1 + K, max(1 + K, 6), 16, 64] if harsh else [16, 64, 64]),
        max_seq_len=max_seq_len,
        prefill_chunk_size=rng.choice([None, None, 3, 7]),
        cuda_graph_config=CudaGraphConfig(
            # Usually every size up to the batch (sizes above it are dropped); sometimes a few, padding to them.
            batch_sizes=sorted({batch, *range(1, batch)} if rng.random() < 0.7 else {rng.randint(1, 4), 4}),
            enable_padding=rng.random() < 0.8,
            piecewise=rng.random() < 0.2,
        )
        if graphs
        else None,
        enable_block_reuse=block_reuse,
        checkpoint_interval=rng.choice([None, P, 2 * P]) if block_reuse else None,
        checkpoint_prompt_end=block_reuse and rng.random() < 0.5,
        checkpoint_request_end=block_reuse and rng.random() < 0.5,
        checkpoint_last_page=rng.random() < 0.8,
        checkpoint_branch_points=rng.random() < 0.8,
        prefix_wait_for_leader=rng.random() < 0.8,
        max_checkpoints=rng.choice([64, 64, 2]),
        overlap_scheduler=overlap,
        indexer_key_dtype=rng.choice(["fp8", "fp8", "fp8", "bf16"]),
        latent_dtype=rng.choice(["auto", "auto", "fp8"]),
    )
    case = Case(seed, profile, model, drafter, spec, cfg, graphs, policy, rng.choice([2, 3, 5, 1000]), reqs)
    _draw_more(case, random.Random(seed * 1_000_003 + 17))
    return case


# The KDA switches a case may set (`_draw_more`), and the ones `_case_env` clears so that a run's own environment does
# not leak into a case that did not draw them.
FUSED = "TRTLLM_GLM_KDA_FUSED_DECODE"
KDA_ENV = ("TRTLLM_GLM_KDA_SHORT_PREFILL", "TRTLLM_GLM_KDA_DECODE_RIDE", "TRTLLM_GLM_KDA_FUSED_DECODE",
           "TRTLLM_GLM_DECODE_FUSE", "TRTLLM_GLM_KDA_CONV_BACKEND", "TRTLLM_GLM_KDA_BACKEND")  # fmt: skip


def _draw_more(case: Case, rng: random.Random) -> None:
    """The dimensions added after the first ones, drawn from a generator of their own so that every earlier
    dimension of a seed stays as it was: the real adaptive policy on an injected clock, batch waiting, the KDA
    short-prefill path with decode rows riding it, the fused KDA decode step, the FP8 LM head."""
    steady = case.profile == "steady"
    K = case.spec.max_draft_len
    if rng.random() < (0.12 if steady else 0.2) or (case.policy is not None and rng.random() < 0.5):
        # The real policy: small exploration periods and probes so that a short case changes K, re-measures and
        # (with a catch-up lag) charges flushes to K = 0. With MTP and graphs the executor's own default is (0, K).
        case.policy = None
        case.spec = dataclasses.replace(case.spec, adaptive=True)
        case.timed = dict(
            candidates=rng.choice([None, (0, K)]),
            explore_every=rng.choice([2, 4, 8]),
            probe_rounds=1,
            min_samples=rng.choice([1, 2]),
            slope=rng.choice([-0.2, 0.1, 0.4, 1.5]),  # seconds a draft adds to a round (its sign: which K wins)
            seed=rng.randrange(1 << 30),
        )
        case.timed["probe_rounds"] = rng.randint(1, case.timed["explore_every"] - 1)
    if rng.random() < (0.15 if steady else 0.35):
        # Arrivals held while the batch decodes (steps launched ahead while held); a ratio ends holds early.
        # A hold needs free batch slots beyond the waiting requests: usually room for every request and one more.
        batch = max(case.cfg.max_batch_size, len(case.reqs) + 1) if rng.random() < 0.7 else case.cfg.max_batch_size
        case.cfg = dataclasses.replace(case.cfg, max_batch_size=batch,
                                       batch_wait_timeout_iters=rng.choice([1, 2, 4, 8]),
                                       batch_wait_max_tokens_ratio=rng.choice([0.0, 0.0, 0.1, 0.5]))  # fmt: skip
    if rng.random() < 0.3:
        # Short prefills through the KDA verify recurrence (the CUDA default; off on the CPU), and decode rows riding
        # their grid within a padding bound (0: never).
        case.env["TRTLLM_GLM_KDA_SHORT_PREFILL"] = rng.choice(["4", "16", "64"])
        case.env["TRTLLM_GLM_KDA_DECODE_RIDE"] = rng.choice(["0", "3", "16", "512"])
    if case.model == "tiny" and rng.random() < 0.2:
        # The fused KDA decode step, interpreted on the CPU (~0.2 s a call: one KDA layer, the speculative runs only,
        # `_fused_decode`).
        case.env[FUSED] = "1"
    case.fp8_head = rng.random() < 0.15
    case.capture = rng.random() < 0.5


def _stops(case: Case, rng: random.Random, free: list[list[int]]) -> None:
    """Give some greedy requests stop tokens (or an ``end_id``) taken from their own free-running output, so that
    they stop mid-output (often on an accepted draft)."""
    for r, out in zip(case.reqs, free):
        if not r.params.greedy or len(out) < 2 or rng.random() > 0.45:
            continue
        tok = out[rng.randrange(1, len(out))]
        if r.no_stop:  # (after the draws: the other requests get the stops they always got)
            rng.random()
            continue
        if rng.random() < 0.2:
            r.params = dataclasses.replace(r.params, end_id=tok, ignore_eos=False)
        else:
            r.params = dataclasses.replace(r.params, stop_token_ids=[tok])


# --------------------------------------------------------------------------------------------------
# Models and references
_MODELS: dict[tuple[str, bool], Glm5NextForCausalLM] = {}


def get_model(name: str, fp8_head: bool = False) -> Glm5NextForCausalLM:
    """The preset ``name`` in fp32, loaded once per process (``tiny``: its first KDA and sparse layers; ``fp8_head``:
    its LM head in block FP8)."""
    if (name, fp8_head) not in _MODELS:
        kw: dict[str, Any] = {"layers": [0, 3]} if name == "tiny" else {}
        model = Glm5NextForCausalLM.from_pretrained(name, dtype="float32", fp8_lm_head=fp8_head or None, **kw)
        _MODELS[name, fp8_head] = model.eval()
    return _MODELS[name, fp8_head]


def case_model(case: Case) -> Glm5NextForCausalLM:
    return get_model(case.model, case.fp8_head)


def plain_config(fmt: ExecutorConfig, **kw: Any) -> ExecutorConfig:
    """A roomy plain executor's sizes (``kw`` overrides them), with the case's cache formats (``fmt``'s indexer keys
    and latent rows: fp8 and bf16 keys score differently, an FP8 latent attends to rounded rows)."""
    sizes = dict(
        tokens_per_block=16, max_tokens=4096, max_batch_size=8, max_num_tokens=512, max_seq_len=REF_MAX_SEQ_LEN
    )
    return ExecutorConfig(**{**sizes, **kw}, indexer_key_dtype=fmt.indexer_key_dtype, latent_dtype=fmt.latent_dtype)


def free_reference(model: Glm5NextForCausalLM, reqs: list[Req], fmt: ExecutorConfig) -> list[Request]:
    """Plain runs of every request, all in one batch: greedy ones free-running (``ignore_eos``, their own budget),
    sampled ones as they are (the oracle drafters need a continuation for every request)."""
    ex = Executor(model, plain_config(fmt))
    out = []
    for r in reqs:
        p = r.params
        if p.greedy:
            p = dataclasses.replace(p, ignore_eos=True, stop_token_ids=None, end_id=None)
        out.append(ex.add_request(r.prompt, p))
    ex.run_until_done()
    return out


def expected(
    ref: Request, params: SamplingParams, prompt_len: int, max_seq_len: int, eos: list[int]
) -> tuple[list[int], list[float], FinishReason]:
    """``ref``'s free-running tokens (and gaps) cut where ``params`` and the context limit end the request."""
    stop = params.stop_ids(eos)
    toks, gaps = ref.output_ids, ref.logit_gaps
    for i, t in enumerate(toks):
        if t in stop:
            return toks[: i + 1], gaps[: i + 1], FinishReason.STOP
        if i + 1 >= params.max_tokens or prompt_len + i + 1 >= max_seq_len:
            return toks[: i + 1], gaps[: i + 1], FinishReason.LENGTH
    raise AssertionError("the reference ran out before the request's budget")


# --------------------------------------------------------------------------------------------------
# Graph-like emulation
@contextmanager
def _graph_like() -> Iterator[None]:
    """Emulated graphs behave like captured ones where reuse could hide a stale read on the CPU: every replay of a
    graph writes its outputs into the same buffers (the emulation returns fresh tensors), a step's results land in
    one of two alternating host buffers and the fused draft's tokens in one landing buffer, read when the host
    asks for them (as the pinned buffers of a CUDA device; on the CPU they are copies at once), and a request's
    generation logits are copied when emitted (``.cpu()``: a view on the CPU)."""
    launch, run, emit = CudaGraphRunner._launch, MtpChainGraphs._replay_or_run, Executor._emit
    chain_key = MtpChainGraphs._catch_or_draft_key
    chain_init, drafts_init = MtpChainGraphs.__init__, DeviceDrafts.__init__

    def keep(owner: Any, key: Any, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        store = owner.__dict__.setdefault("_fuzz_outputs", {})
        bufs = store.get(key)
        with torch.inference_mode():
            if bufs is None or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(bufs, out)):
                bufs = store[key] = tuple(torch.empty_like(t) for t in out)
            for b, t in zip(bufs, out):
                b.copy_(t)
        return bufs

    @contextmanager
    def kernels(meta: Any) -> Iterator[None]:
        # The k-pool cache writes of a replay with padding rows through the (interpreted) kernels, the only ones that
        # skip them; other steps keep the torch references (the interpreter costs most of an emulated case's time).
        prev = os.environ[KPOOL_BACKEND]
        if bool((meta.row_seq_t[: meta.num_tokens] < 0).any()):
            os.environ[KPOOL_BACKEND] = "triton"
        try:
            yield
        finally:
            os.environ[KPOOL_BACKEND] = prev

    def launch_kept(self: CudaGraphRunner, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        with kernels(self.meta):
            return keep(self, key, launch(self, key))

    def run_kept(self: MtpChainGraphs, key: Any, host_committed_lens: Any = None) -> tuple[torch.Tensor, ...]:
        with kernels(self.meta):
            return keep(self, key, run(self, key, host_committed_lens))

    def results_to_host(self: CudaGraphRunner, out: GraphOutputs) -> HostResults:
        n = out.packed.shape[0]
        if self._result_bufs is None:
            shape = (self.input_ids.numel(), out.packed.shape[1])
            self._result_bufs = [torch.empty(shape, dtype=out.packed.dtype) for _ in range(2)]
        buf = self._result_bufs[self._result_turn][:n]
        self._result_turn ^= 1
        buf.copy_(out.packed)
        return HostResults(buf, None)

    def chain_init_landing(self: MtpChainGraphs, *a: Any, **kw: Any) -> None:
        chain_init(self, *a, **kw)
        if self.fused and self.host_drafts is None:
            self.host_drafts = torch.zeros(self.meta.max_num_seqs, self.max_draft_len, dtype=torch.int64)

    def drafts_init_landing(self: DeviceDrafts, tensor: torch.Tensor, host: torch.Tensor | None = None) -> None:
        drafts_init(self, tensor, None)
        if host is not None:
            self._host = host[: tensor.shape[0]]
            self._host.copy_(tensor)

    def emit_copied(self: Executor, req: Request, tokens: list[int], gaps: list[float], logits: Any = None) -> bool:
        return emit(self, req, tokens, gaps, None if logits is None else logits.clone())

    # The MTP graphs a device would hold: those `capture_all` captures at start-up (when the executor's
    # `capture_cuda_graphs` ran) and every one used since. A key asked for without capture (a lag flush behind a
    # step in flight) is None when no such graph exists, as on a device (the emulation has every graph at once):
    # that flush then runs eagerly there too.
    def chain_capture_all(self: MtpChainGraphs, max_wide_size: int | None = None, flushes: bool = False) -> None:
        self.__dict__.setdefault("_fuzz_captured", set()).update(self.startup_keys(max_wide_size, flushes))

    def chain_key_captured(self: MtpChainGraphs, kind: str, committed: Any, capture: bool = True) -> Any:
        key = chain_key(self, kind, committed, True)
        captured = self.__dict__.setdefault("_fuzz_captured", set())
        if key is None or (not capture and key not in captured):
            return None
        captured.add(key)
        return key

    patches = [
        (CudaGraphRunner, "_launch", launch_kept),
        (CudaGraphRunner, "results_to_host", results_to_host),
        (MtpChainGraphs, "_replay_or_run", run_kept),
        (MtpChainGraphs, "__init__", chain_init_landing),
        (DeviceDrafts, "__init__", drafts_init_landing),
        (Executor, "_emit", emit_copied),
        (MtpChainGraphs, "capture_all", chain_capture_all),
        (MtpChainGraphs, "_catch_or_draft_key", chain_key_captured),
    ]
    # The patches go on the base classes: a subclass's own copy (another test that put an inherited method back by
    # assignment) would silently bypass them (logits not copied: "generation logits differ" with nothing wrong).
    shadowed = [f"{sub.__name__}.{name}" for cls, name, _ in patches for sub in (SpeculativeExecutor,)
                if issubclass(sub, cls) and sub is not cls and name in sub.__dict__]  # fmt: skip
    assert not shadowed, f"{shadowed} override the emulation's patches (left behind by another test?)"
    with pytest.MonkeyPatch.context() as mp:
        for cls, name, fn in patches:
            mp.setattr(cls, name, fn)
        mp.setenv(KPOOL_BACKEND, "torch")
        yield


# --------------------------------------------------------------------------------------------------
# One case
class _RoundClock:
    """The real adaptive policy's clock in a case: each stamp (one per round) advances it by a round's made-up cost,
    ``1 + slope * K`` of the interval it closes, a catch-up of held rows in it adding 2, and a little noise from
    its own seed: deterministic for the rounds the policy is fed, with costs that make it change K."""

    def __init__(self, slope: float, seed: int) -> None:
        self.t, self.slope, self.rng = 0.0, slope, random.Random(seed)
        self.policy: AdaptiveDraftPolicy | None = None

    def __call__(self) -> float:
        pol = self.policy
        if pol is not None and pol._open is not None:
            self.t += max(0.05, 1.0 + self.slope * pol._open[2] + 2.0 * pol._open_flush + self.rng.uniform(0, 0.3))
        return self.t


def timed_policy(case: Case) -> AdaptiveDraftPolicy:
    t = dict(case.timed or {})
    clock = _RoundClock(t.pop("slope"), t.pop("seed"))
    pol = AdaptiveDraftPolicy(case.spec.max_draft_len, clock=clock, **t)
    clock.policy = pol
    return pol


def build(case: Case, refs: list[Request]) -> SpeculativeExecutor:
    model = case_model(case)
    policy: AdaptiveDraftPolicy | None = None
    if case.policy is not None:
        script = case.policy
        policy = Scripted(case.spec.max_draft_len, lambda i: script[i % len(script)])
    elif case.timed is not None:
        policy = timed_policy(case)
    oracle = None
    if case.drafter in ("oracle", "oracle_mtp"):
        m = case.corrupt_mod
        cont = {i: list(r.output_ids) for i, r in enumerate(refs)}
        oracle = OracleDrafter(cont, lambda i, j: (7 * i + j) % m == 0, vocab_size=model.config.vocab_size)
    ex = SpeculativeExecutor(model, case.cfg, case.spec, drafter=oracle if case.drafter == "oracle" else None,
                             draft_policy=policy)  # fmt: skip
    if case.drafter == "oracle_mtp":
        assert oracle is not None
        ex.drafter = OracleAcceptanceDrafter(ex.drafter, oracle, model.config.vocab_size)
    if case.graphs and case.capture:
        ex.capture_cuda_graphs()  # as `LLM` does (emulated: the MTP graphs it would hold, `_graph_like`)
    return ex


def record_drafts(ex: SpeculativeExecutor, index: dict[int, int]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """Record every verify round's real drafts, keyed by (case request, the tokens they follow): what the drafter
    proposed from that history. ``index``: request id -> case request."""
    drafts: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    advance = ex._advance

    def spy(plan: list[Any], hidden: torch.Tensor, *a: Any, **kw: Any) -> list[Request]:
        for s in plan:
            r = s.request
            if s.is_decode and s.num_rows > 1 and not r.finished and r.request_id in ex.state:
                st = ex.state[r.request_id]
                d = st.resolve()
                k = len(d) if st.num_proposed is None else st.num_proposed
                drafts[(index[r.request_id], tuple(r.tokens))] = list(d[:k])
        return advance(plan, hidden, *a, **kw)

    ex._advance = spy  # type: ignore[method-assign]
    return drafts


def canonical_drafts(case: Case) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """The MTP drafts of the case's greedy requests in the plainest speculative run: eager synchronous rounds, all
    requests at once, a roomy pool, no prefix cache, no catch-up lag, no policy or concurrency cap."""
    c = case.cfg
    cfg = plain_config(c, tokens_per_block=c.tokens_per_block, max_num_tokens=64,
                       max_seq_len=c.max_seq_len)  # fmt: skip
    spec = dataclasses.replace(case.spec, overlap_rounds=False, early_draft=False, catchup_lag=0, adaptive=False,
                               max_concurrency=None, draft_max_tokens=None, draft_len_fn=None)  # fmt: skip
    ex = SpeculativeExecutor(case_model(case), cfg, spec)
    index: dict[int, int] = {}
    drafts = record_drafts(ex, index)
    for i, r in enumerate(case.reqs):
        if r.params.greedy:
            index[ex.add_request(r.prompt, r.params).request_id] = i
    ex.run_until_done()
    return drafts


def references(case: Case) -> list[Request]:
    """The case's `free_reference`; then stop tokens drawn from it (`_stops`). A conversation's next turn gets the
    answer its previous turn will give (the reference's, cut by that request's budget and stop tokens) written into its
    prompt, and its own reference run."""
    model = case_model(case)
    refs = free_reference(model, case.reqs, case.cfg)
    _stops(case, random.Random(case.seed + 1), [r.output_ids for r in refs])
    turns = [i for i, r in enumerate(case.reqs) if r.turn_of is not None]
    eos = model.config.eos_token_ids
    for i in turns:
        r = case.reqs[i]
        j = r.turn_of
        assert j is not None
        prev = case.reqs[j]
        answer, _, _ = expected(refs[j], prev.params, len(prev.prompt), REF_MAX_SEQ_LEN, eos)
        r.prompt = prev.prompt + answer + r.prompt[-r.extra :]
    if turns:
        for i, ref in zip(turns, free_reference(model, [case.reqs[i] for i in turns], case.cfg)):
            refs[i] = ref
    return refs


def run_case(
    case: Case, refs: list[Request], canon: dict[tuple[int, tuple[int, ...]], list[int]] | None = None
) -> list[str]:
    """Run ``case`` (``refs``: its `references`; ``canon``: its `canonical_drafts`, to compare the drafts with);
    returns what went wrong (empty: nothing)."""
    model = case_model(case)
    ex = build(case, refs)
    for mgr in {id(m): m for m in (ex.manager, ex.separate_draft_manager) if m is not None}.values():
        _poison_pages(mgr)
    index: dict[int, int] = {}
    drafts = record_drafts(ex, index)
    slots0 = ex.manager.num_free_slots
    dm = ex.separate_draft_manager
    dslots0 = dm.num_free_slots if dm is not None else 0
    reqs: list[Request | None] = [None] * len(case.reqs)
    aborted: set[int] = set()
    disabled: set[int] = set()
    step = 0
    while True:
        for i, r in enumerate(case.reqs):
            if reqs[i] is None and r.arrive <= step:
                reqs[i] = ex.add_request(r.prompt, r.params)
                index[reqs[i].request_id] = i
            q = reqs[i]
            if q is not None and r.abort_at == step and not q.finished:
                assert ex.abort_request(q.request_id) is q
                aborted.add(i)
        if not ex.has_work and all(q is not None for q in reqs):
            break
        if ex.has_work:
            ex.step()
            disabled |= {index[rid] for rid, st in ex.state.items() if st.mtp_disabled}
        step += 1
        assert step < 2000, "no progress"
    problems: list[str] = []
    # Only a full separate draft pool may turn speculation off (shared: the target's pages are the MTP plane's; a
    # separate pool as large as the target's fills no sooner, short of prefix caching's sharing); a gap in the MTP
    # history would do it silently.
    spec = case.spec
    pool_limited = getattr(spec, "draft_max_tokens", None) is not None or case.cfg.enable_block_reuse
    if disabled and not (getattr(spec, "draft_kv_mode", "") == "separate" and pool_limited):
        problems.append(f"speculation turned off (mtp_disabled) for requests {sorted(disabled)}")
    eos = model.config.eos_token_ids
    for i, (r, q) in enumerate(zip(case.reqs, reqs)):
        assert q is not None
        out = q.output_ids
        if not q.finished:
            problems.append(f"request {i} did not finish")
            continue
        if not r.params.greedy:
            stop = r.params.stop_ids(eos)
            ok = (
                q.finish_reason is FinishReason.ABORT
                or (q.finish_reason is FinishReason.STOP and out and out[-1] in stop)
                or (q.finish_reason is FinishReason.LENGTH
                    and (len(out) == r.params.max_tokens or len(q.tokens) >= ex.max_seq_len))
            )  # fmt: skip
            if not ok or len(out) > r.params.max_tokens:
                problems.append(f"sampled request {i}: {len(out)} tokens, finish {q.finish_reason}")
            if r.params.logprobs is not None and len(q.logprobs) != len(out):
                problems.append(f"sampled request {i}: {len(q.logprobs)} logprobs for {len(out)} tokens")
            if r.params.return_generation_logits and len(q.generation_logits) != len(out):
                problems.append(f"sampled request {i}: {len(q.generation_logits)} logits for {len(out)} tokens")
            # One uniform per token from the request's own generator (a step launched ahead may draw one more for
            # a request that ended in the step before it). Its tokens are not compared with the plain run's: a
            # rounding difference can flip the indexer's pool selection, which moves the logits by far more than
            # rounding (greedy tokens are compared under the near-tie rule; a draw has no such rule).
            draws = _draws(q.generator, r.params.seed, len(out) + 2)
            extra = 1 if case.cfg.overlap_scheduler or q.finish_reason is FinishReason.ABORT else 0
            if draws is None or not len(out) <= draws <= len(out) + extra:
                problems.append(f"sampled request {i}: {draws} draws from its generator for {len(out)} tokens")
            continue
        ref = refs[i]
        toks, gaps, reason = expected(ref, r.params, len(r.prompt), ex.max_seq_len, eos)
        if i in aborted and q.finish_reason is FinishReason.ABORT:
            toks, gaps = toks[: len(out)], gaps[: len(out)]  # aborted: a prefix of the output
            reason = FinishReason.ABORT
        d = compare_greedy(toks, gaps, out)
        if d is not None and not d.excused and d.test_token is not None and _plain_flips(case, i, out[: d.index + 1]):
            continue  # plain greedy decoding itself picks this token in another batch (see `_plain_flips`)
        if d is not None and not d.excused:
            problems.append(f"request {i}: {d}\n    expected {toks}\n    got      {out}")
        elif d is None and q.finish_reason is not reason:
            problems.append(f"request {i}: finished {q.finish_reason}, expected {reason}")
        if d is None:
            problems += [f"request {i}: {p}" for p in _outputs_differ(ref, q, reason is FinishReason.ABORT)]
    # Nothing left behind: every request retired, every page and slot free, no per-request state.
    if ex.running or ex.waiting or ex._inflight is not None:
        problems.append(f"left: {len(ex.running)} running, {len(ex.waiting)} waiting, in flight {ex._inflight}")
    if ex.state:
        problems.append(f"speculative state left for requests {sorted(ex.state)}")
    m = ex.manager
    if m.num_free_slots != slots0 or m.num_free_pages != m.num_pages:
        problems.append(f"target cache: {m.num_free_slots}/{slots0} slots, {m.num_free_pages}/{m.num_pages} pages")
    if dm is not None and (dm.num_free_slots != dslots0 or dm.num_free_pages != dm.num_pages):
        problems.append(f"draft cache: {dm.num_free_slots}/{dslots0} slots, {dm.num_free_pages}/{dm.num_pages} pages")
    if isinstance(ex.drafter, NGramDrafter) and ex.drafter._index:
        problems.append(f"n-gram index left for requests {sorted(ex.drafter._index)}")
    bad = [ring.num_disagreements for ring in ex.manager.state.decode_tail_rings if ring.num_disagreements]
    if bad:
        problems.append(f"tail-ring device/host disagreements: {bad}")
    if canon is not None:
        # The MTP layer's drafts depend on the history they follow only: any difference is corrupted draft state.
        for key in sorted(drafts.keys() & canon.keys()):
            a, b = drafts[key], canon[key]
            n = min(len(a), len(b))
            if a[:n] != b[:n]:
                i, toks = key
                problems.append(f"request {i} after {len(toks)} tokens drafted {a}, the plain run {b}")
    return problems


def _poison_pages(mgr: Any) -> None:
    """Fill every paged plane with NaN (all bits set in integer planes), and each page again whenever the manager
    hands it to a request (a freed or evicted page keeps its last owner's rows): a row read before it was written
    (a catch-up that never ran, a page copy that left a plane out) then shows in the output or the drafts instead
    of reading as a fresh pool's zeros or as another request's rows."""
    for t in mgr.planes.values():
        t.view(torch.uint8).fill_(0xFF)  # NaN in fp32, bf16 and e4m3 alike
    take = mgr._take_page

    def take_poisoned() -> int:
        page = take()
        for t in mgr.planes.values():
            t[:, page].view(torch.uint8).fill_(0xFF)
        return page

    mgr._take_page = take_poisoned


def _plain_flips(case: Case, i: int, prefix: list[int], max_gap: float = 0.05) -> bool:
    """Whether plain greedy decoding itself emits ``prefix`` (a speculative run's output up to where it diverged)
    for case request ``i`` in some other batch: alone, alone in the case's pages and chunks or in chunks of 7, or
    prefilled with the requests that arrive with it. At a small top-2
    gap a rounding difference between batch shapes can flip the indexer's pool selection (the random ``tiny``
    model selects 4 of its pools once a context passes 16 tokens), which moves the logits by far more than the
    near-tie rule's tolerance; a divergence that plain decoding reproduces is not speculation's."""
    r = case.reqs[i]
    c = case.cfg
    params = dataclasses.replace(r.params, ignore_eos=True, stop_token_ids=None, end_id=None, max_tokens=len(prefix))
    model = case_model(case)
    # (the requests that arrive with it: prefilled in one batch with it, as in the case's first step)
    along = [q for j, q in enumerate(case.reqs) if j != i and q.arrive == r.arrive]
    for cfg, others in (
        (plain_config(c), []),
        (plain_config(c, tokens_per_block=c.tokens_per_block, max_batch_size=c.max_batch_size,
                      max_num_tokens=c.max_num_tokens, prefill_chunk_size=c.prefill_chunk_size), []),
        (plain_config(c, prefill_chunk_size=7), []),
        (plain_config(c), along),
    ):  # fmt: skip
        if others is along and not along:
            continue  # (alone: the first configuration)
        ex = Executor(model, cfg)
        q = ex.add_request(r.prompt, params)
        for o in others:
            ex.add_request(o.prompt, dataclasses.replace(o.params, max_tokens=len(prefix)))
        ex.run_until_done()
        if q.output_ids == prefix and q.logit_gaps[-1] <= max_gap:
            return True
    return False


def _draws(gen: torch.Generator | None, seed: int | None, most: int) -> int | None:
    """How many of the sampler's draws (one float64 uniform each) ``gen`` has made since it was seeded with ``seed``
    (None: more than ``most``, or not that generator)."""
    if gen is None or seed is None:
        return None
    g = torch.Generator().manual_seed(seed)
    state = gen.get_state()
    for n in range(most + 1):
        if torch.equal(g.get_state(), state):
            return n
        torch.rand((), dtype=torch.float64, generator=g)
    return None


def _outputs_differ(ref: Request, got: Request, aborted: bool) -> list[str]:
    """How ``got``'s per-token outputs (logprobs, generation logits, prompt logprobs, context logits) differ from the
    reference's (same tokens: values to fp32 rounding; the reference ran longer, so only its first ones count; an
    aborted request may have recorded only the first prompt rows)."""
    out: list[str] = []
    n = got.num_output

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-3 * max(1.0, abs(b))

    p = got.params
    if p.logprobs is not None:
        if len(got.logprobs) != n:
            out.append(f"{len(got.logprobs)} logprobs for {n} tokens")
        for j, (a, b) in enumerate(zip(got.logprobs, ref.logprobs[:n])):
            t = got.output_ids[j]  # the chosen token's, then the top ones' (ids may swap at an exact tie)
            va, vb = sorted(x.logprob for x in a.values()), sorted(x.logprob for x in b.values())
            if not close(a[t].logprob, b[t].logprob) or len(va) != len(vb) or not all(map(close, va, vb)):
                out.append(f"logprobs of token {j}: {a} against {b}")
                break
    if p.return_generation_logits:
        if len(got.generation_logits) != n:
            out.append(f"{len(got.generation_logits)} generation logits for {n} tokens")
        elif n and not torch.allclose(torch.stack(got.generation_logits), torch.stack(ref.generation_logits[:n]),
                                      atol=1e-3, rtol=1e-3):  # fmt: skip
            out.append("generation logits differ")
    if p.prompt_logprobs is not None:
        a, b = got.prompt_logprobs, ref.prompt_logprobs
        if (len(a) != len(got.prompt_ids) and not (aborted and len(a) < len(got.prompt_ids))) or (
            a and a[0] is not None
        ):
            out.append(f"{len(a)} prompt logprobs for {len(got.prompt_ids)} prompt tokens")
        else:
            for j, (x, y) in enumerate(zip(a[1:], b[1:])):
                t = got.prompt_ids[j + 1]
                if not close(x[t].logprob, y[t].logprob):
                    out.append(f"prompt logprob of token {j + 1}: {x} against {y}")
                    break
    if p.return_context_logits:
        V = ref.context_logits[0].shape[-1]
        a = torch.cat(got.context_logits) if got.context_logits else torch.empty(0, V)
        b = torch.cat(ref.context_logits)
        if aborted:
            b = b[: a.shape[0]]
        if a.shape != b.shape or not torch.allclose(a, b, atol=1e-3, rtol=1e-3):
            out.append(f"context logits {tuple(a.shape)} differ from {tuple(b.shape)}")
    return out


def seeds() -> list[int]:
    return list(range(FIRST_SEED, FIRST_SEED + NUM_CASES))


@pytest.mark.parametrize("seed", seeds())
def test_speculative_runtime_matches_plain_greedy(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """One random case (see the module docstring): speculative output is plain greedy's, and nothing leaks."""
    check_case(
        monkeypatch, make_case(seed), f"TRTLLM_GLM_SPEC_FUZZ_SEED={seed} TRTLLM_GLM_SPEC_FUZZ_CASES=1 pytest {__file__}"
    )


def check_case(monkeypatch: pytest.MonkeyPatch, case: Case, rerun: str) -> None:
    """Run ``case`` against its references and assert every property of the module docstring (``rerun``: how to
    run it again, for the failure message)."""
    _case_env(monkeypatch, case)
    try:
        refs = references(case)  # before any patching
        _fused_decode(monkeypatch, case)
        canon = canonical_drafts(case) if case.drafter == "mtp" else None
        with _maybe_graphs(monkeypatch, case.graphs):
            problems = run_case(case, refs, canon)
    except Exception as e:  # an exception is a finding too: report it with the case
        raise AssertionError(f"{type(e).__name__}: {e}\n{case.describe()}\nrerun: {rerun}") from e
    assert not problems, "\n".join(problems) + f"\n{case.describe()}\nrerun: {rerun}"


def _case_env(monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    """Set the case's switches but the fused KDA decode step's (`_fused_decode`), clearing the others of `KDA_ENV`
    (monkeypatch restores them after the test)."""
    for var in KDA_ENV:
        monkeypatch.delenv(var, raising=False)
    for var, value in case.env.items():
        if var != FUSED:
            monkeypatch.setenv(var, value)


def _fused_decode(monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    """The case's fused KDA decode switch, for its speculative runs (canonical drafts, the run itself) only: plain
    decoding, every step of the references one, would interpret the kernel at every step (the fused and unfused
    steps agree to fp32 rounding, which the comparison allows at near ties)."""
    if case.env.get(FUSED) == "1":
        monkeypatch.setenv(FUSED, "1")
        # The fused step runs where the KDA conv kernels do (CUDA, or TRTLLM_GLM_KDA_CONV_BACKEND=triton): on the CPU
        # that switch would interpret every conv op of the case (~40x its time); this lets the fused kernel alone run
        # interpreted, still behind its own switch and the batch-invariant check.
        monkeypatch.setattr(kda_decode_fused_ops, "_use_kernel", lambda x, backend: True)


@contextmanager
def _maybe_graphs(monkeypatch: pytest.MonkeyPatch, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with monkeypatch.context() as mp, _graph_like():
        emulate_graphs(mp)
        yield

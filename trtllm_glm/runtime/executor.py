"""`Executor`: runs steps of mixed batches through the model on paged caches.

A step: schedule (decode rows first, then prefill chunks), make room in the cache (preempting the
newest running request when pages run out), describe the batch once (``prepare()``), run the model,
sample the rows that end a sequence's pending tokens, and retire finished requests.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

import torch

from .. import envs
from ..cache.latent_format import check_latent_dtype
from ..cache.manager import Glm5NextCacheManager
from ..cache.prefix import Checkpoint
from ..errors import CapacityError
from ..logits import greedy_pack
from ..models.glm5_next import Glm5NextForCausalLM, check_memory
from ..numerics import batch_invariant
from ..transfer import to_device
from .cuda_graph import (
    PADDING_PAST_LEN,
    PADDING_REQUEST_ID,
    CudaGraphConfig,
    CudaGraphRunner,
    DeviceRows,
    GraphOutputs,
    HostResults,
    greedy_and_gap,
)
from .grammar import GrammarCompiler, apply_token_bitmask, fill_bitmasks
from .piecewise import PiecewiseRunner, piecewise_enabled
from .prefill_memory import check_step_rows, prefill_workspace_bytes
from .prefix_cache import PrefixCache
from .request import FinishReason, Request, RequestState
from .sampling import Sampler, SamplingParams, token_logprobs
from .scheduler import ScheduledSeq, Scheduler, check_mixed_prefill_budget
from .step_log import RequestTiming, StepLog, StepRecord, now, step_kind

__all__ = ["Executor", "ExecutorConfig"]


def _arrival(r: Request) -> int:
    return r.arrival


@dataclass
class ExecutorConfig:
    """Sizes of the executor's caches and batches.

    Attributes:
        tokens_per_block: page size (multiple of 4).
        max_tokens: total tokens the page pool holds (rounded up to whole pages).
        max_batch_size: sequences per step (also the number of state slots).
        max_num_tokens: flat rows per step.
        max_seq_len: longest sequence (prompt + output); sets the slot-table width.
        prefill_chunk_size: cap on a prefill chunk (``None``: token budget only).
        mixed_prefill_budget: cap on the prefill rows of a step that also decodes (``None``: token budget only;
            `Scheduler`): bounds the inter-token gap an admission makes.
        cuda_graph_config: CUDA graphs of decode / verify steps (``None``: eager; ignored off CUDA).
        enable_block_reuse: prefix caching: shared sealed pages plus recurrent-state checkpoints
            (docs/design.md §6.4).
        checkpoint_interval: prompt tokens between checkpoints (``None``: only the last page boundary
            before each prompt's end); best a multiple of ``tokens_per_block``.
        max_checkpoints: checkpoints kept (LRU); they have their own budget apart from pages.
        checkpoint_max_bytes: device bytes all checkpoints may hold (``None``: no byte limit; ``"auto"``:
            a quarter of the cache's bytes, at least two checkpoints per state slot: `auto_checkpoint_max_bytes`).
        checkpoint_prompt_end: also checkpoint where each prompt's prefill ends (multi-turn reuse): True for prompts
            of at least a page, an int ``n`` for prompts of at least ``n`` tokens (the LLM passes
            `KvCacheConfig.checkpoint_prompt_end_min_tokens`), False for none.
        checkpoint_last_page: cut each prompt's last chunk at its last page boundary and checkpoint there (a
            repeat of the prompt resumes there; one more prefill step per prompt). Off, only a branch point
            or a waiting request cuts a prompt's last chunk (`PrefixCache.cut`).
        checkpoint_branch_points: also checkpoint where a prompt stops matching cached pages that no
            checkpoint reaches (a shared system prompt, a document asked different questions).
        checkpoint_request_end: also checkpoint each request where it ends (its prompt and answer: the next
            turn of a conversation resumes after the answer; MTP requests skip it, their drafter catches up
            after the end).
        prefix_wait_for_leader: a waiting request whose prompt shares pages with a running request still
            prefilling them waits for that one's checkpoint where they part, instead of recomputing them.
        (The LLM API's `KvCacheConfig` has serving defaults; these are the low-level explicit ones.)
        overlap_scheduler: launch a steady plain decode step before reading the previous one's tokens
            back (TensorRT-LLM's overlap scheduler), so the host's share of a step runs while the GPU
            works. Only with CUDA graphs and requests without per-token outputs (sampled ones draw on the
            device right after the replay); a speculative executor launches its width-one rounds and its MTP
            drafting rounds ahead where it can (docs/speculation.md); other steps run as before. Off here by
            default; the LLM API turns it on (unless ``disable_overlap_scheduler``), as TensorRT-LLM does.
        indexer_key_dtype: ``"fp8"`` or ``"bf16"`` pooled indexer keys in every cache manager (docs/indexer_keys.md).
        latent_dtype: ``"auto"`` (the model dtype) or ``"fp8"`` (e4m3 with block scales) latent rows in every cache
            manager, the draft's included (docs/fp8.md, "FP8 latent cache").
        batch_wait_timeout_iters: while every running request decodes, hold newly waiting requests for up to this
            many steps so that arrivals are admitted together (TensorRT-LLM's name): a step that admits prompts runs
            eagerly and costs several decode steps whatever it admits. 0 (default): admitted at the first step with
            room. Holding ends early when nothing is decoding, a running request still prefills (that step is mixed
            anyway), the waiting requests fill the free batch slots, or ``batch_wait_max_tokens_ratio`` is reached.
        batch_wait_max_tokens_ratio: holding ends once the waiting prompts' tokens reach this share of
            ``max_num_tokens`` (0: only the step count ends it).
    """

    tokens_per_block: int = 16
    max_tokens: int = 8192
    max_batch_size: int = 8
    max_num_tokens: int = 512
    max_seq_len: int = 2048
    prefill_chunk_size: int | None = None
    mixed_prefill_budget: int | None = None
    cuda_graph_config: CudaGraphConfig | None = None
    enable_block_reuse: bool = False
    checkpoint_interval: int | None = None
    max_checkpoints: int = 64
    checkpoint_max_bytes: int | str | None = None
    checkpoint_prompt_end: bool | int = False
    checkpoint_last_page: bool = True
    checkpoint_branch_points: bool = True
    checkpoint_request_end: bool = False
    prefix_wait_for_leader: bool = True
    overlap_scheduler: bool = False
    indexer_key_dtype: str = "fp8"
    latent_dtype: str = "auto"
    batch_wait_timeout_iters: int = 0
    batch_wait_max_tokens_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_latent_dtype(self.latent_dtype)  # a clear ValueError for anything but auto / fp8
        n = self.batch_wait_timeout_iters
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"batch_wait_timeout_iters must be an int >= 0 (steps), got {n!r}")
        f = self.batch_wait_max_tokens_ratio
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"batch_wait_max_tokens_ratio must be a number in [0, 1], got {f!r}")
        check_mixed_prefill_budget(self.mixed_prefill_budget)


@dataclass
class _InFlight:
    """A step the overlap scheduler launched and has not read back: its plan, state slots and results."""

    plan: list[ScheduledSeq]
    slots: list[int]
    out: GraphOutputs
    results: HostResults | None  # None: grammar rows' tokens not chosen yet (`_choose_under_grammar`)


class Executor:
    """Continuous-batching executor for `Glm5NextForCausalLM`.

    Args:
        model: the model (its parameters' device is the executor's device).
        cfg: cache and batch sizes.
        seed: base seed for requests without their own sampling seed.
    """

    # Whether `ExecutorConfig.overlap_scheduler` applies (subclasses decide which of their steps launch ahead).
    supports_overlap = True

    def __init__(self, model: Glm5NextForCausalLM, cfg: ExecutorConfig, *, seed: int = 0) -> None:
        self.model = model
        self.config = model.config
        self.cfg = cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cuda":
            # Fewer launches per KDA layer (one input GEMM, taps without a copy); before any graph capture.
            # The CPU keeps separate GEMMs: its results stay bit for bit what they were.
            model.fuse_weights()
        check_step_rows(cfg.max_num_tokens, self.device)
        P = cfg.tokens_per_block
        # CUDA graphs pad batches with sequences that run on one reserved state slot (cuda_graph.py).
        self._use_graphs = cfg.cuda_graph_config is not None and self._graphs_supported()
        self.manager = self._make_manager(include_mtp_layer=self._target_stores_mtp_layer())
        # A sequence can never outgrow the whole page pool either.
        self.max_seq_len = min(cfg.max_seq_len, self.config.max_position_embeddings, self.manager.num_pages * P)
        # The step metadata is the attention backend's (its class, its persistent buffers).
        self.meta = model.attention_backend.make_metadata(
            self.manager,
            max_num_seqs=cfg.max_batch_size,
            max_num_tokens=cfg.max_num_tokens,
            max_seq_len=self.max_seq_len,
            select_width=self._select_width(),
            device=self.device,
        )
        self.graph_runner: CudaGraphRunner | None = None
        self._step_out: GraphOutputs | None = None
        if self._use_graphs:
            assert cfg.cuda_graph_config is not None
            self._padding_slot = self.manager.add_request(PADDING_REQUEST_ID, 0)
            self.graph_runner = CudaGraphRunner(
                model,
                self.meta,
                self.manager,
                cfg.cuda_graph_config,
                self._graph_widths(),
                self._prepare_graph_step,
                emulate=self.device.type != "cuda",
            )
        # Eager steps (prefill chunks, mixed steps) as token-wise graph segments around eager attention cores. Not in
        # the batch-invariant mode, where no step would replay them (`PiecewiseRunner.allow_batch_invariant`): their
        # start-up captures and pool would buy nothing.
        self.piecewise: PiecewiseRunner | None = None
        real = self.device.type == "cuda"
        # Auto (``CudaGraphConfig.piecewise = None``): with real graphs on one GPU (not yet run with ranks: opt in).
        auto = real and not model.mapping.is_parallel
        if self._use_graphs and piecewise_enabled(cfg.cuda_graph_config, auto) and not batch_invariant():
            assert cfg.cuda_graph_config is not None
            self.piecewise = PiecewiseRunner(
                model,
                max_num_tokens=cfg.max_num_tokens,
                max_tokens=cfg.cuda_graph_config.piecewise_max_num_tokens,
                emulate=not real,
                # KDA cores of decode / short-prefill steps inside the segments (padding entries step this slot).
                padding_slot=self._padding_slot,
                max_num_seqs=cfg.max_batch_size,
            )
        self.scheduler = Scheduler(
            cfg.max_batch_size, cfg.max_num_tokens, cfg.prefill_chunk_size, cfg.mixed_prefill_budget
        )
        self.sampler = Sampler()
        self.seed = seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        # Admissions held back (`ExecutorConfig.batch_wait_timeout_iters`): the step the current hold began at, and
        # the planned steps that held (statistics; steps launched ahead while held are not planned).
        self._hold_since: int | None = None
        self.num_held_steps = 0
        self.num_preemptions = 0
        # The overlap scheduler's launched-but-unread step (`_InFlight`) and how many steps it launched ahead.
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0
        # Eager steps (admissions) left in flight with the next decode step launched from their tokens.
        self.num_chained_eager_steps = 0
        # Admission steps planned and launched before the decode step in flight was read back (`_admit_ahead`).
        self.num_admissions_ahead = 0
        self.num_chunks_ahead = 0  # steps planned ahead that continue a prompt's prefill (`_admit_ahead`)
        self._admission_launched: list[ScheduledSeq] | None = None  # its plan while the step before it is read back
        # Opt-in record of every step and request (runtime/step_log.py); None: nothing is recorded.
        self.step_log: StepLog | None = None
        # What the current `step` call launched: (plan, graph replay, launched ahead), for the step log.
        self._launched: tuple[list[ScheduledSeq], bool, bool] | None = None
        self.prefix: PrefixCache | None = self.new_prefix_cache() if cfg.enable_block_reuse else None
        # Compiles requests' `SamplingParams.guided_decoding` against the tokenizer (set by the LLM, which owns
        # the tokenizer; None: structured output is refused).
        self.grammar_compiler: GrammarCompiler | None = None

    def new_prefix_cache(self) -> PrefixCache:
        """An empty `PrefixCache` with the configured policy (the executor's, or a fresh one after a warm-up)."""
        cfg = self.cfg
        return PrefixCache(
            self,
            checkpoint_interval=cfg.checkpoint_interval,
            prompt_end=cfg.checkpoint_prompt_end,
            last_page=cfg.checkpoint_last_page,
            branch_points=cfg.checkpoint_branch_points,
            wait_for_leader=cfg.prefix_wait_for_leader,
            request_end=cfg.checkpoint_request_end,
            max_checkpoints=cfg.max_checkpoints,
            max_bytes=cfg.checkpoint_max_bytes,
        )

    def _select_width(self) -> int:
        """Columns of the metadata's selection buffer (subclasses may attend wider windows)."""
        return self.config.index_select_width

    def _target_stores_mtp_layer(self) -> bool:
        """Whether the target manager also stores the MTP layer's sparse plane (shared-draft mode)."""
        return False

    def _make_manager(self, *, include_mtp_layer: bool) -> Glm5NextCacheManager:
        P = self.cfg.tokens_per_block
        kw = dict(
            num_pages=-(-self.cfg.max_tokens // P),
            tokens_per_block=P,
            max_num_requests=self.cfg.max_batch_size + int(self._use_graphs),
            include_mtp_layer=include_mtp_layer,
            dtype=self.dtype,
            indexer_key_dtype=self.cfg.indexer_key_dtype,
            latent_dtype=self.cfg.latent_dtype,
            attention_backend=self.model.attention_backend,
        )
        # Refuse a cache that cannot fit before allocating any of it (the message carries the estimate), with
        # room for a prefill chunk's transient buffers at the longest context (`prefill_memory`).
        max_seq = min(self.cfg.max_seq_len, self.config.max_position_embeddings, kw["num_pages"] * P)
        self.workspace_bytes = prefill_workspace_bytes(self.config, self.cfg.max_num_tokens, max_seq, self.dtype)
        check_memory(
            Glm5NextCacheManager.estimate_bytes(self.config, **kw) + self.workspace_bytes,
            self.device,
            what=f"the KV cache ({kw['num_pages']} pages of {P} tokens, {self.cfg.max_batch_size} state slots)"
            + (f" on {self.model.mapping.describe()}" if self.model.mapping.is_parallel else "")
            + f" and a prefill chunk's workspace ({self.workspace_bytes / 2**30:.1f} GiB)",
        )
        return Glm5NextCacheManager(self.config, **kw, device=self.device)

    # --------------------------------------------------------------------------------------------
    # Requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; a prompt that can never fit is refused here, before it takes anything."""
        for t in prompt_ids:
            if not 0 <= t < self.config.vocab_size:
                raise ValueError(f"prompt token {t} outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt_ids) >= self.max_seq_len:
            raise CapacityError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate: the limit is "
                f"{self.max_seq_len} tokens (max_seq_len, context length and cache size)"
            )
        grammar = None
        if params.guided_decoding is not None:
            if self.grammar_compiler is None:
                raise ValueError("guided_decoding needs a vocabulary: this executor has no grammar_compiler")
            grammar = self.grammar_compiler.matcher(params.guided_decoding, params.stop_ids(self.config.eos_token_ids))
        rid = next(self._ids)
        gen = None
        if not params.greedy:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None else self.seed * 1_000_003 + rid)
        req = Request(rid, list(prompt_ids), params, arrival=next(self._arrivals), generator=gen, t_queued=now())
        req.grammar = grammar
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    # --------------------------------------------------------------------------------------------
    # One step
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        With the overlap scheduler a steady decode step may be left running when this returns; the next
        call launches the step after it and only then reads it back (its finished requests return then).
        With a `step_log` attached, the step's `StepRecord` is stored (a call that only reads a step back
        launches nothing and records nothing).
        """
        log = self.step_log
        if log is None:
            return self._run_step()
        token = log.begin_step(self.device)
        self._launched = None
        finished = self._run_step()
        if self._launched is not None:
            plan, graph, ahead = self._launched
            n_dec = sum(1 for s in plan if s.is_decode)
            prefill_rows = sum(s.num_rows for s in plan if not s.is_decode)
            verify = any(s.is_decode and s.num_rows > 1 for s in plan)
            rec = StepRecord(
                index=self.num_steps, kind=step_kind(n_dec, len(plan) - n_dec, verify), num_seqs=len(plan),
                decode_seqs=n_dec, prefill_seqs=len(plan) - n_dec, rows=sum(s.num_rows for s in plan),
                prefill_rows=prefill_rows, graph=graph, overlapped=ahead, t_start=0.0,
            )  # fmt: skip
            log.end_step(token, rec)
        if not log.delivered_by_engine:
            for r in finished:
                log.add_request(RequestTiming.of(r))
        return finished

    def _run_step(self) -> list[Request]:
        if self._inflight is not None:
            return self._step_overlapped()
        plan = self._plan(self._decode_widths())
        if not plan:
            raise CapacityError("no request can be scheduled: the cache cannot hold even one sequence's next rows")
        self._count_step(plan)
        rows = self._forward(plan)
        self._launched = (plan, self._step_out is not None, False)
        return self._leave_or_read_back(plan, rows)

    def _count_step(self, plan: list[ScheduledSeq]) -> None:
        """Count a planned step, and a prefill step for each prompt in it before its first token."""
        self.num_steps += 1
        for s in plan:
            if not s.is_decode and s.request.t_first_token is None:
                s.request.num_prefill_steps += 1

    def _leave_or_read_back(
        self, plan: list[ScheduledSeq], rows: torch.Tensor, slots: list[int] | None = None
    ) -> list[Request]:
        """The step ``plan`` just launched (hidden ``rows``): left in flight when the next step may be launched from its
        tokens on the device (a replay, or an eager step: `_may_chain_eager_step`), else read back and committed;
        returns the requests it finished. ``slots``: its state slots when another step ran since (`_advance`;
        default the metadata's, a step read back at once)."""
        if self._step_out is None and self._may_chain_eager_step(plan):
            self._step_out = self._eager_outputs(plan, rows)
            self.num_chained_eager_steps += 1
        elif self._step_out is None or not self._may_launch_ahead(plan):
            finished = self._advance(plan, rows, slots=slots)
            self._after_step(plan)
            return finished
        self._inflight = self._in_flight(plan, list(self.meta.state_slots) if slots is None else slots, self._step_out)
        return []

    def _in_flight(self, plan: list[ScheduledSeq], slots: list[int], out: GraphOutputs) -> _InFlight:
        """``plan``'s step left in flight: its tokens chosen on the device, their copy to the host started."""
        out = self._choose_tokens(plan, out)
        return _InFlight(plan, slots, out, self._results_to_host(plan, out))

    # --------------------------------------------------------------------------------------------
    # Overlap scheduler
    def _may_launch_ahead(self, plan: list[ScheduledSeq], admitting: bool = False, partial: bool = False) -> bool:
        """Whether the step after ``plan`` can be launched before ``plan``'s tokens are read back.

        It must be the same requests one row further: plain decoding of every running request, nobody
        waiting who could be admitted now (requests may wait while the batch is full: only a finish frees a
        slot, and a finish is seen at a read-back), no request that reaches its length limit with this step (a stop
        token is not known ahead: a request that stops here has its next row computed and dropped), and no per-token
        outputs that read the logits (the next replay overwrites them). Sampled requests draw their tokens
        on the device right after the step's replay (`_choose_tokens`), in the order an ordinary step's
        read-back would, so seeded outputs are the same; a batch with a grammar request chooses its tokens one
        step later, once the host knows the tokens before them (`_choose_under_grammar`). Prefix caching may stay
        on: after a decode step it only seals pages that became full, and the step launched ahead writes the next
        position, which is never on such a page (checkpoints are taken after prefill chunks only, and an admission
        planned ahead shares only pages sealed before it).

        ``admitting``: the step after ``plan`` admits the waiting requests too (`_admit_ahead`): they do not count.
        ``partial``: prompts of ``plan`` not at their last chunk may go on with their next chunk (`_admit_ahead`).
        """
        if not (self.cfg.overlap_scheduler and self.supports_overlap):
            return False
        # Requests waiting are admitted by a step planned with them (`_admit_ahead`, or after a read-back); while the
        # batch is full none could be admitted anyway, so a steady batch keeps overlapping (a served batch at
        # capacity).
        if not admitting and self.admission_pending():
            return False
        # Decode rows, or (after an eager step, `_may_chain_eager_step`) prompts whose last rows ran: every sequence
        # one row further next.
        if len(plan) != len(self.running) or any(
            not self._ends_pending_rows(s) and not (partial and not s.is_decode) for s in plan
        ):
            return False
        for s in plan:
            r, p = s.request, s.request.params
            if r.finished or p.logprobs is not None or p.return_generation_logits:
                return False
            if r.num_output + 1 >= p.max_tokens or len(r.tokens) + 1 >= self.max_seq_len:
                return False
        return True

    @staticmethod
    def _ends_pending_rows(s: ScheduledSeq) -> bool:
        """Whether ``s`` is one decode row, or a prompt's last chunk (its first token is sampled after it)."""
        if s.is_decode:
            return s.num_rows == 1
        return s.start + s.num_rows == len(s.request.tokens)

    @property
    def chains_eager_steps(self) -> bool:
        """Whether an eager step (an admission: prompts beside decode rows) may be left in flight with the next decode
        step launched from its tokens on the device (`_may_chain_eager_step`). The speculative executor's rounds
        after an admission keep their own rules (False there)."""
        return True

    def _may_chain_eager_step(self, plan: list[ScheduledSeq]) -> bool:
        """Whether the eager step ``plan`` (just launched) stays in flight: the next step, every sequence's next decode
        row, replays a graph before ``plan`` is read back (`_step_overlapped`), as after a replayed decode step.

        Without it an admission cost the running requests two host round trips: the decode step before it was read
        back with nothing launched (a request was waiting), then the admission step itself. Every sequence must end
        its pending rows here (decode rows, prompts' last chunks: `_ends_pending_rows`), greedy or sampled without a
        grammar; with prefix caching no prompt of the step may take a prompt-end checkpoint (taken at the read-back,
        it would copy the state after the step launched ahead). `_may_launch_ahead` then asks the rest (lengths,
        logits readers, requests waiting)."""
        runner = self.graph_runner
        if not self.chains_eager_steps or runner is None or not envs.CHAIN_ADMISSIONS.get():
            return False
        if any(s.request.has_grammar for s in plan):
            return False
        if self.prefix is not None and any(
            not s.is_decode and self.prefix.prompt_end_at(len(s.request.prompt_ids)) for s in plan
        ):
            return False
        # The next step must replay a graph (its batch captured): the results' pinned buffers hold that many rows. One
        # captured already: a capture now would describe its padded batch in the metadata, whose host description of
        # ``plan`` (its state slots) is still to be read (a GPU test's lazily captured graphs: 4 slots of 0 for 3).
        partial = self._partial_chunks(plan)
        if partial and not self._chunks_may_go_on_ahead(partial):
            return False
        # (the next step of a partial chunk is planned by `_admit_ahead`, which admits the waiting requests too)
        ahead = self._may_launch_ahead(plan, admitting=bool(partial), partial=bool(partial))
        return ahead and runner.key([1] * len(plan), capture=False) is not None

    def _partial_chunks(self, plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The prompts of ``plan`` that are not at their last chunk (their next step is their next chunk)."""
        return [s for s in plan if not s.is_decode and not self._ends_pending_rows(s)]

    def _chunks_may_go_on_ahead(self, partial: list[ScheduledSeq]) -> bool:
        """Whether the step after these partial prompt chunks may be planned and launched before they are read back
        (`_admit_ahead`): no checkpoint is due where a chunk ends (prefix caching copies the recurrent state at the
        read-back, which would then be the next chunk's), and the cache already holds every prompt's remaining rows
        (planning ahead must never preempt: a request of the step in flight could be the victim). With
        `mixed_prefill_budget` each admission is several capped steps; without this each of them was read back
        before the next was planned, so the GPU idled through the read-back and the planning every time."""
        for s in partial:
            r = s.request
            if self.prefix is not None and s.start + s.num_rows in self.prefix.endpoints(r):
                return False
            try:
                self.manager.ensure_capacity(r.request_id, len(r.tokens) + 1)
            except CapacityError:
                return False
        return True

    def _eager_outputs(self, plan: list[ScheduledSeq], hidden: torch.Tensor) -> GraphOutputs:
        """An eager step's outputs as a replay's (`GraphOutputs`): each sequence's last row, its logits and packed
        ``(greedy id, gap, 1)`` on the device, nothing read back."""
        last, row = [], 0
        for s in plan:
            row += s.num_rows
            last.append(row - 1)
        with torch.inference_mode():
            h = hidden[to_device(last, self.device)]
            logits = self.model.compute_logits(h)
            packed = greedy_and_gap(logits)
        return GraphOutputs(hidden=h, logits=logits, packed=packed, width=1, rows=last)

    def _step_overlapped(self) -> list[Request]:
        """Launch the step after the one in flight (when it may), then read the one in flight back."""
        cur = self._inflight
        assert cur is not None and self.graph_runner is not None
        if cur.results is None:  # the step before it was read back: its grammar rows' masks can be filled now
            cur.out = self._choose_under_grammar(cur.plan, cur.out)
            cur.results = self.graph_runner.results_to_host(cur.out)
        nxt: _InFlight | None = None
        if self._may_launch_ahead(cur.plan):  # (false once a request of the plan has finished)
            # Each request one row further: its length after the step in flight, and room for one more row.
            plan = [ScheduledSeq(s.request, 1, True, past_len=s.start + s.num_rows) for s in cur.plan]
            key = self.graph_runner.key([1] * len(plan))
            try:
                for s in plan:
                    self.manager.ensure_capacity(s.request.request_id, s.start + 1)
            except CapacityError:
                key = None
            if key is not None:
                self.num_steps += 1
                self._before_chained_launch(cur)
                with torch.inference_mode():
                    out = self.graph_runner.replay_chained(key, plan, cur.out)
                nxt = self._in_flight(plan, list(self.meta.state_slots), out)
                self.num_overlapped_steps += 1
                self._launched = (plan, True, True)
        admission = self._admit_ahead(cur) if nxt is None else None
        self._inflight = nxt
        cur.out._host = cur.results.wait()
        self._step_out = cur.out
        # A request that ends in ``cur`` has its next row in the admission step already launched (`_finish`).
        self._admission_launched = admission[0] if admission is not None else None
        try:
            finished = self._advance(cur.plan, cur.out.hidden, slots=cur.slots)
        finally:
            self._admission_launched = None
        self._after_step(cur.plan)
        if admission is not None:
            self._step_out = None  # (the admission step ran eagerly)
            finished += self._leave_or_read_back(*admission)
        return finished

    def _admit_ahead(self, cur: _InFlight) -> tuple[list[ScheduledSeq], torch.Tensor, list[int]] | None:
        """Plan and launch the step that admits waiting requests before the in-flight decode step ``cur`` is read
        back: its decode rows are every running request's next row, their ids taken from ``cur``'s tokens on the
        device, beside the admitted prompts' chunks; the GPU then runs it right after ``cur`` instead of idling
        through ``cur``'s read-back and the planning (issue 42: the running requests' inter-token time around an
        admission, and the admitted requests' TTFT).

        Only when ``cur`` could have had a plain step launched after it but for the waiting requests
        (`_may_launch_ahead`), with room for every running request's next row (the planner then preempts nobody).
        While planning, each running request holds a placeholder for ``cur``'s token (``-1``, never read: its row's
        id comes from the device) and counts ``cur``'s rows computed (a prompt's last chunk, when ``cur`` is an
        admission left in flight: all of them), as after the read-back; both are undone before ``cur`` is read
        back. Returns the step's plan, hidden rows and state slots (read back by the caller), or None.

        A plan that admits nobody (the cache cannot hold the first waiting prompt yet) runs its decode rows eagerly
        once; the steps after it stay synchronous while the request waits (nothing is launched ahead then), so this
        is tried again only after a step left in flight.
        """
        partial = self._partial_chunks(cur.plan)
        if not (self.chains_eager_steps and envs.CHAIN_ADMISSIONS.get() and (partial or self.admission_pending())):
            return None
        if cur.results is None:  # grammar rows: their tokens are chosen after the read-back
            return None
        # (Partial chunks in ``cur`` passed `_chunks_may_go_on_ahead` when ``cur`` was left in flight, and nothing was
        # planned since: a leader's endpoint added by this plan lies past its rows computed, so past ``cur``'s end.)
        if not self._may_launch_ahead(cur.plan, admitting=True, partial=bool(partial)):
            return None
        try:
            for s in cur.plan:
                self.manager.ensure_capacity(s.request.request_id, s.start + s.num_rows + 1)
        except CapacityError:
            return None
        # ``cur``'s rows as computed (a prompt's last chunk in an admission left in flight: all of its rows; a partial
        # chunk makes no token).
        ends = [self._ends_pending_rows(s) for s in cur.plan]
        bumps = [(s.request, s.num_rows, e) for s, e in zip(cur.plan, ends)]
        for r, n, e in bumps:
            if e:
                r.tokens.append(-1)
            r.num_computed += n
        try:
            plan = self._plan()
            row_of = {s.request.request_id: i for i, (s, e) in enumerate(zip(cur.plan, ends)) if e}
            # Decode rows at their positions after ``cur`` (fixed: the lengths are undone below).
            plan = [ScheduledSeq(s.request, 1, True, past_len=s.start) if s.request.request_id in row_of else s
                    for s in plan]  # fmt: skip
            pos, src, row = [], [], 0
            for s in plan:
                i = row_of.get(s.request.request_id)
                if i is not None:
                    pos.append(row)
                    src.append(i)
                row += s.num_rows
            self._count_step(plan)
            values = cur.out.packed[to_device(src, self.device), 0]
            rows = self._forward(plan, device_ids=(pos, values))
        finally:
            for r, n, e in bumps:
                if e:
                    r.tokens.pop()
                r.num_computed -= n
        self.num_admissions_ahead += 1
        self.num_chunks_ahead += bool(partial)
        self._launched = (plan, False, True)
        return plan, rows, list(self.meta.state_slots)

    def _before_chained_launch(self, cur: _InFlight) -> None:
        """Work that needs the in-flight step's outputs on the device before the step launched after it replays
        the same graph and overwrites them (the speculative executor's MTP catch-up); nothing here."""

    def _choose_tokens(self, plan: list[ScheduledSeq], out: GraphOutputs) -> GraphOutputs:
        """``out`` with each row's token chosen on the device (a step launched ahead feeds the next one).

        Greedy-only steps keep the graph's argmax. Otherwise the sampler runs now, on the replay's logits
        (the next replay overwrites them; the stream orders this before it), drawing from each request's
        generator in row order as an ordinary step's read-back would; its tokens replace the first column
        of a copy of ``packed`` (``chosen``), which the next replay takes as its input ids and the
        read-back uses as the step's tokens.
        """
        reqs = [s.request for s in plan]
        if all(r.params.greedy for r in reqs) or any(r.has_grammar for r in reqs):
            return out  # (grammar: every row is chosen later, in row order, by `_choose_under_grammar`)
        # A prompt's partial chunk (`_admit_ahead`) makes no token: it draws nothing from its generator, as at an
        # ordinary read-back.
        live = [i for i, s in enumerate(plan) if self._ends_pending_rows(s)]
        with torch.inference_mode():
            # The graph's argmax serves the greedy rows (no second pass over the vocabulary).
            greedy = out.packed[:, 0].long()
            if not live:
                toks = greedy
            elif len(live) == len(plan):
                toks = self.sampler.sample(out.logits, [r.params for r in reqs], [r.generator for r in reqs], greedy)
            else:
                idx = to_device(live, self.device)
                toks = greedy.clone()
                toks[idx] = self.sampler.sample(
                    out.logits[idx], [reqs[i].params for i in live], [reqs[i].generator for i in live], greedy[idx]
                )
            packed = torch.cat([toks.to(out.packed.dtype)[:, None], out.packed[:, 1:]], dim=1)
        return GraphOutputs(out.hidden, out.logits, packed, out.width, chosen=True, rows=out.rows)

    def _results_to_host(self, plan: list[ScheduledSeq], out: GraphOutputs) -> HostResults | None:
        """Start ``out``'s copy to the host, or None while a grammar request's token is still to be chosen."""
        assert self.graph_runner is not None
        return None if any(s.request.has_grammar for s in plan) else self.graph_runner.results_to_host(out)

    def _choose_under_grammar(self, plan: list[ScheduledSeq], out: GraphOutputs) -> GraphOutputs:
        """The tokens of a step launched ahead whose batch has grammar requests, chosen on the device once the
        step before it was read back (each grammar's matcher then holds every token before this step's).

        Grammar rows take the argmax (and top-2 gap) among the tokens their masks allow; sampled rows are drawn
        from the masked logits, every row in one call in row order, as an ordinary step's read-back does (so
        seeded outputs are the same). Nothing waits for the device: the masks are filled on the host while the
        step runs, the choice is queued behind it, and the next step chains from the result.

        Returns:
            ``out`` with ``packed`` replaced by a copy holding the chosen tokens (``chosen`` and ``masked`` set).
        """
        reqs = [s.request for s in plan]
        items = [(r, j, []) for j, r in enumerate(reqs) if r.has_grammar]
        sampled = not all(r.params.greedy for r in reqs)
        with torch.inference_mode():
            idx, rows, choose = self._masked_choice(out.logits, items, need_logits=sampled)
            packed = out.packed.clone()
            packed.index_copy_(0, idx, rows)
            if sampled:
                toks = self.sampler.sample(choose, [r.params for r in reqs], [r.generator for r in reqs],
                                           packed[:, 0].long())  # fmt: skip
                packed[:, 0] = toks.to(packed.dtype)
        return GraphOutputs(out.hidden, out.logits, packed, out.width, chosen=True, masked=True, rows=out.rows)

    def _decode_widths(self) -> dict[int, int] | None:
        """Rows per running decode request this step (``None``: one each; speculation verifies more)."""
        return None

    def _after_step(self, plan: list[ScheduledSeq]) -> None:
        """Seal final pages and take checkpoints (prefix caching), after the step is fully committed."""
        if self.prefix is not None:
            self.prefix.after_step(plan, self.draft_history_len)

    # --------------------------------------------------------------------------------------------
    # Drafter hooks of prefix caching (the speculative executor overrides them)
    @property
    def separate_draft_manager(self) -> Glm5NextCacheManager | None:
        """A draft cache manager apart from the target's, whose pages and slot checkpoints follow the target's."""
        return None

    @property
    def state_reads_next_token(self) -> bool:
        """Whether a request's state at committed length ``E`` depends on token ``E`` too (an MTP drafter's row
        ``E - 1`` reads that token's embedding): then a checkpoint there serves only prompts with the same token
        ``E`` (`cache.prefix.checkpoint_key`). Without a drafter the state is the tokens before ``E`` alone."""
        return False

    def draft_history_len(self, req: Request) -> int:
        """Positions the drafter's per-position cache covers for ``req`` (all computed ones without one)."""
        return req.num_computed

    def restore_draft(self, req: Request, ck: Checkpoint, draft_pages: list[int]) -> None:
        """Restore the drafter's state of a request admitted from checkpoint ``ck``."""

    def checkpoint_draft(self, req: Request, ck: Checkpoint) -> None:
        """Add the drafter's state of ``req`` to checkpoint ``ck`` being taken."""

    def seal_draft_page(self, req: Request, logical_page: int, key: bytes) -> None:
        """Seal the drafter's copy of a page the target just sealed."""

    def _plan(self, decode_width: dict[int, int] | None = None) -> list[ScheduledSeq]:
        """Schedule and make room in the cache.

        Running requests allocate first (the schedule lists them first). When one cannot grow, the
        newest running request that arrived after it is preempted; if there is none, the request waits a
        step (older requests always make progress, so nothing thrashes). Waiting requests are admitted
        only into free room, in arrival order, and never cause a preemption.
        """
        if self.prefix is not None:
            self.prefix.match(list(self.waiting), self.running)
        held = self._admissions_held(self.num_steps)
        while True:
            waiting = self.waiting if self.prefix is None else self.prefix.admissible(self.waiting)
            if held:
                waiting = []
            plan = self.scheduler.schedule(self.running, waiting, decode_width)
            if self.prefix is not None:
                plan = self.prefix.cut(plan)
            planned: list[ScheduledSeq] = []
            admitted: list[Request] = []
            fresh: list[int] = []  # admitted state slots to zero, all at once below
            victim = None
            admission_closed = False
            for s in plan:
                r = s.request
                need = r.num_computed + s.num_rows
                if r.state is RequestState.WAITING:
                    if admission_closed or self.manager.num_free_slots == 0:
                        admission_closed = True
                        continue
                    try:
                        self._admit(r, need, fresh)
                    except CapacityError:
                        admission_closed = True
                        continue
                    admitted.append(r)
                    planned.append(s)
                    continue
                try:
                    self.manager.ensure_capacity(r.request_id, need)
                except CapacityError:
                    victim = self._pick_victim(newer_than=r)
                    if victim is None:
                        continue
                    break
                planned.append(s)
            if victim is None:
                # Nothing read or wrote these slots since they were taken (other admissions take other slots).
                self.manager.reset_state_slots(fresh)
                t_admit = now() if admitted else 0.0
                for r in admitted:
                    self.waiting.remove(r)
                    r.state = RequestState.RUNNING
                    if r.t_admitted is None:
                        r.t_admitted = t_admit
                    # Oldest first (the schedule's order): a request admitted after a newer one (held for a prefix
                    # leader) must still be scheduled before it, or its verify rows may never fit the step's budget.
                    bisect.insort(self.running, r, key=_arrival)
                    if self.prefix is not None:
                        self.prefix.admitted(r)
                if self.prefix is not None:
                    for r in self.waiting:
                        self.prefix.unmatch(r)
                return planned
            for r in admitted:
                self.manager.free_request(r.request_id)
                self.on_unadmit(r)
            self._preempt(victim)

    def _hold_conditions(self) -> bool:
        """Whether the batch is one whose waiting requests `ExecutorConfig.batch_wait_timeout_iters` holds back: every
        running request decodes, and the waiting ones neither fill the free batch slots nor reach the token ratio."""
        if self.cfg.batch_wait_timeout_iters <= 0 or not self.waiting or not self.running:
            return False
        free = min(self.cfg.max_batch_size - len(self.running), self.manager.num_free_slots)
        ratio = self.cfg.batch_wait_max_tokens_ratio
        return (
            all(r.is_decode for r in self.running)
            and len(self.waiting) < free
            and not (ratio > 0 and sum(r.num_pending for r in self.waiting) >= ratio * self.cfg.max_num_tokens)
        )

    def _admissions_held(self, step: int) -> bool:
        """Whether step ``step`` holds the waiting requests back: `_hold_conditions`, and the first of them has waited
        fewer than ``batch_wait_timeout_iters`` steps (counted from the step it was first held at)."""
        if not self._hold_conditions():
            self._hold_since = None
            return False
        if self._hold_since is None:
            self._hold_since = step
        if step - self._hold_since >= self.cfg.batch_wait_timeout_iters:
            self._hold_since = None
            return False
        self.num_held_steps += 1
        return True

    def admission_pending(self) -> bool:
        """Whether the next step (``num_steps``: planned, or launched ahead of a read-back) could admit a waiting
        request: room in the batch and a state slot, and not held back (`_admissions_held`; the first held step is
        always planned, so a hold starts at a read-back). A step launched ahead cannot admit: it is not launched
        while this holds."""
        if not (self.waiting and len(self.running) < self.cfg.max_batch_size and self.manager.num_free_slots > 0):
            return False
        if not self._hold_conditions() or self._hold_since is None:
            return True
        return self.num_steps - self._hold_since >= self.cfg.batch_wait_timeout_iters

    def _admit(self, r: Request, num_tokens: int, fresh: list[int]) -> None:
        """Give a waiting request its slot and pages (restoring its prefix match, if any). A slot that is not
        restored is appended to ``fresh`` unzeroed: the caller zeroes the step's admissions at once."""
        if self.prefix is not None:
            self.prefix.admit(r, num_tokens, fresh)
        else:
            fresh.append(self.manager.add_request(r.request_id, num_tokens, reset=False))

    def on_unadmit(self, req: Request) -> None:
        """Hook: ``req`` was admitted in a planning round that then preempted; its target cache is freed."""

    def _pick_victim(self, newer_than: Request) -> Request | None:
        cands = [r for r in self.running if r.arrival > newer_than.arrival]
        return max(cands, key=lambda r: r.arrival) if cands else None

    def _preempt(self, req: Request) -> None:
        """Free the request's pages and state; it recomputes its tokens (prompt + output) later."""
        self.manager.free_request(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.num_cached_tokens = 0
        req.pages_sealed = 0
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.on_preempt(req)

    def on_preempt(self, req: Request) -> None:
        """Hook for subclasses that keep more per-request state (drafters)."""

    # --------------------------------------------------------------------------------------------
    # CUDA graphs (cuda_graph.py)
    def _graphs_supported(self) -> bool:
        """Whether this executor can run CUDA graphs (a CUDA device; tests emulate them on the CPU)."""
        return self.device.type == "cuda"

    def _graph_widths(self) -> tuple[int, ...]:
        """Row widths of the steps captured as graphs (plain decoding: width one)."""
        return (1,)

    def capture_cuda_graphs(self) -> None:
        """Capture every graph now (otherwise each is captured on its first use). No-op without graphs."""
        if self.graph_runner is not None:
            self.graph_runner.capture_all()
        self._capture_piecewise()

    def _capture_piecewise(self) -> None:
        """Every piecewise bucket of the eager steps now (a lazy capture stalls the prefill that first needs it:
        ~0.2 s a bucket on an H100)."""
        if self.piecewise is not None:
            self.piecewise.capture_all(manager=self.manager, meta=self.meta)

    def _prepare_graph_step(self, plan: list[ScheduledSeq], P: int, W: int) -> None:
        """Describe ``plan`` (uniform width ``W``) padded to ``P`` sequences on the padding slot."""
        pad = P - len(plan)
        rids = [s.request.request_id for s in plan]
        proposed = self._proposed(plan) if W > 1 else None
        self.meta.prepare(
            rids + [PADDING_REQUEST_ID] * pad,
            past_lens=[s.start for s in plan] + [PADDING_PAST_LEN] * pad,
            q_lens=[W] * P,
            num_decode_seqs=P,
            state_slots=self.manager.get_batch_state_slots(rids) + [self._padding_slot] * pad,
            num_padding_seqs=pad,
            # Verify rows past a sequence's proposed drafts (filler) are never accepted: the MoE skips them.
            live_q_lens=[1 + k for k in proposed] + [0] * pad if proposed is not None else None,
        )
        self._before_forward(plan)
        if W > 1:
            self.meta.spec.verify_seqs = list(range(P))

    def _sample_rows(self, hidden: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, list[list[float]]]:
        """FP32 logits ``[n, V]`` of ``rows`` and, on the host, each one's (greedy id, top-2 gap, accepted).

        A replayed step already holds both (in-graph argmax and gap): only the one device-to-host copy.
        """
        out = self._step_out
        if out is not None:
            host = out.host_rows()
            if out.rows is not None:  # one packed row per sequence, at these step rows (`_eager_outputs`)
                where = {r: j for j, r in enumerate(out.rows)}
                rows = [where[i] for i in rows]
            if rows == list(range(len(rows))):
                return out.logits[: len(rows)], host[: len(rows)]
            return out.logits[to_device(rows, self.device)], [host[i] for i in rows]
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[to_device(rows, self.device)])
            return logits, greedy_and_gap(logits).tolist()

    def _forward(
        self, plan: list[ScheduledSeq], device_ids: tuple[list[int], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Run the model on the plan; returns the final hidden of every row ``[N, D]``.

        ``device_ids``: ``(positions, values [m])``: the step's rows at those positions take their ids from ``values``
        on the device (tokens the host has not read back: `_admit_ahead`); such a step runs eagerly or piecewise.
        """
        self._step_out = None
        runner = self.graph_runner
        graph_ok = device_ids is None and runner is not None
        if graph_ok and all(s.is_decode for s in plan) and self._graph_step_allowed(plan):
            key = runner.key([s.num_rows for s in plan])
            if key is not None:
                ids, device_rows = self._graph_inputs(plan)
                with torch.inference_mode():
                    self._step_out = runner.replay(key, plan, ids, self._proposed(plan), device_rows=device_rows)
                # A prompt's last row, alone in its chunk, is a decode row: its context logits are recorded here too.
                self._record_prompt(plan, self._step_out.hidden)
                return self._step_out.hidden
            runner.stats.eager_steps += 1
        ids: list[int] | torch.Tensor = []
        for s in plan:
            ids.extend(self._rows_for(s))
        if device_ids is not None:
            pos, values = device_ids
            ids = to_device(ids, self.device, torch.int64)
            ids[to_device(pos, self.device)] = values.to(torch.int64)  # stream-ordered after the step that made them
        n_dec = sum(1 for s in plan if s.is_decode)
        self.meta.prepare(
            [s.request.request_id for s in plan],
            past_lens=[s.start for s in plan],
            q_lens=[s.num_rows for s in plan],
            num_decode_seqs=n_dec,
        )
        self._before_forward(plan)
        pw = self.piecewise
        if pw is not None and pw.applies(self.meta):
            with torch.inference_mode():
                hidden = pw.forward(ids, self.meta, self.manager)
        else:
            input_ids = ids if isinstance(ids, torch.Tensor) else to_device(ids, self.device, torch.int64)
            with torch.inference_mode():
                hidden = self.model(input_ids, self.meta, self.manager)
        self._record_prompt(plan, hidden)
        return hidden

    def _graph_step_allowed(self, plan: list[ScheduledSeq]) -> bool:
        """Whether a decode step may replay a graph (the speculative executor refuses verify steps whose drafts
        a grammar must judge: a verify graph accepts drafts on the device, before any mask)."""
        return True

    def _masked_choice(
        self, logits: torch.Tensor, items: list[tuple[Request, int, list[int]]], *, need_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each grammar row's token among those its mask allows.

        Masks are computed on the host (llguidance: `grammar.fill_bitmasks`), copied to the logits' device and read
        by the greedy kernel as it scans the rows (`trtllm_glm.logits.greedy_pack`: no masked copy of the logits on
        CUDA), outside any captured graph.

        Args:
            logits: ``[n, V]`` FP32 logits of the step's sampled rows.
            items: per grammar request ``(request, first_row, drafts)`` (`grammar.fill_bitmasks`).
            need_logits: also return the masked logits (sampled requests draw from them).

        Returns:
            ``(rows [m] int64, packed [m, 3] float64, masked)`` on the device: the grammar rows, in ``items``'
            order, their ``(token, top-2 gap, 1)`` under the masks, and ``[n, V]`` logits with those rows masked
            (a copy: the raw rows stay for logprobs) when ``need_logits``, else None.
        """
        n, V = logits.shape
        bm = fill_bitmasks([(r.grammar, row, d) for r, row, d in items], n, V)
        rows = [i for _, row, d in items for i in range(row, row + 1 + len(d))]
        idx = to_device(rows, logits.device)
        masks = bm[rows].to(logits.device, non_blocking=True)
        packed = greedy_pack(logits.index_select(0, idx), bitmask=masks)[1]
        masked = None
        if need_logits:
            masked = logits.clone()
            masked.index_copy_(0, idx, apply_token_bitmask(masked.index_select(0, idx), masks))
        return idx, packed, masked

    def _record_prompt(self, plan: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Context logits and prompt logprobs of the prompt rows this step computed (when asked for)."""
        row = 0
        for s in plan:
            r, start = s.request, row
            row += s.num_rows
            p = r.params
            if not (p.return_context_logits or p.prompt_logprobs is not None):
                continue
            n_prompt = len(r.prompt_ids)
            lo = max(r.num_computed, r.prompt_rows_recorded)
            hi = min(r.num_computed + s.num_rows, n_prompt)
            if lo >= hi:
                continue
            idx = torch.arange(start + lo - r.num_computed, start + hi - r.num_computed, device=self.device)
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden[idx])
            if p.return_context_logits:
                r.context_logits.append(logits.cpu())
            if p.prompt_logprobs is not None:
                if lo == 0:
                    r.prompt_logprobs.append(None)  # nothing predicts the first prompt token
                nxt = r.prompt_ids[lo + 1 : hi + 1]
                r.prompt_logprobs.extend(token_logprobs(logits[: len(nxt)], nxt, p.prompt_logprobs))
            r.prompt_rows_recorded = hi

    def _rows_for(self, s: ScheduledSeq) -> list[int]:
        """Token ids of the rows ``s`` feeds this step."""
        r = s.request
        return r.tokens[r.num_computed : r.num_computed + s.num_rows]

    def _graph_inputs(self, plan: list[ScheduledSeq]) -> tuple[list[int], DeviceRows | None]:
        """Input tokens of a replayed step: host ids ``[B * W]`` and rows to take on the device instead
        (`CudaGraphRunner.replay`'s ``device_rows``; plain decoding has none)."""
        ids: list[int] = []
        for s in plan:
            ids.extend(self._rows_for(s))
        return ids, None

    def _proposed(self, plan: list[ScheduledSeq]) -> list[int] | None:
        """Real drafts per sequence of a verify step (None: plain decoding has none)."""
        return None

    def _before_forward(self, plan: list[ScheduledSeq]) -> None:
        """Hook: runs after ``prepare()`` and before the model (speculative verify sets its fields here)."""

    def _advance(self, plan: list[ScheduledSeq], hidden: torch.Tensor, slots: list[int] | None = None) -> list[Request]:
        """Commit the rows, sample where a sequence's pending rows ended, retire finished requests.

        ``slots`` are the step's state slots (default: the metadata's; a step read back late passes its own).
        A request that finished before its step was read back (aborted, or stopped by the step before,
        with this one launched ahead) is skipped: its rows are dropped.
        """
        to_sample: list[tuple[Request, int]] = []
        live = [not s.request.finished for s in plan]
        # Every row of a plain step is committed: the state owner advances each slot's committed length.
        self.manager.state.commit_verified(
            self.meta.state_slots if slots is None else slots, [s.num_rows * ok for s, ok in zip(plan, live)]
        )
        row = 0
        for s, ok in zip(plan, live):
            r = s.request
            row += s.num_rows
            if not ok:
                continue
            r.num_computed += s.num_rows
            if r.num_computed == len(r.tokens):
                to_sample.append((r, row - 1))
        finished: list[Request] = []
        if to_sample:
            logits, packed = self._sample_rows(hidden, [i for _, i in to_sample])
            reqs = [r for r, _ in to_sample]
            greedy = [int(p[0]) for p in packed]
            gaps = [p[1] for p in packed]
            choose = logits
            constrained = [j for j, r in enumerate(reqs) if r.has_grammar]
            out = self._step_out
            if constrained and not (out is not None and out.masked):  # (masked: chosen already, on the device)
                items = [(reqs[j], j, []) for j in constrained]
                sampled = not all(r.params.greedy for r in reqs)
                _, packed_c, masked = self._masked_choice(logits, items, need_logits=sampled)
                choose = logits if masked is None else masked
                for j, (t, gp, _) in zip(constrained, packed_c.tolist()):
                    greedy[j], gaps[j] = int(t), gp
            if (out is not None and out.chosen) or all(r.params.greedy for r in reqs):
                toks = greedy  # greedy, or drawn already (`_choose_tokens`)
            else:
                toks = self.sampler.sample(choose, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
            for j, (r, t, gp) in enumerate(zip(reqs, toks, gaps)):
                # A slice of the logits only for requests that read them (a view costs ~2 µs per row).
                if self._emit(r, [t], [gp], logits[j : j + 1] if r.wants_logits else None):
                    finished.append(r)
        for r in finished:
            self._finish(r)
        return finished

    # --------------------------------------------------------------------------------------------
    def stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """Why emitting ``token`` (already appended) ends ``req``, if it does."""
        p = req.params
        if req.stop_id_set is None:
            # end_id (when set) replaces the model's EOS ids; ignore_eos disables both. Built once per
            # request: a set per emitted token is measurable host time at large batches.
            req.stop_id_set = p.stop_ids(self.config.eos_token_ids)
        if token in req.stop_id_set:
            return FinishReason.STOP
        if req.num_output >= p.max_tokens or len(req.tokens) >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _emit(self, req: Request, tokens: list[int], gaps: list[float], logits: torch.Tensor | None = None) -> bool:
        """Append tokens (with their top-2 logit gaps) in order until one finishes the request.

        Args:
            req: the request.
            tokens: ids to emit, in order.
            gaps: top-2 logit gap of the distribution each token was chosen from.
            logits: ``[len(tokens), V]`` those distributions (for logprobs / generation logits).
        """
        p = req.params
        if logits is not None and p.logprobs is not None:
            lps = token_logprobs(logits[: len(tokens)], tokens, p.logprobs)
        if req.t_first_token is None and tokens:
            req.t_first_token = now()
        for i, (t, gp) in enumerate(zip(tokens, gaps)):
            req.tokens.append(int(t))
            req.logit_gaps.append(float(gp))
            if logits is not None:
                if p.logprobs is not None:
                    req.logprobs.append(lps[i])
                if p.return_generation_logits:
                    req.generation_logits.append(logits[i].float().cpu())
            reason = self.stop_reason(req, int(t))
            if reason is not None:
                req.finish_reason = reason
                return True
            if req.grammar is not None:
                req.grammar.accept(int(t))  # a refused token (never chosen under the mask) leaves only the end
        return False

    def abort_request(self, request_id: int) -> Request | None:
        """Stop a waiting or running request now and free its pages and state slot.

        Returns:
            The request (finish reason ``abort``), or ``None`` when no live request has this id.
        """
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.state = RequestState.FINISHED
                r.finish_reason = FinishReason.ABORT
                self.on_abort(r)
                return r
        for r in self.running:
            if r.request_id == request_id:
                r.finish_reason = FinishReason.ABORT
                self._finish(r)
                self.on_abort(r)
                return r
        return None

    def on_abort(self, req: Request) -> None:
        """Hook for subclasses that keep per-request state (drafters)."""

    def _finish(self, req: Request) -> None:
        # Not when a step launched ahead (overlap scheduler, an admission planned ahead) already wrote the slot past
        # the request's end.
        ahead = any(
            plan is not None and any(s.request is req for s in plan)
            for plan in (self._inflight.plan if self._inflight is not None else None, self._admission_launched)
        )
        if self.prefix is not None and req.finish_reason is not FinishReason.ABORT and not ahead:
            self.prefix.at_finish(req, self.draft_history_len)
        req.state = RequestState.FINISHED
        self.running.remove(req)
        self.manager.free_request(req.request_id)

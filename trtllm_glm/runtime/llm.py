"""An LLM API shaped like TensorRT-LLM's: ``LLM(model=..., kv_cache_config=...)`` and ``generate()``."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import envs
from ..cache.index_keys import indexer_key_dtype
from ..cache.latent_format import check_latent_dtype
from ..config import Glm5NextConfig, resolve_preset_dir
from ..distributed.comm import NULL_COMM, Comm
from ..distributed.mapping import Mapping, ParallelConfigError
from ..distributed.sharding import check_shardable
from ..models.glm5_next import Glm5NextForCausalLM, resolve_fp8_lm_head
from ..numerics import set_batch_invariant
from .cuda_graph import CudaGraphConfig
from .executor import Executor, ExecutorConfig
from .grammar import GrammarCompiler
from .output import OutputProcessor
from .request import FinishReason, Request
from .sampling import Logprob, SamplingParams
from .sizing import StepSizes, resolve_step_sizes
from .speculative_executor import SpeculativeExecutor
from .tokenizer import load_tokenizer
from .validation import InvalidRequestError, check_prompt_ids, check_request, check_text
from .warmup import WarmupReport, warm_up

__all__ = [
    "AUTO_BATCH_INVARIANT",
    "LLM",
    "KvCacheConfig",
    "CompletionOutput",
    "RequestOutput",
    "AsyncRequestOutput",
    "resolve_batch_invariant",
]

# What ``LLM(batch_invariant=None)`` ("auto") means: the mode off. On the H200 the mode's plain decode step costs
# 1.05-1.09x the default's, but 64-row verify steps 1.6x and prefill 6.2-6.5x (docs/numerics.md, "What it costs").
AUTO_BATCH_INVARIANT = False


def resolve_batch_invariant(value: bool | None) -> bool:
    """``LLM``'s ``batch_invariant`` argument as a bool: ``None`` ("auto") is ``TRTLLM_GLM_BATCH_INVARIANT`` when
    that is set (``1`` / ``0``), else `AUTO_BATCH_INVARIANT`.

    Raises:
        TypeError: anything but a bool or ``None``.
        ValueError: a ``TRTLLM_GLM_BATCH_INVARIANT`` value other than 1 / 0 (on / off, true / false, yes / no).
    """
    if value is None:
        env = envs.BATCH_INVARIANT.get()
        return AUTO_BATCH_INVARIANT if env is None else env
    if not isinstance(value, bool):
        raise TypeError(f"batch_invariant must be True, False or None (auto), got {value!r}")
    return value


log = logging.getLogger("trtllm_glm")


@dataclass
class KvCacheConfig:
    """Paged cache sizing (TensorRT-LLM's name).

    Attributes:
        tokens_per_block: tokens per page (multiple of 4).
        max_tokens: tokens the page pool holds over all requests (``None``: ``max_batch_size *
            max_seq_len``, every request at full length).
        enable_block_reuse: prefix caching (TensorRT-LLM's name): requests whose prompt starts like an
            earlier one's share its full pages and restore a recurrent-state checkpoint instead of
            recomputing (docs/design.md §6.4). On by default.
        checkpoint_interval: prompt tokens between checkpoints. ``"auto"`` (default): the prefill chunk
            (``max_num_tokens``, or ``prefill_chunk_size`` when smaller) rounded down to a page, so that
            checkpoints fall where a long prompt's chunks end anyway; ``None``: no stride (only the
            checkpoints below).
        max_checkpoints: checkpoints kept (least recently used evicted first).
        checkpoint_max_bytes: device bytes the checkpoints may hold (least recently used evicted first; a
            checkpoint larger than the whole budget is skipped and counted). ``"auto"`` (default): a quarter
            of the KV cache's bytes (pages and state slots), at least two checkpoints per state slot (a checkpoint
            is a state slot's copy: ~153 MB on GLM-5.3-Flash); ``None``: no limit.
        checkpoint_prompt_end: also checkpoint where each prompt's prefill ends, so that the next turn of
            a conversation (this prompt + the answer + more) reuses the whole prompt. On by default.
        checkpoint_prompt_end_min_tokens: the shortest prompt that gets a prompt-end checkpoint (default 64; never
            less than a page). A checkpoint is a whole state-slot copy whatever the prompt's length (~94-153 MB on
            GLM-5.3-Flash, a share of ``checkpoint_max_bytes`` that evicts others), and a short prompt's saves
            its next turn only the prompt's few tokens of prefill (the answer is recomputed either way). Short
            prompts keep their request-end checkpoint: the next turn still resumes after the answer where one is
            taken (docs/prefix_caching.md, "Short prompts").
        checkpoint_last_page: also cut each prompt's prefill at its last page boundary and checkpoint there, so
            that the first repeat of the prompt resumes there too. Off by default: the cut costs every prompt
            longer than a page one more (eager) prefill step before its first token; off, a repeat finds the
            pages sealed and checkpoints there as a branch point, and the repeats after it resume.
        checkpoint_request_end: also checkpoint each request where it ends (prompt + answer), so that the
            next turn of a conversation resumes after the answer (on by default; MTP requests skip it).
        checkpoint_branch_points: when a prompt matches cached pages further than any checkpoint reaches
            (a shared system prompt, a document asked another question), checkpoint it where the match ends,
            so that every later request sharing that prefix resumes there. On by default.
        indexer_key_dtype: precision of the sparse layers' pooled indexer keys in the cache: ``"fp8"``
            (default: e4m3 after a Hadamard rotation, one power-of-two scale per pool, 132 bytes a pool) or
            ``"bf16"`` (TensorRT-LLM's choice: 256 bytes a pool, queries scored in bf16 too; closer to the
            reference's float selection where ``index_topk`` drops pools). docs/indexer_keys.md.
        latent_dtype: storage of the sparse layers' latent rows (the MLA KV cache proper): ``"auto"`` (default: the
            model dtype, 1024 bytes a token and layer in bf16) or ``"fp8"`` (e4m3 codes with a power-of-two fp32
            scale per 128 columns, 528 bytes; quantised where rows are written, dequantised where attention reads
            them). docs/fp8.md, "FP8 latent cache".
    """

    tokens_per_block: int = 16
    max_tokens: int | None = None
    enable_block_reuse: bool = True
    checkpoint_interval: int | str | None = "auto"
    max_checkpoints: int = 64
    checkpoint_max_bytes: int | str | None = "auto"
    checkpoint_prompt_end: bool = True
    checkpoint_prompt_end_min_tokens: int = 64
    checkpoint_last_page: bool = False
    checkpoint_branch_points: bool = True
    checkpoint_request_end: bool = True
    indexer_key_dtype: str = "fp8"
    latent_dtype: str = "auto"

    def __post_init__(self) -> None:
        indexer_key_dtype(self.indexer_key_dtype)  # a clear ValueError for anything but fp8 / bf16
        check_latent_dtype(self.latent_dtype)  # and for anything but auto / fp8
        if self.tokens_per_block <= 0 or self.tokens_per_block % 4:
            raise ValueError(f"tokens_per_block must be a positive multiple of 4, got {self.tokens_per_block}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        for name in ("checkpoint_interval", "checkpoint_max_bytes"):
            v = getattr(self, name)
            if v is None or v == "auto":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, 'auto' or None, got {v!r}")
        if self.max_checkpoints < 0:
            raise ValueError(f"max_checkpoints must be >= 0, got {self.max_checkpoints}")
        n = self.checkpoint_prompt_end_min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"checkpoint_prompt_end_min_tokens must be a positive int (prompt tokens), got {n!r}")
        ci = self.checkpoint_interval
        if isinstance(ci, int) and not isinstance(ci, bool) and ci < self.tokens_per_block:
            # A stride below a page cuts every prefill chunk into a few rows (measured 4.5-6x slower prefill at
            # 1 or 3) and checkpoints nothing a page-granular match can restore.
            raise ValueError(
                f"checkpoint_interval must be at least tokens_per_block ({self.tokens_per_block}) or 'auto' / None, "
                f"got {ci}"
            )

    def resolved_interval(self, max_num_tokens: int, prefill_chunk_size: int | None) -> int | None:
        """``checkpoint_interval`` with ``"auto"`` resolved for these step sizes."""
        if self.checkpoint_interval != "auto":
            return self.checkpoint_interval  # type: ignore[return-value]
        chunk = min(max_num_tokens, prefill_chunk_size or max_num_tokens)
        P = self.tokens_per_block
        return max(P, chunk // P * P)


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Speculative decoding statistics (zero without speculation).
    num_draft_rounds: int = 0
    mean_accepted_length: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    # Top-2 logit gap behind each output token (near-tie checks, docs/design.md §7).
    logit_gaps: list[float] = field(default_factory=list)
    # Per output token {token_id: Logprob} (SamplingParams.logprobs), else None.
    logprobs: list[dict[int, Logprob]] | None = None
    # Per prompt token (None for the first) {token_id: Logprob} (SamplingParams.prompt_logprobs), else None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # [num_generated, vocab] FP32 logits each output token was chosen from (return_generation_logits).
    generation_logits: torch.Tensor | None = None


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # [prompt_len, vocab] FP32 logits of the prompt rows (SamplingParams.return_context_logits), else None.
    context_logits: torch.Tensor | None = None
    # Prompt tokens restored from the prefix cache instead of computed (TensorRT-LLM's name).
    num_cached_tokens: int = 0


def _check_device_name(device: object) -> None:
    """A device torch does not know is a one-line error naming what is accepted (torch's own lists every backend)."""
    try:
        torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (a device torch knows), got {device!r}") from None


class LLM:
    """Offline generation with a Glm5Next model.

    Args:
        model: a preset name (``"tiny"``: the embedded seeded tiny model), a checkpoint directory, or a
            `Glm5NextForCausalLM` already built (its device and dtype are used as they are).
        kv_cache_config: paged cache sizing.
        max_batch_size: sequences per step. ``None`` (default): 64, halved (down to 8) while the caches and a
            prefill chunk's buffers do not fit the device's free memory (`trtllm_glm.runtime.sizing`).
        max_num_tokens: flat rows per step (prefill chunks are cut to fit). ``None`` (default): 8,192 (TensorRT-LLM's
            default), halved (down to 512) while it does not fit, before the batch is. A value given is kept, and
            one that cannot fit is refused with the estimate and what is free.
        max_seq_len: longest prompt + output.
        dtype: parameter dtype (default: the checkpoint's ``torch_dtype``); block-FP8 weights stay FP8.
        quantization: how weights are held (vLLM's name): ``None`` / ``"auto"``, a block-FP8 checkpoint's
            quantized weights stay float8_e4m3fn with their fp32 tile scales; ``"fp8"``, also quantise a bf16
            checkpoint or a preset's weights to block FP8 at load; ``"none"``, dequantise everything at load
            (debugging). See docs/fp8.md.
        fp8_lm_head: the LM head in block FP8: ``None`` (default), as the checkpoint stores it (GLM's FP8
            checkpoints: bf16; quantising at load keeps it in ``dtype``); ``"auto"``, FP8 when the rest of the model
            holds block-FP8 weights (an FP8 checkpoint or ``quantization="fp8"``); ``True`` / ``False``, FP8 / the
            model dtype whatever the rest holds. A head tied to the embedding stays float (``True`` is refused). Not
            for a model object (use its ``set_fp8_lm_head_``). docs/fp8.md, "The LM head".
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        seed: seed of preset weights and of sampling without a per-request seed.
        prefill_chunk_size: cap on a prefill chunk.
        mixed_prefill_budget: cap on all prefill rows of a step that also decodes (``None``: only
            ``max_num_tokens``): admissions spread over more steps so that no decode step waits for a wide one
            (docs/serving.md, "Admission steps and inter-token latency").
        tokenizer: a tokenizer object (``encode``/``decode``) overriding the model's.
        speculative_config: a registered decoding config (`MTPDecodingConfig`, `NGramDecodingConfig`:
            `speculative.registry`); None: no speculation.
        num_threads: torch intra-op CPU threads (process-wide). ``None``: the ``TRTLLM_GLM_NUM_THREADS``
            environment variable, else one thread for a small model on the CPU (under
            `SMALL_MODEL_PARAMS` parameters, where torch's default threading costs far more than it
            gains: the tiny preset runs ~15x faster on one thread of a 2-core machine), else torch's
            default.
        cuda_graph_config: CUDA graphs of decode / verify steps (`CudaGraphConfig`, or a mapping of its
            fields); on by default, as in TensorRT-LLM; ``None`` turns them off. Ignored on the CPU.
            Every graph (target decode / verify, MTP draft steps) is captured while the LLM is built.
        disable_overlap_scheduler: turn off the overlap scheduler (TensorRT-LLM's name and default: on).
            With it, a steady decode step is launched before the previous step's tokens are read back,
            so the host's share of a step hides behind the GPU's (CUDA graphs only; sampled rows draw on
            the device first; speculative decoding, logprobs and steps that admit requests run one at a
            time as before). Tokens and outputs are the same either way (seeded samples included).
        tensor_parallel_size: ranks that split attention (query / KDA heads) and the dense MLPs
            (TensorRT-LLM's name; docs/parallelism.md). Above 1 the LLM starts one worker process per extra
            rank (this process is rank 0), or, launched by torchrun, runs as this process's rank.
        moe_expert_parallel_size: blocks of whole routed experts (default: the world size divided by
            ``moe_tensor_parallel_size``, else 1); with ``tensor_parallel_size=1`` it alone sets the world size
            (attention then replicated).
        moe_tensor_parallel_size: slices of each routed expert's intermediate dimension (default: the world
            size divided by ``moe_expert_parallel_size``).
        batch_invariant: the batch-invariant numerics mode (docs/numerics.md; vLLM's name): every row's bits
            independent of the other rows of a step, of the verify width and of the batch, so speculative greedy
            decoding equals plain greedy decoding bit for bit. ``None`` ("auto"): `AUTO_BATCH_INVARIANT`. The mode
            is process-wide (`trtllm_glm.numerics.set_batch_invariant`; kernels read it where they choose a launch
            shape, CUDA graphs are captured in it): the last LLM built in a process sets it. Spawned workers of a
            parallel LLM get the same value.

        batch_wait_timeout_iters: while the batch decodes, hold newly arrived requests up to this many steps so that
            they are admitted together (`ExecutorConfig.batch_wait_timeout_iters`, TensorRT-LLM's name; 0, the
            default: admitted at the first step with room).
        batch_wait_max_tokens_ratio: stop holding once the waiting prompts reach this share of ``max_num_tokens``.

        warmup: on CUDA, run every kind of step a served batch can take once while the LLM is built (prefill
            widths, mixed steps, a full batch, growing contexts, sampling: `trtllm_glm.runtime.warmup`), so that no
            Triton kernel compiles while serving. Ignored on the CPU (nothing compiles there) and, for now, by a
            parallel LLM. ``llm.warmup_report`` says what it ran.

    A parallel LLM holds processes and process groups: call `shutdown` (or use ``with LLM(...) as llm:``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Glm5NextForCausalLM,
        *,
        kv_cache_config: KvCacheConfig | None = None,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        max_seq_len: int = 2048,
        dtype: str | torch.dtype | None = None,
        quantization: str | None = None,
        fp8_lm_head: str | bool | None = None,
        device: str | None = None,
        seed: int = 0,
        prefill_chunk_size: int | None = None,
        mixed_prefill_budget: int | None = None,
        tokenizer: object | None = None,
        speculative_config: object | None = None,
        num_threads: int | None = None,
        cuda_graph_config: CudaGraphConfig | None = CudaGraphConfig(),  # noqa: B008 - frozen, shared safely
        disable_overlap_scheduler: bool = False,
        tensor_parallel_size: int = 1,
        moe_expert_parallel_size: int | None = None,
        moe_tensor_parallel_size: int | None = None,
        batch_invariant: bool | None = None,
        batch_wait_timeout_iters: int = 0,
        batch_wait_max_tokens_ratio: float = 0.0,
        warmup: bool = True,
        _spawned_rank: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(disable_overlap_scheduler, bool):
            raise TypeError(f"disable_overlap_scheduler must be a bool, got {disable_overlap_scheduler!r}")
        if not isinstance(warmup, bool):
            raise TypeError(f"warmup must be a bool, got {warmup!r}")
        if device is not None:
            _check_device_name(device)
        resolve_fp8_lm_head(fp8_lm_head)  # a bad value is refused before anything is built
        if fp8_lm_head is not None and isinstance(model, Glm5NextForCausalLM):
            raise ValueError(
                "fp8_lm_head applies to a model the LLM loads; a model object is used as it is (call its "
                "set_fp8_lm_head_ first)"
            )
        self.batch_invariant = resolve_batch_invariant(batch_invariant)
        # What the workers of a spawned world build with (they load their own tokenizer: they never decode).
        init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "_spawned_rank", "tokenizer")}
        init_kwargs.pop("__class__", None)
        for name, value in (
            ("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens), ("max_seq_len", max_seq_len),
        ):  # fmt: skip
            if value is None and name != "max_seq_len":
                continue  # sized at start-up (`resolve_step_sizes`)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 (a prompt token and a generated one), got {max_seq_len}")
        self._engine: Any = None  # the AsyncEngine of generate_async, started on first use
        # One stepper of the executor at a time: `generate` callers from several threads take turns, and the
        # engine of `generate_async` is started only between them (two steppers corrupt a step).
        self._executor_lock = threading.RLock()
        self.mapping = Mapping.from_sizes(tensor_parallel_size, moe_expert_parallel_size, moe_tensor_parallel_size)
        self.comm: Comm = NULL_COMM
        self._ranks = None  # RankGroup: the workers this process (rank 0) started
        self._owns_group = False  # whether shutdown leaves the process group (not one the caller set up)
        self._closed = False
        kv = kv_cache_config or KvCacheConfig()
        # Before anything runs: weights' first launches and every CUDA graph capture happen in the mode.
        set_batch_invariant(self.batch_invariant)
        t0 = time.perf_counter()
        if self.mapping.is_parallel:
            self.device, model = self._join_world(model, device, init_kwargs, _spawned_rank)
            try:
                self.model = Glm5NextForCausalLM.from_pretrained(
                    model, dtype=dtype, device=self.device, seed=seed, mapping=self.mapping, quantization=quantization,
                    fp8_lm_head=fp8_lm_head,
                )  # fmt: skip
                self.model.set_comm(self.comm)
            except BaseException:
                self.shutdown()
                raise
        elif isinstance(model, Glm5NextForCausalLM):
            self.model = model.eval()
            self.device = str(next(model.parameters()).device)
            model = "model object"
        else:
            self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(f"device {self.device!r} asked for but CUDA is not available on this machine")
            self.model = Glm5NextForCausalLM.from_pretrained(
                model, dtype=dtype, device=self.device, seed=seed, quantization=quantization, fp8_lm_head=fp8_lm_head
            )
        weights_s = time.perf_counter() - t0  # start-up breakdown (the debug line below; issue 30's timing)
        configure_cpu_threads(num_threads, self.model if torch.device(self.device).type == "cpu" else None)
        self.config = self.model.config
        self.tokenizer = tokenizer or load_tokenizer(model, self.config)
        max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.step_sizes = self._step_sizes(max_batch_size, max_num_tokens, max_seq_len, kv)
        max_batch_size, max_num_tokens = self.step_sizes.max_batch_size, self.step_sizes.max_num_tokens
        self.executor_config = ExecutorConfig(
            tokens_per_block=kv.tokens_per_block,
            max_tokens=kv.max_tokens or max_batch_size * max_seq_len,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            mixed_prefill_budget=mixed_prefill_budget,
            cuda_graph_config=CudaGraphConfig.from_value(cuda_graph_config)
            if torch.device(self.device).type == "cuda"
            else None,
            enable_block_reuse=kv.enable_block_reuse,
            checkpoint_interval=kv.resolved_interval(max_num_tokens, prefill_chunk_size),
            max_checkpoints=kv.max_checkpoints,
            checkpoint_max_bytes=kv.checkpoint_max_bytes,
            # The executor's checkpoint_prompt_end takes the minimum in place of True (`PrefixCache`'s prompt_end).
            checkpoint_prompt_end=kv.checkpoint_prompt_end_min_tokens if kv.checkpoint_prompt_end else False,
            checkpoint_last_page=kv.checkpoint_last_page,
            checkpoint_branch_points=kv.checkpoint_branch_points,
            checkpoint_request_end=kv.checkpoint_request_end,
            overlap_scheduler=not disable_overlap_scheduler,
            indexer_key_dtype=kv.indexer_key_dtype,
            latent_dtype=kv.latent_dtype,
            batch_wait_timeout_iters=batch_wait_timeout_iters,
            batch_wait_max_tokens_ratio=batch_wait_max_tokens_ratio,
        )
        self.seed = seed
        self.speculative_config = speculative_config
        try:
            self.executor = self._make_executor()
            # Structured output (runtime/grammar.py): grammars compile against this tokenizer (lazily: nothing is
            # built, nor llguidance imported, before the first request that asks for one).
            self.executor.grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size,
                                                             self.config.eos_token_ids)  # fmt: skip
            t_graphs = time.perf_counter()
            # Every graph now, as TensorRT-LLM's warm-up does: a capture on first use stalls that request.
            self.executor.capture_cuda_graphs()
            graphs_s = time.perf_counter() - t_graphs
            self.warmup_report: WarmupReport | None = None
            if warmup and torch.device(self.device).type == "cuda" and not self.mapping.is_parallel:
                self.warmup_report = warm_up(self.executor, seed=seed)
            if self.mapping.is_parallel:
                from .ranks import install_lockstep

                install_lockstep(self.executor, self.comm)
                if self._ranks is not None:
                    self._ranks.wait_ready()
                    self._ranks.mirror(self.executor)
        except BaseException:
            self.shutdown()
            raise

        log.debug(
            "loaded %s in %.1f s (weights %.1f s, graphs %.1f s): %s on %s, %s, batch-invariant %s", model,
            time.perf_counter() - t0, weights_s, graphs_s,
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters",
            self.device, str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "on" if self.batch_invariant else "off",
        )  # fmt: skip

    def _join_world(
        self,
        model: object,
        device: str | None,
        init_kwargs: dict,
        spawned: tuple[int, int] | None,
    ) -> tuple[str, str | os.PathLike[str]]:
        """Become one rank of the parallel world (`runtime.ranks`); returns this rank's device and the model path.

        Spawned workers join at rank 0's port; under torchrun the environment names the rank; otherwise this
        process is rank 0 and starts the others (after checking, before any process starts, that the sizes
        divide the model's).
        """
        from ..distributed.process_group import init_rank, torchrun_env

        if isinstance(model, Glm5NextForCausalLM):
            raise ParallelConfigError(
                "tensor / expert parallelism needs a preset name or a checkpoint directory (each rank loads its "
                "own share), not a model object"
            )
        assert isinstance(model, (str, os.PathLike))
        check_shardable(Glm5NextConfig.from_pretrained(resolve_preset_dir(model)), self.mapping)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {str(dev)!r} asked for but CUDA is not available on this machine")
        init_method = None
        if spawned is not None:
            rank, port = spawned
            local = rank
            init_method = f"tcp://127.0.0.1:{port}"
        elif (env := torchrun_env()) is not None:
            rank, world, local = env
            if world != self.mapping.world_size:
                raise ParallelConfigError(
                    f"torchrun started {world} processes but the parallel sizes need {self.mapping.world_size}"
                )
        else:
            import torch.distributed as dist

            from .ranks import RankGroup

            if dist.is_initialized():
                raise RuntimeError(
                    "this process is already part of a torch.distributed world (another parallel LLM?): "
                    "shutdown() it before building a new one"
                )
            rank = local = 0
            self._ranks = RankGroup(self.mapping, init_kwargs, dev.type, llm_factory=type(self))
            # An LLM dropped without shutdown() still stops its workers (when collected, or at exit).
            weakref.finalize(self, self._ranks.shutdown)
            init_method = self._ranks.init_method
        self.mapping = self.mapping.with_rank(rank)
        if dev.type == "cuda":
            dev = torch.device("cuda", local if dev.index is None else dev.index + local)
        import torch.distributed as dist

        self._owns_group = not dist.is_initialized()
        try:
            self.comm = init_rank(self.mapping, dev, init_method)
        except BaseException:
            self.shutdown()
            raise
        return str(dev), model

    # --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine thread of `generate_async` (in-flight requests end with ``finish_reason`` abort), the
        worker processes and the process group of a parallel LLM (idempotent)."""
        if self._engine is not None:
            self._engine.stop(drain_timeout=0.0)
            self._engine = None
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._ranks is not None:
            self._ranks.shutdown()
        elif self._owns_group:
            from ..distributed.process_group import shutdown_rank

            shutdown_rank()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def parallel_error(self) -> str | None:
        """Why this parallel LLM's world failed (a rank raised, died or diverged), else ``None``."""
        return self._ranks.failure if self._ranks is not None else None

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this LLM started (empty on one device or under torchrun)."""
        return self._ranks.pids if self._ranks is not None else []

    def _step_sizes(
        self, max_batch_size: int | None, max_num_tokens: int | None, max_seq_len: int, kv: KvCacheConfig
    ) -> StepSizes:
        """The batch and token budget (`resolve_step_sizes`); the ranks of a parallel LLM agree on the smallest."""
        sizes = resolve_step_sizes(
            self.config, self.device, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len, tokens_per_block=kv.tokens_per_block, kv_max_tokens=kv.max_tokens,
            dtype=next(self.model.parameters()).dtype,  # the executor's activation and cache dtype
            indexer_key_dtype=kv.indexer_key_dtype, latent_dtype=kv.latent_dtype,
        )  # fmt: skip
        if self.mapping.is_parallel and sizes.auto:
            # Every rank must run the same steps: take the smallest automatic sizes over the world.
            got = self.comm.gather_ints([sizes.max_batch_size, sizes.max_num_tokens])
            b, n = min(g[0] for g in got), min(g[1] for g in got)
            sizes = replace(
                sizes,
                max_batch_size=b,
                max_num_tokens=n,
                reduced=sizes.reduced or (b, n) != (sizes.max_batch_size, sizes.max_num_tokens),
            )
        return sizes

    def _make_executor(self) -> Executor:
        if self.speculative_config is None:
            return Executor(self.model, self.executor_config, seed=self.seed)
        # An unregistered config is a TypeError naming the registered ones (`speculation_entry`).
        return SpeculativeExecutor(self.model, self.executor_config, self.speculative_config, seed=self.seed)

    # --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a list of prompts (text or token ids).

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default: greedy, 32 tokens).
            progress: called as ``progress(tokens_generated, steps)`` after every step.

        Returns:
            One `RequestOutput` per prompt (a single one for a single prompt), in prompt order.
        """
        single, plist, params = _split_args(prompts, sampling_params)
        # Validate every prompt before queueing any, so a bad one loses nothing.
        encoded = [self._encode(i, p) for i, p in enumerate(plist)]
        for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
            self._check(i if not single else None, ids, sp)
        with self._executor_lock:  # callers from other threads wait for this one's batch
            self._stop_engine()  # generate steps the executor itself
            return self._generate_locked(single, encoded, params, progress)

    def _generate_locked(
        self,
        single: bool,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        progress: Callable[[int, int], None] | None,
    ) -> RequestOutput | list[RequestOutput]:
        ex = self.executor
        groups: list[list[Request]] = []  # per prompt, its n requests
        procs: dict[int, OutputProcessor] = {}  # requests with stop strings: their detokenizer and stop search
        try:
            for (_, ids), sp in zip(encoded, params):
                group = []
                for i in range(max(sp.n, sp.best_of or 0)):
                    # Choice i draws with seed + i (the server's rule), so the n samples differ.
                    spi = sp if sp.seed is None or i == 0 else replace(sp, seed=sp.seed + i)
                    if (sp.best_of or 0) > sp.n and sp.logprobs is None:  # best_of ranks by the chosen logprobs
                        spi = replace(spi, logprobs=0)
                    r = ex.add_request(ids, spi)
                    group.append(r)
                    if sp.stop:
                        procs[r.request_id] = OutputProcessor(self.tokenizer, sp.stop_strings)
                groups.append(group)
        except Exception:
            for r in (r for g in groups for r in g):
                ex.waiting.remove(r)
            raise
        reqs = [r for g in groups for r in g]
        live = {r.request_id: r for r in reqs if r.request_id in procs}
        seen = dict.fromkeys(live, 0)
        steps = 0
        while ex.has_work:
            ex.step()
            steps += 1
            for rid, r in list(live.items()):
                self._apply_stop_strings(r, procs[rid], seen)
                if r.finished:
                    del live[rid]
            if progress is not None:
                progress(sum(r.num_output for r in reqs), steps)
        outs = []
        for group, (text, _), sp in zip(groups, encoded, params):
            r0 = group[0]
            if len(group) > sp.n:  # best_of: the n most likely, best first (ties: generation order)
                score = [sum(d[t].logprob for t, d in zip(r.output_ids, r.logprobs)) for r in group]
                group = [group[k] for k in sorted(range(len(group)), key=lambda k: -score[k])[: sp.n]]
            comps = [self._completion(i, r, procs.get(r.request_id)) for i, r in enumerate(group)]
            if sp.logprobs is None:
                for c in comps:
                    c.logprobs = None
            outs.append(RequestOutput(r0.request_id, text, list(r0.prompt_ids), comps, context_logits=self._context(r0),
                                      num_cached_tokens=r0.num_cached_tokens))  # fmt: skip
        return outs[0] if single else outs

    def _apply_stop_strings(self, r: Request, proc: OutputProcessor, seen: dict[int, int]) -> None:
        """Feed ``r``'s new tokens to its stop search; a stop string ends it (finish reason ``stop``), keeping the
        tokens up to the one that completed the string."""
        base = len(r.prompt_ids)
        while seen[r.request_id] < r.num_output and not proc.stopped:
            proc.add(r.tokens[base + seen[r.request_id]])
            seen[r.request_id] += 1
        if proc.stopped:
            if not r.finished:
                self.executor.abort_request(r.request_id)
            del r.tokens[base + seen[r.request_id] :]
            r.finish_reason = FinishReason.STOP
        elif r.finished:
            proc.finish()

    def _check(self, i: int | None, ids: list[int], sp: SamplingParams) -> None:
        """The server's request checks (`validation.check_request`), raised as ``ValueError``s."""
        where = "prompt" if i is None else f"prompt {i}"
        check_prompt_ids(ids, self.config.vocab_size, where)
        try:
            check_request(len(ids), sp, vocab_size=self.config.vocab_size, max_seq_len=self.executor.max_seq_len)
            if sp.guided_decoding is not None:  # compiled now (and cached), so that a bad grammar loses nothing
                try:
                    assert self.executor.grammar_compiler is not None
                    self.executor.grammar_compiler.compile(sp.guided_decoding)
                except ValueError as e:
                    raise InvalidRequestError(f"guided_decoding: {e}", param="guided_decoding") from None
        except InvalidRequestError as e:
            msg = str(e) if e.param == "stop_token_ids" else f"{where}: {e}"
            raise InvalidRequestError(msg, param=e.param, code=e.code) from None

    def _encode(self, i: int, p: object) -> tuple[str | None, list[int]]:
        """A prompt as ``(text or None, token ids)``; token-id prompts must hold plain ints (no coercion)."""
        if isinstance(p, str):
            check_text(p, f"prompt {i}")
            return p, self.tokenizer.encode(p)  # type: ignore[attr-defined]
        if isinstance(p, (bytes, bytearray)) or not isinstance(p, Sequence):
            raise TypeError(f"prompt {i}: expected a string or a list of token ids, got {type(p).__name__}")
        bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise TypeError(
                f"prompt {i}: token ids must be ints, got {type(bad[0]).__name__} {bad[0]!r}"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            )
        return None, list(p)

    def _completion(self, index: int, r: Request, proc: OutputProcessor | None = None) -> CompletionOutput:
        """Completion ``index`` of a prompt from its finished request (the stop search's text when it had one)."""
        out = r.output_ids
        rounds = r.num_verify_rounds
        n = len(out)
        return CompletionOutput(
            index=index,
            text=proc.text if proc is not None else self.tokenizer.decode(out),  # type: ignore[attr-defined]
            token_ids=list(out),
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            num_draft_rounds=rounds,
            mean_accepted_length=(r.num_accepted_total / rounds) if rounds else 0.0,
            acceptance_per_position=[
                a / p if p else 0.0 for a, p in zip(r.accepted_per_position, r.proposed_per_position)
            ],
            logit_gaps=list(r.logit_gaps[:n]),
            logprobs=list(r.logprobs[:n]) if r.params.logprobs is not None else None,
            prompt_logprobs=list(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None,
            generation_logits=_stack(r.generation_logits[:n], self.config.vocab_size)
            if r.params.return_generation_logits
            else None,
        )

    @staticmethod
    def _context(r: Request) -> torch.Tensor | None:
        return torch.cat(r.context_logits) if r.params.return_context_logits and r.context_logits else None

    def _output(self, r: Request, prompt: str | None) -> RequestOutput:
        return RequestOutput(
            r.request_id, prompt, list(r.prompt_ids), [self._completion(0, r)], context_logits=self._context(r),
            num_cached_tokens=r.num_cached_tokens,
        )  # fmt: skip

    # --------------------------------------------------------------------------------------------
    def generate_async(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = False,
    ) -> AsyncRequestOutput:
        """Generate for one prompt alongside other callers (TensorRT-LLM's ``generate_async``).

        The request is checked now (a bad one raises here, as in `generate`) and joins the running batch
        of a background engine thread (the server's `AsyncEngine`) when the result is first awaited or
        iterated, on the caller's event loop. Many calls share the batch (continuous batching).

        Args:
            prompt: a string or a list of token ids.
            sampling_params: default greedy, 32 tokens.
            streaming: iterating yields a partial `RequestOutput` per engine step that gave the request
                tokens (text and token ids so far); without it, iterating yields the final one only.

        Returns:
            An `AsyncRequestOutput`: ``await out`` (or ``await out.aresult()``) gives the final
            `RequestOutput`; ``async for partial in out`` streams.
        """
        if isinstance(prompt, (list, tuple)) and not prompt:
            check_prompt_ids([], self.config.vocab_size)  # raises: the prompt is empty
        if isinstance(sampling_params, (list, tuple)):
            raise TypeError("generate_async takes one SamplingParams (one prompt), not a list")
        single, plist, params = _split_args(prompt, sampling_params)
        if not single:
            raise TypeError("generate_async takes one prompt (a string or a list of token ids), not a list of them")
        if params[0].n != 1:
            raise ValueError(f"generate_async makes one completion (n=1); n={params[0].n} is for generate()")
        if (params[0].best_of or 1) != 1:
            raise ValueError(f"generate_async makes one completion; best_of={params[0].best_of} is for generate()")
        text, ids = self._encode(0, plist[0])
        self._check(None, ids, params[0])
        return AsyncRequestOutput(self, text, ids, params[0], streaming)

    def _async_engine(self) -> Any:
        """The engine of `generate_async`, started on first use (after a `generate` call in progress ends)."""
        with self._executor_lock:
            if self._engine is None or not self._engine.running:
                from .async_engine import AsyncEngine

                self._engine = AsyncEngine(self, max_queue_size=1 << 20)  # callers queue without limit, as generate
                self._engine.start()
            return self._engine

    def _stop_engine(self) -> None:
        if self._engine is None:
            return
        if self._engine.stats()["live"]:
            raise RuntimeError("generate() cannot run while generate_async requests are in flight; await them first")
        self._engine.stop(drain_timeout=0.0)
        self._engine = None


class AsyncRequestOutput:
    """The result of `LLM.generate_async`: awaitable (the final `RequestOutput`) and async-iterable
    (partial `RequestOutput`s with ``finished=False``, then the final one, when streaming).

    Attributes:
        prompt: the prompt text (``None`` for token ids).
        prompt_token_ids: the prompt's ids.
        finished: whether the final output has been produced.
    """

    def __init__(self, llm: LLM, prompt: str | None, ids: list[int], params: SamplingParams, streaming: bool) -> None:
        self._llm = llm
        self.prompt = prompt
        self.prompt_token_ids = ids
        self._params = params
        self._streaming = streaming
        self._stream: Any = None
        self._final: RequestOutput | None = None
        self._iterating = False
        self.finished = False

    async def _submit(self) -> Any:
        if self._stream is None:
            from .async_engine import GenerationRequest

            engine = self._llm._async_engine()
            gen = GenerationRequest(self.prompt_token_ids, self._params, self._params.stop_strings)
            self._stream = await engine.submit([gen])
        return self._stream

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        if self._final is not None:
            yield self._final
            return
        if self._iterating:
            raise RuntimeError("this output is already being iterated")
        self._iterating = True
        stream = await self._submit()
        text: list[str] = []
        ids: list[int] = []
        lps: list = []
        reason = None
        try:
            async for d in stream:
                reason = d.finish_reason or reason
                if d.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {d.error}")
                text.append(d.text)
                ids.extend(d.token_ids)
                if d.logprobs is not None:
                    lps.extend(d.logprobs)
                if d.finish_reason is None and self._streaming and d.token_ids:
                    comp = CompletionOutput(
                        0, "".join(text), list(ids), None, logprobs=list(lps) if d.logprobs is not None else None
                    )
                    yield RequestOutput(stream.request_ids[0], self.prompt, self.prompt_token_ids, [comp], False)
        finally:
            stream.abort()  # the caller stopped iterating early: free the request's pages now
        req = stream.requests[0]
        if self._params.stop:
            # The engine cut the text before the stop string and dropped the tokens after it; so does the result.
            del req.tokens[len(req.prompt_ids) + len(ids) :]
            if reason == "stop":
                req.finish_reason = FinishReason.STOP
        self._final = self._llm._output(req, self.prompt)
        if self._params.stop:
            self._final.outputs[0].text = "".join(text)
        self.finished = True
        yield self._final

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def aresult(self) -> RequestOutput:
        """The final `RequestOutput` (waits for the request to finish)."""
        async for out in self._outputs():
            last = out
        return last

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self.aresult().__await__()

    def abort(self) -> None:
        """Stop the request (its output ends with ``finish_reason`` ``"abort"``)."""
        if self._stream is not None:
            self._stream.abort()


def _split_args(prompts: object, sampling_params: object) -> tuple[bool, list[object], list[SamplingParams]]:
    """``generate``'s arguments as (single prompt?, prompts, one SamplingParams per prompt), refusing what
    is neither a prompt nor a list of prompts, and sampling params that are not `SamplingParams`."""
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (str, Sequence)):
        raise TypeError(
            "prompts must be a string, a list of token ids, or a list of strings / token-id lists; got "
            f"{type(prompts).__name__}"
        )
    # A flat list of numbers is one token-id prompt (floats and bools are rejected in _encode).
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, float)))
    plist: list = [prompts] if single else list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or SamplingParams()] * len(plist)
    elif isinstance(sampling_params, (list, tuple)):
        bad = [p for p in sampling_params if not isinstance(p, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params: expected SamplingParams items, got {type(bad[0]).__name__}")
        params = list(sampling_params)
        if len(params) != len(plist):
            raise ValueError(f"sampling_params: {len(params)} given for {len(plist)} prompts (give one, or one each)")
    else:
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
            f"{type(sampling_params).__name__}"
        )
    return single, plist, params


SMALL_MODEL_PARAMS = 50_000_000


def configure_cpu_threads(num_threads: int | None, model: torch.nn.Module | None) -> int:
    """Set torch's intra-op threads (see `LLM`'s ``num_threads``); returns the count in force."""
    if num_threads is None:
        num_threads = envs.NUM_THREADS.get()
    if num_threads is None and model is not None and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        num_threads = 1
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def _stack(rows: list[torch.Tensor], vocab: int) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.empty(0, vocab)

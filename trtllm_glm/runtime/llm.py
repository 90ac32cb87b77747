"""An LLM API shaped like TensorRT-LLM's: ``LLM(model=..., kv_cache_config=...)`` and ``generate()``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..models.glm5_next import Glm5NextForCausalLM
from .executor import Executor, ExecutorConfig
from .request import Request
from .sampling import SamplingParams
from .tokenizer import load_tokenizer

__all__ = ["LLM", "KvCacheConfig", "CompletionOutput", "RequestOutput"]


@dataclass
class KvCacheConfig:
    """Paged cache sizing (TensorRT-LLM's name).

    Attributes:
        tokens_per_block: tokens per page (multiple of 4).
        max_tokens: tokens the page pool holds over all requests (``None``: ``max_batch_size *
            max_seq_len``, every request at full length).
    """

    tokens_per_block: int = 16
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.tokens_per_block % 4:
            raise ValueError(f"tokens_per_block must be a positive multiple of 4, got {self.tokens_per_block}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


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
    # Top-2 logit gap behind each output token (near-tie checks, DESIGN §7).
    logit_gaps: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """Offline generation with a Glm5Next model.

    Args:
        model: a preset name (``"tiny"``: the embedded seeded tiny model) or a checkpoint directory.
        kv_cache_config: paged cache sizing.
        max_batch_size: sequences per step.
        max_num_tokens: flat rows per step (prefill chunks are cut to fit).
        max_seq_len: longest prompt + output.
        dtype: parameter dtype (default: the checkpoint's ``torch_dtype``).
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        seed: seed of preset weights and of sampling without a per-request seed.
        prefill_chunk_size: cap on a prefill chunk.
        tokenizer: a tokenizer object (``encode``/``decode``) overriding the model's.
        speculative_config: `MTPDecodingConfig` or `NGramDecodingConfig` (None: no speculation).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        kv_cache_config: KvCacheConfig | None = None,
        max_batch_size: int = 8,
        max_num_tokens: int = 512,
        max_seq_len: int = 2048,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        seed: int = 0,
        prefill_chunk_size: int | None = None,
        tokenizer: object | None = None,
        speculative_config: object | None = None,
    ) -> None:
        kv = kv_cache_config or KvCacheConfig()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = Glm5NextForCausalLM.from_pretrained(model, dtype=dtype, device=self.device, seed=seed)
        self.config = self.model.config
        self.tokenizer = tokenizer or load_tokenizer(model, self.config)
        max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.executor_config = ExecutorConfig(
            tokens_per_block=kv.tokens_per_block,
            max_tokens=kv.max_tokens or max_batch_size * max_seq_len,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            prefill_chunk_size=prefill_chunk_size,
        )
        self.seed = seed
        self.speculative_config = speculative_config
        self.executor = self._make_executor()

    def _make_executor(self) -> Executor:
        if self.speculative_config is None:
            return Executor(self.model, self.executor_config, seed=self.seed)
        from ..speculative.config import MTPDecodingConfig, NGramDecodingConfig
        from ..speculative.executor import SpeculativeExecutor

        if not isinstance(self.speculative_config, (MTPDecodingConfig, NGramDecodingConfig)):
            raise TypeError(
                f"speculative_config must be MTPDecodingConfig or NGramDecodingConfig, "
                f"got {type(self.speculative_config).__name__}"
            )
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
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        plist: list = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"{len(params)} sampling params for {len(plist)} prompts")
        else:
            params = [sampling_params or SamplingParams()] * len(plist)

        encoded: list[tuple[str | None, list[int]]] = []
        for p in plist:
            if isinstance(p, str):
                encoded.append((p, self.tokenizer.encode(p)))  # type: ignore[attr-defined]
            else:
                encoded.append((None, [int(t) for t in p]))
        # Validate every prompt before queueing any, so a bad one loses nothing.
        ex = self.executor
        reqs: list[Request] = []
        try:
            for (_, ids), sp in zip(encoded, params):
                reqs.append(ex.add_request(ids, sp))
        except Exception:
            for r in reqs:
                ex.waiting.remove(r)
            raise
        steps = 0
        while ex.has_work:
            ex.step()
            steps += 1
            if progress is not None:
                progress(sum(len(r.output_ids) for r in reqs), steps)
        outs = [self._output(r, text) for r, (text, _) in zip(reqs, encoded)]
        return outs[0] if single else outs

    def _output(self, r: Request, prompt: str | None) -> RequestOutput:
        out = r.output_ids
        rounds = r.num_verify_rounds
        comp = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(out),  # type: ignore[attr-defined]
            token_ids=list(out),
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            num_draft_rounds=rounds,
            mean_accepted_length=(r.num_accepted_total / rounds) if rounds else 0.0,
            acceptance_per_position=[
                a / p if p else 0.0 for a, p in zip(r.accepted_per_position, r.proposed_per_position)
            ],
            logit_gaps=list(r.logit_gaps),
        )
        return RequestOutput(r.request_id, prompt, list(r.prompt_ids), [comp])

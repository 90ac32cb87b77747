"""Requests as the runtime tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import Logprob, SamplingParams

__all__ = ["Request", "RequestState", "FinishReason"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # aborted by the caller (a client that went away)


@dataclass
class Request:
    """One generation request.

    ``tokens`` is the prompt followed by every emitted token; ``num_computed`` of them are in the cache.
    The rows still to feed are ``tokens[num_computed:]``: one row (the last emitted token) for a plain
    decode, several for a prefill chunk or a resumed (recomputed) request.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # Top-2 logit gap of the distribution each output token was sampled from (near-tie checks).
    logit_gaps: list[float] = field(default_factory=list)
    # Speculative decoding statistics (filled by the speculative executor).
    draft_tokens_proposed: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    num_verify_rounds: int = 0
    num_accepted_total: int = 0
    # What SamplingParams asked to return (filled as tokens are emitted / prompt rows computed).
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    context_logits: list[torch.Tensor] = field(default_factory=list)
    # Prompt rows whose context logits / prompt logprobs are recorded (a resumed request recomputes its
    # prompt; those rows are not recorded twice).
    prompt_rows_recorded: int = 0
    # Prefix caching: prompt tokens restored from a checkpoint at admission (not computed), the match
    # found for the next admission (cleared if the request is not admitted), and the content keys of the
    # request's pages computed so far (docs/design.md §6.4).
    num_cached_tokens: int = 0
    prefix_hit: Any = None
    page_keys: list[bytes] = field(default_factory=list)
    # Logical pages of the current allocation already offered for sealing (reset when pages are freed).
    pages_sealed: int = 0
    # The ids that finish this request (`SamplingParams.stop_ids` with the model's EOS), set on first use.
    stop_id_set: set[int] | None = field(default=None, repr=False)
    # Where its time went (``time.perf_counter`` seconds; `trtllm_glm.runtime.step_log.RequestTiming`): queued
    # by ``add_request``, first admitted, first output token read back; prefill steps before that token.
    t_queued: float = 0.0
    t_admitted: float | None = None
    t_first_token: float | None = None
    num_prefill_steps: int = 0
    # Structured output: the request's `trtllm_glm.runtime.grammar.RequestGrammar` (None: unconstrained), set
    # at `Executor.add_request` and advanced over every emitted token.
    grammar: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt must hold at least one token")
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        """``len(output_ids)`` without copying them."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def wants_logits(self) -> bool:
        """Whether emitted tokens need their distributions (logprobs or generation logits)."""
        p = self.params
        return p.logprobs is not None or p.return_generation_logits

    @property
    def has_grammar(self) -> bool:
        """Whether tokens are chosen under a grammar's mask, filled on the host: such a request's logits rows are
        masked before sampling, so a step launched ahead chooses its tokens only once the step before it was read
        back (`Executor._choose_under_grammar`), and its verify rows never run as a graph that accepts drafts on
        the device."""
        return self.grammar is not None

    @property
    def num_pending(self) -> int:
        """Rows not yet in the cache."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_pending == 1

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

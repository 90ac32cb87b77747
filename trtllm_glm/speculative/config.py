"""Speculative decoding configuration, shaped like TensorRT-LLM's ``*DecodingConfig`` classes.

Every config names its drafts per round ``max_draft_len`` (TensorRT-LLM's name); `MTPDecodingConfig` also takes
its old name, ``num_nextn_predict_layers`` (which in the model config counts MTP layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = ["DecodingBaseConfig", "MTPDecodingConfig", "NGramDecodingConfig", "SpeculativeConfig", "DRAFT_KV_MODES"]

DRAFT_KV_MODES = ("shared", "separate")

MAX_MTP_DRAFTS = 5
MAX_PARALLEL_DRAFTS = 7
# The longest MTP catch-up lag (`MTPDecodingConfig.catchup_lag`): its hidden rows are held per state slot.
MAX_CATCHUP_LAG = 256


@dataclass
class DecodingBaseConfig:
    """What every decoding config holds (TensorRT-LLM's ``DecodingBaseConfig``); a new drafter's config subclasses
    it (`speculative.registry`).

    Attributes:
        max_draft_len: drafts per round, ``1 .. MAX_DRAFT_LEN``.
        adaptive: choose each round's draft length with an `AdaptiveDraftPolicy`; None (default): as
            `adaptive_for` decides for the executor (the drafter's own default, `ADAPTIVE_AUTO`).
    """

    # Per-request adaptive width: called with the request each round, returns the drafts to propose
    # (0 = a width-one round); None keeps the configured maximum. Each width is its own graph shape.
    draft_len_fn: Callable[[object], int] | None = None
    # TensorRT-LLM's ``DecodingBaseConfig.max_concurrency``: rounds whose decode batch holds more requests
    # than this run width one (no drafts); None speculates at every batch size.
    max_concurrency: int | None = None
    max_draft_len: int = 1
    adaptive: bool | None = None

    # What ``adaptive=None`` means where a round's cost is measured on a GPU's CUDA graphs (`adaptive_for`); off for
    # drafters whose policy has not been measured there.
    ADAPTIVE_AUTO: ClassVar[bool] = False
    # The most drafts per round the config accepts (and the CLI's ``--draft-len`` range).
    MAX_DRAFT_LEN: ClassVar[int] = MAX_PARALLEL_DRAFTS
    # Deprecated keyword -> field names the constructor (and the YAML) still take (`_renamed`).
    ALIASES: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self._check_common()

    def _check_common(self) -> None:
        """Checks every config shares: ``max_draft_len``, ``adaptive``, ``max_concurrency``."""
        k, top = self.max_draft_len, self.MAX_DRAFT_LEN
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= top:
            raise ValueError(f"max_draft_len must be in [1, {top}], got {k!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool or None (the drafter's default), got {self.adaptive!r}")
        mc = self.max_concurrency
        if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or mc <= 0):
            raise ValueError(f"max_concurrency must be None or a positive int, got {mc!r}")

    def adaptive_for(self, *, cuda_graphs: bool, parallel: bool = False) -> bool:
        """Whether an executor runs the adaptive draft-length policy: ``adaptive`` when set; by default
        (``None``) `ADAPTIVE_AUTO` where the steps replay CUDA graphs on a GPU (the policy's costs are measured
        wall times; emulated graphs on the CPU are not) and no ``draft_len_fn`` chooses the lengths itself, never in
        a parallel world (each rank's clock would choose differently; the ranks must draft in lockstep)."""
        if parallel:
            return False
        if self.adaptive is not None:
            return self.adaptive
        return self.ADAPTIVE_AUTO and cuda_graphs and self.draft_len_fn is None


_C = TypeVar("_C", bound=type)


def _renamed(old: str, new: str) -> Callable[[_C], _C]:
    """Class decorator: the dataclass's constructor also takes ``old=`` for ``new=`` and reading ``old`` gives
    ``new``, so that code and YAML files written with the old name keep working. Not a field: `dataclasses.replace`,
    equality and repr see ``new`` only."""

    def wrap(cls: _C) -> _C:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if old in kwargs:
                v = kwargs.pop(old)
                if new in kwargs and kwargs[new] != v:
                    raise ValueError(f"{old} is the old name of {new}: give one of them, got {v!r} and {kwargs[new]!r}")
                kwargs[new] = v
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        setattr(cls, old, property(lambda self: getattr(self, new), doc=f"The old name of ``{new}``."))
        cls.ALIASES = {**cls.ALIASES, old: new}  # type: ignore[attr-defined]
        return cls

    return wrap


@_renamed("num_nextn_predict_layers", "max_draft_len")
@dataclass
class MTPDecodingConfig(DecodingBaseConfig):
    """Speculate with the model's MTP layer, chained for ``max_draft_len`` drafts.

    Attributes:
        max_draft_len: drafts per round (1..5), the MTP layer applied that many times. The constructor and
            the YAML also take its old name, ``num_nextn_predict_layers``.
        draft_kv_mode: ``"shared"`` (the MTP layer's pages live in the target manager: one more sparse
            layer in the same slot space) or ``"separate"`` (its own draft KV manager and page pool).
        draft_max_tokens: page-pool size of the separate draft manager (default: the target's).
        index_share_for_mtp_iteration: chained MTP steps (2nd draft on) reuse step 0's top-k pools and
            attend every token since step 0's open pool instead of re-running the indexer's scoring;
            ``None`` takes the model config's ``index_share_for_mtp_iteration``. Drafts only: output
            stays lossless either way.
        max_concurrency: speculate only while the decode batch holds at most this many requests (None:
            always). Above it a round drafts nothing and verifies nothing, but the MTP layer still catches up
            on each committed token, so drafting resumes as soon as the batch shrinks.
        draft_vocab_size: the draft steps score only this many most frequent token ids (FR-Spec style: a
            ``[N, D]`` slice of the LM head made once at load; `speculative.draft_vocab`); verification keeps
            the full vocabulary, so the output is unchanged. None (default): the full vocabulary. Needs a
            token-frequency ranking: ``draft_vocab_file``, or the checkpoint's ``token_frequency.json``.
        draft_vocab_file: the token-frequency ranking (JSON, `speculative.draft_vocab.load_token_ranking`) for
            ``draft_vocab_size``; None takes the checkpoint's own.
        draft_head_fp8: the draft steps' LM head (the full vocabulary's, or ``draft_vocab_size``'s rows) as a
            block-FP8 copy (128 x 128 tiles, `quant.fp8`) read by the FP8 linear: half the bytes of a bf16 head per
            draft step, where the head is most of a draft step's cost at real geometry. Verification keeps the
            model's own head, so the output is unchanged; only which drafts are proposed may change (near ties of
            the draft head). Costs ``N x D`` bytes of GPU memory for the copy (the full vocabulary: half a bf16
            head). Off by default (not yet measured on a GPU).
        adaptive: each round's draft length (``0 .. max_draft_len``; under CUDA graphs 0 or ``K``) is chosen by an
            `AdaptiveDraftPolicy` from the decode batch size, the measured round costs and the running acceptance,
            down to 0 where speculation cannot pay. Default (None): on where the steps replay CUDA graphs on a GPU
            (`DecodingBaseConfig.adaptive_for`; not in a parallel world), off elsewhere; True / False force it. On an
            H100 (trained ``small``, bf16, overlap scheduler, 384 tokens, 2026-12-08, graphs uploaded at capture) it ran
            at batch 1 0.94x fixed K = 3 (1.67x plain decoding), at batch 16 0.90x plain (fixed K = 3: 0.83-0.94x); at
            batch 64 (2026-12-07) 0.74x plain (fixed K = 3: 0.61x): its K = 0 rounds there still cost more than plain
            steps (docs/speculation.md, "Adaptive draft length").
        overlap_rounds: under the overlap scheduler, launch each drafting round (its fused MTP draft and its
            verify) from the previous round's outputs on the device before that round is read back (issue 43
            item 1). Off by default: on an H100 (trained ``small``, bf16, batch 1) a round launched ahead costs
            1.84 ms against 1.68 ms synchronously (1,756 against 1,923 tokens/s): the ahead path is host-bound, its
            device-side re-description of the round adding 34 small launches to the GPU's 0.95 ms
            (`benchmarks/results/profiles/mtp_round_ahead_profile_small_h100_2026-12-06.log`).
        early_draft: launch each round's fused MTP draft right behind its verify, from the verify's outputs on the
            device (its accepted counts read there), before the host reads the round back; the host then books the
            drafts instead of preparing and launching the draft after the read-back, so the GPU runs the verify and
            the next draft back to back while the host reads the verify back (the next verify is still prepared
            after the read-back). For a steady batch of greedy requests drafting K (with the adaptive policy: while
            its last choice was K); other rounds draft after the read-back. On by default: on an H100 (trained
            ``small``, bf16, overlap scheduler on) 1,382 -> 2,198 tokens/s at batch 1 (1.27x plain decoding),
            18,490 -> 22,635 at 16, 44,902 -> 49,978 at 64
            (`benchmarks/results/spec/spec_default_small_h100_2026-12-06.log`). Drafts only: output unchanged.
        catchup_lag: in rounds where nobody drafts (an adaptive length of 0, ``max_concurrency``), the MTP layer
            may fall behind the committed tokens by up to this many rows per request: their target hidden rows
            are kept on the device and the MTP layer catches up on them in one forward when drafting resumes or
            the lag is full, instead of one MTP forward (a launch and its host work) per step. Such rounds then
            cost about a plain decode step where the GPU bounds it (the real4 slice, batch 1 / 16, H100); at batch 64 of
            ``small``, host-bound, 1.35x (2026-12-07, docs/speculation.md). 0 catches up every step. Drafts only: output
            is unchanged either way.
    """

    max_draft_len: int = 1
    draft_kv_mode: str = "shared"
    draft_max_tokens: int | None = None
    index_share_for_mtp_iteration: bool | None = None
    draft_vocab_size: int | None = None
    draft_vocab_file: str | None = None
    draft_head_fp8: bool = False
    overlap_rounds: bool = False
    early_draft: bool = True
    catchup_lag: int = 64

    MAX_DRAFT_LEN: ClassVar[int] = MAX_MTP_DRAFTS
    ADAPTIVE_AUTO: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._check_common()
        lag = self.catchup_lag
        if not isinstance(lag, int) or isinstance(lag, bool) or not 0 <= lag <= MAX_CATCHUP_LAG:
            raise ValueError(f"catchup_lag must be an int in [0, {MAX_CATCHUP_LAG}], got {lag!r}")
        if self.draft_kv_mode not in DRAFT_KV_MODES:
            raise ValueError(f"draft_kv_mode must be one of {DRAFT_KV_MODES}, got {self.draft_kv_mode!r}")
        if self.draft_max_tokens is not None and self.draft_max_tokens <= 0:
            raise ValueError("draft_max_tokens must be positive")
        n = self.draft_vocab_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
            raise ValueError(f"draft_vocab_size must be None (the full vocabulary) or a positive int, got {n!r}")
        f = self.draft_vocab_file
        if f is not None and (not isinstance(f, str) or not f):
            raise ValueError(f"draft_vocab_file must be None or a file path, got {f!r}")
        if f is not None and n is None:
            raise ValueError("draft_vocab_file is the ranking of draft_vocab_size: set draft_vocab_size too")
        if not isinstance(self.draft_head_fp8, bool):
            raise ValueError(f"draft_head_fp8 must be a bool, got {self.draft_head_fp8!r}")
        if not isinstance(self.overlap_rounds, bool):
            raise ValueError(f"overlap_rounds must be a bool, got {self.overlap_rounds!r}")
        if not isinstance(self.early_draft, bool):
            raise ValueError(f"early_draft must be a bool, got {self.early_draft!r}")


@dataclass
class NGramDecodingConfig(DecodingBaseConfig):
    """Prompt-lookup (n-gram) parallel drafting: up to ``max_draft_len`` tokens that followed the latest
    earlier occurrence of the sequence's longest matching suffix. Needs no extra weights, so it drives wide
    (DFlash-width) verification.

    Attributes:
        max_draft_len: drafts per round (1..7).
        max_matching_ngram_size: longest suffix tried first.
        min_matching_ngram_size: shortest suffix accepted as a match.
        max_concurrency: speculate only while the decode batch holds at most this many requests (None:
            always); larger batches run plain width-one rounds, where verifying drafts costs more than it saves.
        adaptive: choose each round's draft length with an `AdaptiveDraftPolicy` (as MTP's option; off by
            default here: prompt-lookup acceptance swings between requests and rounds far more than MTP's).
    """

    max_draft_len: int = 4
    max_matching_ngram_size: int = 4
    min_matching_ngram_size: int = 1

    MAX_DRAFT_LEN: ClassVar[int] = MAX_PARALLEL_DRAFTS

    def __post_init__(self) -> None:
        self._check_common()
        if not 1 <= self.min_matching_ngram_size <= self.max_matching_ngram_size:
            raise ValueError("need 1 <= min_matching_ngram_size <= max_matching_ngram_size")


# Any registered decoding config (`speculative.registry`); the name the executor's signature kept.
SpeculativeConfig = DecodingBaseConfig

"""Sampling parameters and the token sampler.

`SamplingParams` follows the shape of TensorRT-LLM's LLM-API ``SamplingParams`` (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``end_id``, ``ignore_eos``) but defaults
to greedy decoding (``temperature=0``), which is what the losslessness checks of speculative decoding need.

`Sampler` applies temperature, then top-k, then top-p, and draws from each request's own CPU generator,
so a seeded request produces the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..logits import draw_reference, filter_sorted, greedy_top2, sample_rows
from ..transfer import to_device
from .grammar import GuidedDecodingParams

__all__ = [
    "SamplingParams",
    "GuidedDecodingParams",
    "Sampler",
    "Logprob",
    "top2_gap",
    "make_generator",
    "token_logprobs",
]

# Top logprobs returned per token at most (a bound so that one request cannot ask for the whole vocabulary).
MAX_LOGPROBS = 20
# Most completions per prompt (OpenAI's own bound) and stop strings one request may ask for (API and server).
MAX_N = 128
MAX_STOP_STRINGS = 16
# Temperatures below this are greedy (vLLM's rule, ``_SAMPLING_EPS``): ``logits / T`` overflows FP32 long before
# T reaches 0 (T = 1e-300 divided by zero in FP32 and drew the vocabulary's last id), and the distribution is
# the argmax's to within rounding well before that.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution (``log_softmax`` of the logits,
    before temperature / top-k / top-p) and its rank in that distribution (1 = most likely)."""

    logprob: float
    rank: int


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request decoding controls.

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 (or below 1e-5, vLLM's rule) means greedy (argmax, ties to the lower id); above, samples
            from ``softmax(logits / T)``. Any finite value >= 0 (TensorRT-LLM's range; the server, as OpenAI's
            API, refuses more than 2).
        top_p: nucleus mass in ``(0, 1]``; 1 disables it.
        top_k: keep the ``k`` most likely tokens (ties to the lower id); 0 (or -1, vLLM's spelling) disables it.
        seed: seeds the request's own generator; ``None`` draws from torch's global RNG.
        stop_token_ids: extra ids that end the request (the stop token is kept in the output).
        end_id: end-of-sequence id overriding the model's EOS ids; ``None`` uses the model's.
        ignore_eos: never stop on EOS / ``end_id`` (``stop_token_ids`` still apply).
        logprobs: return, per generated token, the logprob of the chosen token plus the ``logprobs`` most
            likely tokens (0 = the chosen token only; at most 20); ``None`` returns none.
        prompt_logprobs: the same for every prompt token after the first (``None``: none).
        return_context_logits: return ``[prompt_len, vocab]`` FP32 logits of the prompt rows.
        return_generation_logits: return ``[num_generated, vocab]`` FP32 logits each output token was
            chosen from.
        guided_decoding: structured output (`GuidedDecodingParams`: a JSON schema, any JSON object, a regex
            or a grammar): every token is chosen among those that keep the output inside it, and end of
            sequence only where the output is complete (runtime/grammar.py). Logprobs and generation logits
            stay those of the model's raw distribution.
    """

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    end_id: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # TensorRT-LLM's / vLLM's: completions per prompt (`LLM.generate`; choice i of n draws with seed + i when a
    # seed is given) and stop strings (the text is cut before the first one and the request ends, finish
    # reason "stop"; tokens after the one that completed it are dropped).
    n: int = 1
    # TensorRT-LLM's / vLLM v0's: generate best_of completions per prompt (`LLM.generate`) and return the n with the
    # highest cumulative logprob (the chosen tokens' logprobs under the raw distribution), best first.
    best_of: int | None = None
    stop: str | list[str] | None = None
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = disabled), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0  # the same as the server: -1 and 0 both mean off
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        b = self.best_of
        if b is not None and (not _is_int(b) or not self.n <= b <= MAX_N):
            raise ValueError(f"best_of must be None or an int in [n={self.n}, {MAX_N}], got {b!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None:
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            if len(stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
            for i, s in enumerate(stop):
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(
                        f"stop[{i}]: not valid Unicode text (a lone surrogate at character {e.start})"
                    ) from None
            self.stop = list(stop)
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            bad = [i for i in ids if not _is_int(i) or i < 0]
            if bad:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {bad!r}")
            self.stop_token_ids = ids
        if self.end_id is not None and (not _is_int(self.end_id) or self.end_id < 0):
            raise ValueError(f"end_id must be None or a non-negative int, got {self.end_id!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("return_context_logits", "return_generation_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        g = self.guided_decoding
        if g is not None:
            if not isinstance(g, GuidedDecodingParams):
                raise ValueError(f"guided_decoding must be a GuidedDecodingParams or None, got {type(g).__name__}")
            g.validate()

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty without any)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature`` 0 (or below `GREEDY_TEMPERATURE`), or ``top_k == 1`` (which leaves a
        single candidate)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def stop_ids(self, eos_ids: Iterable[int] = ()) -> set[int]:
        """Ids that finish this request: ``stop_token_ids`` plus ``end_id`` (else ``eos_ids``) unless ``ignore_eos``.

        Args:
            eos_ids: the model's EOS ids (``Glm5NextConfig.eos_token_ids``).
        """
        out = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            out |= {self.end_id} if self.end_id is not None else set(eos_ids)
        return out


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's CPU generator: seeded from ``params.seed``, or ``None`` for the global RNG."""
    if params.seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(params.seed)


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """Per row: the chosen token's `Logprob` plus those of the ``k`` most likely tokens.

    Args:
        logits: ``[n, V]`` raw logits.
        chosen: ``n`` token ids (the emitted or the next prompt token).
        k: top tokens per row (0: the chosen one only).

    Returns:
        ``n`` dicts ``{token_id: Logprob}`` (the chosen token first, then by rank; ties rank by lower id).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    n = lp.shape[0]
    if n == 0:
        return []
    idx = torch.tensor(list(chosen), dtype=torch.long, device=lp.device)
    picked = lp.gather(1, idx[:, None])[:, 0]
    # Rank = 1 + number of strictly better tokens (an exact tie shares the better rank).
    ranks = (lp > picked[:, None]).sum(-1) + 1
    # A stable sort (not topk) so that equal logprobs list the lower id first on every device.
    top_v, top_i = torch.sort(lp, dim=-1, descending=True, stable=True)
    top_v, top_i = top_v[:, :k], top_i[:, :k]
    picked_l, ranks_l, top_v_l, top_i_l = picked.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    out: list[dict[int, Logprob]] = []
    for r in range(n):
        d = {int(chosen[r]): Logprob(picked_l[r], int(ranks_l[r]))}
        for j, (t, v) in enumerate(zip(top_i_l[r], top_v_l[r])):
            d.setdefault(int(t), Logprob(v, j + 1))
        out.append(d)
    return out


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Difference between the largest and second-largest logit of each row (0 for an exact tie).

    Args:
        logits: ``[B, V]`` with ``V >= 2``.

    Returns:
        ``[B]`` fp32, non-negative.
    """
    if logits.dim() != 2 or logits.shape[1] < 2:
        raise ValueError(f"top2_gap needs logits of shape [B, V>=2], got {tuple(logits.shape)}")
    return greedy_top2(logits)[1]


class Sampler:
    """Chooses one token per row from final logits."""

    top2_gap = staticmethod(top2_gap)

    @torch.no_grad()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pick the next token of every row.

        Greedy rows take the argmax (``torch.argmax`` returns the first maximum, i.e. the lower id). The other
        rows are filtered together (`_filter`: ``logits / T``, keep the ``top_k`` best in stable order, ties to
        the lower id, then the smallest prefix whose renormalised mass reaches ``top_p``, at least one token;
        every operation is row-wise, so no row depends on its neighbours), and each inverts its kept tokens'
        cumulative distribution at one uniform drawn from the row's CPU generator (in row order). One number
        per row comes from the CPU, so a seed gives the same draw on every device (short of the uniform
        landing within rounding of a boundary), and nothing waits for the device: the filtering, the
        cumulative sums and the search stay where the logits are, in a fixed number of launches however many
        rows sample. (A multinomial draw on the CPU, as before, costs ~3 ms per row at a 155K vocabulary.)

        Args:
            logits: ``[B, V]`` (fp32 expected; other float dtypes are upcast).
            params: ``B`` sampling parameters.
            generators: ``B`` CPU generators or ``None`` (global RNG); only non-greedy rows consume draws.
            greedy: optional ``[B]`` int64 ``torch.argmax(logits, -1)`` when the caller has it already (a
                replayed graph computed it).

        Returns:
            ``[B]`` int64 token ids on ``logits``' device.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        if len(params) != B or len(generators) != B:
            raise ValueError(f"got {B} logit rows but {len(params)} params and {len(generators)} generators")
        logits = logits.float()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) == B:  # every row is drawn (or none is there)
            out = torch.empty(B, dtype=torch.long, device=logits.device)
        elif greedy is not None:
            out = greedy.clone()
        else:
            out = torch.argmax(logits, dim=-1)
        if rows:
            # One uniform per sampled row, in row order (the generators are the requests' own).
            u = [torch.rand((), dtype=torch.float64, generator=generators[i]).item() for i in rows]
            sub = [params[i] for i in rows]
            rp = self._row_params(sub, u, logits.device, rows)
            # The rows' draws written into ``out`` (`trtllm_glm.logits.sample_rows`: the reference, or with
            # TRTLLM_GLM_SAMPLING_BACKEND=triton two launches for rows with top-k <= 256).
            out = sample_rows(logits, rp, out, top_k=[p.top_k for p in sub], top_p=any(p.top_p < 1.0 for p in sub))
        return out

    @staticmethod
    def filtered_probs(row: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k and top-p on one row (the reference view of `_filter`; it syncs once).

        Args:
            row: ``[V]`` fp32 logits.
            p: non-greedy parameters.

        Returns:
            ``(ids [n], probs [n])``: the kept token ids in descending-probability order (ties to the
            lower id) and their renormalised probabilities (fp32, summing to 1).
        """
        ids, probs, keep = Sampler._filter(row[None], [p], Sampler._row_params([p], [0.0], row.device))
        n = int(keep.sum().item())  # a prefix: the mass before a token only grows
        return ids[0, :n], probs[0, :n] / probs[0, :n].sum()

    @staticmethod
    def _row_params(
        params: Sequence[SamplingParams], u: Sequence[float], device: torch.device, rows: Sequence[int] | None = None
    ) -> torch.Tensor:
        """``[R, 5]`` fp64 on ``device`` (one copy): per row the uniform, temperature, top-p (``inf`` when off, so
        that rounding of a full cumulative sum cannot cut the tail), top-k (the vocabulary when off) and the row's
        index in the logits (``rows``, default ``0 .. R - 1``)."""
        vals: list[float] = []
        for i, (p, x) in enumerate(zip(params, u)):
            top_p = p.top_p if p.top_p < 1.0 else math.inf
            vals += [x, p.temperature, top_p, p.top_k if p.top_k > 0 else math.inf, rows[i] if rows else i]
        return to_device(vals, device, torch.float64).view(-1, 5)

    @staticmethod
    def _filter(
        rows: torch.Tensor, params: Sequence[SamplingParams], rp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Temperature, top-k and top-p on ``rows`` ``[R, V]`` (`trtllm_glm.logits.filter_sorted`; ``params`` only
        skip the masks nobody asked for)."""
        return filter_sorted(rows, rp, top_k=any(p.top_k > 0 for p in params), top_p=any(p.top_p < 1.0 for p in params))

    @staticmethod
    def _draw(rows: torch.Tensor, params: Sequence[SamplingParams], u: Sequence[float]) -> torch.Tensor:
        """One token per row of ``rows`` ``[R, V]``, each at its uniform in ``u`` (``R`` floats in [0, 1)): the
        torch reference (`trtllm_glm.logits.draw_reference`), whatever the sampling backend.

        Returns:
            ``[R]`` int64 token ids on ``rows``' device.
        """
        rp = Sampler._row_params(params, u, rows.device)
        return draw_reference(
            rows, rp, top_k=any(p.top_k > 0 for p in params), top_p=any(p.top_p < 1.0 for p in params)
        )

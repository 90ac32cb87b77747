"""A restricted draft vocabulary (FR-Spec style): MTP draft steps score only the most frequent tokens.

`DraftVocab` holds a ``[N, D]`` copy of the head's rows of the ``N`` most frequent ids, made once when the executor is
built (graphs captured on it keep a fixed address), and maps each draft's argmax in that subset back to its full id.
Verification scores the full vocabulary, so the output is unchanged. The ranking comes from `TOKEN_FREQUENCY_FILE`
beside a checkpoint or ``MTPDecodingConfig.draft_vocab_file`` (`load_token_ranking`); a size with no ranking is
refused (`resolve_draft_vocab`): a made-up ranking would silently drop acceptance. docs/speculation.md, "Restricted
draft vocabulary".
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from torch import nn

from ..linear import model_linear
from ..quant.fp8 import dequantize_block_fp8

__all__ = ["TOKEN_FREQUENCY_FILE", "DraftVocab", "load_token_ranking", "resolve_draft_vocab", "subset_ids"]

# The ranking's file name inside a checkpoint directory.
TOKEN_FREQUENCY_FILE = "token_frequency.json"


def load_token_ranking(path: str | os.PathLike[str]) -> list[int]:
    """Token ids, most frequent first, from a token-frequency file.

    The file is a JSON object with ``"ranking"``: a list of distinct non-negative token ids, most frequent first
    (other keys, e.g. ``"counts"`` and ``"source"``, document where it came from and are not read).

    Raises:
        ValueError: unreadable file, no ``ranking`` list, or ids that are not distinct non-negative ints.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"token-frequency file {os.fspath(path)!r}: cannot read it ({e})") from None
    ranking = data.get("ranking") if isinstance(data, dict) else None
    if not isinstance(ranking, list) or not ranking:
        raise ValueError(
            f"token-frequency file {os.fspath(path)!r}: expected an object with a non-empty 'ranking' list"
        )
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ranking):
        raise ValueError(f"token-frequency file {os.fspath(path)!r}: 'ranking' must hold non-negative int ids")
    if len(set(ranking)) != len(ranking):
        raise ValueError(f"token-frequency file {os.fspath(path)!r}: 'ranking' repeats an id")
    return ranking


def subset_ids(ranking: Sequence[int], size: int, vocab_size: int) -> list[int]:
    """The ``size`` most frequent ids of ``ranking`` that exist in a ``vocab_size`` vocabulary, ascending.

    Ascending order makes the subset's argmax break ties as the full vocabulary's does (lowest id first), so a
    draft whose full-vocabulary argmax lies in the subset is the same draft.

    Raises:
        ValueError: ``size`` outside ``1 .. vocab_size``, or the ranking holds fewer than ``size`` such ids.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}] (the model's vocabulary), got {size}")
    ids = [t for t in ranking if t < vocab_size][:size]
    if len(ids) < size:
        raise ValueError(
            f"draft_vocab_size={size} but the token-frequency ranking holds only {len(ids)} ids of this vocabulary"
        )
    return sorted(ids)


def _head_rows(lm_head: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids [N]`` of the LM head's weight as a ``[N, D]`` float tensor in ``dtype`` (an FP8 head is
    dequantised row by row: each row takes its block's scales)."""
    w = lm_head.weight
    if w.dtype == torch.float8_e4m3fn:
        block = int(getattr(lm_head, "block", 128))
        scale = lm_head.weight_scale_inv  # [ceil(V / block), ceil(D / block)]
        rows = w.index_select(0, ids)  # [N, D]
        # Dequantise the gathered rows as a (N x D) block-FP8 matrix of row blocks of one row each.
        row_scale = scale.index_select(0, torch.div(ids, block, rounding_mode="floor"))  # [N, ceil(D / block)]
        return dequantize_block_fp8_rows(rows, row_scale, block).to(dtype)
    return w.index_select(0, ids).to(dtype)


def dequantize_block_fp8_rows(rows: torch.Tensor, row_scale: torch.Tensor, block: int) -> torch.Tensor:
    """``rows [N, D]`` FP8 codes times ``row_scale [N, ceil(D / block)]`` (each row's column-block scales): FP32."""
    D = rows.shape[1]
    return rows.float() * row_scale.float().repeat_interleave(block, dim=1)[:, :D]


class DraftVocab:
    """The draft steps' LM head over ``N`` token ids: ``[N, D]`` head rows, argmax mapped back to full ids.

    Args:
        lm_head: the target model's LM head (``weight [V, D]``; float, or block-FP8 with ``weight_scale_inv``).
        ids: the ``N`` token ids (distinct, ascending; `subset_ids`).

    Attributes:
        ids: ``[N]`` int64 token ids on the head's device.
        weight: ``[N, D]`` head rows in the head's float dtype (bf16 / fp32; an FP8 head's rows dequantised to
            the activations' dtype ``act_dtype``), allocated once: CUDA graphs captured on it stay valid.
    """

    def __init__(self, lm_head: nn.Module, ids: Sequence[int], act_dtype: torch.dtype | None = None) -> None:
        w = lm_head.weight
        if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            raise ValueError("draft vocabulary ids must be distinct and ascending")
        if not ids or min(ids) < 0 or max(ids) >= w.shape[0]:
            raise ValueError(f"draft vocabulary ids must be in [0, {w.shape[0]})")
        self.ids = torch.tensor(list(ids), dtype=torch.int64, device=w.device)
        dtype = act_dtype if w.dtype == torch.float8_e4m3fn else w.dtype
        with torch.no_grad():
            self.weight = _head_rows(lm_head, self.ids, dtype or torch.bfloat16).contiguous()

    @property
    def size(self) -> int:
        """``N``."""
        return int(self.ids.numel())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, D]`` -> ``[n, N]`` FP32 logits of the subset (the model's float projection: batch-invariant
        in that mode, like the full head)."""
        return model_linear(hidden.to(self.weight.dtype), self.weight).float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, D]`` -> ``[n]`` int64 full-vocabulary ids of the argmax inside the subset (graph-safe: no
        host work, fixed buffers)."""
        return self.ids.index_select(0, self.logits(hidden).argmax(dim=-1))


def greedy_reference(lm_head: nn.Module, ids: Sequence[int], hidden: torch.Tensor) -> torch.Tensor:
    """The plain reference of `DraftVocab.greedy`: full FP32 logits, every id outside ``ids`` masked to -inf,
    argmax. ``hidden [n, D]`` -> ``[n]`` int64."""
    w = lm_head.weight
    if w.dtype == torch.float8_e4m3fn:
        w = dequantize_block_fp8(w, lm_head.weight_scale_inv, int(getattr(lm_head, "block", 128)))
    logits = hidden.float() @ w.float().t()
    mask = torch.full_like(logits, float("-inf"))
    mask[:, list(ids)] = 0.0
    return (logits + mask).argmax(dim=-1)


def resolve_draft_vocab(
    lm_head: nn.Module,
    vocab_size: int,
    size: int | None,
    path: str | os.PathLike[str] | None,
    checkpoint_dir: str | os.PathLike[str] | None,
    act_dtype: torch.dtype | None = None,
) -> DraftVocab | None:
    """The MTP drafter's draft vocabulary for ``MTPDecodingConfig.draft_vocab_size`` / ``draft_vocab_file``.

    Args:
        lm_head: the target's LM head.
        vocab_size: the model's vocabulary size ``V``.
        size: ``N`` (None, or ``V`` itself: the full vocabulary, no `DraftVocab`).
        path: the ranking file; None looks for `TOKEN_FREQUENCY_FILE` in ``checkpoint_dir``.
        checkpoint_dir: the directory the model was loaded from (None for presets built from a seed).
        act_dtype: the activations' dtype (an FP8 head's subset is held in it).

    Raises:
        ValueError: a size with no ranking to take it from, or a size or ranking that does not fit.
    """
    if size is None:
        return None
    if path is None and checkpoint_dir is not None:
        cand = os.path.join(os.fspath(checkpoint_dir), TOKEN_FREQUENCY_FILE)
        path = cand if os.path.isfile(cand) else None
    if path is None:
        raise ValueError(
            f"draft_vocab_size={size} needs a token-frequency ranking: this model ships no {TOKEN_FREQUENCY_FILE} "
            "(pass MTPDecodingConfig(draft_vocab_file=...), or leave draft_vocab_size=None for the full vocabulary)"
        )
    ids = subset_ids(load_token_ranking(path), size, vocab_size)
    if size == vocab_size:
        return None  # every id: the full head is the same draft, without the copy
    return DraftVocab(lm_head, ids, act_dtype)

"""The MTP draft steps' own LM head: a restricted draft vocabulary (FR-Spec style) and / or an FP8 copy.

`DraftVocab` holds a ``[N, D]`` copy of the head's rows of the ``N`` most frequent ids, made once when the executor is
built (graphs captured on it keep a fixed address), and maps each draft's argmax in that subset back to its full id;
with ``fp8`` the copy is block-FP8 (``MTPDecodingConfig.draft_head_fp8``; also over the full vocabulary: ``ids=None``).
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
from ..quant.fp8 import dequantize_block_fp8, quantize_block_fp8
from ..quant.ops import fp8_linear

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


# The FP8 draft head's scale tile (the model's block-FP8 weights use the same).
FP8_BLOCK = 128


class DraftVocab:
    """The draft steps' LM head over ``N`` token ids: ``[N, D]`` head rows, argmax mapped back to full ids.

    Args:
        lm_head: the target model's LM head (``weight [V, D]``; float, or block-FP8 with ``weight_scale_inv``).
        ids: the ``N`` token ids (distinct, ascending; `subset_ids`); None: every id (``N = V``, no mapping: an FP8
            copy of the whole head).
        act_dtype: the activations' dtype (an FP8 head's rows are dequantised to it).
        fp8: hold the rows as block-FP8 codes and scales (`quant.fp8.quantize_block_fp8` of the float rows) and
            project with the FP8 linear.

    Attributes:
        ids: ``[N]`` int64 token ids on the head's device, or None (the full vocabulary).
        weight: ``[N, D]`` head rows in the head's float dtype (bf16 / fp32; an FP8 head's rows dequantised to
            the activations' dtype ``act_dtype``), or FP8 codes with ``fp8``; allocated once: CUDA graphs captured on
            it stay valid.
        scale_inv: ``[ceil(N / block), ceil(D / block)]`` fp32 tile scales with ``fp8``, else None.
        block: their tile edge (128; an FP8 model head reused whole keeps its own).
    """

    def __init__(
        self, lm_head: nn.Module, ids: Sequence[int] | None, act_dtype: torch.dtype | None = None, fp8: bool = False
    ) -> None:
        w = lm_head.weight
        self.act_dtype = (act_dtype or torch.bfloat16) if w.dtype == torch.float8_e4m3fn else w.dtype
        self.scale_inv: torch.Tensor | None = None
        self.block = FP8_BLOCK
        if ids is None:
            if not fp8:
                raise ValueError("a draft head over the full vocabulary is only made as an FP8 copy (fp8=True)")
            self.ids = None
            self._n = int(w.shape[0])
            rows_ids = torch.arange(self._n, device=w.device)
        else:
            if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
                raise ValueError("draft vocabulary ids must be distinct and ascending")
            if not ids or min(ids) < 0 or max(ids) >= w.shape[0]:
                raise ValueError(f"draft vocabulary ids must be in [0, {w.shape[0]})")
            self.ids = torch.tensor(list(ids), dtype=torch.int64, device=w.device)
            self._n = len(ids)
            rows_ids = self.ids
        with torch.no_grad():
            if fp8 and ids is None and w.dtype == torch.float8_e4m3fn:
                # The model's head is block-FP8 already: the same codes and scales (no second copy).
                self.weight, self.scale_inv = w, lm_head.weight_scale_inv
                self.block = int(getattr(lm_head, "block", FP8_BLOCK))
            elif fp8:
                # Quantised in row chunks: the float rows of a full head would be a transient copy of V x D fp32.
                codes, scales = [], []
                for r0 in range(0, self._n, 64 * FP8_BLOCK):
                    rows = _head_rows(lm_head, rows_ids[r0 : r0 + 64 * FP8_BLOCK], torch.float32)
                    q, s = quantize_block_fp8(rows, FP8_BLOCK)
                    codes.append(q)
                    scales.append(s)
                self.weight, self.scale_inv = torch.cat(codes).contiguous(), torch.cat(scales).contiguous()
            else:
                self.weight = _head_rows(lm_head, rows_ids, self.act_dtype).contiguous()

    @property
    def size(self) -> int:
        """``N``."""
        return self._n

    @property
    def fp8(self) -> bool:
        """Whether the rows are block-FP8."""
        return self.scale_inv is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, D]`` -> ``[n, N]`` FP32 logits of the subset (the model's float projection, or the FP8
        linear with ``fp8``: batch-invariant in that mode, like the full head)."""
        if self.scale_inv is not None:
            return fp8_linear(hidden.to(self.act_dtype), self.weight, self.scale_inv, self.block).float()
        return model_linear(hidden.to(self.weight.dtype), self.weight).float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, D]`` -> ``[n]`` int64 full-vocabulary ids of the argmax inside the subset (graph-safe: no
        host work, fixed buffers)."""
        best = self.logits(hidden).argmax(dim=-1)
        return best if self.ids is None else self.ids.index_select(0, best)


def greedy_reference(
    lm_head: nn.Module, ids: Sequence[int] | None, hidden: torch.Tensor, fp8: bool = False
) -> torch.Tensor:
    """The plain reference of `DraftVocab.greedy`: full FP32 logits, every id outside ``ids`` masked to -inf (None:
    none), argmax. ``fp8``: the head's rows of ``ids`` rounded as `DraftVocab` rounds them (block-FP8 over the subset's
    own tiles) and the activations rounded to the head's dtype first. ``hidden [n, D]`` -> ``[n]`` int64."""
    w = lm_head.weight
    if w.dtype == torch.float8_e4m3fn:
        w = dequantize_block_fp8(w, lm_head.weight_scale_inv, int(getattr(lm_head, "block", 128)))
    w = w.float()
    keep = list(range(w.shape[0])) if ids is None else list(ids)
    if fp8 and not (ids is None and lm_head.weight.dtype == torch.float8_e4m3fn):
        q, s = quantize_block_fp8(w[keep], FP8_BLOCK)
        w = w.clone()
        w[keep] = dequantize_block_fp8(q, s, FP8_BLOCK)
    x = hidden.float()
    if fp8 and lm_head.weight.dtype != torch.float8_e4m3fn:
        x = hidden.to(lm_head.weight.dtype).float()
    logits = x @ w.t()
    mask = torch.full_like(logits, float("-inf"))
    mask[:, keep] = 0.0
    return (logits + mask).argmax(dim=-1)


def resolve_draft_vocab(
    lm_head: nn.Module,
    vocab_size: int,
    size: int | None,
    path: str | os.PathLike[str] | None,
    checkpoint_dir: str | os.PathLike[str] | None,
    act_dtype: torch.dtype | None = None,
    fp8: bool = False,
) -> DraftVocab | None:
    """The MTP drafter's draft head for ``MTPDecodingConfig.draft_vocab_size`` / ``draft_vocab_file`` /
    ``draft_head_fp8`` (None: the model's own LM head serves the drafts).

    Args:
        lm_head: the target's LM head.
        vocab_size: the model's vocabulary size ``V``.
        size: ``N`` (None, or ``V`` itself: the full vocabulary, no `DraftVocab`).
        path: the ranking file; None looks for `TOKEN_FREQUENCY_FILE` in ``checkpoint_dir``.
        checkpoint_dir: the directory the model was loaded from (None for presets built from a seed).
        act_dtype: the activations' dtype (an FP8 head's subset is held in it).
        fp8: the draft head as a block-FP8 copy (over the subset, or the full vocabulary without ``size``).

    Raises:
        ValueError: a size with no ranking to take it from, or a size or ranking that does not fit.
    """
    if size is None:
        return DraftVocab(lm_head, None, act_dtype, fp8=True) if fp8 else None
    if path is None and checkpoint_dir is not None:
        cand = os.path.join(os.fspath(checkpoint_dir), TOKEN_FREQUENCY_FILE)
        path = cand if os.path.isfile(cand) else None
    if path is None:
        raise ValueError(
            f"draft_vocab_size={size} needs a token-frequency ranking: this model ships no {TOKEN_FREQUENCY_FILE} "
            "(pass MTPDecodingConfig(draft_vocab_file=...), or leave draft_vocab_size=None for the full vocabulary)"
        )
    ids = subset_ids(load_token_ranking(path), size, vocab_size)
    if size == vocab_size:  # every id: the full head is the same draft, without the copy (or the FP8 one)
        return DraftVocab(lm_head, None, act_dtype, fp8=True) if fp8 else None
    return DraftVocab(lm_head, ids, act_dtype, fp8=fp8)

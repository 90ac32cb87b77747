"""Feed-forward blocks: the dense SwiGLU MLP and the sigmoid-routed MoE (HF DeepSeek-V3/GLM weight names).

Weight names under a decoder layer's ``mlp.`` prefix:

* dense layers (``mlp_layer_types[i] == "dense"``): ``gate_proj``, ``up_proj``, ``down_proj``;
* MoE layers: ``gate.weight`` ``[E, hidden]``, ``gate.e_score_correction_bias`` ``[E]``,
  ``experts.{e}.{gate,up,down}_proj.weight`` and ``shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Glm5NextConfig
from .init import init_linear_

__all__ = ["GatedMLP", "MoEGate", "MoE", "make_ffn"]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; no clamp when ``limit`` is ``None``.

    Args:
        gate: ``[..., I]`` gate projection.
        up: ``[..., I]`` up projection.
        limit: ``swiglu_limit`` (10 in GLM-5.3-Flash).
    """
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """Clamped SwiGLU MLP: ``down(silu(min(gate(x), L)) * clamp(up(x), -L, L))``, no biases.

    Args:
        hidden_size: model width.
        intermediate_size: inner width.
        swiglu_limit: the clamp ``L`` (``None``: plain SwiGLU).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[..., hidden]``. Returns ``[..., hidden]`` in ``x``'s dtype."""
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Draw gate, up, down weights from N(0, std) in that order from ``generator`` (CPU)."""
        init_linear_(self, generator, std)


class MoEGate(nn.Module):
    """Sigmoid router with an auxiliary-loss-free correction bias (selection only).

    The bias steers *which* experts are chosen; the combine weights come from the un-biased sigmoid
    scores. Scores, selection and weights are all computed in fp32 whatever the module dtype, so that
    a bf16 model picks the same experts as its fp32 reference up to the logits' rounding.

    Args:
        hidden_size: model width.
        n_experts: number of routed experts ``E``.
        top_k: experts per token.
        norm_topk_prob: normalise the top-k weights to sum to one before scaling.
        routed_scaling_factor: multiplier applied to the final weights.
        n_group: expert groups; with ``n_group > 1`` only the ``topk_group`` groups whose two best
            biased scores sum highest are eligible (DeepSeek-V3 group-limited routing).
        topk_group: groups kept per token.
    """

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, {n_experts}], got {top_k}")
        if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad expert groups: n_group={n_group}, topk_group={topk_group}, experts={n_experts}")
        self.n_group = n_group
        self.topk_group = topk_group
        self.n_experts = n_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        # A parameter (not a buffer) so that `.to(dtype)` and state_dict loading treat it like HF does.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: ``[N, hidden]``.

        Returns:
            ``(topk_ids, topk_weights)``: ``[N, top_k]`` int64 expert ids, ordered by biased score
            (descending, ties to the lower id), and ``[N, top_k]`` fp32 combine weights.
        """
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            n = choice.shape[0]
            grouped = choice.view(n, self.n_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, : self.topk_group]
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(n, -1), float("-inf"))
        # torch.topk does not specify tie order; a stable descending sort keeps lower ids first.
        _, order = torch.sort(choice, dim=-1, descending=True, stable=True)
        topk_ids = order[:, : self.top_k]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            # The epsilon only matters if every selected sigmoid underflowed to zero.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.routed_scaling_factor

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Draw the router weight, then the correction bias, from N(0, std).

        The bias is random rather than zero so that a randomly initialised model exercises the
        selection-only path (a zero bias would hide a bug that uses it in the weights).
        """
        w = torch.empty(self.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        self.weight.copy_(w)
        b = torch.empty(self.e_score_correction_bias.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        self.e_score_correction_bias.copy_(b)


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts.

    Args:
        config: uses ``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``,
            ``n_shared_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``routed_scaling_factor``.
    """

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.n_routed_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.gate = MoEGate(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.routed_scaling_factor,
            config.n_group,
            config.topk_group,
        )
        lim = config.swiglu_limit
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, lim) for _ in range(config.n_routed_experts)
        )
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts > 0:
            self.shared_experts = GatedMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, lim
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[N, hidden]`` (any leading dims are flattened). Returns ``[N, hidden]`` in ``x``'s dtype.

        Expert outputs are weighted and accumulated in fp32, then cast once.
        """
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        out = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=x.device)
        if n > 0:
            topk_ids, topk_w = self.gate(x2)
            flat_ids = topk_ids.reshape(-1)
            flat_w = topk_w.reshape(-1)
            flat_tok = torch.arange(n, device=x.device).repeat_interleave(self.top_k)
            # Group (token, expert) pairs by expert once; each token appears at most once per expert, so
            # index_add_ has no duplicate targets within a call and stays deterministic on GPU too.
            order = torch.argsort(flat_ids, stable=True)
            tok_sorted = flat_tok[order]
            w_sorted = flat_w[order]
            counts = torch.bincount(flat_ids, minlength=self.n_routed_experts).tolist()
            start = 0
            for e, c in enumerate(counts):
                if c == 0:
                    continue
                tok = tok_sorted[start : start + c]
                y = self.experts[e](x2.index_select(0, tok))
                out.index_add_(0, tok, y.float() * w_sorted[start : start + c, None])
                start += c
        if self.shared_experts is not None:
            out += self.shared_experts(x2).float()
        return out.to(x.dtype).reshape(shape)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Seeded init: router (weight, bias), then experts 0..E-1, then the shared experts."""
        self.gate.reset_parameters(generator, std)
        for expert in self.experts:
            expert.reset_parameters(generator, std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(generator, std)


def make_ffn(config: Glm5NextConfig, layer_idx: int) -> GatedMLP | MoE:
    """The FFN of decoder layer ``layer_idx``: dense or MoE as ``mlp_layer_types`` says.

    The MTP layer (``layer_idx >= num_hidden_layers``) is always MoE, as in the real checkpoint.
    """
    if not config.is_moe_layer(layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit)
    return MoE(config)

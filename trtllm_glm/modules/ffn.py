"""Feed-forward blocks: the dense SwiGLU MLP and the sigmoid-routed MoE (HF DeepSeek-V3/GLM weight names).

Weight names under a decoder layer's ``mlp.`` prefix:

* dense layers (``mlp_layer_types[i] == "dense"``): ``gate_proj``, ``up_proj``, ``down_proj``;
* MoE layers: ``gate.weight`` ``[E, hidden]``, ``gate.e_score_correction_bias`` ``[E]``,
  ``experts.{e}.{gate,up,down}_proj.weight`` and ``shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..act import swiglu
from ..config import Glm5NextConfig
from ..linear import linear_fp32
from .init import init_linear_
from .weight_views import FusedWeights, refuse_stale, same_memory

__all__ = ["GatedMLP", "MoEGate", "MoE", "make_ffn", "MOE_BACKEND_ENV", "MOE_SKIP_DEAD_ROWS_ENV", "FUSED_MAX_ROWS"]


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

    After `fuse_weights` the gate and up weights are views of one ``[2I, H]`` storage and a forward is one GEMM,
    one SwiGLU launch (`trtllm_glm.act.swiglu`) and the down GEMM, instead of three GEMMs and four elementwise
    kernels; until then (and on the CPU, where executors never fuse) it is the plain three-GEMM code.

    Args:
        hidden_size: model width.
        intermediate_size: inner width.
        swiglu_limit: the clamp ``L`` (``None``: plain SwiGLU).
        fusable: whether `fuse_weights` may give gate and up one storage. `MoE` passes ``False`` for its routed
            experts: their weights are already views of the MoE's stacked tensors, which fusing would re-home.

    Attributes:
        backend: SwiGLU backend of the fused path (``None`` follows ``TRTLLM_GLM_SWIGLU_BACKEND``, see
            `trtllm_glm.act.swiglu_backend`).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None, *, fusable: bool = True
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.fusable = fusable
        self.backend: str | None = None
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # `fuse_weights`: gate rows then up rows in one storage. A plain attribute (no parameter or buffer), so
        # state dicts and `Module._apply` only ever see the two parameters.
        self._gate_up: FusedWeights | None = None

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Give ``gate_proj.weight`` and ``up_proj.weight`` one ``[2I, H]`` storage, the parameters becoming views.

        A forward then runs one GEMM for both (at decode batch sizes each launch costs about as much as the bytes
        it reads). Names, shapes and ``state_dict`` are unchanged, and in-place loads write through the views. A
        parameter replaced later (``load_state_dict(assign=True)``, ``p.data = ...``) is noticed and the forward
        falls back to separate GEMMs until `fuse_weights` runs again; ``module.to(...)`` and other ``_apply``
        casts re-fuse. A no-op when not `fusable` or when the two weights differ in dtype or device. Numerics: the
        same products, possibly in another GEMM kernel (last-bit differences in low precision).
        """
        if not self.fusable:
            return
        # Idempotent (`FusedWeights.ensure`): a fused pair keeps its storage.
        self._gate_up = FusedWeights.ensure(self._gate_up, [self.gate_proj, self.up_proj])

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        refuse_stale(self, ("_gate_up",))
        return out

    def _fused_weight(self) -> torch.Tensor | None:
        """The ``[2I, H]`` gate|up weight when the fused path applies, else ``None``."""
        f = self._gate_up
        return f.weight if f is not None and f.usable() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x ``[..., hidden]``. Returns ``[..., hidden]`` in ``x``'s dtype."""
        w = self._fused_weight()
        if w is None:
            return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
        assert self._gate_up is not None
        gate_up = self._gate_up.linear(x.reshape(-1, x.shape[-1]))
        h = swiglu(gate_up, self.swiglu_limit, self.backend)
        return self.down_proj(h).reshape(*x.shape[:-1], self.hidden_size)

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
        # Routing after the logits: None follows TRTLLM_GLM_ROUTER_BACKEND (`trtllm_glm.moe.router.route`).
        self.backend: str | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        The logits are one fp32 GEMM (`trtllm_glm.linear.linear_fp32`: one Triton launch reading the weight in
        its own dtype for CUDA inference with up to 64 rows, ``F.linear(x.float(), W.float())`` otherwise;
        ``TRTLLM_GLM_SKINNY_GEMM_BACKEND`` overrides the choice). The rest goes through
        `trtllm_glm.moe.router.route`: one Triton launch for CUDA inference with ``n_group == 1``, else
        `route_reference` (``backend`` or ``TRTLLM_GLM_ROUTER_BACKEND`` override the choice). Both give the same
        ids in the same order.

        Args:
            x: ``[N, hidden]``.

        Returns:
            ``(topk_ids, topk_weights)``: ``[N, top_k]`` int64 expert ids, ordered by biased score
            (descending, ties to the lower id), and ``[N, top_k]`` fp32 combine weights.
        """
        # Imported here: trtllm_glm.moe imports this module (ops uses clamped_swiglu).
        from ..moe.router import route

        logits = linear_fp32(x, self.weight)
        return route(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.norm_topk_prob,
            self.routed_scaling_factor,
            self.n_group,
            self.topk_group,
            backend=self.backend,
        )

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


MOE_BACKEND_ENV = "TRTLLM_GLM_MOE_BACKEND"
MOE_BACKENDS = ("auto", "torch", "triton")
# "0" computes the routed experts of dead rows too (`MoE.forward`'s ``row_live`` ignored): the A/B switch.
MOE_SKIP_DEAD_ROWS_ENV = "TRTLLM_GLM_MOE_SKIP_DEAD_ROWS"
# "auto" takes the fused kernels on CUDA up to this many rows. Beyond it (prefill) the per-expert loop is as
# fast (every expert gets many rows; one host sync per layer is nothing next to the GEMMs) and the fused
# path's [N * k, H] fp32 pair buffer would grow large (537 MB at 4096 rows of the real model).
FUSED_MAX_ROWS = 1024


def _mark_stack_dirty(module: nn.Module, incompatible_keys: object) -> None:
    """Load-state-dict post hook: ``assign=True`` may have replaced expert parameters by other tensors."""
    module._stack_dirty = True


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts.

    Two implementations of the routed experts, chosen per call by `backend` (or the environment variable
    ``TRTLLM_GLM_MOE_BACKEND`` when `backend` is ``None``): ``"torch"``, a host loop over the experts present
    (one host sync, data-dependent shapes; the exact and fast path on the CPU), ``"triton"``, the fused
    kernels of `trtllm_glm.moe.kernels` (no host sync, CUDA-graph capturable; on the CPU through Triton's
    interpreter), and ``"auto"`` (default): the fused kernels for CUDA inputs of at most `fused_max_rows`
    rows when no gradient is needed, the loop otherwise.

    Weight storage: the experts' weights live in two stacked tensors, ``[E, 2I, H]`` (each expert's gate then
    up rows) and ``[E, H, I]`` (down), and every expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` weight
    is a view into them. So the per-expert parameters (checkpoint names, strict loading, state dicts) are
    unchanged, the fused kernels read the stacked tensors directly, and nothing is stored twice. The stack
    survives ``.to()`` / ``.cuda()`` / ``to_empty()`` (`_apply` converts the stacked tensors and re-points the
    views) and in-place loads (``load_state_dict`` copies into the views). When parameters are replaced by
    other tensors (``load_state_dict(assign=True)``, a hand-assigned ``nn.Parameter``, ``deepcopy``), the
    next fused call re-stacks: zero-copy when the new tensors are already laid out as one stacked block
    (e.g. per-expert views of a reference model's fused ``gate_up_proj``), else one copy into new stacked
    tensors with the parameters re-pointed to it, the old storage then being freed unless held elsewhere.
    A hand-assigned parameter of an expert other than the first and last is only noticed after
    `mark_weights_changed`.

    Args:
        config: uses ``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``,
            ``n_shared_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``routed_scaling_factor``.
    """

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size
        self.n_routed_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.swiglu_limit = config.swiglu_limit
        self.backend: str | None = None
        self.fused_max_rows = FUSED_MAX_ROWS
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
        # Not fusable: each expert's gate and up weights are views of the stacked tensors below.
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, lim, fusable=False)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts > 0:
            self.shared_experts = GatedMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, lim
            )
        # Plain attributes (not parameters or buffers): invisible to state dicts and to Module._apply.
        self._w_gate_up: torch.Tensor | None = None
        self._w_down: torch.Tensor | None = None
        self._stack_dirty = True
        self.register_load_state_dict_post_hook(_mark_stack_dirty)
        self._stack_experts()

    # ----------------------------------------------------------------------------------------------
    # Stacked expert weights
    # ----------------------------------------------------------------------------------------------
    def _expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight) for ex in self.experts]

    def _stack_is_current(self) -> bool:
        """Every expert weight is the matching view of the stacked tensors (O(E): run when marked dirty)."""
        w13, w2 = self._w_gate_up, self._w_down
        if w13 is None or w2 is None:
            return False
        inter = self.intermediate_size
        for e, (g, u, d) in enumerate(self._expert_weights()):
            for t, ref in ((g, w13[e, :inter]), (u, w13[e, inter:]), (d, w2[e])):
                if not same_memory(t, ref):
                    return False
        return True

    def _stack_experts(self) -> None:
        """Make the stacked tensors current: keep, view zero-copy, or copy once and re-point the parameters."""
        if self._stack_is_current():
            self._stack_dirty = False
            return
        weights = self._expert_weights()
        first = weights[0][0]
        if any(t.dtype != first.dtype or t.device != first.device for ws in weights for t in ws):
            raise RuntimeError("MoE: expert weights must share one dtype and device to be stacked")
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            # A copy here would allocate from the graph's pool and be recorded into it.
            raise RuntimeError("MoE: expert weights changed since the last eager call; run one before capturing")
        e, inter, hid = len(weights), self.intermediate_size, self.hidden_size
        w13 = _as_stacked([t for g, u, _ in weights for t in (g, u)], (e, 2 * inter, hid))
        w2 = _as_stacked([d for _, _, d in weights], (e, hid, inter))
        # Normal tensors even when called under inference_mode: they become the parameters' storage.
        with torch.inference_mode(False), torch.no_grad():
            if w13 is None:
                w13 = torch.empty(e, 2 * inter, hid, dtype=first.dtype, device=first.device)
                for i, (g, u, _) in enumerate(weights):
                    w13[i, :inter].copy_(g)
                    w13[i, inter:].copy_(u)
            if w2 is None:
                w2 = torch.empty(e, hid, inter, dtype=first.dtype, device=first.device)
                for i, (_, _, d) in enumerate(weights):
                    w2[i].copy_(d)
        self._point_experts_at(w13, w2)

    def _point_experts_at(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        inter = self.intermediate_size
        for e, ex in enumerate(self.experts):
            # `.data =` keeps each Parameter object (and its requires_grad) and swaps its storage.
            ex.gate_proj.weight.data = w13[e, :inter]
            ex.up_proj.weight.data = w13[e, inter:]
            ex.down_proj.weight.data = w2[e]
        self._w_gate_up, self._w_down = w13, w2
        self._stack_dirty = False

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_gate_up [E, 2I, H], w_down [E, H, I])``, the storage of the experts' weights (re-stacked first
        if parameters were replaced)."""
        w13, w2 = self._w_gate_up, self._w_down
        if self._stack_dirty or w13 is None or w2 is None or not self._stack_spot_check(w13, w2):
            self._stack_experts()
            w13, w2 = self._w_gate_up, self._w_down
        assert w13 is not None and w2 is not None
        return w13, w2

    def _stack_spot_check(self, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """O(1) check of the first and last experts (catches deepcopy and most hand replacements)."""
        inter = self.intermediate_size
        for e in (0, len(self.experts) - 1):
            ex = self.experts[e]
            if not (
                same_memory(ex.gate_proj.weight, w13[e, :inter])
                and same_memory(ex.up_proj.weight, w13[e, inter:])
                and same_memory(ex.down_proj.weight, w2[e])
            ):
                return False
        return True

    def mark_weights_changed(self) -> None:
        """Tell the module that expert parameters were replaced by hand (re-stacked on the next fused call)."""
        self._stack_dirty = True

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Convert the stacked tensors once and hand each expert parameter its view of the result.

        ``Module.to`` / ``cuda`` / ``half`` / ``to_empty`` all go through here; converting the experts one by
        one would break the stack (and a later re-stack would copy every expert).
        """
        w13, w2 = self._w_gate_up, self._w_down
        if not recurse or not self._stack_is_current():
            self._w_gate_up = self._w_down = None
            self._stack_dirty = True
            return super()._apply(fn, recurse)
        assert w13 is not None and w2 is not None
        new13, new2 = fn(w13), fn(w2)
        if new13.shape != w13.shape or new2.shape != w2.shape:
            self._w_gate_up = self._w_down = None
            self._stack_dirty = True
            return super()._apply(fn, recurse)
        inter = self.intermediate_size
        views: dict[int, torch.Tensor] = {}
        for e, (g, u, d) in enumerate(self._expert_weights()):
            views[id(g)], views[id(u)], views[id(d)] = new13[e, :inter], new13[e, inter:], new2[e]

        def convert(t: torch.Tensor) -> torch.Tensor:
            v = views.get(id(t))
            return v if v is not None else fn(t)

        out = super()._apply(convert, recurse)
        self._w_gate_up, self._w_down = new13, new2
        # Normally still current; a conversion that replaced Parameter objects is caught on the next call.
        self._stack_dirty = True
        return out

    # ----------------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------------
    def _backend(self, x: torch.Tensor) -> str:
        """``"torch"`` or ``"triton"`` for this call."""
        choice = self.backend if self.backend is not None else os.environ.get(MOE_BACKEND_ENV, "auto")
        if choice not in MOE_BACKENDS:
            raise ValueError(f"MoE backend must be one of {MOE_BACKENDS}, got {choice!r}")
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.experts[0].gate_proj.weight.requires_grad)
        if choice == "auto":
            fused = x.device.type == "cuda" and x.shape[0] <= self.fused_max_rows and not needs_grad
            return "triton" if fused else "torch"
        if choice == "triton" and needs_grad:
            raise RuntimeError("MoE: the triton backend has no backward; run under torch.no_grad() or use 'torch'")
        return choice

    def _routed_loop(self, x2: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Per-expert host loop: ``[N, H]`` fp32 (one host sync for the expert counts)."""
        n = x2.shape[0]
        out = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=x2.device)
        flat_ids = topk_ids.reshape(-1)
        flat_w = topk_w.reshape(-1)
        flat_tok = torch.arange(n, device=x2.device).repeat_interleave(self.top_k)
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
        return out

    def _routed_fused(
        self, x2: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, row_live: torch.Tensor | None
    ) -> torch.Tensor:
        """Fused kernels over the stacked weights: ``[N, H]`` fp32, no host sync."""
        from ..moe import kernels

        w13, w2 = self.stacked_expert_weights()
        return kernels.fused_moe(x2, topk_ids, topk_w, w13, w2, self.swiglu_limit, row_live=row_live)

    def forward(self, x: torch.Tensor, row_live: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts (plus the shared ones) of every row.

        Expert outputs are weighted and accumulated in fp32, then cast once.

        Args:
            x: ``[N, hidden]`` (any leading dims are flattened).
            row_live: optional ``[N]`` int or bool flags (``AttentionMetadata.row_live_t``): a row flagged 0
                is one whose output nobody reads (CUDA-graph padding, verify filler). Its routed part is 0
                and, on the fused path, none of its experts is read or computed. ``TRTLLM_GLM_MOE_SKIP_DEAD_ROWS=0``
                ignores the flags.

        Returns:
            ``[N, hidden]`` in ``x``'s dtype.
        """
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        if row_live is not None and row_live.shape != (n,):
            raise ValueError(f"MoE: row_live must be [N={n}], got {tuple(row_live.shape)}")
        if row_live is not None and os.environ.get(MOE_SKIP_DEAD_ROWS_ENV, "1") == "0":
            row_live = None
        if n > 0:
            topk_ids, topk_w = self.gate(x2)
            if self._backend(x2) == "triton":
                out = self._routed_fused(x2, topk_ids, topk_w, row_live)
            else:
                if row_live is not None:  # the loop still computes dead rows; their weights make them 0
                    topk_w = topk_w * (row_live != 0).unsqueeze(1)
                out = self._routed_loop(x2, topk_ids, topk_w)
        else:
            out = torch.zeros(0, self.hidden_size, dtype=torch.float32, device=x.device)
        if self.shared_experts is not None:
            out.add_(self.shared_experts(x2))  # fp32 += bf16 in one launch (the add upcasts; same values)
        return out.to(x.dtype).reshape(shape)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float) -> None:
        """Seeded init: router (weight, bias), then experts 0..E-1, then the shared experts."""
        self.gate.reset_parameters(generator, std)
        for expert in self.experts:
            expert.reset_parameters(generator, std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(generator, std)


def _as_stacked(parts: list[torch.Tensor], shape: tuple[int, int, int]) -> torch.Tensor | None:
    """A zero-copy ``shape`` view over ``parts`` if they tile one storage back to back in order, else ``None``.

    ``parts`` are the row blocks of the stacked tensor (``[E, 2I, H]``: gate_0, up_0, gate_1, ...), each
    contiguous. Meta tensors have no addresses: never viewed.
    """
    first = parts[0]
    if first.device.type == "meta" or any(not t.is_contiguous() for t in parts):
        return None
    storage = first.untyped_storage()
    step = first.numel()
    base = first.storage_offset()
    size = first.element_size()
    for i, t in enumerate(parts):
        if t.numel() != step or t.dtype != first.dtype or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if t.storage_offset() != base + i * step:
            return None
    total = step * len(parts)
    if (base + total) * size > storage.nbytes():
        return None
    e, rows, cols = shape
    return first.as_strided(shape, (rows * cols, cols, 1), base)


def make_ffn(config: Glm5NextConfig, layer_idx: int) -> GatedMLP | MoE:
    """The FFN of decoder layer ``layer_idx``: dense or MoE as ``mlp_layer_types`` says.

    The MTP layer (``layer_idx >= num_hidden_layers``) is always MoE, as in the real checkpoint.
    """
    if not config.is_moe_layer(layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit)
    return MoE(config)

"""Feed-forward blocks: the dense SwiGLU MLP and the sigmoid-routed MoE (HF DeepSeek-V3/GLM weight names).

Weight names under a decoder layer's ``mlp.`` prefix:

* dense layers (``mlp_layer_types[i] == "dense"``): ``gate_proj``, ``up_proj``, ``down_proj``;
* MoE layers: ``gate.weight`` ``[E, hidden]``, ``gate.e_score_correction_bias`` ``[E]``,
  ``experts.{e}.{gate,up,down}_proj.weight`` and ``shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import envs
from ..act import clamped_swiglu, swiglu
from ..config import Glm5NextConfig
from ..distributed.mapping import Mapping
from ..distributed.sharding import expert_block
from ..linear import linear_fp32, model_linear
from .init import init_linear_
from .weight_views import FusedWeights, refuse_stale, same_memory

__all__ = ["GatedMLP", "MoEGate", "MoE", "make_ffn", "MOE_BACKEND_ENV", "MOE_SKIP_DEAD_ROWS_ENV", "FUSED_MAX_ROWS"]


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


MOE_BACKEND_ENV = envs.MOE_BACKEND.name
# "0" computes the routed experts of dead rows too (`MoE.forward`'s ``row_live`` ignored): the A/B switch.
MOE_SKIP_DEAD_ROWS_ENV = envs.MOE_SKIP_DEAD_ROWS.name
# Rows per fused call: "auto" takes the fused kernels on CUDA at every row count, a prefill chunk in slabs of at
# most this many rows (one launch sequence each, no host sync), so that the [N * k, H] fp32 pair buffer stays
# bounded (1.07 GB at 8192 rows of the real model). The per-expert loop it replaced at prefill sizes paid one
# host sync and ~12 launches per expert (3,500 GEMM launches per 32K prompt per MoE layer on the H200 profile).
FUSED_MAX_ROWS = 8192


def _mark_stack_dirty(module: nn.Module, incompatible_keys: object) -> None:
    """Load-state-dict post hook: ``assign=True`` may have replaced expert parameters by other tensors."""
    module._stack_dirty = True


# The stacked groups of an expert's projections (`MoE._groups`) and the block-FP8 scale attribute of a quantized
# linear (``weight`` float8_e4m3fn [out, in], ``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)]).
_GATE_UP = ("gate_proj", "up_proj")
_DOWN = ("down_proj",)
_EXPERT_PROJS = _GATE_UP + _DOWN
_SCALE = "weight_scale_inv"


def _scale_of(linear: nn.Module) -> torch.Tensor | None:
    """A block-FP8 linear's ``weight_scale_inv``; ``None`` for an unquantized one."""
    return getattr(linear, _SCALE, None)


def _scale_block(linear: nn.Module) -> int:
    """The scale tile edge of a block-FP8 linear (`Fp8Linear.block`; 128, the checkpoint's, for a plain linear
    carrying a ``weight_scale_inv``)."""
    return int(getattr(linear, "block", 128))


def _convert_keeping_dtype(fn, t: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``fn(t)`` (an `nn.Module._apply` conversion) with ``t``'s dtype kept: only a device move applies."""
    # Probed on an empty slice: a dtype cast of a whole FP8 stack (gigabytes) is never materialised.
    probe = fn(t.detach()[:0])
    return fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts.

    Two implementations of the routed experts, chosen per call by `backend` (or the environment variable
    ``TRTLLM_GLM_MOE_BACKEND`` when `backend` is ``None``): ``"torch"``, a host loop over the experts present
    (one host sync, data-dependent shapes; the exact and fast path on the CPU), ``"triton"``, the fused
    kernels of `trtllm_glm.moe.kernels` (no host sync, CUDA-graph capturable; on the CPU through Triton's
    interpreter), and ``"auto"`` (default): the fused kernels for CUDA inputs when no gradient is needed, the
    loop otherwise. The fused path takes at most `fused_max_rows` rows per call (a longer prefill chunk runs in
    slabs: each row's result depends on its own operands only, so slabs change no value).

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

    Block-FP8 experts (every expert linear holding a ``float8_e4m3fn`` ``weight`` and an fp32 ``weight_scale_inv``
    ``[ceil(out/128), ceil(in/128)]``, as a quantized checkpoint loads them) are stacked the same way, their
    scales too: ``[E, 2 ceil(I/128), ceil(H/128)]`` (gate tile rows, then up's) and ``[E, ceil(H/128),
    ceil(I/128)]`` (`stacked_expert_scales`). The fused kernels read the FP8 stacks; the loop computes each used
    expert on its weights dequantised per tile (fp32, then ``x``'s dtype: a dequantised-at-load model's math).
    Dtype conversions (``.to(torch.bfloat16)``, ``.half()``) leave FP8 expert weights and their scales as they
    are; device moves apply.
    Expert parallelism (``mapping``, docs/parallelism.md): the module holds experts ``[expert_start,
    expert_start + len(experts))`` only (``experts[i]`` is global expert ``expert_start + i``), each with its
    ``moe_tp`` slice of the intermediate dimension, and its slice of the shared experts; the router is
    replicated. `forward` then returns this rank's partial sum (pairs routed to other ranks' experts are left
    out of the sort), which the decoder layer all-reduces.

    Args:
        config: uses ``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``,
            ``n_shared_experts``, ``num_experts_per_tok``, ``norm_topk_prob``, ``routed_scaling_factor``.
        mapping: this rank's layout (``None``: one rank, every expert).
    """

    def __init__(self, config: Glm5NextConfig, mapping: Mapping | None = None) -> None:
        super().__init__()
        mapping = mapping or Mapping()
        self.expert_start, n_local = expert_block(config, mapping)
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size // mapping.moe_tp_size
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
            GatedMLP(config.hidden_size, self.intermediate_size, lim, fusable=False) for _ in range(n_local)
        )
        self.shared_experts: GatedMLP | None = None
        if config.n_shared_experts > 0:
            self.shared_experts = GatedMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts // mapping.world_size,
                lim,
            )
        # Plain attributes (not parameters or buffers): invisible to state dicts and to Module._apply. The stacked
        # tensors in `_groups` order: gate_up and down weights, then (block-FP8 experts) their scales.
        self._stacks: list[torch.Tensor] | None = None
        self._stack_dirty = True
        self.register_load_state_dict_post_hook(_mark_stack_dirty)
        self._stack_experts()

    # ----------------------------------------------------------------------------------------------
    # Stacked expert weights
    # ----------------------------------------------------------------------------------------------
    def _quantized(self) -> bool:
        """Whether any expert linear is block-FP8 (carries ``weight_scale_inv``); O(E)."""
        return any(_scale_of(getattr(ex, n)) is not None for ex in self.experts for n in _EXPERT_PROJS)

    def _groups(self, quantized: bool) -> list[tuple[tuple[str, ...], str, tuple[int, int, int]]]:
        """``(projections, attribute, stacked shape)`` of each stacked tensor: one expert's slab of a stack is
        its projections' ``attribute`` tensors, one after the other along rows."""
        e, inter, hid = len(self.experts), self.intermediate_size, self.hidden_size
        groups = [(_GATE_UP, "weight", (e, 2 * inter, hid)), (_DOWN, "weight", (e, hid, inter))]
        if quantized:
            # Imported here: trtllm_glm.moe imports this module (ops uses clamped_swiglu).
            from ..moe.ops import expert_scale_shapes

            s13, s2 = expert_scale_shapes(e, hid, inter, self.fp8_block)
            groups += [(_GATE_UP, _SCALE, s13), (_DOWN, _SCALE, s2)]
        return groups

    @staticmethod
    def _views(stack: torch.Tensor, names: tuple[str, ...], e: int) -> list[torch.Tensor]:
        """Expert ``e``'s row blocks of ``stack``, one per projection of ``names``."""
        rows = stack.shape[1] // len(names)
        return [stack[e, j * rows : (j + 1) * rows] for j in range(len(names))]

    def _stack_matches(self, stacks: list[torch.Tensor], experts: list[int]) -> bool:
        """The given experts' tensors are the matching views of ``stacks``."""
        quantized = len(stacks) == 4
        groups = self._groups(quantized)
        if len(stacks) != len(groups):
            return False
        for stack, (names, attr, shape) in zip(stacks, groups):
            if tuple(stack.shape) != shape:
                return False
            for e in experts:
                ex = self.experts[e]
                for n, ref in zip(names, self._views(stack, names, e)):
                    t = getattr(getattr(ex, n), attr, None)
                    if t is None or not same_memory(t, ref):
                        return False
        # An unquantized stack goes stale when scales appear (the views check above does not see them).
        return quantized or all(_scale_of(getattr(self.experts[e], n)) is None for e in experts for n in _EXPERT_PROJS)

    def _stack_is_current(self) -> bool:
        """Every expert tensor is the matching view of the stacked tensors (O(E): run when marked dirty)."""
        return self._stacks is not None and self._stack_matches(self._stacks, list(range(len(self.experts))))

    def _stack_experts(self) -> None:
        """Make the stacked tensors current: keep, view zero-copy, or copy once and re-point the parameters."""
        if self._stack_is_current():
            self._stack_dirty = False
            return
        quantized = self._quantized()
        groups = self._groups(quantized)
        parts: list[list[torch.Tensor]] = []
        for names, attr, shape in groups:
            rows = shape[1] // len(names)
            ps = []
            for e, ex in enumerate(self.experts):
                for n in names:
                    t = getattr(getattr(ex, n), attr, None)
                    if t is None:
                        raise RuntimeError(f"MoE: experts.{e}.{n} has no {attr}: every expert linear or none is FP8")
                    if tuple(t.shape) != (rows, shape[2]):
                        raise RuntimeError(
                            f"MoE: experts.{e}.{n}.{attr} must be {[rows, shape[2]]}, got {list(t.shape)}"
                        )
                    ps.append(t)
            parts.append(ps)
        weights = parts[0] + parts[1]
        first = weights[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in weights):
            raise RuntimeError("MoE: expert weights must share one dtype and device to be stacked")
        if quantized:
            if first.dtype != torch.float8_e4m3fn:
                raise RuntimeError(f"MoE: block-FP8 expert weights must be float8_e4m3fn, got {first.dtype}")
            if any(t.dtype != torch.float32 or t.device != first.device for ps in parts[2:] for t in ps):
                raise RuntimeError("MoE: expert weight_scale_inv tensors must be fp32 on the weights' device")
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            # A copy here would allocate from the graph's pool and be recorded into it.
            raise RuntimeError("MoE: expert weights changed since the last eager call; run one before capturing")
        stacks: list[torch.Tensor] = []
        # Normal tensors even when called under inference_mode: they become the parameters' storage.
        with torch.inference_mode(False), torch.no_grad():
            for (names, _, shape), ps in zip(groups, parts):
                stack = _as_stacked(ps, shape)
                if stack is None:
                    stack = torch.empty(shape, dtype=ps[0].dtype, device=ps[0].device)
                    rows = shape[1] // len(names)
                    for i, t in enumerate(ps):
                        e, j = divmod(i, len(names))
                        stack[e, j * rows : (j + 1) * rows].copy_(t)
                stacks.append(stack)
        self._point_experts_at(stacks)

    def _point_experts_at(self, stacks: list[torch.Tensor]) -> None:
        for (names, attr, _), stack in zip(self._groups(len(stacks) == 4), stacks):
            for e, ex in enumerate(self.experts):
                for n, view in zip(names, self._views(stack, names, e)):
                    # `.data =` keeps each Parameter object (and its requires_grad) and swaps its storage.
                    getattr(getattr(ex, n), attr).data = view
        self._stacks = stacks
        self._stack_dirty = False

    def _current_stacks(self) -> list[torch.Tensor]:
        """The stacked tensors, re-stacked first if parameters were replaced."""
        stacks = self._stacks
        if self._stack_dirty or stacks is None or not self._stack_matches(stacks, [0, len(self.experts) - 1]):
            # The O(1) spot check of the first and last experts catches deepcopy and most hand replacements.
            self._stack_experts()
            stacks = self._stacks
        assert stacks is not None
        return stacks

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_gate_up [E, 2I, H], w_down [E, H, I])``, the storage of the experts' weights (re-stacked first
        if parameters were replaced); ``float8_e4m3fn`` for block-FP8 experts (see `stacked_expert_scales`)."""
        stacks = self._current_stacks()
        return stacks[0], stacks[1]

    def stacked_expert_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block-FP8 experts: ``(w_gate_up_scale [E, 2 ceil(I/128), ceil(H/128)], w_down_scale [E, ceil(H/128),
        ceil(I/128)])`` fp32, the storage of the experts' ``weight_scale_inv`` (gate tile rows then up tile rows);
        ``None`` for unquantized experts."""
        stacks = self._current_stacks()
        return (stacks[2], stacks[3]) if len(stacks) == 4 else None

    @property
    def fp8_block(self) -> int:
        """The scale tile edge of block-FP8 experts (their linears' ``block``; 128 in the real checkpoint)."""
        return _scale_block(self.experts[0].gate_proj) if len(self.experts) else 128

    def mark_weights_changed(self) -> None:
        """Tell the module that expert parameters were replaced by hand (re-stacked on the next fused call)."""
        self._stack_dirty = True

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Convert the stacked tensors once and hand each expert parameter its view of the result.

        ``Module.to`` / ``cuda`` / ``half`` / ``to_empty`` all go through here; converting the experts one by
        one would break the stack (and a later re-stack would copy every expert). Block-FP8 expert weights and
        their scales keep their dtypes (a float cast of e4m3 codes without their scales would change the
        function): ``.to(torch.bfloat16)`` moves nothing of them, ``.to("cuda", torch.bfloat16)`` moves them.
        """
        quantized = self._quantized()
        keep: set[int] = set()
        if quantized:
            for ex in self.experts:
                for n in _EXPERT_PROJS:
                    lin = getattr(ex, n)
                    if _scale_of(lin) is not None:
                        keep.update((id(lin.weight), id(lin.weight_scale_inv)))

        def guarded(t: torch.Tensor) -> torch.Tensor:
            return _convert_keeping_dtype(fn, t) if id(t) in keep else fn(t)

        stacks = self._stacks
        if not recurse or stacks is None or not self._stack_is_current():
            self._stacks = None
            self._stack_dirty = True
            return super()._apply(guarded, recurse)
        new = [_convert_keeping_dtype(fn, s) if quantized else fn(s) for s in stacks]
        if any(a.shape != b.shape for a, b in zip(new, stacks)):
            self._stacks = None
            self._stack_dirty = True
            return super()._apply(guarded, recurse)
        views: dict[int, torch.Tensor] = {}
        for (names, attr, _), stack in zip(self._groups(len(stacks) == 4), new):
            for e, ex in enumerate(self.experts):
                for n, view in zip(names, self._views(stack, names, e)):
                    views[id(getattr(getattr(ex, n), attr))] = view

        def convert(t: torch.Tensor) -> torch.Tensor:
            v = views.get(id(t))
            return v if v is not None else guarded(t)

        out = super()._apply(convert, recurse)
        self._stacks = new
        # Normally still current; a conversion that replaced Parameter objects is caught on the next call.
        self._stack_dirty = True
        return out

    # ----------------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------------
    def _backend(self, x: torch.Tensor) -> str:
        """``"torch"`` or ``"triton"`` for this call."""
        choice = envs.MOE_BACKEND.get() if self.backend is None else envs.MOE_BACKEND.check(self.backend)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.experts[0].gate_proj.weight.requires_grad)
        if choice == "auto":
            # Every row count takes the fused kernels (prefill chunks in slabs of `fused_max_rows`): no host loop,
            # no sync, and in the batch-invariant mode one path (and one tile shape) for every row count.
            fused = x.device.type == "cuda" and not needs_grad
            return "triton" if fused else "torch"
        if choice == "triton" and needs_grad:
            raise RuntimeError("MoE: the triton backend has no backward; run under torch.no_grad() or use 'torch'")
        return choice

    def _routed_loop(self, x2: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Per-expert host loop: ``[N, H]`` fp32 (one host sync for the expert counts).

        Block-FP8 experts compute on their weights dequantised per tile (in ``x``'s dtype, as a model
        dequantised at load would; in fp32 that is `fused_moe_ref`'s numerics).
        """
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
        e0, n_local = self.expert_start, len(self.experts)
        for e, c in enumerate(counts):
            # Expert parallelism: another rank computes the pairs of experts outside this block.
            if c and e0 <= e < e0 + n_local:
                tok = tok_sorted[start : start + c]
                ex = self.experts[e - e0]
                xe = x2.index_select(0, tok)
                y = _fp8_expert_forward(ex, xe, self.swiglu_limit) if _scale_of(ex.gate_proj) is not None else ex(xe)
                out.index_add_(0, tok, y.float() * w_sorted[start : start + c, None])
            start += c
        return out

    def _routed_fused(
        self, x2: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, row_live: torch.Tensor | None
    ) -> torch.Tensor:
        """Fused kernels over the stacked weights: ``[N, H]`` fp32, no host sync."""
        from ..moe import kernels

        w13, w2 = self.stacked_expert_weights()
        s13, s2 = self.stacked_expert_scales() or (None, None)
        partial = len(self.experts) < self.n_routed_experts
        n = x2.shape[0]
        slab = max(1, self.fused_max_rows)
        out = torch.empty(n, self.hidden_size, dtype=torch.float32, device=x2.device) if n > slab else None
        for r0 in range(0, n, slab):
            r1 = min(n, r0 + slab)
            part = kernels.fused_moe(
                x2[r0:r1],
                topk_ids[r0:r1],
                topk_w[r0:r1],
                w13,
                w2,
                self.swiglu_limit,
                out=out[r0:r1] if out is not None else None,
                row_live=row_live[r0:r1] if row_live is not None else None,
                w_gate_up_scale=s13,
                w_down_scale=s2,
                expert_start=self.expert_start if partial else None,
                fp8_block=self.fp8_block,
            )
            if out is None:
                return part
        assert out is not None
        return out

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
        if row_live is not None and not envs.MOE_SKIP_DEAD_ROWS.get():
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


def _fp8_expert_forward(expert: GatedMLP, x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """A block-FP8 expert as the same expert with its weights dequantised at load would compute it: weights
    dequantised per tile in fp32, then in ``x``'s dtype (fp32: `fused_moe_ref`'s numerics; bf16: a
    bf16-dequantised model's). ``[n, H]`` -> ``[n, H]`` in ``x``'s dtype."""
    # Imported here: trtllm_glm.moe imports this module (ops uses clamped_swiglu).
    from ..moe.ops import dequantize_experts

    def lin(linear: nn.Module, t: torch.Tensor) -> torch.Tensor:
        w = dequantize_experts(linear.weight, linear.weight_scale_inv, block=_scale_block(linear))
        return model_linear(t, w.to(t.dtype))

    return lin(expert.down_proj, clamped_swiglu(lin(expert.gate_proj, x), lin(expert.up_proj, x), limit))


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


def make_ffn(config: Glm5NextConfig, layer_idx: int, mapping: Mapping | None = None) -> GatedMLP | MoE:
    """The FFN of decoder layer ``layer_idx``: dense or MoE as ``mlp_layer_types`` says.

    The MTP layer (``layer_idx >= num_hidden_layers``) is always MoE, as in the real checkpoint. Under tensor
    parallelism ``config`` is the rank's local config (its ``intermediate_size`` already this rank's share)
    and ``mapping`` gives the MoE its expert block and slices.
    """
    if not config.is_moe_layer(layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.swiglu_limit)
    return MoE(config, mapping)

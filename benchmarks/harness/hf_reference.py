"""The published `transformers` reference: small random models for parity tests, and `run_transformers`, its
``generate`` on our weights for scale.

Every parameter is perturbed away from its init so that gates, pooling weights, the pooling position
bias, mHC mixing and router biases all change the output: a parity test then fails if any of them is
computed differently.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from typing import Any

import torch

from trtllm_glm.config import Glm5NextConfig as OurConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

TEXT_BASE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "index_topk": 256,
    "index_head_dim": 128,
    "index_n_heads": 2,
    "index_kpool": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "swiglu_limit": 1.5,
    "mlp_layer_types": ["dense"] + ["sparse"] * 7,
    # Special ids above 255 so that the byte tokenizer of a checkpoint without tokenizer.json fits.
    "pad_token_id": 299,
    "eos_token_id": 298,
}
VISION_SMALL: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 32,
    "out_hidden_size": 64,
    "projection_intermediate_size": 32,
}


def import_reference():
    """The reference classes, imported with its plain-torch KDA and conv paths.

    The reference binds fla-core's Triton kernels at import time when fla imports; those need a GPU
    (or the interpreter), so fla is hidden while the modeling module is first imported. Our own code
    is unaffected (it imports fla lazily and only on CUDA).
    """
    if "transformers.models.glm5_next.modeling_glm5_next" not in sys.modules:
        saved = {k: sys.modules[k] for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["fla"] = None  # type: ignore[assignment]
        try:
            importlib.import_module("transformers.models.glm5_next.modeling_glm5_next")
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    return Glm5NextConfig, Glm5NextForConditionalGeneration


def build_hf_model(seed: int = 0, **text_overrides: Any):
    """A random fp32 `Glm5NextForConditionalGeneration` (eager attention), every weight perturbed."""
    Glm5NextConfig, Glm5NextForConditionalGeneration = import_reference()

    text = dict(TEXT_BASE)
    text.update(text_overrides)
    cfg = Glm5NextConfig(text_config=text, vision_config=VISION_SMALL)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            t = torch.empty(p.shape)
            if name.endswith(("norm.weight", "layernorm.weight")):
                t.normal_(1.0, 0.2, generator=g)
            elif name.endswith(".scale"):  # mHC scales
                t.normal_(1.0, 0.3, generator=g)
            elif name.endswith(".base"):  # mHC biases
                t.normal_(0.0, 0.5, generator=g)
            elif name.endswith(".fn"):  # mHC projections
                t.normal_(0.0, 0.3, generator=g)
            elif "A_log" in name or "dt_bias" in name or "compress_ape" in name:
                t.normal_(0.0, 1.0, generator=g)
            elif "k_norm.bias" in name:
                t.normal_(0.0, 0.2, generator=g)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                t.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)
            p.copy_(t)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.empty(b.shape).normal_(0.0, 0.1, generator=g))
    return model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` fp32 logits of one sequence (one full forward, no cache)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recomputation; returns tokens and the top-2 gap behind each."""
    seq = list(ids)
    toks, gaps = [], []
    for _ in range(n):
        logits = hf_logits(model, seq)[-1]
        top = torch.topk(logits, 2).values
        t = int(torch.argmax(logits))
        toks.append(t)
        gaps.append(float(top[0] - top[1]))
        seq.append(t)
    return toks, gaps


def to_checkpoint_names(model) -> dict[str, torch.Tensor]:
    """The reference's in-memory tensors under the real checkpoint's names (text model only).

    Undoes the reference's load-time conversions: fused ``experts.gate_up_proj`` / ``down_proj`` back
    to per-expert linears, the fused ``conv1d`` back to ``q/k/v_conv1d``, ``forget_gate.*`` and
    ``{attn,ffn}_hc.*`` back to their checkpoint names.
    """
    out: dict[str, torch.Tensor] = {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, t in tensors.items():
        if not name.startswith("model.language_model.") and name != "lm_head.weight":
            continue
        n = name.replace(".self_attn.forget_gate.", ".self_attn.")
        for blk in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".{blk}_hc.{part}", f".hc_{blk}_{part}")
        if n.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[n.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter]
                out[n.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:]
            continue
        if n.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[n.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
            continue
        if n.endswith("self_attn.conv1d.weight"):
            c = t.shape[0] // 3
            for j, qkv in enumerate("qkv"):
                out[n.replace("conv1d", f"{qkv}_conv1d")] = t[j * c : (j + 1) * c]
            continue
        out[n] = t
    return out


def run_transformers(model_cfg: OurConfig, ours: Glm5NextForCausalLM, batch: int, prompt_len: int, gen: int):
    """The reference's ``generate`` (greedy, its own cache) on the same trunk weights: tokens/s."""
    HfConfig, HfModel = import_reference()
    text = model_cfg.text_dict()
    text.pop("num_nextn_predict_layers", None)
    text.pop("index_share_for_mtp_iteration", None)
    cfg = HfConfig(text_config=text, vision_config=VISION_SMALL)
    dev = next(ours.parameters()).device
    dt = next(ours.parameters()).dtype
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            hf = HfModel(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    mtp = f".layers.{model_cfg.num_hidden_layers}."
    sd = {k: v for k, v in ours.hf_state_dict().items() if mtp not in k}
    res = hf.load_state_dict(_to_reference_names(sd, hf), strict=False)
    missing = [k for k in res.missing_keys if ".visual." not in k]
    if missing or res.unexpected_keys:
        raise RuntimeError(
            f"weights do not map onto the reference: missing {missing[:3]}, unexpected {res.unexpected_keys[:3]}"
        )
    ids = torch.randint(0, model_cfg.vocab_size, (batch, prompt_len), device=dev)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return {"tokens_per_s": batch * gen / (time.perf_counter() - t0)}


def _to_reference_names(sd: dict[str, torch.Tensor], hf) -> dict[str, torch.Tensor]:
    """Our checkpoint names -> the reference's in-memory names (fused experts and conv taps)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        n = k
        for blk in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".hc_{blk}_{part}", f".{blk}_hc.{part}")
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            n = n.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
        if ".mlp.experts." in n:
            pre, rest = n.split(".mlp.experts.")
            e, which = rest.split(".", 1)
            experts.setdefault(pre, {}).setdefault(int(e), {})[which.split(".")[0]] = v
            continue
        if any(f".self_attn.{c}_conv1d." in n for c in "qkv"):
            pre, rest = n.split(".self_attn.")
            convs.setdefault(pre, {})[rest[0]] = v
            continue
        out[n] = v
    for pre, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in es])
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in es])
    for pre, c in convs.items():
        out[f"{pre}.self_attn.conv1d.weight"] = torch.cat([c["q"], c["k"], c["v"]])
    return out

"""Seeded random models at real geometry, drawn on the device itself."""

from __future__ import annotations

import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.models.glm5_next import Glm5NextForCausalLM


@torch.no_grad()
def random_model(cfg: Glm5NextConfig, device: str, dtype: str, seed: int) -> Glm5NextForCausalLM:
    """A random model initialised on ``device`` itself.

    `Glm5NextForCausalLM.from_config` draws every weight on the CPU (so that a seed gives the same
    weights everywhere); at real geometry that takes minutes, which a benchmark need not spend.
    """
    if device == "cpu":
        return Glm5NextForCausalLM.from_config(cfg, seed=seed, dtype=dtype, device=device)
    from trtllm_glm.models.glm5_next import is_fp32_param, resolve_dtype

    with torch.device("meta"):
        m = Glm5NextForCausalLM(cfg)
    # Cast on the meta device first: materialising FP32 and then casting would need 1.5x the model's bytes
    # (the 8-layer slice would not fit in 141 GB).
    m = m.to(resolve_dtype(dtype)).to_empty(device=device)
    m.keep_fp32_params_()
    g = torch.Generator(device=device).manual_seed(seed)
    std = cfg.initializer_range
    for name, p in m.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")) or name.endswith("_scale"):
            p.fill_(1.0)
        elif name.endswith(("k_norm.bias", "_base", "e_score_correction_bias")):
            p.zero_()
        elif name.endswith("A_log"):
            p.uniform_(0.0, 2.7, generator=g)
        elif name.endswith("dt_bias") or "compress_ape" in name:
            p.normal_(0.0, 0.1, generator=g)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=g)
        else:
            p.normal_(0.0, std, generator=g)
        assert is_fp32_param(name) or p.dtype == resolve_dtype(dtype)
    return m.eval()

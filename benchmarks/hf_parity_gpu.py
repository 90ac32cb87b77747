"""Real-geometry parity with the `transformers` reference on a GPU: KL divergence and argmax agreement.

Builds the reference ``Glm5NextForConditionalGeneration`` with the real GLM-5.3-Flash text config cut
to ``--layers`` trunk layers (sparse MLA at ``i % 4 == 3``, dense FFN for layers 0-2, 288-expert MoE
after), random-initialised by the reference's own ``_init_weights``, directly on the GPU. Its weights
are handed to our ``Glm5NextForCausalLM`` through the checkpoint names (`to_checkpoint_names`), and
both run the same random prompts (context logits of every prompt row):

* ``fp32 ref`` vs ``bf16 ref``: the bf16 floor (only when the fp32 model fits, ``--fp32-floor``);
* ``bf16 ref (eager)`` vs ``bf16 ref (sdpa)``: a bf16 floor at any depth (rounding order only);
* ``bf16 ref`` vs ``bf16 ours`` (and ``fp32 ref`` vs ``bf16 ours`` with the fp32 floor).

Prompts longer than ``index_topk`` (2048) make both sides drop pools, so their selections may differ
near ties (our FP8 pooled scores vs the reference's float scores); shorter ones select every pool.

Usage (H200): ``python -m benchmarks.hf_parity_gpu --layers 4 --fp32-floor`` and ``--layers 8``;
``--indexer-key-dtype fp8 bf16`` runs ours once per indexer key format (docs/indexer_keys.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.harness.rows import write_json


def kl_and_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(p || q) per row (nats) and argmax agreement, both from FP32 logits ``[n, V]``."""
    lp = F.log_softmax(p_logits.float(), -1)
    lq = F.log_softmax(q_logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item()
    return kl, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 512, 3000])
    ap.add_argument("--fp32-floor", action="store_true", help="also run the reference in fp32 (needs memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--indexer-key-dtype", nargs="+", default=["fp8"], choices=["fp8", "bf16"])
    args = ap.parse_args()

    from benchmarks.harness.hf_reference import VISION_SMALL, import_reference, to_checkpoint_names
    from trtllm_glm import LLM, KvCacheConfig, SamplingParams
    from trtllm_glm.config import Glm5NextConfig
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM

    HfConfig, HfModel = import_reference()
    L = args.layers
    text = {
        "num_hidden_layers": L,
        "index_kpool": 4,
        "mlp_layer_types": ["dense" if i < 3 else "sparse" for i in range(L)],
    }
    cfg = HfConfig(text_config=text, vision_config=VISION_SMALL)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in args.lengths]

    def ref_logits(model) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for p in prompts:
                outs.append(model(input_ids=torch.tensor([p], device="cuda"), use_cache=False).logits[0].float().cpu())
        return outs

    t0 = time.time()
    torch.manual_seed(args.seed)
    dt0 = torch.float32 if args.fp32_floor else torch.bfloat16
    torch.set_default_dtype(dt0)
    with torch.device("cuda"):
        hf = HfModel(cfg).eval()
    torch.set_default_dtype(torch.float32)
    print(f"reference built ({dt0}) in {time.time() - t0:.0f} s; {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    fp32 = None
    if args.fp32_floor:
        t0 = time.time()
        fp32 = ref_logits(hf)
        print(f"reference fp32 forward {time.time() - t0:.1f} s")
        hf = hf.to(torch.bfloat16)
        # The reference keeps these in fp32 when it loads a bf16 checkpoint (_keep_in_fp32_modules_strict).
        for n, p in hf.named_parameters():
            if any(k in n for k in ("e_score_correction_bias", "conv1d", "dt_bias", "A_log")):
                p.data = p.data.float()
    t0 = time.time()
    bf16 = ref_logits(hf)
    print(f"reference bf16 forward {time.time() - t0:.1f} s")
    # A bf16 floor that fits at any depth: the same reference with SDPA instead of eager attention
    # differs from itself only in rounding order.
    for c in (hf.config, hf.config.text_config):
        c._attn_implementation = "sdpa"
    bf16_sdpa = ref_logits(hf)
    for c in (hf.config, hf.config.text_config):
        c._attn_implementation = "eager"

    # Our model takes the reference's GPU tensors as its parameters (assign): no second copy in memory.
    sd = {k: v.detach() for k, v in to_checkpoint_names(hf).items()}
    ours_cfg = Glm5NextConfig.from_dict(cfg.to_diff_dict())
    with torch.device("meta"):
        ours = Glm5NextForCausalLM(ours_cfg)
    ours.load_weights(sd, device="cuda", dtype=torch.bfloat16, source="reference", assign=True)
    del sd
    gc.collect()
    print(f"ours loaded; {torch.cuda.memory_allocated() / 2**30:.1f} GiB in use")
    rows = []
    for key_dtype in args.indexer_key_dtype:
        llm = LLM(model=ours.eval(), max_batch_size=4, max_num_tokens=1024, max_seq_len=4096,
                  kv_cache_config=KvCacheConfig(tokens_per_block=64, indexer_key_dtype=key_dtype),
                  warmup=False)  # fmt: skip
        t0 = time.time()
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, return_context_logits=True))
        print(f"ours bf16 prefill ({key_dtype} indexer keys) {time.time() - t0:.1f} s")
        for i, o in enumerate(outs):
            n = len(prompts[i])
            row = {"layers": L, "prompt_len": n, "drops_pools": n > ours_cfg.index_topk, "indexer_key_dtype": key_dtype}
            row["kl_ref_bf16_vs_ours"], row["argmax_ref_bf16_vs_ours"] = kl_and_agreement(bf16[i], o.context_logits)
            row["kl_ref_eager_vs_sdpa"], row["argmax_ref_eager_vs_sdpa"] = kl_and_agreement(bf16[i], bf16_sdpa[i])
            if fp32 is not None:
                row["kl_fp32_vs_ref_bf16"], row["argmax_fp32_vs_ref_bf16"] = kl_and_agreement(fp32[i], bf16[i])
                row["kl_fp32_vs_ours"], row["argmax_fp32_vs_ours"] = kl_and_agreement(fp32[i], o.context_logits)
            rows.append(row)
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}))
        llm.shutdown()
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()

"""Evaluate a model trained by `train_small.py` on the held-out standard-library modules.

Measures, and writes as JSON and Markdown under ``benchmarks/results/small/``:

* held-out bits per byte through our runtime (`LLM`), with the trained sparse selection and with
  ``index_topk`` raised past the context (dense), against unigram and bigram byte models fitted on the
  training corpus;
* each indexer's recall of the dense attention's top pools (the reference's float math on the same
  inputs: trunk sparse layers and the MTP layer), the share of dense attention mass its selection keeps, a
  most-recent-pools selection of the same width for comparison, and how often our runtime's FP8 selection
  agrees with the float one;
* MTP mean accepted length and per-position acceptance for K = 1..5 and n-gram K = 7 through
  `LLM(speculative_config=...)` on held-out prompts, and the lossless check (speculative greedy == plain
  greedy, near ties excused) for every one of those runs;
* greedy samples.

Usage::

    python scripts/eval_small.py --model trtllm_glm/presets/small
    python scripts/eval_small.py --model /tmp/smoke --quick --out-prefix /tmp/smoke_eval
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import train_small as ts  # noqa: E402

from trtllm_glm import LLM, KvCacheConfig, MTPDecodingConfig, NGramDecodingConfig, SamplingParams  # noqa: E402
from trtllm_glm.config import Glm5NextConfig, resolve_preset_dir  # noqa: E402
from trtllm_glm.runtime.lossless import compare_greedy  # noqa: E402

LN2 = math.log(2.0)
SAMPLE_PROMPTS = ("def ", "import os\n\n\nclass ", "    def __init__(self")


# --------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------
def ngram_baselines(train_stream: torch.Tensor, held: list[bytes]) -> dict[str, float]:
    """Unigram and bigram byte models fitted on the training stream, in bits per held-out byte.

    Unigram: add-one counts over the 256 bytes. Bigram: ``(c(a, b) + P_uni(b)) / (c(a) + 1)`` (a
    one-count Dirichlet prior centred on the unigram); a file's first byte is scored by the unigram.
    """
    s = train_stream[train_stream < 256]
    uni = torch.bincount(s, minlength=256).double() + 1.0
    p_uni = uni / uni.sum()
    pairs = torch.bincount(s[:-1] * 256 + s[1:], minlength=256 * 256).double().view(256, 256)
    p_bi = (pairs + p_uni[None, :]) / (pairs.sum(1, keepdim=True) + 1.0)
    bits_u = bits_b = 0.0
    n = 0
    for data in held:
        x = torch.tensor(list(data))
        bits_u += float(-torch.log2(p_uni[x]).sum())
        bits_b += float(-torch.log2(p_uni[x[0]])) + float(-torch.log2(p_bi[x[:-1], x[1:]]).sum())
        n += len(x)
    return {"unigram": bits_u / n, "bigram": bits_b / n, "bytes": n}


# --------------------------------------------------------------------------------------------------
# Bits per byte through our runtime
# --------------------------------------------------------------------------------------------------
def with_index_topk(model_dir: str, topk: int, tmp: str) -> str:
    """A directory holding ``model_dir``'s weights with ``index_topk`` replaced (the dense variant)."""
    out = os.path.join(tmp, f"topk{topk}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text["index_topk"] = topk
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            dst = os.path.join(out, name)
            if not os.path.exists(dst):
                os.symlink(os.path.abspath(os.path.join(model_dir, name)), dst)
    return out


def windows(held: list[bytes], ctx: int, max_bytes: int) -> list[bytes]:
    """Consecutive ``ctx``-byte windows of the held-out files (each file cut independently), up to
    ``max_bytes`` in all, taken round-robin over files so every module is represented."""
    per_file = [[d[i : i + ctx] for i in range(0, len(d), ctx)] for d in held]
    out: list[bytes] = []
    total = 0
    j = 0
    while total < max_bytes and any(j < len(p) for p in per_file):
        for p in per_file:
            if j < len(p) and total < max_bytes:
                out.append(p[j])
                total += len(p[j])
        j += 1
    return out


def runtime_bits(model_dir: str, chunks: list[bytes], bos: int) -> float:
    """Bits per byte of our runtime's context logits: each chunk is ``[BOS] + bytes``, every byte scored."""
    llm = LLM(model=model_dir, device="cpu", max_batch_size=8, max_num_tokens=8192, max_seq_len=4096)
    prompts = [[bos] + list(c) for c in chunks]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, return_context_logits=True, ignore_eos=True))
    bits = 0.0
    n = 0
    for p, o in zip(prompts, outs):
        logp = torch.log_softmax(o.context_logits[:-1].double(), dim=-1)
        tgt = torch.tensor(p[1:])
        bits += float(-logp[torch.arange(len(tgt)), tgt].sum()) / LN2
        n += len(tgt)
    return bits / n


# --------------------------------------------------------------------------------------------------
# Indexer recall (reference float math)
# --------------------------------------------------------------------------------------------------
def load_reference_with_mtp(model_dir: str):
    """The reference trunk (``from_pretrained``) and the MTP block rebuilt from the checkpoint's layer L."""
    from transformers.utils import logging as hf_logging

    from trtllm_glm.models.checkpoint import load_state_dict

    _, model_cls, _ = ts.import_reference()
    # The reference has no MTP block, so its load report lists the checkpoint's layer L as unexpected (~50
    # lines on every run); the block is loaded below, and a real load error still raises.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = model_cls.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    L = model.config.text_config.num_hidden_layers
    sd = load_state_dict(model_dir)
    prefix = f"model.layers.{L}."
    mtp_sd = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    if not mtp_sd:
        return model, None
    E = model.config.text_config.n_routed_experts
    fused = {k: v for k, v in mtp_sd.items() if ".experts." not in k}
    ex = "mlp.experts."
    fused[ex + "gate_up_proj"] = torch.stack(
        [torch.cat([mtp_sd[f"{ex}{e}.gate_proj.weight"], mtp_sd[f"{ex}{e}.up_proj.weight"]]) for e in range(E)]
    )
    fused[ex + "down_proj"] = torch.stack([mtp_sd[f"{ex}{e}.down_proj.weight"] for e in range(E)])
    mtp = ts.MTPBlock(model.config.text_config).float()
    mtp.load_state_dict(fused, strict=True)
    return model, mtp.eval()


@torch.no_grad()
def indexer_recall(model, mtp, chunks: list[bytes], bos: int) -> dict:
    """Per sparse layer (trunk, then MTP): recall of the dense attention's top pools by the indexer's
    selection, attention mass kept, and the same for a most-recent-pools selection of equal width.

    Rows are counted where more complete pools are visible than the selection keeps (elsewhere every
    selection is exact). The model runs as served: sparse layers attend under the selection.
    """
    kp = model.config.text_config.index_kpool
    k_pools = model.config.text_config.index_topk // kp
    stats: dict[str, dict[str, float]] = {}
    for c in chunks:
        ids = torch.tensor([[bos] + list(c)])
        aux: list = []
        h = ts.trunk_forward(model, ids, sparse=True, aux=aux, index_loss=False)
        names = [f"layer {i}" for i, t in enumerate(model.config.text_config.layer_types) if t == "indexed_attention"]
        if mtp is not None and ids.shape[1] > 2:
            ts.mtp_forward(mtp, model, h, ids, sparse=True, aux=aux)
            names.append("mtp")
        for name, a in zip(names, aux):
            st = stats.setdefault(name, dict.fromkeys(("rows", "hit", "mass", "best", "recent_hit", "recent_mass"), 0))
            _accumulate(st, a, kp, k_pools)
    out = {}
    for name, st in stats.items():
        r = max(1, st["rows"])
        out[name] = {
            "rows": st["rows"],
            "recall": st["hit"] / (r * k_pools),
            "mass_kept": st["mass"] / r,
            "mass_best": st["best"] / r,
            "recent_recall": st["recent_hit"] / (r * k_pools),
            "recent_mass_kept": st["recent_mass"] / r,
        }
    return out


def _accumulate(st: dict, a, kp: int, k_pools: int) -> None:
    """Add one window's rows to ``st``: masses are shares of the dense attention mass (summed over heads)
    that falls on complete visible pools."""
    target = a.target[0]  # [S, P] dense attention mass per pool (heads summed)
    sel = a.selected[0]  # [S, W] selected token positions, -1 padded
    for s in range(target.shape[0]):
        n_c = (s + 1) // kp
        if n_c <= k_pools:
            continue
        row = target[s, :n_c]
        total = float(row.sum()) or 1.0
        best = set(torch.topk(row, k_pools).indices.tolist())
        chosen = sorted({int(t) // kp for t in sel[s].tolist() if t >= 0 and int(t) // kp < n_c})
        recent = list(range(n_c - k_pools, n_c))
        st["rows"] += 1
        st["hit"] += len(best.intersection(chosen))
        st["recent_hit"] += len(best.intersection(recent))
        st["mass"] += float(row[chosen].sum()) / total
        st["best"] += float(row[sorted(best)].sum()) / total
        st["recent_mass"] += float(row[recent].sum()) / total


def runtime_selection_agreement(model_dir: str, model, chunks: list[bytes], bos: int) -> float:
    """Share of the first sparse layer's pools selected by our runtime (FP8 scores) that the reference's
    float selection also picks, on the same inputs (the layers before it are KDA, computed alike)."""
    llm = LLM(model=model_dir, device="cpu", max_seq_len=4096, max_num_tokens=8192)
    first = next(layer for layer in llm.model.model.layers if layer.is_sparse)
    kp = llm.config.index_kpool
    k_pools = llm.config.index_topk_pools
    hit = total = 0
    for c in chunks:
        ids = [bos] + list(c)
        got: list[torch.Tensor] = []
        hook = first.self_attn.indexer.register_forward_hook(lambda _m, _i, o, got=got: got.append(o.clone()))
        llm.generate(ids, SamplingParams(max_tokens=1))
        hook.remove()
        ours = torch.cat(got)[: len(ids)]
        aux: list = []
        with torch.no_grad():
            ts.trunk_forward(model, torch.tensor([ids]), sparse=True, aux=aux, index_loss=False)
        ref = aux[0].selected[0]
        for s in range(len(ids)):
            n_c = (s + 1) // kp
            if n_c <= k_pools:
                continue
            a = {int(t) // kp for t in ours[s].tolist() if t >= 0 and int(t) // kp < n_c}
            b = {int(t) // kp for t in ref[s].tolist() if t >= 0 and int(t) // kp < n_c}
            hit += len(a & b)
            total += len(b)
    return hit / max(1, total)


# --------------------------------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------------------------------
def held_out_prompts(held: list[bytes], n: int, length: int) -> list[str]:
    """``n`` prompts of about ``length`` bytes, each ending at a line end, from different held-out files
    (from the middle of each file, so that they are not all import blocks)."""
    out = []
    files = [d for d in held if len(d) > 4 * length]
    for i in range(n):
        d = files[i % len(files)]
        start = d.find(b"\n", len(d) // 3 + (i // len(files)) * length) + 1
        end = d.rfind(b"\n", start, start + length) + 1
        text = d[start : end if end > start else start + length]
        out.append(text.decode("utf-8", errors="ignore"))
    return out


def spec_runs(model_dir: str, prompts: list[str], gen: int, ks: list[int], ngram_k: int) -> dict:
    """Plain greedy, MTP K in ``ks`` and n-gram ``ngram_k`` on the same prompts: acceptance and lossless."""
    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    common = {"device": "cpu", "max_batch_size": len(prompts), "max_seq_len": 4096,
              "kv_cache_config": KvCacheConfig(tokens_per_block=16)}  # fmt: skip
    t = time.perf_counter()
    plain = LLM(model=model_dir, **common).generate(prompts, sp)
    plain_s = time.perf_counter() - t
    runs = {"plain": {"tokens_per_s": gen * len(prompts) / plain_s}}
    configs = [(f"mtp K={k}", MTPDecodingConfig(adaptive=False, num_nextn_predict_layers=k)) for k in ks]
    configs.append((f"ngram K={ngram_k}", NGramDecodingConfig(max_draft_len=ngram_k)))
    for name, cfg in configs:
        llm = LLM(model=model_dir, speculative_config=cfg, **common)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        el = time.perf_counter() - t
        rounds = sum(o.outputs[0].num_draft_rounds for o in outs)
        accepted = sum(o.outputs[0].mean_accepted_length * o.outputs[0].num_draft_rounds for o in outs)
        width = max(len(o.outputs[0].acceptance_per_position) for o in outs)
        per_pos = []
        for j in range(width):
            num = sum(
                o.outputs[0].acceptance_per_position[j] * o.outputs[0].num_draft_rounds
                for o in outs
                if j < len(o.outputs[0].acceptance_per_position)
            )
            per_pos.append(num / max(1, rounds))
        lossless = {"identical": 0, "near_tie": 0, "diverged": 0}
        for p, o in zip(plain, outs):
            d = compare_greedy(p.outputs[0].token_ids, p.outputs[0].logit_gaps, o.outputs[0].token_ids)
            key = "identical" if d is None else ("near_tie" if d.excused else "diverged")
            lossless[key] += 1
        runs[name] = {
            "mean_accepted_length": accepted / max(1, rounds),
            "acceptance_per_position": per_pos,
            "rounds": rounds,
            "tokens_per_s": gen * len(prompts) / el,
            "lossless": lossless,
        }
    return runs


def samples(model_dir: str, prompts: list[str], n: int) -> list[dict]:
    llm = LLM(model=model_dir, device="cpu", max_batch_size=len(prompts), max_seq_len=4096)
    outs = llm.generate(list(prompts), SamplingParams(max_tokens=n, ignore_eos=True))
    return [{"prompt": p, "completion": o.outputs[0].text} for p, o in zip(prompts, outs)]


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(rep: dict) -> str:
    """The report as Markdown tables."""
    b = rep["bits_per_byte"]
    ctx = b["ctx"]
    base = rep["baselines"]
    out = [f"# Small model evaluation ({rep['date']})", "", f"Model: `{rep['model']}`; {rep['setup']}", ""]
    out += [
        "## Held-out bits per byte",
        "",
        _row(["model"] + [f"ctx {c}" for c in ctx]),
        _row(["---"] * (1 + len(ctx))),
    ]
    for name in ("unigram", "bigram"):
        out.append(_row([f"{name} (training counts)"] + [f"{base[name]:.3f}"] * len(ctx)))
    for mode in ("dense", "sparse"):
        out.append(_row([f"model, {mode} attention"] + [f"{b[mode][str(c)]:.3f}" for c in ctx]))
    out += ["", f"Model scored on {b['bytes']} held-out bytes per column; baselines on all {base['bytes']}.", ""]
    head = ["layer", "rows", "recall of dense top pools", "mass kept", "best mass", "recent recall", "recent mass"]
    out += ["## Indexer", "", _row(head), _row(["---"] * len(head))]
    for name, r in rep["indexer"].items():
        keys = ("recall", "mass_kept", "mass_best", "recent_recall", "recent_mass_kept")
        out.append(_row([name, r["rows"]] + [f"{r[k]:.3f}" for k in keys]))
    out += ["", f"Runtime FP8 selection vs the float selection, first sparse layer: {rep['fp8_agreement']:.3f}", ""]
    head = ["drafter", "mean accepted length", "acceptance per position", "tok/s (CPU)", "lossless"]
    out += ["## Speculative decoding (greedy, held-out prompts)", "", _row(head), _row(["---"] * len(head))]
    for name, r in rep["speculative"].items():
        if name == "plain":
            out.append(_row(["plain", "1", "-", f"{r['tokens_per_s']:.1f}", "-"]))
            continue
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        ll = r["lossless"]
        verdict = f"{ll['identical']} identical, {ll['near_tie']} near tie, {ll['diverged']} diverged"
        out.append(_row([name, f"{r['mean_accepted_length']:.2f}", acc, f"{r['tokens_per_s']:.1f}", verdict]))
    out += ["", "## Greedy samples", ""]
    for smp in rep["samples"]:
        # "text", not "python": samples need not parse (and ruff formats python blocks in Markdown).
        out += ["```text", smp["prompt"] + smp["completion"], "```", ""]
    return "\n".join(out)


def evaluate(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_preset_dir(args.model))
    cfg = Glm5NextConfig.from_pretrained(model_dir)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else ts.BOS
    train_paths, held_paths = ts.stdlib_files()
    held = [d for d in ts.read_files(held_paths) if d]
    corpus = ts.Corpus(train_paths, max_bytes=args.baseline_bytes)
    rep: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "setup": f"held-out modules {', '.join(ts.HELD_OUT_MODULES)}; CPU, {args.threads} thread(s); "
        f"index_topk {cfg.index_topk}",
        "baselines": ngram_baselines(corpus.stream, held),
    }
    t0 = time.perf_counter()
    bits: dict = {"ctx": args.ctx, "dense": {}, "sparse": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.ctx:
            chunks = windows(held, c, args.max_bytes)
            bits["bytes"] = sum(len(x) for x in chunks)
            bits["sparse"][str(c)] = runtime_bits(model_dir, chunks, bos)
            dense_dir = with_index_topk(model_dir, max(cfg.index_topk, 4 * ((c + 4) // 4)), tmp)
            bits["dense"][str(c)] = runtime_bits(dense_dir, chunks, bos)
            sparse, dense = bits["sparse"][str(c)], bits["dense"][str(c)]
            print(f"ctx {c}: sparse {sparse:.3f}  dense {dense:.3f} bits/byte", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rep["bits_per_byte"] = bits
    model, mtp = load_reference_with_mtp(model_dir)
    rec_chunks = windows(held, args.recall_ctx, args.recall_bytes)
    rep["indexer"] = indexer_recall(model, mtp, rec_chunks, bos)
    rep["fp8_agreement"] = runtime_selection_agreement(model_dir, model, rec_chunks[: args.fp8_chunks], bos)
    print(f"indexer: {json.dumps(rep['indexer'])}", flush=True)
    prompts = held_out_prompts(held, args.prompts, args.prompt_len)
    rep["speculative"] = spec_runs(model_dir, prompts, args.gen, args.ks, args.ngram_k)
    print(f"speculative: {json.dumps(rep['speculative'])}", flush=True)
    rep["samples"] = samples(model_dir, list(SAMPLE_PROMPTS[: args.num_samples]) + prompts[:1], args.sample_len)
    rep["eval_s"] = time.perf_counter() - t0
    if args.out_prefix:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_prefix)), exist_ok=True)
        with open(args.out_prefix + ".json", "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=1)
        with open(args.out_prefix + ".md", "w", encoding="utf-8") as f:
            f.write(markdown(rep))
        print(f"wrote {args.out_prefix}.json and .md", flush=True)
    return rep


QUICK = {
    "ctx": [64],
    "max_bytes": 512,
    "baseline_bytes": 100_000,
    "recall_ctx": 64,
    "recall_bytes": 256,
    "fp8_chunks": 1,
    "prompts": 2,
    "prompt_len": 48,
    "gen": 12,
    "ks": [1, 3],
    "num_samples": 1,
    "sample_len": 16,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--out-prefix", default=None, help="write PREFIX.json and PREFIX.md")
    p.add_argument("--ctx", type=int, nargs="+", default=[256, 1024], help="window lengths for bits per byte")
    p.add_argument("--max-bytes", type=int, default=65536, help="held-out bytes scored per window length")
    p.add_argument("--baseline-bytes", type=int, default=None, help="training bytes the n-gram baselines count")
    p.add_argument("--recall-ctx", type=int, default=1024, help="window length for the indexer recall")
    p.add_argument("--recall-bytes", type=int, default=16384, help="held-out bytes for the indexer recall")
    p.add_argument("--fp8-chunks", type=int, default=4, help="windows for the FP8-vs-float selection check")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts for speculative decoding")
    p.add_argument("--prompt-len", type=int, default=256, help="bytes per prompt (cut at a line end)")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="MTP draft lengths")
    p.add_argument("--ngram-k", type=int, default=7, help="n-gram draft length")
    p.add_argument("--num-samples", type=int, default=3, help="fixed sample prompts")
    p.add_argument("--sample-len", type=int, default=160, help="tokens per greedy sample")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="tiny amounts of everything (tests, smoke models)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    evaluate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

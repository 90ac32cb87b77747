"""Count the ``small`` preset's training targets and write its token-frequency ranking (the restricted draft
vocabulary's source: `trtllm_glm.speculative.draft_vocab`, ``MTPDecodingConfig.draft_vocab_size``).

The text is exactly the training corpus of `scripts/train_small.py` (`train_small.stdlib_files` and `Corpus`: each
non-empty training file's bytes followed by EOS); the counted tokens are the ones the model learnt to predict
(every byte and EOS; BOS only ever starts a window, it is never a target). The run checks that it read the
same number of bytes and files as the training run recorded in ``training_summary.json`` (same CPython
version's standard library), and refuses to write otherwise.

Usage::

    python scripts/token_frequency.py                     # writes trtllm_glm/presets/small/token_frequency.json
    python scripts/token_frequency.py --out /tmp/freq.json --no-check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import train_small  # noqa: E402

from trtllm_glm.speculative.draft_vocab import TOKEN_FREQUENCY_FILE  # noqa: E402

SMALL_DIR = os.path.join(ROOT, "trtllm_glm", "presets", "small")


def count_targets(paths: list[str]) -> tuple[list[int], int, int]:
    """``(counts [VOCAB], corpus bytes, files)`` over the training files as `train_small.Corpus` streams them."""
    counts = [0] * train_small.VOCAB
    total = files = 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        if not data:  # Corpus skips empty files (no EOS either)
            continue
        files += 1
        total += len(data)
        for b, n in enumerate(_byte_counts(data)):
            counts[b] += n
        counts[train_small.EOS] += 1
    return counts, total, files


def _byte_counts(data: bytes) -> list[int]:
    out = [0] * 256
    for b in set(data):
        out[b] = data.count(bytes([b]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(SMALL_DIR, TOKEN_FREQUENCY_FILE))
    ap.add_argument("--no-check", action="store_true", help="write even if the corpus differs from the training run's")
    args = ap.parse_args()
    train, _ = train_small.stdlib_files()
    counts, total, files = count_targets(train)
    with open(os.path.join(SMALL_DIR, "training_summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    # The summary's corpus_bytes is the stream's length: the bytes plus one EOS per file.
    want = (summary["corpus_bytes"], summary["corpus_files"])
    if (total + files, files) != want and not args.no_check:
        print(f"corpus differs from the training run's: {total + files} tokens / {files} files, trained on {want}")
        return 1
    # Most frequent first; ties (ids never seen) by id, so the file is reproducible.
    ranking = sorted(range(len(counts)), key=lambda t: (-counts[t], t))
    doc = {
        "description": "Token ids of the small preset, most frequent first, counted over its training targets "
        "(scripts/token_frequency.py); the restricted MTP draft vocabulary takes its first N ids.",
        "source": f"CPython {platform.python_version()} standard library training files of scripts/train_small.py "
        f"({files} files, {total} bytes, each followed by EOS)",
        "ranking": ranking,
        "counts": [counts[t] for t in ranking],
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    covered = {n: sum(counts[t] for t in ranking[:n]) / sum(counts) for n in (16, 32, 64, 96, 128)}
    print(f"wrote {args.out}: {sum(c > 0 for c in counts)} ids seen; share of targets in the top N: "
          + ", ".join(f"{n}: {v:.4f}" for n, v in covered.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

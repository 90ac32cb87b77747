"""Prompts from the small preset's held-out standard-library modules (as scripts/eval_small.py draws them)."""

from __future__ import annotations


def held_out_prompt_ids(n: int, length: int) -> list[list[int]]:
    """``n`` byte-token prompts of about ``length`` bytes from the small preset's held-out stdlib modules."""
    from scripts import eval_small, train_small  # heavy (the LLM API): only when a trained preset runs

    _, held = train_small.stdlib_files()
    texts = eval_small.held_out_prompts(train_small.read_files(held), n, length)
    return [list(t.encode("utf-8")) for t in texts]

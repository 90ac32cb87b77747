"""Prompts: from the small preset's held-out standard-library modules (as scripts/eval_small.py draws them), and
openings it continues well."""

from __future__ import annotations


def held_out_prompt_ids(n: int, length: int) -> list[list[int]]:
    """``n`` byte-token prompts of about ``length`` bytes from the small preset's held-out stdlib modules."""
    from scripts import eval_small, train_small  # heavy (the LLM API): only when a trained preset runs

    _, held = train_small.stdlib_files()
    texts = eval_small.held_out_prompts(train_small.read_files(held), n, length)
    return [list(t.encode("utf-8")) for t in texts]


# Openings the trained small preset continues well (its MTP drafts are accepted): the speculative tests' and the
# round benchmarks' prompts.
CODE_OPENINGS = [
    "    def __init__(self",
    "import os\nimport sys\n\n\ndef main(",
    "class Config:\n    def __init__(self, name",
    "for i in range(len(",
    "        return self.",
    "def test_",
    "    if not isinstance(value, str):\n        raise TypeError(",
    "from collections import ",
    "        self._data = {}\n        self._",
    "    @property\n    def ",
]

"""Reasoning output: a GLM model's thinking text split from its answer (``reasoning_content`` vs ``content``).

The ``glm45`` parser (SGLang's and vLLM's name): where the output starts (inside the thinking, or after a closed
``<think></think>``) is read from the rendered prompt's tail, an opening tag at the start of the output opens the
thinking, the first closing tag ends it, and everything after it is content, tags included. Streaming:
`ReasoningParser.feed` returns the ``(reasoning, content)`` text it can release per delta, holding back what may be
the beginning of a tag (a tag split across deltas is still found); `finish` releases the rest. docs/serving.md,
"Reasoning output".
"""

from __future__ import annotations

__all__ = [
    "ReasoningParser",
    "REASONING_PARSERS",
    "resolve_reasoning_parser",
    "split_reasoning",
    "partial_suffix",
    "grammar_reasoning",
]

REASONING_PARSERS = ("glm45",)

_OPEN, _CLOSE = "<think>", "</think>"


class ReasoningParser:
    """Splits one generation's text into thinking and answer, incrementally.

    Args:
        prompt_text: the rendered prompt (its tail says whether the output starts inside the thinking);
            ``None``: the output may open the thinking itself.
    """

    def __init__(self, prompt_text: str | None = None) -> None:
        tail = (prompt_text or "").rstrip()
        # "start": the thinking may still open; "think": inside it; "content": the answer.
        self._state = "think" if tail.endswith(_OPEN) else ("content" if tail.endswith(_CLOSE) else "start")
        self._held = ""
        self._after_close = False  # the answer's first text may begin with the template's newline after the tag
        self.thought = self._state == "think"  # whether the generation had a thinking part

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` released by ``text`` (either may be empty)."""
        buf = self._held + text
        self._held = ""
        reasoning, content = "", ""
        if self._state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(_OPEN):
                buf = stripped[len(_OPEN) :]
                self._state = "think"
                self.thought = True
            elif _OPEN.startswith(stripped):  # whitespace or a partial opening tag so far: wait for more
                self._held = buf
                return "", ""
            else:
                self._state = "content"
        if self._state == "think":
            i = buf.find(_CLOSE)
            if i >= 0:
                reasoning, buf = buf[:i], buf[i + len(_CLOSE) :]
                self._state = "content"
                self._after_close = True
            else:
                hold = partial_suffix(buf, _CLOSE)
                reasoning, self._held = buf[: len(buf) - hold], buf[len(buf) - hold :]
                return reasoning, ""
        if self._state == "content":
            if self._after_close and buf:
                buf = buf.lstrip("\n")  # the newline templates put after the closing tag is not answer text
                self._after_close = not buf
            content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back when the generation ends (a partial tag is text after all)."""
        held, self._held = self._held, ""
        if self._state == "think":
            return held, ""
        return "", held

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the thinking."""
        return self._state == "think"


def partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag`` (text a stream holds back until
    it knows whether ``tag`` starts there; the tool-call parser's too)."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


def split_reasoning(text: str, prompt_text: str | None = None) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of a whole generation."""
    p = ReasoningParser(prompt_text)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    reasoning = r1 + r2
    return (reasoning if p.thought else None), c1 + c2


def resolve_reasoning_parser(choice: str | None, template_source: str | None) -> str | None:
    """The parser a server uses: ``"auto"`` (default) picks ``glm45`` for a chat template that writes ``</think>``
    (the checkpoint's format), else none; ``"none"`` turns it off; a name picks it.

    Raises:
        ValueError: an unknown name.
    """
    if choice in (None, "auto"):
        return "glm45" if template_source and _CLOSE in template_source else None
    if choice == "none":
        return None
    if choice not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be auto, none or one of {REASONING_PARSERS}, got {choice!r}")
    return choice


def grammar_reasoning(prompt_text: str | None) -> str | None:
    """Where a constrained answer's grammar starts, for `GuidedDecodingParams.reasoning`, from the rendered prompt's
    tail (as `ReasoningParser` reads it): ``"inside"`` when the prompt opened the thinking, ``None`` when it closed
    it (thinking disabled: the grammar applies from the first token), else ``"optional"``."""
    state = ReasoningParser(prompt_text)._state
    return {"think": "inside", "content": None}.get(state, "optional")

"""Chat templates: the checkpoint's own (Jinja, as Hugging Face stores it) or a simple one for presets.

The preset template (`DEFAULT_CHAT_TEMPLATE`) writes GLM's role tags as plain text, one ``<|role|>`` line and the
content per message, then ``<|assistant|>`` and a newline for a generation prompt; the tokenizer adds BOS. A
checkpoint template (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``: a string, or a list
of ``{"name", "template"}`` from which ``default`` is taken) is rendered in a sandboxed Jinja environment with
``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``, and encoded without adding BOS (the
template writes its own special tokens, as Hugging Face's ``apply_chat_template`` expects). docs/serving.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatTemplate", "DEFAULT_CHAT_TEMPLATE", "load_chat_template", "ChatTemplateError", "RESERVED_VARIABLES"]

# Template variables a request's chat_template_kwargs may not replace.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"


class ChatTemplateError(ValueError):
    """A template cannot render these messages (the request is invalid, or the template is broken)."""


@dataclass
class ChatTemplate:
    """Renders chat messages to prompt token ids.

    Attributes:
        source: ``"preset"`` or the file the Jinja template came from.
        jinja: the Jinja source (``None`` for the preset template).
        special: ``bos_token`` / ``eos_token`` strings passed to the Jinja template.
    """

    source: str = "preset"
    jinja: str | None = None
    special: dict[str, str] | None = None

    def render(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, extra: dict | None = None
    ) -> str:
        """The prompt text of ``messages`` (each ``{"role", "content"}``, content already flattened); ``extra``:
        more template variables (a request's ``chat_template_kwargs``; the preset template has none to read)."""
        if self.jinja is None:
            text = "".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        bad = sorted(set(extra or ()) & RESERVED_VARIABLES)
        if bad:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(bad)}")
        return _render_jinja(self.jinja, messages, add_generation_prompt, {**(self.special or {}), **(extra or {})})

    def encode(
        self,
        tokenizer: Any,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = True,
        extra: dict | None = None,
        text: str | None = None,
    ) -> list[int]:
        """Prompt token ids of ``messages`` (or of ``text``, already rendered from them)."""
        text = self.render(messages, add_generation_prompt, extra) if text is None else text
        return list(tokenizer.encode(text, add_bos=self.jinja is None))


def _render_jinja(src: str, messages: Sequence[dict[str, str]], add_generation_prompt: bool, special: dict) -> str:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with torch
        raise ChatTemplateError("the checkpoint's chat template needs the 'jinja2' package") from e

    def raise_exception(msg: str) -> None:
        raise ChatTemplateError(msg)

    # trim_blocks / lstrip_blocks: what Hugging Face renders templates with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        tpl = env.from_string(src)
        return tpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


def _token_str(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def load_chat_template(model: str | os.PathLike[str]) -> ChatTemplate:
    """The chat template of a checkpoint directory, else the preset template.

    Args:
        model: a checkpoint directory or a preset name.

    Raises:
        ChatTemplateError: the directory holds a template that cannot be read or compiled.
    """
    d = os.fspath(model)
    if not os.path.isdir(d):
        return ChatTemplate()
    special: dict[str, str] = {}
    src: str | None = None
    where = ""
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ChatTemplateError(f"{cfg_path}: cannot read ({e})") from e
        if isinstance(cfg, dict):
            for k in ("bos_token", "eos_token"):
                s = _token_str(cfg.get(k))
                if s is not None:
                    special[k] = s
            ct = cfg.get("chat_template")
            if isinstance(ct, list):
                named = {x.get("name"): x.get("template") for x in ct if isinstance(x, dict)}
                ct = named.get("default")
            if isinstance(ct, str):
                src, where = ct, cfg_path
    jinja_path = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            src, where = f.read(), jinja_path
    if src is None:
        return ChatTemplate()
    tpl = ChatTemplate(source=where, jinja=src, special=special)
    # Compile now, so that a broken template fails at start-up rather than on the first request.
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(src)
    except ImportError:  # pragma: no cover
        pass
    except TemplateError as e:
        raise ChatTemplateError(f"{where}: chat template does not compile: {e}") from e
    return tpl

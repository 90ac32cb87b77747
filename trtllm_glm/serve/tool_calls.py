"""Tool calls in GLM's format: parsing a chat answer's ``<tool_call>`` blocks into OpenAI ``tool_calls``.

One block per call (SGLang's ``glm45`` / ``glm47``): the function name, then ``<arg_key>``/``<arg_value>`` pairs. A
value is read as JSON where the function's schema types the parameter as other than ``string`` (kept as a string when
it is not valid JSON); text before the first block is ``content``; a block that never closes stays text.
`ToolCallParser` works on streamed text (a possible tag start is held back; each call is released whole when its
block closes). `tool_call_grammar` writes the format as a grammar (llguidance's Lark dialect) for
``tool_choice: "required"`` and a named function. The format and the API: docs/serving.md, "Tool calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .reasoning import partial_suffix

__all__ = [
    "ToolCall",
    "ToolCallParser",
    "parse_tool_calls",
    "check_tools",
    "render_tool_call",
    "tool_call_grammar",
    "TOOL_PARSERS",
]

TOOL_PARSERS = ("glm45", "glm47")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name,
                                                                            "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


def check_tools(tools: Any) -> dict[str, dict]:
    """``name -> JSON schema of its parameters`` of a request's ``tools``; raises ``ValueError`` naming the problem.

    Each tool must be ``{"type": "function", "function": {"name": str, "description"?: str, "parameters"?: object}}``.
    """
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"tools.{i}: expected {{'type': 'function', 'function': {{...}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools.{i}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in out:
            raise ValueError(f"tools.{i}.function.name {name!r} is given twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools.{i}.function.parameters must be a JSON schema object")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ValueError(f"tools.{i}.function: unsupported key(s) {sorted(extra)}")
        out[name] = params
    return out


def _value(raw: str, schema: dict | None) -> Any:
    kind = (schema or {}).get("type", "string")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _parse_block(block: str, tools: dict[str, dict]) -> ToolCall | None:
    """A call from the text between ``<tool_call>`` and ``</tool_call>``; ``None`` if it names no known function."""
    head = block.split("<arg_key>", 1)[0]
    name = head.strip()
    if name not in tools:
        return None
    props = tools[name].get("properties", {}) if isinstance(tools[name], dict) else {}
    args = {k.strip(): _value(v.strip("\n"), props.get(k.strip())) for k, v in _ARG.findall(block)}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits a streamed answer into content and tool calls.

    Args:
        tools: ``name -> parameters schema`` (`check_tools`); blocks naming other functions stay text.
    """

    def __init__(self, tools: dict[str, dict]) -> None:
        self.tools = tools
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace between blocks (and after the last) is no answer text
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` released by ``text``."""
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    self._after_call = not self._buf
                i = self._buf.find(_OPEN)
                if i < 0:
                    hold = partial_suffix(self._buf, _OPEN)
                    content += self._buf[: len(self._buf) - hold]
                    self._buf = self._buf[len(self._buf) - hold :]
                    break
                content += self._buf[:i]
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(_CLOSE)
            if j < 0:
                break  # the block is still open: wait for its end
            block = self._buf[len(_OPEN) : j]
            call = _parse_block(block, self.tools)
            if call is None:
                content += self._buf[: j + len(_CLOSE)]  # not a call of a known function: text as it was
            else:
                calls.append(call)
                self._after_call = True
            self._buf = self._buf[j + len(_CLOSE) :]
            self._in_call = False
        self.calls += calls
        return content, calls

    def finish(self) -> str:
        """The generation ended: what is held back is text (an unclosed block included)."""
        held, self._buf, self._in_call = self._buf, "", False
        return held


def parse_tool_calls(text: str, tools: dict[str, dict]) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole answer."""
    p = ToolCallParser(tools)
    content, calls = p.feed(text)
    return content + p.finish(), calls


def render_tool_call(name: str, arguments: Any) -> str:
    """A call as GLM writes it (for assistant messages rendered back into a prompt by the preset template)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    parts = [f"{_OPEN}{name}\n"]
    for k, v in (arguments or {}).items() if isinstance(arguments, dict) else ():
        val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        parts.append(f"<arg_key>{k}</arg_key>\n<arg_value>{val}</arg_value>\n")
    return "".join(parts) + _CLOSE


# How generated JSON values are spaced inside a call (the server's response_format uses the same): see
# `trtllm_glm.runtime.grammar.JSON_DEFAULTS`; spelled here so that this module needs no runtime import.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_END_VALUE = '"</arg_value>"'


def _lit(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _is_text(schema: dict) -> bool:
    """Whether `_parse_block` keeps this parameter's value as raw text (`_value`)."""
    kind = schema.get("type", "string")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value_rule(schema: Any) -> str:
    """The grammar of one argument's value, ``</arg_value>`` included.

    Text parameters (the parser keeps their raw text): an enum or const of strings is a choice of literals, a
    pattern a full match of it, length bounds allow that many characters other than ``<``, and free text ends at
    the first ``</arg_value>``. Any other parameter is one JSON value valid under its schema.
    """
    schema = schema if isinstance(schema, dict) else {}
    if not _is_text(schema):
        sub = {**schema, "x-guidance": {**_JSON_LAYOUT, **(schema.get("x-guidance") or {})}}
        return f"%json {json.dumps(sub, ensure_ascii=False)} {_END_VALUE}"
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(_lit(c) for c in choices) + ") " + _END_VALUE
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        body = pattern.removeprefix("^").removesuffix("$").replace("/", "\\/")
        return f"/{body}/ {_END_VALUE}"
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        lo = lo if isinstance(lo, int) and lo >= 0 else 0
        hi_s = str(hi) if isinstance(hi, int) and hi >= lo else ""
        return "/[^<]{" + f"{lo},{hi_s}" + "}/ " + _END_VALUE
    # Free text: a lazy lexeme that ends with (and includes) the first </arg_value> (llguidance's `stop`). A
    # greedy one would swallow the closing tag's "<" and never close.
    return "free_text"


def tool_call_grammar(tools: dict[str, dict], names: list[str], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of an answer made only of calls, in GLM's format.

    Each call is a ``<tool_call>`` block of one of ``names`` whose arguments are the function's parameters in
    schema order (required ones always, optional ones maybe), each value following its parameter's schema
    (`_value_rule`), so that `parse_tool_calls` reads back arguments valid under the schema.

    Args:
        tools: ``name -> parameters schema`` (`check_tools`).
        names: the functions the answer may call (one for a named ``tool_choice``).
        parallel: one or more calls (blocks separated by a newline); else exactly one.
    """
    newline = _lit("\n")
    rules = [
        "start: call" + (f" ({newline} call)*" if parallel else ""),
        "call: " + " | ".join(f"call_{i}" for i in range(len(names))),
    ]
    for i, name in enumerate(names):
        params = tools[name] if isinstance(tools[name], dict) else {}
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        required = params.get("required")
        required = [k for k in required if isinstance(k, str)] if isinstance(required, list) else []
        parts = []
        for j, key in enumerate(list(props) + [k for k in required if k not in props]):
            head = _lit(f"<arg_key>{key}</arg_key>\n<arg_value>")
            rules.append(f"arg_{i}_{j}: {head} {_value_rule(props.get(key, {}))} {newline}")
            parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"call_{i}: {_lit(f'<tool_call>{name}')} {newline} {' '.join(parts)} {_lit('</tool_call>')}")
    rules.append('free_text[stop="</arg_value>"]: /(?s:.*)/')
    return "\n".join(rules) + "\n"

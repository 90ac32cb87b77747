"""Tool calls in GLM's format: parsing a chat answer's ``<tool_call>`` blocks into OpenAI ``tool_calls``.

GLM-4.5 and later call a function with a block per call (SGLang's ``glm45`` / ``glm47`` parsers read the same
shape; 4.7 leaves out the newlines)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

An argument's value is the text between its tags; where the function's JSON schema gives the parameter a type other
than ``string`` the value is read as JSON (``3``, ``true``, ``{"a": 1}``), and kept as a string when it is not valid
JSON. Text before the first block is the answer's ``content``; several blocks are parallel calls. A block that
never closes (the output was cut) stays text.

`ToolCallParser` works on streamed text: content is released as it comes, except what may be the start of a
``<tool_call>`` tag (held back until known), and each call is released whole when its block closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .reasoning import partial_suffix

__all__ = ["ToolCall", "ToolCallParser", "parse_tool_calls", "check_tools", "render_tool_call", "TOOL_PARSERS"]

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

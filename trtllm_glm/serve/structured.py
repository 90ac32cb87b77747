"""What a request's ``response_format`` and forcing ``tool_choice`` ask the output to match, as a grammar.

``response_format`` (OpenAI's shapes): ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` (any JSON
object), ``{"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}`` (one JSON
value valid under the schema; without a schema, any JSON object; the schema is enforced whatever ``strict``
says). ``tool_choice: "required"`` or ``{"type": "function", "function": {"name"}}``: the answer is only calls, in
GLM's format (`tool_calls.tool_call_grammar`). Each becomes a `GuidedDecodingParams` the sampler enforces; the
server compiles it before queueing the request, so an invalid schema is a 400 naming the problem.
"""

from __future__ import annotations

import re
from typing import Any

from ..runtime.grammar import GuidedDecodingParams
from .tool_calls import tool_call_grammar

__all__ = ["StructuredRequestError", "response_format_params", "tool_choice_params"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class StructuredRequestError(ValueError):
    """A ``response_format`` or ``tool_choice`` the server cannot honour (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_format_params(rf: Any) -> GuidedDecodingParams | None:
    """The grammar a ``response_format`` asks for (``None``: free text); raises `StructuredRequestError`."""
    if rf is None:
        return None
    p = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredRequestError(f"{p} must be an object with a 'type'", p)
    kind = rf["type"]
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise StructuredRequestError(
            f"{p}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{p}.type"
        )
    extra = sorted(set(rf) - allowed[kind])
    if extra:
        raise StructuredRequestError(f"{p}: unsupported key(s) {extra} for type {kind!r}", p)
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    js = rf.get("json_schema")
    q = f"{p}.json_schema"
    if not isinstance(js, dict):
        raise StructuredRequestError(f"{q} is required with type 'json_schema' (an object with 'name' and 'schema')", q)
    extra = sorted(set(js) - {"name", "description", "schema", "strict"})
    if extra:
        raise StructuredRequestError(f"{q}: unsupported key(s) {extra}", q)
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StructuredRequestError(f"{q}.name must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{q}.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise StructuredRequestError(f"{q}.strict must be a bool", f"{q}.strict")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise StructuredRequestError(f"{q}.description must be a string", f"{q}.description")
    schema = js.get("schema")
    if schema is None:
        return GuidedDecodingParams(json_object=True)
    if not isinstance(schema, (dict, bool)):
        raise StructuredRequestError(f"{q}.schema must be a JSON schema object, got {type(schema).__name__}",
                                     f"{q}.schema")  # fmt: skip
    return GuidedDecodingParams(json=schema if isinstance(schema, dict) else ("true" if schema else "false"))


def tool_choice_params(choice: Any, tools: dict[str, dict], parallel: bool) -> GuidedDecodingParams | None:
    """The grammar a forcing ``tool_choice`` asks for (``None`` for ``auto`` / ``none``).

    Args:
        choice: the request's ``tool_choice``.
        tools: ``name -> parameters schema`` of its ``tools`` (`tool_calls.check_tools`).
        parallel: ``parallel_tool_calls`` (``required`` then allows several calls; a named function is one).
    """
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return GuidedDecodingParams(grammar=tool_call_grammar(tools, list(tools), parallel=parallel))
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise StructuredRequestError(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        if set(choice) - {"type", "function"} or set(fn) - {"name"}:
            raise StructuredRequestError("tool_choice: only {'type': 'function', 'function': {'name'}}", "tool_choice")
        name = fn["name"]
        if name not in tools:
            raise StructuredRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                         "tool_choice")  # fmt: skip
        return GuidedDecodingParams(grammar=tool_call_grammar(tools, [name], parallel=False))
    raise StructuredRequestError(
        f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}", "tool_choice"
    )

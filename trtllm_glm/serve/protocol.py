"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) as strict pydantic models.

Strict: a wrong JSON type is an error rather than coerced (``"max_tokens": "5"`` is refused), and unknown
fields are refused by name (a misspelt ``max_token`` would otherwise be silently ignored). Extensions
shared with vLLM / trtllm-serve: ``top_k`` (-1 or 0 = off), ``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..runtime.sampling import MAX_LOGPROBS, MAX_N

# OpenAI's bound on temperature (the wire format's; SamplingParams itself has none).
MAX_TEMPERATURE = 2.0

__all__ = [
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "StreamOptions",
    "MAX_N",
    "format_validation_error",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``include_usage``: a last chunk with the usage. ``continuous_usage_stats`` (vLLM's extension):
    every chunk carries the usage so far, and every engine step that produced tokens makes a chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    # OpenAI's range (the Python API's SamplingParams takes any finite temperature >= 0, as TensorRT-LLM's).
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # str | list[str]; checked by the server (a clearer message than a pydantic union error).
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extension: the prompt's and each choice's token ids in the response (always, for a server without a
    # tokenizer, whose text is empty).
    return_token_ids: bool = False


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or a list of
    token-id lists; ``logprobs``: top tokens per position (0..20)."""

    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # vLLM's extension: the same structured output as chat's (json_object / json_schema).
    response_format: dict[str, Any] | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message. Unknown keys are refused by name, as at the top level. An assistant message may carry its
    ``tool_calls`` and a ``tool`` message the ``tool_call_id`` it answers (both reach the chat template);
    ``function_call`` (OpenAI's deprecated form) and ``audio`` are accepted only empty."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _no_tools(self) -> ChatMessage:
        for key in ("function_call", "audio"):
            if getattr(self, key):
                raise ValueError(f"{key} is not supported by this server (tool_calls is)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        for i, c in enumerate(self.tool_calls or ()):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    f"tool_calls.{i}: expected {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
                )
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``logprobs: true`` returns the chosen token's logprob, plus the
    ``top_logprobs`` most likely tokens (0..20)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's / SGLang's: extra variables for the chat template (GLM's ``enable_thinking: false`` turns thinking off).
    chat_template_kwargs: dict[str, Any] | None = None


def format_validation_error(e: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of the first pydantic error, worded for an API user."""
    err = e.errors(include_url=False)[0]
    # A key that is no UTF-8 text (a lone surrogate) is spelled with escapes: it must still name the parameter.
    loc = [str(x).encode("utf-8", "backslashreplace").decode("utf-8") for x in err.get("loc", ())]
    param = ".".join(loc) if loc else None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"unsupported parameter {param!r}", param
    if kind == "missing":
        return f"missing required parameter {param!r}", param
    if param == "temperature" and kind == "less_than_equal":
        return (f"temperature: at most {MAX_TEMPERATURE:g} on this API, as OpenAI's (got {err.get('input')!r}; "
                "the Python API's SamplingParams takes any finite temperature >= 0)"), param  # fmt: skip
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return f"{param}: {err.get('msg', 'invalid value')} (got {shown})", param

"""Request checks shared by both front doors: `LLM.generate` / `generate_async` and the HTTP server.

A request that cannot be served as asked is refused before it is queued, with one message naming the
argument, rather than being trimmed silently: the server answers these with HTTP 400 (``param`` and ``code``
go into its OpenAI error object), the Python API raises them (`InvalidRequestError` is a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling import SamplingParams

__all__ = ["InvalidRequestError", "check_text", "check_prompt_ids", "check_request"]


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked.

    Args:
        message: what is wrong, naming the argument.
        param: the argument (the server's error ``param``), e.g. ``"prompt"``, ``"max_tokens"``.
        code: a short machine-readable code (``"context_length_exceeded"``), or ``None``.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_text(text: str, param: str = "prompt") -> None:
    """Refuse text that has no UTF-8 encoding (a lone surrogate such as ``"\\ud800"``, which JSON and Python
    strings can carry but no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{param}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character {e.start})",
            param=param,
        ) from None


def check_prompt_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """A token-id prompt must be non-empty and inside the vocabulary."""
    if len(ids) == 0:
        raise InvalidRequestError(f"{param}: the prompt is empty", param=param)
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})", param=param)


def check_request(
    prompt_len: int,
    params: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> None:
    """Refuse a request whose prompt plus ``max_tokens`` exceeds the context limit, or whose
    ``stop_token_ids`` lie outside the vocabulary (they could never match).

    Args:
        prompt_len: prompt tokens.
        params: validated sampling parameters.
        vocab_size: the model's vocabulary size.
        max_seq_len: longest prompt + output the engine serves (``executor.max_seq_len``).
        prompt_param, max_tokens_param: the names the messages use for the two arguments.
    """
    if prompt_len >= max_seq_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_seq_len} tokens, but the prompt has {prompt_len} "
            f"tokens, which leaves no room to generate",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if prompt_len + params.max_tokens > max_seq_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_seq_len} tokens, but {prompt_len + params.max_tokens} "
            f"were requested ({prompt_len} in the prompt, {params.max_tokens} in {max_tokens_param}); lower "
            f"{max_tokens_param} to at most {max_seq_len - prompt_len}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    for t in params.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})", param="stop_token_ids"
            )

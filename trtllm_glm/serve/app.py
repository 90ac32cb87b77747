"""The OpenAI-compatible FastAPI app over an `AsyncEngine`.

Routes (shapes as trtllm-serve / vLLM): ``GET /health``, ``GET /health_generate``, ``GET /version``,
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics``.

Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
parameters and prompts that do not fit, 404 for an unknown model or route, 503 (with ``Retry-After``)
when the queue is full or the server is shutting down, 500 when generation itself failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from .. import __version__
from ..errors import CapacityError
from ..runtime.grammar import GuidedDecodingParams
from ..runtime.sampling import MAX_STOP_STRINGS, Logprob, SamplingParams
from ..runtime.tokenizer import NoTokenizer
from ..runtime.validation import InvalidRequestError, check_prompt_ids, check_request, check_text
from .chat import RESERVED_VARIABLES, ChatTemplate, ChatTemplateError
from .engine import AsyncEngine, Delta, EngineStoppedError, GenerationRequest, QueueFullError, ResultStream
from .metrics import CONTENT_TYPE_LATEST
from .output import TokenStrings
from .protocol import ChatCompletionRequest, CompletionRequest, format_validation_error
from .reasoning import ReasoningParser, grammar_reasoning, split_reasoning
from .structured import StructuredRequestError, response_format_params, tool_choice_params
from .tool_calls import ToolCallParser, check_tools, parse_tool_calls, render_tool_call

__all__ = ["build_app", "ApiError"]

log = logging.getLogger("trtllm_glm.serve")

# Seconds a client told "overloaded" should wait before retrying.
RETRY_AFTER_S = 1
# Logprobs below this are reported as this (JSON has no -inf).
MIN_LOGPROB = -9999.0


class ApiError(Exception):
    """An error the client should see as an OpenAI error object.

    Args:
        status: HTTP status.
        message: what was wrong, naming the parameter.
        type: OpenAI error type (``invalid_request_error``, ``server_error``...).
        param: the offending parameter, if any.
        code: a short machine-readable code.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _invalid(e: InvalidRequestError) -> ApiError:
    return ApiError(400, str(e), param=e.param, code=e.code)


def check_text_param(text: str, param: str) -> None:
    """`check_text` answered with HTTP 400."""
    try:
        check_text(text, param)
    except InvalidRequestError as e:
        raise _invalid(e) from None


class _EventStream(StreamingResponse):
    """Server-sent events that always run ``on_close`` when the response ends, however it ends (client
    disconnect, cancellation, error), so that an abandoned request is aborted and frees its pages."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
            if spec >= (2, 4):  # the server reports a closed connection itself: Starlette's way, no watch
                await super().__call__(scope, receive, send)
                return
            await self._stream_until_disconnect(receive, send)
            if self.background is not None:
                await self.background()
        finally:
            self._on_close()

    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        """`StreamingResponse`'s way for servers of ASGI spec < 2.4 (uvicorn's): stream the body while ``receive`` is
        watched for the client's disconnect, which stops the stream; an error of either is raised here, and a
        cancellation of this task cancels the stream and waits for it. Starlette runs the two in an anyio task group,
        ~35 us of the event loop per response (bench_api), paid by every request of a burst before the next one is
        parsed. The body streams in a task of its own rather than in this one, so that a chunk's wake-up resumes
        that task's few frames, not every middleware's."""
        loop = asyncio.get_running_loop()
        streamer = loop.create_task(self.stream_response(send))
        ended: list[BaseException | None] = []  # what ended the watch: None for a disconnect, else its error

        async def watch() -> None:
            try:
                await self.listen_for_disconnect(receive)
                ended.append(None)
            except Exception as e:  # noqa: BLE001 - raised in the request's task, as Starlette's task group does
                ended.append(e)
            streamer.cancel()

        watcher = loop.create_task(watch())
        try:
            await streamer  # a cancellation of this task cancels the stream, then arrives here
        except asyncio.CancelledError:
            if not ended or _cancelling():
                raise
            if ended[0] is not None:
                raise ended[0] from None
        finally:
            watcher.cancel()


def _cancelling() -> int:
    """Cancellations of the current task still requested (``Task.cancelling``, Python 3.11+; 0 on 3.10, which does
    not count them)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


class _RequestRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns a ``Response`` itself (listed in ``/openapi.json``
    as any route). FastAPI's handler would solve dependencies, look for a body parameter and serialise a
    return value on every request, none of which such an endpoint has: ~20 us per request (bench_api)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        return self.endpoint


# ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` without building an encoder per call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


def _chunk_prefix(head: dict[str, Any]) -> str:
    """The start every chunk of one streamed response shares, ``data: {<head's fields>,"choices":[``, serialised
    once per response rather than once per chunk (`_chunk` completes it)."""
    return f'data: {_JSON.encode(head)[:-1]},"choices":['


def _chunk(prefix: str, choices: str, tail: str) -> str:
    """An SSE event, byte for byte ``_sse({**head, "choices": [*choices], **extra})``: ``prefix`` of ``head``
    (`_chunk_prefix`), ``choices`` the serialised choices comma-separated, ``tail`` the serialised ``extra``
    fields, each with its leading comma (``""`` when none)."""
    return f"{prefix}{choices}]{tail}}}\n\n"


def _lp(x: float) -> float:
    return x if math.isfinite(x) and x > MIN_LOGPROB else MIN_LOGPROB


@dataclass
class _Choice:
    """A generation's accumulated output (non-streaming responses)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0


@dataclass
class _Job:
    """A validated generation request, ready to submit."""

    gens: list[GenerationRequest]
    prompt_lens: list[int]  # per prompt (usage counts each prompt once, whatever n is)
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk, a chunk per token-producing step
    logprobs: int | None  # top tokens per position, None: no logprobs
    token_ids: bool = False  # return the prompt's and the choices' token ids
    prompts: list[list[int]] = field(default_factory=list)
    n: int = 1  # choices per prompt
    # When the request entered the app (``perf_counter``, the clock of every process on the machine): the server's
    # TTFT account starts here, body parsing and validation included.
    arrival: float | None = None


class _Server:
    """Request handling shared by the routes (one per app)."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate, reasoning_parser: str | None = None
    ) -> None:
        self.reasoning_parser = reasoning_parser  # "glm45" or None (serve/reasoning.py)
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.token_strings = TokenStrings(engine.tokenizer)
        self.created = int(time.time())

    # --------------------------------------------------------------------------------------------
    # Parsing and validation
    async def parse(self, request: Request, cls: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
        for key in obj:  # a field named by text with no UTF-8 form (a lone surrogate) is named with escapes
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                raise ApiError(400, f"unsupported parameter {name!r}", param=name) from None
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            msg, param = format_validation_error(e)
            raise ApiError(400, msg, param=param) from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    def common(self, req: Any) -> tuple[list[str], dict[str, Any]]:
        """Checks shared by both routes; returns the stop strings and SamplingParams keyword arguments."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) != 0:
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        if req.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        stop = req.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
        if any(s == "" for s in stop):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        for i, s in enumerate(stop):  # as prompts: text that has no UTF-8 form can never match generated text
            try:
                check_text(s, f"stop[{i}]")
            except InvalidRequestError as e:
                raise ApiError(400, str(e), param="stop") from None
        kw = dict(
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            top_k=max(0, req.top_k),
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
            ignore_eos=req.ignore_eos,
        )
        return stop, kw

    def token_prompt(self, ids: list[int], param: str) -> list[int]:
        # Bounds in C first: check_prompt_ids' loop over every id (~3 us per 30 ids) only runs to name a bad one.
        if ids and min(ids) >= 0 and max(ids) < self.engine.vocab_size:
            return ids
        try:
            check_prompt_ids(ids, self.engine.vocab_size, param)
        except InvalidRequestError as e:
            raise _invalid(e) from None
        return ids

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of prompt text; text no tokenizer can encode (a lone surrogate; a checkpoint without a
        tokenizer) is the client's error."""
        try:
            check_text(text, param)
            return self.tokenizer.encode(text)
        except InvalidRequestError as e:
            raise _invalid(e) from None
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def completion_prompts(self, p: Any) -> list[list[int]]:
        if isinstance(p, str):
            return [self.token_prompt(self.encode(p, "prompt"), "prompt")]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return [self.token_prompt(self.encode(x, f"prompt.{i}"), f"prompt.{i}") for i, x in enumerate(p)]
            if _is_ids(p):
                return [self.token_prompt(list(p), "prompt")]
            if all(isinstance(x, list) and _is_ids(x) for x in p):
                return [self.token_prompt(list(x), f"prompt.{i}") for i, x in enumerate(p)]
        if isinstance(p, list) and not p:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        raise ApiError(
            400, "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            param="prompt",
        )  # fmt: skip

    def build_job(
        self,
        prompts: list[list[int]],
        req: Any,
        max_tokens: int | None,
        max_tokens_param: str,
        logprobs: int | None,
        prompt_param: str = "prompt",
        guided: GuidedDecodingParams | None = None,
        best_of: int | None = None,
    ) -> _Job:
        stop, kw = self.common(req)
        limit = self.engine.max_seq_len
        n = req.n if best_of is None else best_of  # best_of: that many generated, the best n returned
        if len(prompts) * n > self.engine.capacity:
            what = "n" if best_of is None else "best_of"
            raise ApiError(
                400, f"{len(prompts)} prompt(s) x {what}={n} sequences exceed what this server holds at once "
                f"({self.engine.capacity})", param=what,
            )  # fmt: skip
        gens: list[GenerationRequest] = []
        for ids in prompts:
            # Without max_tokens the completion may fill the context (at least one token, so that a prompt
            # with no room left is refused below by the shared check).
            mt = max(1, limit - len(ids)) if max_tokens is None else max_tokens
            for j in range(n):
                seed = kw["seed"]
                if seed is not None and n > 1:
                    seed = seed + j  # distinct choices from one seed, still reproducible
                try:
                    sp = SamplingParams(
                        max_tokens=mt, logprobs=logprobs, guided_decoding=guided, **{**kw, "seed": seed}
                    )
                    check_request(
                        len(ids), sp, vocab_size=self.engine.vocab_size, max_seq_len=limit,
                        prompt_param=prompt_param, max_tokens_param=max_tokens_param,
                    )  # fmt: skip
                except InvalidRequestError as e:
                    raise _invalid(e) from None
                except ValueError as e:
                    raise ApiError(400, str(e)) from None
                gens.append(GenerationRequest(ids, sp, stop))
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = bool(so and so.continuous_usage_stats)
        token_ids = bool(req.return_token_ids) or isinstance(self.tokenizer, NoTokenizer)
        return _Job(gens, [len(p) for p in prompts], req.stream, include_usage, continuous, logprobs, token_ids,
                    prompts, n)  # fmt: skip

    async def check_grammar(self, guided: GuidedDecodingParams | None, param: str) -> None:
        """Compile a request's grammar before it is queued (then cached for its generations): an invalid schema
        or grammar is the client's error, named. Compiled off the event loop (a large schema takes a while)."""
        if guided is None:
            return
        compiler = getattr(self.engine, "grammar_compiler", None)
        if compiler is None:
            raise ApiError(400, f"{param}: structured output is not available on this server", param=param)
        try:
            await asyncio.to_thread(compiler.compile, guided)
        except (ValueError, TypeError, RuntimeError, RecursionError) as e:  # what the grammar library says of it
            raise ApiError(400, f"{param}: {e}", param=param) from None

    # --------------------------------------------------------------------------------------------
    # Submission and collection
    async def submit(self, job: _Job) -> ResultStream:
        m = self.engine.metrics
        failed = self.engine.fatal_error()
        if failed is not None:  # a rank of the world died: nothing can run (the server is shutting down)
            m.requests_rejected.labels(reason="shutting_down").inc()
            raise ApiError(
                503, f"a model rank failed: {failed}; the server is shutting down", type="server_error",
                code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        try:
            return await self.engine.submit(job.gens, arrival=job.arrival)
        except QueueFullError as e:
            m.requests_rejected.labels(reason="overloaded").inc()
            raise ApiError(
                503, str(e), type="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except EngineStoppedError as e:
            m.requests_rejected.labels(reason="shutting_down").inc()
            raise ApiError(
                503, str(e), type="server_error", code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except CapacityError as e:
            raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def collect(self, request: Request, stream: ResultStream) -> list[_Choice] | None:
        """Every generation's full output; ``None`` when the client disconnected first (aborted)."""
        choices = [_Choice() for _ in range(stream.n)]

        async def consume() -> None:
            async for d in stream:
                c = choices[d.index]
                c.text.append(d.text)
                c.token_ids.extend(d.token_ids)
                if d.logprobs is not None:
                    c.logprobs.extend(d.logprobs)
                c.offsets.extend(d.text_offsets)
                c.num_output_tokens = d.num_output_tokens
                if d.finish_reason is not None:
                    c.finish_reason, c.error = d.finish_reason, d.error

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
                return choices
            return None
        finally:
            watch.cancel()
            work.cancel()
            stream.abort()

    # --------------------------------------------------------------------------------------------
    # Logprob formatting
    def completion_logprobs(self, ids: list[int], lps: list[dict[int, Logprob]], offsets: list[int]) -> dict:
        tokens, token_lps, tops = [], [], []
        for t, d in zip(ids, lps):
            s, _ = self.token_strings(t)
            tokens.append(s)
            token_lps.append(_lp(d[t].logprob))
            tops.append({self.token_strings(k)[0]: _lp(v.logprob) for k, v in d.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets[: len(ids)]}

    def chat_logprobs(self, ids: list[int], lps: list[dict[int, Logprob]], k: int) -> dict:
        content = []
        for t, d in zip(ids, lps):
            s, b = self.token_strings(t)
            # The k most likely tokens (the chosen one leads the dict; a stable sort keeps it first in a tie).
            top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
            content.append({
                "token": s, "logprob": _lp(d[t].logprob), "bytes": b,
                "top_logprobs": [
                    {"token": self.token_strings(i)[0], "logprob": _lp(v.logprob), "bytes": self.token_strings(i)[1]}
                    for i, v in top
                ],
            })  # fmt: skip
        return {"content": content}

    @staticmethod
    def usage(job: _Job, completion_tokens: int) -> dict[str, int]:
        p = sum(job.prompt_lens)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    @staticmethod
    def usage_tail(job: _Job, completion_tokens: int) -> str:
        """A chunk's ``usage`` field with its leading comma, as `_chunk` takes it: ``_JSON.encode`` of `usage`
        written directly (three integers; with continuous usage every chunk carries one)."""
        p = sum(job.prompt_lens)
        return (f',"usage":{{"prompt_tokens":{p},"completion_tokens":{completion_tokens},'
                f'"total_tokens":{p + completion_tokens}}}')  # fmt: skip

    @staticmethod
    def error_event(message: str) -> str:
        return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": "generation_failed"}})

    # --------------------------------------------------------------------------------------------
    # /v1/completions
    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        best_of = req.best_of if req.best_of is not None and req.best_of != req.n else None
        if best_of is not None:  # (OpenAI's and vLLM v0's rules)
            if best_of < req.n:
                raise ApiError(400, f"best_of ({best_of}) must be >= n ({req.n})", param="best_of")
            if req.stream:
                raise ApiError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
        self.check_model(req.model)
        try:
            guided = response_format_params(req.response_format)
        except StructuredRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        prompts = self.completion_prompts(req.prompt)
        await self.check_grammar(guided, "response_format")
        # best_of > n ranks by the chosen tokens' logprobs: computed for every generation, returned as asked.
        lp = req.logprobs if best_of is None else (req.logprobs or 0)
        job = self.build_job(prompts, req, req.max_tokens, "max_tokens", lp, guided=guided, best_of=best_of)
        job.arrival = arrival
        stream = await self.submit(job)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if job.stream:
            return _EventStream(self._completion_events(job, stream, rid, created), stream.abort)
        choices = await self.collect(request, stream)
        if choices is None:
            return Response(status_code=499)
        self._raise_failed(choices)
        generated = sum(c.num_output_tokens for c in choices)  # usage counts every generation, best_of's too
        if best_of is not None:
            choices = _best_choices(choices, best_of, req.n)
            job.n, job.logprobs = req.n, req.logprobs
        out = []
        for i, c in enumerate(choices):
            lp = self.completion_logprobs(c.token_ids, c.logprobs, c.offsets) if job.logprobs is not None else None
            ch = {"index": i, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason}
            if job.token_ids:
                ch.update(prompt_token_ids=job.prompts[i // job.n], token_ids=c.token_ids)
            out.append(ch)
        body = {
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name, "choices": out,
            "usage": self.usage(job, generated),
        }  # fmt: skip
        return JSONResponse(body)

    def _completion_events(self, job: _Job, stream: ResultStream, rid: str, created: int) -> AsyncIterator[str]:
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def choice(d: Delta) -> dict:
            lp = None
            if job.logprobs is not None and d.token_ids:
                lp = self.completion_logprobs(d.token_ids, d.logprobs or [], d.text_offsets)
            ch = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
            if job.token_ids:
                ch["token_ids"] = d.token_ids
                if d.index not in sent_prompt:  # the prompt's ids once, with the choice's first chunk
                    sent_prompt.add(d.index)
                    ch["prompt_token_ids"] = job.prompts[d.index // job.n]
            return ch

        sent_prompt: set[int] = set()
        return self._stream_events(job, stream, head, choice)

    async def _stream_events(
        self, job: _Job, stream: ResultStream, head: dict, choice, prelude: tuple[dict, ...] = ()
    ) -> AsyncIterator[str]:
        """Server-sent events of one streamed request (completions and chat share this loop).

        Args:
            job: the request's options (logprobs, usage reporting).
            stream: its deltas.
            head: fields every chunk carries (id, object, created, model).
            choice: builds the chunk's choice from a delta.
            prelude: choices sent before any delta (chat's role chunk per choice).
        """
        done_tokens: dict[int, int] = {}
        so_far: dict[int, int] = {}
        prefix = _chunk_prefix(head)
        # With usage reporting on, every chunk carries a usage field (null until the final chunk, unless
        # continuous usage is asked for).
        usage_none = ',"usage":null' if job.include_usage or job.continuous_usage else ""
        try:
            for c in prelude:
                yield _chunk(prefix, _JSON.encode(c), usage_none)
            async for d in stream:
                if d.error is not None:
                    yield self.error_event(d.error)
                    stream.abort()
                    break
                # Tokens whose text is still held back (half a character, maybe a stop string) make no
                # chunk of their own unless their logprobs or running usage must be sent.
                keep = d.token_ids and (job.logprobs is not None or job.continuous_usage or job.token_ids)
                if not d.text and d.finish_reason is None and not keep:
                    continue
                so_far[d.index] = d.num_output_tokens
                tail = usage_none
                if job.continuous_usage:
                    tail = self.usage_tail(job, sum(so_far.values()))
                yield _chunk(prefix, _JSON.encode(choice(d)), tail)
                if d.finish_reason is not None:
                    done_tokens[d.index] = d.num_output_tokens
            else:
                if job.include_usage:
                    yield _chunk(prefix, "", self.usage_tail(job, sum(done_tokens.values())))
            yield "data: [DONE]\n\n"
        finally:
            stream.abort()

    # --------------------------------------------------------------------------------------------
    # /v1/chat/completions
    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        tools, guided, guided_param = self.check_structured(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text":
                        raise ApiError(
                            400, f"messages.{i}.content.{j}: only text parts are supported, got type {part.type!r}",
                            param=f"messages.{i}.content",
                        )  # fmt: skip
                    if part.text is None:
                        raise ApiError(
                            400, f"messages.{i}.content.{j}: a text part needs a 'text' string",
                            param=f"messages.{i}.content",
                        )  # fmt: skip
                    check_text_param(part.text, f"messages.{i}.content.{j}.text")
                    parts.append(part.text)
                content = "".join(parts)
            elif isinstance(content, str):
                check_text_param(content, f"messages.{i}.content")
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        if self.chat_template.jinja is None:  # the preset template writes text only: calls and tools as GLM does
            messages = _flatten_tools(messages, req.tools)
        extra = dict(req.chat_template_kwargs or {})
        bad = sorted(set(extra) & RESERVED_VARIABLES)
        if bad:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
        if req.tools and self.chat_template.jinja is not None:
            extra["tools"] = req.tools  # Hugging Face's apply_chat_template(tools=...) variable
        try:
            prompt_text = self.chat_template.render(messages, req.add_generation_prompt, extra)
            ids = self.chat_template.encode(self.tokenizer, messages, text=prompt_text)
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        except ValueError as e:  # the tokenizer refused the rendered text (a checkpoint without a tokenizer)
            raise ApiError(400, f"messages: {e}", param="messages") from None
        ids = self.token_prompt(ids, "messages")
        if req.max_completion_tokens is not None and req.max_tokens is not None:
            raise ApiError(400, "give max_completion_tokens or max_tokens, not both", param="max_tokens")
        mt, mt_param = req.max_completion_tokens, "max_completion_tokens"
        if mt is None:
            mt, mt_param = req.max_tokens, "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if guided is not None and self.reasoning_parser is not None:  # think first, then the constrained answer
            guided = dataclasses.replace(guided, reasoning=grammar_reasoning(prompt_text))
        await self.check_grammar(guided, guided_param)
        job = self.build_job([ids], req, mt, mt_param, logprobs, prompt_param="messages", guided=guided)
        job.arrival = arrival
        stream = await self.submit(job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        # A constrained answer follows the thinking (the grammar starts after the closing tag: runtime/grammar.py).
        parse = self.reasoning_parser is not None
        if job.stream:
            events = self._chat_events(job, stream, rid, created, prompt_text if parse else None, tools,
                                       req.parallel_tool_calls)  # fmt: skip
            return _EventStream(events, stream.abort)
        choices = await self.collect(request, stream)
        if choices is None:
            return Response(status_code=499)
        self._raise_failed(choices)
        out = []
        for i, c in enumerate(choices):
            lp = self.chat_logprobs(c.token_ids, c.logprobs, logprobs) if logprobs is not None else None
            message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text)}
            if parse:
                reasoning, message["content"] = split_reasoning(message["content"], prompt_text)
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
            finish = c.finish_reason
            if tools is not None:
                message["content"], calls = parse_tool_calls(message["content"], tools)
                if not req.parallel_tool_calls:
                    calls = calls[:1]
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    message["content"] = message["content"] or None
                    finish = "tool_calls"
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            if job.token_ids:
                out[-1]["token_ids"] = c.token_ids
        body = {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name, "choices": out,
            "usage": self.usage(job, sum(c.num_output_tokens for c in choices)),
        }  # fmt: skip
        if job.token_ids:
            body["prompt_token_ids"] = job.prompts[0]
        return JSONResponse(body)

    def _chat_events(
        self,
        job: _Job,
        stream: ResultStream,
        rid: str,
        created: int,
        prompt_text: str | None = None,
        tools: dict[str, dict] | None = None,
        parallel_tool_calls: bool = True,
    ) -> AsyncIterator[str]:
        """``prompt_text``: the rendered prompt when a reasoning parser splits the thinking from the answer;
        ``tools``: the functions whose calls are parsed out of the answer (streamed whole, one delta each)."""
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        k = job.logprobs
        parsers: dict[int, ReasoningParser] = {}
        tool_parsers: dict[int, ToolCallParser] = {}

        def choice(d: Delta) -> dict:
            lp = self.chat_logprobs(d.token_ids, d.logprobs or [], k) if k is not None and d.token_ids else None
            if prompt_text is not None:
                p = parsers.setdefault(d.index, ReasoningParser(prompt_text))
                reasoning, content = p.feed(d.text)
                if d.finish_reason is not None:
                    r2, c2 = p.finish()
                    reasoning, content = reasoning + r2, content + c2
            else:
                reasoning, content = "", d.text
            delta: dict[str, Any] = {}
            finish = d.finish_reason
            if tools is not None:
                tp = tool_parsers.setdefault(d.index, ToolCallParser(tools))
                done_before = len(tp.calls)
                content, calls = tp.feed(content)
                if d.finish_reason is not None:
                    content += tp.finish()
                if not parallel_tool_calls:
                    calls = calls[: max(0, 1 - done_before)]
                if calls:
                    delta["tool_calls"] = [c.to_openai(index=done_before + n) for n, c in enumerate(calls)]
                if finish is not None and tp.calls:
                    finish = "tool_calls"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or (prompt_text is None and tools is None and d.finish_reason is None):
                delta["content"] = content
            ch = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if job.token_ids:
                ch["token_ids"] = d.token_ids
            return ch

        # The role comes first, once per choice.
        prelude = tuple(
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(stream.n)
        )
        return self._stream_events(job, stream, head, choice, prelude)

    @staticmethod
    def check_structured(req: ChatCompletionRequest) -> tuple[dict[str, dict] | None, GuidedDecodingParams | None, str]:
        """From ``tools``, ``tool_choice`` and ``response_format``: the functions whose calls are parsed from the
        answers (``None``: no parsing), the grammar the answer must follow (``None``: free text) and the
        parameter that asked for it. ``tool_choice: "required"`` and a named function are enforced by a grammar
        of GLM's call format (serve/structured.py), so they hold for any model."""
        choice = req.tool_choice
        try:
            fmt = response_format_params(req.response_format)
            if not req.tools:
                if choice not in (None, "none", "auto"):
                    raise ApiError(400, "tool_choice needs tools", param="tool_choice")
                return None, fmt, "response_format"
            try:
                tools = check_tools(req.tools)
            except ValueError as e:
                raise ApiError(400, str(e), param="tools") from None
            forced = tool_choice_params(choice, tools, req.parallel_tool_calls)
        except StructuredRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        if forced is not None:
            if fmt is not None:
                raise ApiError(400, "response_format cannot be combined with a tool_choice that forces a call",
                               param="response_format")  # fmt: skip
            return tools, forced, "tool_choice"
        return (None if choice == "none" else tools), fmt, "response_format"

    def _raise_failed(self, choices: list[_Choice]) -> None:
        down = getattr(self.engine, "down_reason", None)  # the engine process died: unavailable, not a bad request
        for c in choices:
            if c.error is not None and down is not None:
                raise ApiError(503, down, type="server_error", code="unavailable")
            if c.error is not None:
                raise ApiError(500, c.error, type="server_error", code="generation_failed")

    # --------------------------------------------------------------------------------------------
    async def health_generate(self) -> Response:
        ids = [self.tokenizer.bos_id if getattr(self.tokenizer, "bos_id", None) is not None else 0]
        try:
            stream = await self.engine.submit([GenerationRequest(ids, SamplingParams(max_tokens=1))])
            deltas: list[Delta] = [d async for d in stream]
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            raise ApiError(503, f"generation check failed: {e}", type="server_error", code="unhealthy") from None
        last = deltas[-1]
        if last.finish_reason not in ("stop", "length"):
            raise ApiError(503, f"generation check failed: {last.error or last.finish_reason}", type="server_error",
                           code="unhealthy")  # fmt: skip
        return Response(status_code=200)


def _is_ids(xs: list[Any]) -> bool:
    """Every item is a JSON integer (``type`` rather than ``isinstance``: a JSON boolean is a ``bool``, an ``int``
    subclass, and no token id)."""
    return all(type(x) is int for x in xs)


def _best_choices(choices: list[_Choice], best_of: int, n: int) -> list[_Choice]:
    """Per prompt, the ``n`` of its ``best_of`` generations with the highest cumulative logprob (the sum of the chosen
    tokens' logprobs under the model's raw distribution; vLLM v0's ranking), best first (ties: generation order)."""
    out: list[_Choice] = []
    for p in range(0, len(choices), best_of):
        group = choices[p : p + best_of]
        score = [sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)) for c in group]
        out.extend(group[k] for k in sorted(range(len(group)), key=lambda k: -score[k])[:n])
    return out


def _flatten_tools(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[dict[str, Any]]:
    """Messages for the preset template (text only): the tools as a system message in front, an assistant's calls
    written into its content as GLM writes them, a tool's answer as a ``tool`` message."""
    out = []
    if tools:
        out.append({"role": "system", "content": "# Tools\n" + json.dumps(tools, ensure_ascii=False)})
    for m in messages:
        content = m["content"]
        for c in m.get("tool_calls") or ():
            fn = c["function"]
            content += ("\n" if content else "") + render_tool_call(fn["name"], fn.get("arguments"))
        out.append({"role": m["role"], "content": content})
    return out


def build_app(
    engine: AsyncEngine,
    *,
    served_model_name: str,
    chat_template: ChatTemplate | None = None,
    manage_engine: bool = True,
    drain_timeout: float = 30.0,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app.

    Args:
        engine: the engine to serve.
        served_model_name: the ``model`` the app answers to (others get 404).
        chat_template: how chat messages become a prompt (default: the preset template).
        manage_engine: start the engine on app start-up and stop it (draining) on shutdown; ``False`` when
            the caller owns the engine's lifetime (tests that drive the app in-process).
        drain_timeout: seconds in-flight requests get to finish at shutdown before they are aborted.
        reasoning_parser: ``"glm45"``: chat answers carry the thinking text in ``reasoning_content`` (streamed as
            its own deltas), apart from ``content``; ``None``: all text is content (serve/reasoning.py).
    """
    srv = _Server(engine, served_model_name, chat_template or ChatTemplate(), reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.stop, drain_timeout)

    app = FastAPI(title="trtllm-glm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        if 400 <= e.status < 500:
            engine.metrics.requests_rejected.labels(reason="invalid").inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind,
                        code=code).response()  # fmt: skip

    def guarded(fn: Callable[[Request], Any]) -> Callable[[Request], Any]:
        # Unexpected exceptions become a 500 error object here: Starlette's own handler would re-raise.
        async def route(request: Request) -> Response:
            try:
                return await fn(request)
            except ApiError:
                raise
            except Exception as e:  # noqa: BLE001
                log.exception("unhandled error in %s", request.url.path)
                return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

        return route

    @app.get("/health")
    async def health() -> Response:
        failed = engine.fatal_error()  # a rank of a tensor-parallel LLM failed (the plain reason first)
        if failed:
            return ApiError(503, f"a model rank failed: {failed}", type="server_error", code="unavailable").response()
        if not engine.running:
            reason = getattr(engine, "down_reason", None) or "the engine is not running"
            return ApiError(503, reason, type="server_error", code="unavailable").response()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await srv.health_generate()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": srv.created, "owned_by": "trtllm_glm",
                "root": served_model_name, "max_model_len": engine.max_seq_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        # An engine process renders its own registry (it holds the engine's counters); in-process, the local one.
        render = getattr(engine, "render_metrics", None)
        body = await render() if render is not None else engine.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    for path, endpoint in (("/v1/completions", srv.completions), ("/v1/chat/completions", srv.chat)):
        app.router.add_api_route(path, guarded(endpoint), methods=["POST"], route_class_override=_RequestRoute)
    return app

"""The messages between the API process and the engine process (`engine_client` and `engine_core`).

Every message is a `msgspec` struct encoded as tagged, array-like MessagePack (its tag and fields in order, no field
names on the wire; no pickle). The hot path is `StepOutput`, one per engine-loop iteration. API -> engine:
`AddRequest`, `AbortRequest`, `CountRejected`, `ScrapeMetrics`, `StopEngine`. Engine -> API: `EngineReady` or
`EngineFailed` (start-up), `StepOutput`, `MetricsPage`, `EngineFatal`, `EngineStopped`. docs/serving.md, "Processes".
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "GenSpec", "AddRequest", "AbortRequest", "CountRejected", "ScrapeMetrics", "StopEngine", "ToEngine",
    "EngineReady", "EngineFailed", "Ack", "DeltaMsg", "StepOutput", "MetricsPage", "EngineFatal", "EngineStopped",
    "FromEngine", "new_encoder", "to_engine_decoder", "from_engine_decoder",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# API -> engine
class GenSpec(msgspec.Struct, array_like=True):
    """One generation of a request: prompt ids and `SamplingParams` fields (a mapping: the params are rebuilt
    and validated on the engine side). Stop strings stay in the API process, which detokenizes."""

    prompt_ids: list[int]
    params: dict[str, Any]


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue ``gens`` together under ``key`` (the API's stream id); ``arrival`` is the submission time
    (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of the machine)."""

    key: int
    gens: list[GenSpec]
    arrival: float


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    """Abort the generations of ``key`` still running (finish reason ``reason``); ``index >= 0``: only that one
    (a stop string ended it)."""

    key: int
    reason: str
    index: int = -1


class CountRejected(msgspec.Struct, tag=True, array_like=True):
    """The API refused an HTTP request (``request_rejected_total{reason}`` lives in the engine's registry)."""

    reason: str


class ScrapeMetrics(msgspec.Struct, tag=True, array_like=True):
    """Render the engine's Prometheus registry; answered by a `MetricsPage` with the same ``token``.
    ``generated``: tokens returned to clients since the previous scrape (the API process counts them: it
    detokenizes, so it knows which tokens a stop string cut)."""

    token: int
    generated: int = 0


class StopEngine(msgspec.Struct, tag=True, array_like=True):
    """Drain (live requests get ``drain_timeout`` seconds, the rest are aborted), then exit."""

    drain_timeout: float


ToEngine = AddRequest | AbortRequest | CountRejected | ScrapeMetrics | StopEngine


# ------------------------------------------------------------------------------------------------
# Engine -> API
class EngineReady(msgspec.Struct, tag=True, array_like=True):
    """The engine is built and serving. ``config``: the model config (``Glm5NextConfig.to_dict``) for the API's
    tokenizer; ``lines``: the start-up log lines (what was loaded)."""

    pid: int
    config: dict[str, Any]
    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    capacity: int
    lines: list[str]
    stats: dict[str, int]


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    """Start-up failed: the exception's class name and message (re-raised in the API process as one line)."""

    error_type: str
    message: str


class Ack(msgspec.Struct, array_like=True):
    """The engine took (``error_type is None``) or refused an `AddRequest`."""

    key: int
    error_type: str | None = None
    message: str | None = None


class DeltaMsg(msgspec.Struct, array_like=True):
    """A generation's new tokens (no text: the API process detokenizes) of stream ``key``; ``logprobs`` per
    token ``{token_id: (logprob, rank)}``, chosen token first; ``finish_reason`` / ``error`` on its last one."""

    key: int
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]]] | None
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    """One engine-loop iteration's output: acknowledgements first, then every delta, and the stats (``None``:
    unchanged)."""

    acks: list[Ack]
    deltas: list[DeltaMsg]
    stats: dict[str, int] | None = None


class MetricsPage(msgspec.Struct, tag=True, array_like=True):
    """The engine's ``/metrics`` page (Prometheus text format)."""

    token: int
    body: bytes


class EngineFatal(msgspec.Struct, tag=True, array_like=True):
    """The engine cannot serve any more: ``kind`` ``rank`` (a rank of the parallel world failed) or ``loop``
    (the engine loop died). The API drains and exits."""

    kind: str
    reason: str


class EngineStopped(msgspec.Struct, tag=True, array_like=True):
    """The drain is over (every generation got its final delta before this); the process exits next."""


FromEngine = EngineReady | EngineFailed | StepOutput | MetricsPage | EngineFatal | EngineStopped


def new_encoder() -> msgspec.msgpack.Encoder:
    """An encoder (one per socket owner: an encoder reuses its buffer)."""
    return msgspec.msgpack.Encoder()


def to_engine_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of `ToEngine` messages (one per thread: decoders are cheap and keep no shared state)."""
    return msgspec.msgpack.Decoder(ToEngine)


def from_engine_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of `FromEngine` messages."""
    return msgspec.msgpack.Decoder(FromEngine)

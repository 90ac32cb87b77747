"""Prometheus metrics of the serving engine (``/metrics``).

Names follow the ``vllm:`` / trtllm-serve conventions under a ``trtllm:`` prefix, so that existing
dashboards only need the prefix changed: ``trtllm:num_requests_running``, ``trtllm:time_to_first_token_seconds``,
``trtllm:spec_decode_num_accepted_tokens_total``... Every `ServeMetrics` owns its own
``CollectorRegistry`` (never the process-global one), so one process can hold many engines and apps.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

__all__ = ["ServeMetrics", "CONTENT_TYPE_LATEST", "PREFIX"]

PREFIX = "trtllm:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)  # fmt: skip


class ServeMetrics:
    """The engine's counters, gauges and histograms in a private registry.

    The engine thread updates them (``prometheus_client`` metrics are thread-safe); `render` produces the
    text exposition format for ``/metrics``.

    Args:
        registry: where to register (default: a new ``CollectorRegistry``).
        prefix: metric-name prefix.
    """

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = PREFIX) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, prefix
        self.requests_finished = Counter(
            p + "request_finished", "Finished requests (one per generated sequence) by finish reason: "
            "stop, length, abort (client went away or shutdown), error.", ["finished_reason"], registry=r,
        )  # fmt: skip
        self.requests_rejected = Counter(
            p + "request_rejected", "HTTP requests refused before generation by reason: overloaded "
            "(queue full), shutting_down, invalid (4xx).", ["reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens returned to clients.", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Submission to the first generated token.",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Time between consecutive engine steps that gave a request "
            "tokens (a speculative step can give several).", buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Submission to the end of the request.", buckets=_E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            p + "request_queue_time_seconds", "Submission to admission into the running batch (TTFT's first part).",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill_time = Histogram(
            p + "request_prefill_time_seconds", "Admission to the step that produced the first token being read "
            "back (TTFT's second part: prefill steps and the steps around them).", buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.delivery_time = Histogram(
            p + "request_first_token_delivery_seconds", "First token read back to handed to the request's stream "
            "(TTFT's third part: output processing and the engine loop's other work).", buckets=_TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.decode_time = Histogram(
            p + "request_decode_time_seconds", "First token to the end of the request.", buckets=_E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.running = Gauge(p + "num_requests_running", "Requests in the executor's running batch.", registry=r)
        self.waiting = Gauge(
            p + "num_requests_waiting", "Queue depth: accepted requests not running yet (incl. preempted).", registry=r
        )
        self.kv_pages_used = Gauge(p + "kv_cache_pages_used", "KV cache pages in use (target pool).", registry=r)
        self.kv_pages_total = Gauge(p + "kv_cache_pages_total", "KV cache pages in the target pool.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).", registry=r)
        self.draft_kv_pages_used = Gauge(
            p + "draft_kv_cache_pages_used", "Pages in use in a separate MTP draft pool (0 without one).", registry=r
        )
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted (pages freed, recomputed).", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Admitted requests that looked up the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Admitted requests that restored a prefix checkpoint.", registry=r
        )
        self.prefix_reused_tokens = Counter(
            p + "prefix_cache_reused_tokens", "Prompt tokens restored from the prefix cache, not computed.", registry=r
        )
        self.prefix_lost_requests = Counter(
            p + "prefix_cache_lost_requests", "Admitted requests whose prompt matched cached pages beyond the "
            "checkpoint they could restore (they recomputed those tokens and checkpointed the branch point).",
            registry=r,
        )  # fmt: skip
        self.prefix_lost_tokens = Counter(
            p + "prefix_cache_lost_tokens", "Prompt tokens recomputed although their pages were cached, for want "
            "of a checkpoint there (reuse lost).", registry=r,
        )  # fmt: skip
        self.prefix_checkpoints_skipped = Counter(
            p + "prefix_cache_checkpoints_skipped", "Checkpoints not taken: larger than the byte budget, or no "
            "device memory.", registry=r,
        )  # fmt: skip
        self.prefix_checkpoint_bytes = Gauge(
            p + "prefix_cache_checkpoint_bytes", "Device bytes held by recurrent-state checkpoints.", registry=r
        )
        self.engine_steps = Counter(p + "engine_steps", "Executor steps run.", registry=r)
        self.kernel_compiles = Counter(
            p + "kernel_compiles", "Triton kernels compiled after start-up (each one stalled a served step; the "
            "start-up warm-up should leave none).", registry=r,
        )  # fmt: skip
        self.step_errors = Counter(
            p + "engine_step_errors", "Executor steps that raised (their requests failed).", registry=r
        )
        self.spec_num_drafts = Counter(
            p + "spec_decode_num_drafts", "Speculative verify rounds that carried drafts.", registry=r
        )
        self.spec_num_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Draft tokens proposed for verification.", registry=r
        )
        self.spec_num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens not counted).", registry=r
        )
        self.spec_unspeculated_rounds = Counter(
            p + "spec_decode_num_unspeculated_rounds",
            "Rounds run without drafts because the batch exceeded the speculative config's max_concurrency.",
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position (0-based).",
            ["position"], registry=r,
        )  # fmt: skip
        # Export the label sets before the first event, so scrapers see zeros rather than no series.
        for reason in ("stop", "length", "abort", "error"):
            self.requests_finished.labels(finished_reason=reason)
        for reason in ("overloaded", "shutting_down", "invalid"):
            self.requests_rejected.labels(reason=reason)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format, without the ``*_created`` series
        (per-series creation timestamps that dashboards do not use and that double the page)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A view of a registry whose metrics leave out their ``*_created`` samples (this registry only;
    ``prometheus_client.disable_created_metrics`` would change every registry of the process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self._registry.collect():
            m.samples = [s for s in m.samples if not s.name.endswith("_created")]
            yield m

"""Prometheus metrics of one server: a per-app registry, step-level metrics fed by the scheduler's step
listener, request-level metrics fed by the server's stream handling.

Names follow vLLM's where one exists (prefix `exspec_` instead of `vllm:`), so its dashboards translate.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from exspec.scheduler.types import RequestOutput, StepStats

# The exact family names /metrics exports (counters with their `_total`, as in the text format's TYPE lines).
METRIC_NAMES: tuple[str, ...] = (
    "exspec_num_requests_running",
    "exspec_num_requests_waiting",
    "exspec_kv_slots_used_ratio",
    "exspec_prompt_tokens_total",
    "exspec_generation_tokens_total",
    "exspec_request_success_total",
    "exspec_spec_decode_num_draft_tokens_total",
    "exspec_spec_decode_num_accepted_tokens_total",
    "exspec_spec_decode_num_accepted_tokens_per_pos_total",
    "exspec_scheduler_steps_total",
    "exspec_time_to_first_token_seconds",
    "exspec_inter_token_latency_seconds",
    "exspec_e2e_request_latency_seconds",
    "exspec_request_queue_time_seconds",
    "exspec_step_duration_seconds",
    "exspec_batch_size",
    "exspec_acceptance_length",
)

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5
)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 12.0, 17.0, 33.0)


class ServerMetrics:
    """Every metric of one app, in its own `CollectorRegistry` (two apps in one process never share one)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.num_running = Gauge("exspec_num_requests_running", "Requests in the running pool", registry=r)
        self.num_waiting = Gauge("exspec_num_requests_waiting", "Requests queued before admission", registry=r)
        self.kv_used = Gauge("exspec_kv_slots_used_ratio", "Fraction of KV slots in use (0..1)", registry=r)
        self.prompt_tokens = Counter("exspec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("exspec_generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            "exspec_request_success", "Finished requests, by finish reason", ["finished_reason"], registry=r
        )
        self.draft_tokens = Counter(
            "exspec_spec_decode_num_draft_tokens", "Draft tokens proposed (rows that opted out of speculation propose none)", registry=r
        )
        self.accepted_tokens = Counter(
            "exspec_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target", registry=r
        )
        self.accepted_per_pos = Counter(
            "exspec_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by draft position (0-based)",
            ["position"],
            registry=r,
        )
        self.steps = Counter("exspec_scheduler_steps", "Scheduler steps, by kind", ["kind"], registry=r)
        self.ttft = Histogram(
            "exspec_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "exspec_inter_token_latency_seconds",
            "Time per output token after the first (a delta of n tokens counts n times its gap / n)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "exspec_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "exspec_request_queue_time_seconds", "Submit to first scheduled", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_duration = Histogram(
            "exspec_step_duration_seconds", "Seconds per step phase", ["phase"], buckets=_STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "exspec_batch_size", "Sequences per decode step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.acceptance_length = Histogram(
            "exspec_acceptance_length",
            "Per speculative step: mean tokens emitted per sequence (1 + accepted drafts)",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )

    def bind_scheduler(self, scheduler) -> None:
        """Gauges read the scheduler at scrape time; step metrics come from its step listener."""
        self.num_running.set_function(lambda: scheduler.num_running)
        self.num_waiting.set_function(lambda: scheduler.num_waiting)
        self.kv_used.set_function(lambda: scheduler.kv_slots_used_ratio)
        scheduler.add_step_listener(self.observe_step)

    def observe_step(self, stats: StepStats) -> None:
        self.steps.labels(kind=stats.kind).inc()
        self.step_duration.labels(phase="schedule").observe(stats.schedule_s)
        self.step_duration.labels(phase="draft").observe(stats.draft_s)
        self.step_duration.labels(phase="verify").observe(stats.verify_s)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_tokens)
        if stats.kind == "prefill" or stats.batch_size <= 0:
            return
        self.batch_size.observe(stats.batch_size)
        if stats.num_draft_tokens > 0:
            accepted = sum(stats.accepted_per_position)
            self.draft_tokens.inc(stats.num_proposed_tokens)
            self.accepted_tokens.inc(accepted)
            for pos, count in enumerate(stats.accepted_per_position):
                self.accepted_per_pos.labels(position=str(pos)).inc(count)
            self.acceptance_length.observe(1.0 + accepted / stats.batch_size)

    def request_timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def exposition(self) -> bytes:
        """The text format, without prometheus-client's `*_created` timestamp series (noise on dashboards)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class RequestTimer:
    """Request-level latencies of one scheduler request, fed with each delta of its stream."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.last_token_at: float | None = None
        self.first_delta = True

    def observe(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        if self.first_delta:
            self.first_delta = False
            if out.queue_time_s is not None:
                m.queue_time.observe(out.queue_time_s)
        n = len(out.token_ids)
        if n:
            if self.last_token_at is None:
                m.ttft.observe(now - self.arrival)
                n -= 1  # the first token has no inter-token gap; the rest of its delta came with it
                gap = 0.0
            else:
                gap = (now - self.last_token_at) / n
            for _ in range(n):
                m.itl.observe(gap)
            self.last_token_at = now
        if out.finished:
            m.e2e.observe(now - self.arrival)
            m.request_success.labels(finished_reason=out.finish_reason or "unknown").inc()

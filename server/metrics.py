"""Prometheus metrics of one server: a per-app registry, step-level metrics fed by the scheduler's step
listener, request-level metrics fed by the server's stream handling.

Two families are exported from the same events:
- `exspec_*`: exspec's own names (the project's Grafana dashboard reads these);
- `vllm:*`: vLLM's documented production metrics, with vLLM's names, types, units, labels (`model_name`,
  `engine`) and buckets, so that vLLM's Grafana dashboards, `vllm bench serve`'s speculative-decoding report
  and other tools built for vLLM read exspec unchanged.
Every metric is one row of `METRICS`, which gives its name in each family it belongs to (its twin's, when
both do); a quantity both families share is one `_Twin`: one call updates both, so the two can never disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from exspec.scheduler.types import RequestOutput, StepStats

VLLM_LABELS = ("model_name", "engine")  # every vllm:* series carries both; engine is always "0" here
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM creates a success series per reason up front

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5
)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 12.0, 17.0, 33.0)

# vLLM's buckets, so that its dashboards' heatmaps and quantiles look as they do against vLLM.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
_VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)
_VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)
_VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM builds 1-2-5 buckets up to max_model_len; a fixed 1-2-5 series up to 1M tokens covers every length.
_VLLM_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)


@dataclass(frozen=True)
class Metric:
    """One metric: its names in the two families (None: not in that family), its type, help and buckets."""

    attr: str  # the ServerMetrics attribute updates go through
    kind: type  # Gauge | Counter | Histogram
    exspec: str | None  # exspec_* name (a counter's without `_total`, as prometheus-client takes it)
    vllm: str | None  # vllm:* name, labelled model_name and engine
    doc: str  # help of the exspec_* series
    vllm_doc: str = ""  # help of the vllm:* series
    labels: tuple[str, ...] = ()  # labels of its own (beyond vLLM's model_name and engine)
    buckets: tuple[float, ...] | None = None  # histograms: exspec_*'s buckets
    vllm_buckets: tuple[float, ...] | None = None  # histograms: vllm:*'s buckets (vLLM's own)

    def exported(self) -> tuple[str, ...]:
        """The family names /metrics shows (counters with their `_total`, as in the text format's TYPE lines)."""
        suffix = "_total" if self.kind is Counter else ""
        return tuple(n + suffix for n in (self.exspec, self.vllm) if n is not None)


# In registration order (the order of /metrics): the twins, then exspec's own, then vLLM's own.
METRICS: tuple[Metric, ...] = (
    # --- shared by both families (scheduler state, token counts, speculation, request latencies)
    Metric("num_running", Gauge, "exspec_num_requests_running", "vllm:num_requests_running",
           "Requests in the running pool", "Requests in the running pool (vLLM's name)"),
    Metric("num_waiting", Gauge, "exspec_num_requests_waiting", "vllm:num_requests_waiting",
           "Requests queued before admission", "Requests queued before admission (vLLM's name)"),
    Metric("kv_usage", Gauge, "exspec_kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
           "Fraction of KV cache blocks in use (0..1)", "Fraction of KV cache blocks in use, 0..1 (vLLM's name)"),
    Metric("preemptions", Counter, "exspec_num_preemptions", "vllm:num_preemptions",
           "Running sequences preempted (KV blocks freed, recomputed later)",
           "Cumulative number of preemptions (vLLM's name)"),
    Metric("prompt_tokens", Counter, "exspec_prompt_tokens", "vllm:prompt_tokens", "Prompt tokens prefilled",
           "Prompt tokens prefilled (vLLM's name)"),
    Metric("generation_tokens", Counter, "exspec_generation_tokens", "vllm:generation_tokens", "Tokens generated",
           "Tokens generated (vLLM's name)"),
    Metric("request_success", Counter, "exspec_request_success", "vllm:request_success",
           "Finished requests, by finish reason", "Finished requests by finish reason (vLLM's name)",
           ("finished_reason",)),
    Metric("drafts", Counter, "exspec_spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
           "Drafts verified: one per sequence per speculative step that proposed draft tokens",
           "Sequences verified with draft tokens, per step (vLLM's name)"),
    Metric("draft_tokens", Counter, "exspec_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
           "Draft tokens proposed (rows that opted out of speculation propose none)",
           "Draft tokens proposed (vLLM's name)"),
    Metric("accepted_tokens", Counter, "exspec_spec_decode_num_accepted_tokens",
           "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target",
           "Draft tokens accepted (vLLM's name)"),
    Metric("accepted_per_pos", Counter, "exspec_spec_decode_num_accepted_tokens_per_pos",
           "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens, by draft position (0-based)",
           "Accepted draft tokens by 0-based position (vLLM's name)", ("position",)),
    Metric("ttft", Histogram, "exspec_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
           "Arrival to first token", "Arrival to first token, seconds (vLLM's name)",
           buckets=_LATENCY_BUCKETS, vllm_buckets=_VLLM_TTFT_BUCKETS),
    Metric("e2e", Histogram, "exspec_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
           "Arrival to last token", "Arrival to last token, seconds (vLLM's name)",
           buckets=_LATENCY_BUCKETS, vllm_buckets=_VLLM_REQUEST_BUCKETS),
    Metric("queue_time", Histogram, "exspec_request_queue_time_seconds", "vllm:request_queue_time_seconds",
           "Submit to first scheduled", "Submit to first scheduled, seconds (vLLM's name)",
           buckets=_LATENCY_BUCKETS, vllm_buckets=_VLLM_REQUEST_BUCKETS),
    # --- exspec only
    Metric("kv_slots", Gauge, "exspec_kv_slots_used_ratio", None, "Fraction of sequence slots in use (0..1)"),
    Metric("itl", Histogram, "exspec_inter_token_latency_seconds", None,
           "Time per output token after the first (a delta of n tokens counts n times its gap / n)",
           buckets=_ITL_BUCKETS),
    Metric("steps", Counter, "exspec_scheduler_steps", None, "Scheduler steps, by kind", labels=("kind",)),
    Metric("step_duration", Histogram, "exspec_step_duration_seconds", None, "Seconds per step phase",
           labels=("phase",), buckets=_STEP_BUCKETS),
    Metric("batch_size", Histogram, "exspec_batch_size", None, "Sequences per decode step", buckets=_BATCH_BUCKETS),
    Metric("decode_steps_by_k", Counter, "exspec_decode_steps", None,
           "Decode steps, by the k they ran (draft tokens per sequence, the speculation policy's choice; 0: none)",
           labels=("k",)),
    Metric("acceptance_length", Histogram, "exspec_acceptance_length", None,
           "Per speculative decode step: mean tokens emitted per sequence (1 + accepted drafts)",
           buckets=_ACCEPT_BUCKETS),
    # --- vLLM only: vLLM's own definitions, derived from the same events
    Metric("vllm_itl", Histogram, None, "vllm:inter_token_latency_seconds", "",
           "Seconds between two steps that brought a request tokens (vLLM's name)", vllm_buckets=_VLLM_ITL_BUCKETS),
    Metric("vllm_tpot", Histogram, None, "vllm:time_per_output_token_seconds", "",
           "Same as vllm:inter_token_latency_seconds (vLLM's older, deprecated name)", vllm_buckets=_VLLM_ITL_BUCKETS),
    Metric("vllm_request_tpot", Histogram, None, "vllm:request_time_per_output_token_seconds", "",
           "Per request: decode seconds / (generated tokens - 1) (vLLM's name)", vllm_buckets=_VLLM_ITL_BUCKETS),
    Metric("vllm_iteration_tokens", Histogram, None, "vllm:iteration_tokens_total", "",  # a histogram, as in vLLM
           "Prompt and generated tokens per scheduler step (vLLM's name)", vllm_buckets=_VLLM_ITERATION_BUCKETS),
    Metric("vllm_prompt_len", Histogram, None, "vllm:request_prompt_tokens", "",
           "Prompt tokens per finished request (vLLM's name)", vllm_buckets=_VLLM_TOKEN_COUNT_BUCKETS),
    Metric("vllm_generation_len", Histogram, None, "vllm:request_generation_tokens", "",
           "Generated tokens per finished request (vLLM's name)", vllm_buckets=_VLLM_TOKEN_COUNT_BUCKETS),
    Metric("vllm_inference_time", Histogram, None, "vllm:request_inference_time_seconds", "",
           "First scheduled to last token, seconds (vLLM's name)", vllm_buckets=_VLLM_REQUEST_BUCKETS),
    Metric("vllm_prefill_time", Histogram, None, "vllm:request_prefill_time_seconds", "",
           "First scheduled to first token, seconds (vLLM's name)", vllm_buckets=_VLLM_REQUEST_BUCKETS),
    Metric("vllm_decode_time", Histogram, None, "vllm:request_decode_time_seconds", "",
           "First to last token, seconds (vLLM's name)", vllm_buckets=_VLLM_REQUEST_BUCKETS),
)
# The exact family names /metrics exports; vLLM's as in vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py.
EXSPEC_METRIC_NAMES: tuple[str, ...] = tuple(m.exported()[0] for m in METRICS if m.exspec is not None)
VLLM_METRIC_NAMES: tuple[str, ...] = tuple(m.exported()[-1] for m in METRICS if m.vllm is not None)
METRIC_NAMES: tuple[str, ...] = EXSPEC_METRIC_NAMES + VLLM_METRIC_NAMES


class _Twin:
    """One quantity exported as an exspec_* series and its vllm:* namesake: every update goes to both."""

    def __init__(self, *series) -> None:
        self._series = series  # the exspec_* series, the vllm:* series (model_name and engine bound)

    def inc(self, amount: float = 1.0) -> None:
        for series in self._series:
            series.inc(amount)

    def observe(self, value: float) -> None:
        for series in self._series:
            series.observe(value)

    def set_function(self, fn) -> None:
        for series in self._series:
            series.set_function(fn)


class _LabelledTwin:
    """A `_Twin` with labels of its own (finished_reason, position): `.labels(...)` gives the twin series."""

    def __init__(self, own, vllm, base: dict[str, str]) -> None:
        self._own, self._vllm, self._base = own, vllm, base  # own: None for a vllm:* series alone

    def labels(self, **labels: str) -> _Twin:
        own = () if self._own is None else (self._own.labels(**labels),)
        return _Twin(*own, self._vllm.labels(**self._base, **labels))


class ServerMetrics:
    """Every metric of one app, in its own `CollectorRegistry` (two apps in one process never share one).

    `model_name` is the served model name: the `model_name` label of every vllm:* series.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        base = {"model_name": model_name, "engine": "0"}
        for m in METRICS:
            setattr(self, m.attr, self._declare(m, base))
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)

    def _declare(self, m: Metric, base: dict[str, str]):
        """The row's series: a `_Twin` (or `_LabelledTwin`) when it is in both families, else its one family's
        series (a vllm:* one with model_name and engine bound)."""
        own = vllm = None
        if m.exspec is not None:
            extra = {"buckets": m.buckets} if m.kind is Histogram else {}
            own = m.kind(m.exspec, m.doc, m.labels, registry=self.registry, **extra)
        if m.vllm is not None:
            extra = {"buckets": m.vllm_buckets} if m.kind is Histogram else {}
            vllm = m.kind(m.vllm, m.vllm_doc, VLLM_LABELS + m.labels, registry=self.registry, **extra)
        if vllm is None:
            return own
        if m.labels:
            return _LabelledTwin(own, vllm, base)
        return vllm.labels(**base) if own is None else _Twin(own, vllm.labels(**base))

    def bind_scheduler(self, scheduler) -> None:
        """Gauges read the scheduler at scrape time; step metrics come from its step listener."""
        self.num_running.set_function(lambda: scheduler.num_running)
        self.num_waiting.set_function(lambda: scheduler.num_waiting)
        self.kv_slots.set_function(lambda: scheduler.kv_slots_used_ratio)
        self.kv_usage.set_function(lambda: scheduler.kv_cache_usage_perc)
        scheduler.add_step_listener(self.observe_step)

    def observe_step(self, stats: StepStats) -> None:
        self.steps.labels(kind=stats.kind).inc()
        self.step_duration.labels(phase="schedule").observe(stats.schedule_s)
        self.step_duration.labels(phase="draft").observe(stats.draft_s)
        self.step_duration.labels(phase="verify").observe(stats.verify_s)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_tokens)
        self.vllm_iteration_tokens.observe(stats.num_prompt_tokens + stats.num_tokens)
        self.preemptions.inc(stats.num_preemptions)
        if stats.batch_size <= 0:
            return
        accepted = sum(stats.accepted_per_position)
        if stats.num_draft_tokens > 0:  # decode steps, and prefill steps that verified drafts (fused prefill)
            self.drafts.inc(stats.num_drafts)
            self.draft_tokens.inc(stats.num_proposed_tokens)
            self.accepted_tokens.inc(accepted)
            for pos, count in enumerate(stats.accepted_per_position):
                self.accepted_per_pos.labels(position=str(pos)).inc(count)
        if stats.kind == "prefill":
            return
        self.batch_size.observe(stats.batch_size)  # of decode steps
        self.decode_steps_by_k.labels(k=str(stats.num_draft_tokens)).inc()  # what the policy chose, live
        if stats.num_draft_tokens > 0:
            self.acceptance_length.observe(1.0 + accepted / stats.batch_size)  # per decode step

    def request_timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def exposition(self) -> bytes:
        """The text format, without prometheus-client's `*_created` timestamp series (noise on dashboards,
        and `vllm bench serve` would add them into its spec-decode counters, as vLLM disables them too)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class RequestTimer:
    """Request-level latencies of one scheduler request, fed with each delta of its stream.

    The intervals follow vLLM's (docs/design/metrics.md): queue = submit to first scheduled; prefill = first
    scheduled to first token; decode = first to last token; inference = prefill + decode; TTFT and e2e from
    the HTTP arrival. "First scheduled" is the arrival plus the scheduler's queue time, so prefill also holds
    the few milliseconds of tokenisation before submit.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request arrived
        self.queue_time: float | None = None  # seconds from submit to first scheduled, from the first delta
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.first_delta = True

    def observe(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        if self.first_delta:
            self.first_delta = False
            if out.queue_time_s is not None:
                self.queue_time = out.queue_time_s
                m.queue_time.observe(out.queue_time_s)
        n = len(out.token_ids)
        if n:
            if self.last_token_at is None:
                self.first_token_at = now
                m.ttft.observe(now - self.arrival)
                n, per_token = n - 1, 0.0  # the first token has no gap; the rest of its delta came with it
            else:
                gap = now - self.last_token_at
                m.vllm_itl.observe(gap)  # vLLM: one observation per step that brought tokens, its whole gap
                m.vllm_tpot.observe(gap)
                per_token = gap / n
            for _ in range(n):
                m.itl.observe(per_token)  # exspec: one observation per token, the step's gap shared out
            self.last_token_at = now
        if out.finished:
            self._finish(out, now)

    def _finish(self, out: RequestOutput, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - self.arrival)
        m.request_success.labels(finished_reason=out.finish_reason or "unknown").inc()
        m.vllm_prompt_len.observe(out.prompt_tokens)
        m.vllm_generation_len.observe(out.completion_tokens)
        if self.first_token_at is None or self.last_token_at is None:
            return  # finished before its first token (aborted or refused): no prefill or decode phase
        scheduled_at = self.arrival + (self.queue_time or 0.0)
        decode = self.last_token_at - self.first_token_at
        m.vllm_prefill_time.observe(max(self.first_token_at - scheduled_at, 0.0))
        m.vllm_decode_time.observe(decode)
        m.vllm_inference_time.observe(max(self.last_token_at - scheduled_at, 0.0))
        if out.completion_tokens > 1:
            m.vllm_request_tpot.observe(decode / (out.completion_tokens - 1))

"""The scheduler's public contract: its configuration, the deltas a request streams, and step statistics.

SchedulerConfig's defaults are the command line's (exspec.cli.settings reads them here); torch-free at import."""

from __future__ import annotations

from dataclasses import dataclass, replace

from exspec.engine.config import check_num_speculative_tokens
from exspec.engine.types import TokenLogprob
from exspec.errors import ExspecError, QueueFullError, SchedulerClosedError  # noqa: F401 (re-exported)
from exspec.scheduler import policies


DEFAULT_BATCH_SIZE = 8  # B when none is given
POOL_FACTOR = 4  # W = POOL_FACTOR x B when no pool size is given (serve, generate; the bench's --pool-factor)


def default_pool_size(max_batch_size: int, factor: int | None = None) -> int:
    """W when none is given: factor (POOL_FACTOR) x B, the live sequences among which a step looks for a same-length
    group. At B = 1 every sequence is a group of its own, so with no factor given W = 1: a larger pool would only
    take turns between sequences, which on the CPU costs time (the toy demo target alone at B = 1, pool 4 against
    1: 0.96x to 0.97x tokens/s, its decode forwards 4-8% slower; 350m pair: equal; docs/BENCHMARKS.md section 2)."""
    if factor is None:
        factor = POOL_FACTOR if max_batch_size > 1 else 1
    return factor * max_batch_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = DEFAULT_BATCH_SIZE  # B: sequences in one speculative step
    pool_size: int = POOL_FACTOR * DEFAULT_BATCH_SIZE  # W >= B: live (prefilled, running) sequences the pool holds
    max_waiting: int = 256  # requests queued before admission; beyond it submit() raises QueueFullError
    num_speculative_tokens: int = 4  # k (fixed policy) or the largest k (adaptive policy)
    speculation: str = "auto"  # a speculation policy in scheduler/policies/ (policies.names()): auto | fixed | adaptive
    # a same-length group smaller than this runs as a mixed batch; 0: B (a group runs alone only when it fills the
    # batch: a mixed step costs about what a grouped one of as many rows does, while a step of half the rows costs far
    # more than half; with B // 2 the 350m pair at B = 4 decoded 2-row groups beside 6 waiting rows, and target-ar
    # was 15% slower in a probe: docs/BENCHMARKS.md section 2, session 31)
    min_group_size: int = 0
    max_wait_steps: int = 8  # aging: a running sequence waits at most this many decode steps
    max_prefill_tokens: int = 512  # rows x width of a prefill step at most, padding included (chunked beyond it)
    # While sequences decode, a prefill step is also cut to about this many seconds at the prefill speed measured
    # so far (seconds per token, padding included), so that a running stream's gap between two tokens stays short
    # where a prefill of max_prefill_tokens is slow (a CPU); the prefill steps that fill free places of the decode
    # batch run back to back within it; 0: no cut.
    max_prefill_chunk_s: float = 0.15
    # `SchedulerCore.calibrate`: a calibration row that has written this many tokens starts again from its prompt, so
    # that the policy measures acceptance on text like served answers: decoded on for all of the calibration's steps
    # (hundreds), a small model's greedy text loops, where n-gram lookup accepted 62-96% per position and the policy
    # chose k = 4 at every batch size; capped at 64, 10-56% and k = 0 from B = 2 (SmolLM2, docs/BENCHMARKS.md section 7).
    calibration_answer_tokens: int = 64

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, value: object) -> None:
            raise ExspecError(f"{name} must be {rule}, got {value!r}")

        if self.max_batch_size < 1:
            bad("max_batch_size", ">= 1", self.max_batch_size)
        if self.pool_size < self.max_batch_size:
            bad("pool_size", f">= max_batch_size ({self.max_batch_size})", self.pool_size)
        if self.max_waiting < 1:
            bad("max_waiting", ">= 1", self.max_waiting)
        if bad_k := check_num_speculative_tokens(self.num_speculative_tokens, "num_speculative_tokens"):
            raise ExspecError(bad_k)
        if self.speculation not in policies.names():
            bad("speculation", f"one of {', '.join(policies.names())}", self.speculation)
        if self.min_group_size < 0:
            bad("min_group_size", ">= 0", self.min_group_size)
        if self.max_wait_steps < 1:
            bad("max_wait_steps", ">= 1", self.max_wait_steps)
        if self.max_prefill_tokens < 1:
            bad("max_prefill_tokens", ">= 1", self.max_prefill_tokens)
        if not self.max_prefill_chunk_s >= 0:
            bad("max_prefill_chunk_s", ">= 0", self.max_prefill_chunk_s)
        if self.calibration_answer_tokens < 1:
            bad("calibration_answer_tokens", ">= 1", self.calibration_answer_tokens)

    @property
    def group_threshold(self) -> int:
        return self.min_group_size or self.max_batch_size


@dataclass(frozen=True)
class RequestOutput:
    """One delta of a request's stream. The last delta has finished=True."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens new in this delta (possibly several from one speculative step)
    text: str  # text new in this delta (incremental detokenisation; stop strings cut)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
    prompt_tokens: int  # prompt length
    completion_tokens: int  # tokens generated so far, this delta included
    error: str | None = None  # message when finish_reason == "error"
    num_draft_tokens: int = 0  # draft tokens proposed for this request so far
    num_accepted_tokens: int = 0  # of those, accepted so far
    queue_time_s: float | None = None  # on the first delta: seconds from submit() to first scheduled
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, when the request asked for them
    # on the first delta with tokens, when the request asked for prompt_logprobs: one per prompt token (None first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """`then` following `first` as one delta: tokens, their logprobs and text joined, the rest `then`'s (the totals
    so far, the finish), queue_time_s and prompt_logprobs the first delta's (where it has them)."""
    logprobs = then.logprobs
    if first.logprobs is not None:
        logprobs = first.logprobs + (then.logprobs or ())
    return replace(then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text,
                   queue_time_s=first.queue_time_s if first.queue_time_s is not None else then.queue_time_s,
                   logprobs=logprobs,
                   prompt_logprobs=then.prompt_logprobs if first.prompt_logprobs is None else first.prompt_logprobs)


@dataclass(frozen=True)
class StepStats:
    """What one scheduler step did, for metrics."""

    kind: str  # "grouped" | "mixed" | "prefill"
    batch_size: int  # sequences in the step
    num_draft_tokens: int  # k used (0 for prefill or speculation off)
    num_proposed_tokens: int  # draft tokens proposed over all rows (rows that opted out propose none)
    num_drafts: int  # rows that proposed at least one draft token (vLLM's "drafts")
    accepted_per_position: tuple[int, ...]  # [k]: rows whose i-th draft token was accepted
    num_tokens: int  # tokens emitted by the step (all rows)
    num_prompt_tokens: int  # prompt tokens prefilled by the step
    schedule_s: float  # time choosing the batch
    draft_s: float  # time drafting
    verify_s: float  # time verifying and accepting (prefill: the forward)
    num_preemptions: int = 0  # sequences preempted to make room for this step (or an earlier one that ran nothing)

"""Offline generation through the same scheduler as the server: a plain loop over `SchedulerCore.step`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from exspec.engine.params import SamplingParams
from exspec.scheduler.core import EngineProtocol, SchedulerCore
from exspec.scheduler.policies import SpeculationPolicy
from exspec.scheduler.request import Request
from exspec.scheduler.types import SchedulerConfig, StepStats


@dataclass
class OfflineResult:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None


@dataclass
class RunSummary:
    """Totals over a run, for the CLI summary and the benchmarks."""

    num_generated_tokens: int = 0
    decode_seconds: float = 0.0  # wall time of decode (non-prefill) steps
    forward_seconds: float = 0.0  # of which in the engine's forwards and acceptance (StepStats draft_s + verify_s)
    wall_seconds: float = 0.0  # whole run, prefill included
    steps: dict[str, int] = field(default_factory=lambda: {"grouped": 0, "mixed": 0, "prefill": 0})
    num_draft_tokens: int = 0  # proposed, over all rows of all steps
    num_accepted_tokens: int = 0
    num_row_steps: int = 0  # sum of batch sizes of decode steps
    num_decode_tokens: int = 0  # tokens emitted by decode steps
    num_fused_rows: int = 0  # rows of prefill steps that verified drafts (the engine's fused prefill)
    num_fused_tokens: int = 0  # tokens those rows emitted (1 + accepted drafts each)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per sequence per step that verified drafts or decoded (1 + accepted drafts, before
        truncation): decode steps and the rows of fused prefills (whose first token comes with accepted drafts)."""
        rows = self.num_row_steps + self.num_fused_rows
        return (self.num_decode_tokens + self.num_fused_tokens) / rows if rows else 0.0

    @property
    def forward_seconds_per_step(self) -> float:
        """Seconds per decode step in the draft and target forwards (and acceptance): the cost model of
        speculation, without scheduling and host overhead."""
        decode = self.steps["grouped"] + self.steps["mixed"]
        return self.forward_seconds / decode if decode else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def grouped_fraction(self) -> float:
        decode = self.steps["grouped"] + self.steps["mixed"]
        return self.steps["grouped"] / decode if decode else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def add(self, stats: StepStats, seconds: float) -> None:
        self.steps[stats.kind] += 1
        if stats.kind == "prefill" and stats.num_proposed_tokens:  # a fused prefill: drafts verified with the prompts
            self.num_fused_rows += stats.batch_size
            self.num_fused_tokens += stats.num_tokens
            self.num_draft_tokens += stats.num_proposed_tokens
            self.num_accepted_tokens += sum(stats.accepted_per_position)
        if stats.kind != "prefill":
            self.decode_seconds += seconds
            self.forward_seconds += stats.draft_s + stats.verify_s
            self.num_row_steps += stats.batch_size
            self.num_decode_tokens += stats.num_tokens
            self.num_draft_tokens += stats.num_proposed_tokens
            self.num_accepted_tokens += sum(stats.accepted_per_position)


class OfflineRun:
    """One offline run, stepped by its caller: `step()` runs one scheduler step and adds its wall time to
    `summary.wall_seconds`, so that a caller may run several at once (one per engine), a step at a time, and time each
    by its own steps (`exspec bench`'s step interleaving: a slow spell of the machine then falls on every method).
    `generate_offline` steps one to the end. Prompts are handed over at construction (untimed: a few microseconds)."""

    def __init__(
        self,
        engine: EngineProtocol,
        prompts: list[list[int]],
        params: list[SamplingParams],
        config: SchedulerConfig,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        self.core = SchedulerCore(engine, replace(config, max_prefill_chunk_s=0.0), speculation, prefill_first=True)
        self.requests = [Request(str(i), list(p), sp, order=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        for r in self.requests:
            self.core.add(r)
        self.summary = RunSummary()

    @property
    def done(self) -> bool:
        return not self.core.has_work()

    def step(self) -> int:
        """One scheduler step; returns the number of requests it finished."""
        t0 = time.perf_counter()
        deltas, stats = self.core.step()
        seconds = time.perf_counter() - t0
        for st in stats:  # one per engine call (several only while a failing row is isolated)
            self.summary.add(st, seconds / len(stats))
        self.summary.num_generated_tokens += sum(len(out.token_ids) for _, out in deltas)
        self.summary.wall_seconds += time.perf_counter() - t0
        return sum(1 for _, out in deltas if out.finished)

    def results(self) -> list[OfflineResult]:
        """In input order."""
        return [
            OfflineResult(i, list(r.output_token_ids), r.text, r.finish_reason, r.error)
            for i, r in enumerate(self.requests)
        ]


def generate_offline(
    engine: EngineProtocol,
    prompts: list[list[int]],
    params: list[SamplingParams],
    config: SchedulerConfig,
    progress: bool = False,
    speculation: SpeculationPolicy | None = None,
) -> tuple[list[OfflineResult], RunSummary]:
    """Run every prompt to completion; results come back in input order. `speculation`: a policy to keep
    across calls (what it measured carries over, as in a server); None: a fresh one from `config`.
    `summary.wall_seconds` is the run's wall time, first step to last.

    No stream waits between two tokens of an offline run, so its prefill chunks are not cut to
    `max_prefill_chunk_s` (a server's inter-token latency bound): a long prompt is prefilled in chunks of
    `max_prefill_tokens` and joins the decode batch sooner, and a large chunk costs less per token than a small one
    (docs/BENCHMARKS.md section 2); and its prompts are prefilled first (`SchedulerCore`'s `prefill_first`), so the
    decode batches stay full to the end."""
    run = OfflineRun(engine, prompts, params, config, speculation)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(run.requests), unit="req", desc="generate", leave=False)
    start = time.perf_counter()
    while not run.done:
        finished = run.step()
        if bar is not None:
            bar.update(finished)
    run.summary.wall_seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return run.results(), run.summary

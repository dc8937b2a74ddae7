"""The EXSPEC sliding pool, synchronous: admit, prefill, choose a batch, run one engine step, emit deltas.

`SchedulerCore` does no threading and no asyncio: `AsyncScheduler` drives it from a worker thread and
`generate_offline` from a plain loop, so the online server and offline generation share one scheduler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, PrefillChunk, StepBatch, StepOutput
from exspec.errors import ConfigError, ExspecError
from exspec.scheduler.policy import Candidate, SpeculationPolicy, age_threshold_for, choose_batch, plan_prefill
from exspec.scheduler.request import IncrementalDetokenizer, Request, RequestState
from exspec.scheduler.stopping import StopRule
from exspec.scheduler.types import RequestOutput, SchedulerConfig, StepStats

log = logging.getLogger("exspec.scheduler")


class EngineProtocol(Protocol):
    """What the scheduler needs from an engine (`exspec.engine.SpecEngine`, or a fake in tests): sequences
    are named by the scheduler's ids; the engine's per-sequence state stays private."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_draft: bool
    num_slots: int
    num_free_slots: int

    def check_prompt(self, prompt_token_ids: list[int]) -> None: ...
    def check_params(self, params: SamplingParams) -> None: ...
    def add(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def prefill(self, batch: PrefillBatch) -> StepOutput: ...
    def step(self, batch: StepBatch) -> StepOutput: ...


Delta = tuple[Request, RequestOutput]
INTERNAL_ERROR = "internal error while generating this request; the server log has the details"


class SchedulerCore:
    def __init__(
        self, engine: EngineProtocol, config: SchedulerConfig, speculation: SpeculationPolicy | None = None
    ) -> None:
        """`speculation`: a policy carried over from an earlier core, with what it measured (a server's one
        scheduler keeps its policy across requests; an offline caller running batch after batch may too)."""
        if config.pool_size > engine.num_slots:
            raise ConfigError(
                f"pool_size ({config.pool_size}) exceeds the engine's KV slots ({engine.num_slots}): "
                "raise max_num_seqs or lower pool_size"
            )
        try:
            self.age_threshold = age_threshold_for(config.max_wait_steps, config.pool_size, config.max_batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.engine = engine
        self.config = config
        k_max = config.num_speculative_tokens if engine.has_draft else 0
        self.speculation = speculation or SpeculationPolicy(config.speculation, k_max)
        self.waiting: deque[Request] = deque()
        self.pool: list[Request] = []  # admitted: prefilling or running, in arrival order
        self._by_seq: dict[int, Request] = {}  # engine sequence id -> request, while admitted
        self._next_seq_id = 0
        self._last_was_prefill = False
        self._pending: list[Delta] = []  # deltas of requests that failed outside a step's results
        self.num_left_waiting = 0  # requests that left `waiting` (admitted or aborted): monotonic

    # ------------------------------------------------------------------ queue

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.pool)

    def has_work(self) -> bool:
        return bool(self.waiting or self.pool)

    def add(self, req: Request) -> None:
        req.detok = IncrementalDetokenizer(self.engine.tokenizer, req.prompt_token_ids)
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> Delta | None:
        """Cancel a request at a step boundary; its KV slot is free when this returns."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self.num_left_waiting += 1
                return self._finish(req, reason, error)
        for req in self.pool:
            if req.request_id == request_id:
                return self._finish(req, reason, error)
        return None

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[Delta]:
        ids = [r.request_id for r in (*self.waiting, *self.pool)]
        return [d for d in (self.abort(i, reason, error) for i in ids) if d is not None]

    # ------------------------------------------------------------------ one step

    def step(self) -> tuple[list[Delta], list[StepStats]]:
        """Schedule and run one step (one engine call, more only when a failing row is being isolated).
        Returns the deltas it produced and the statistics of each engine call."""
        t0 = time.perf_counter()
        self._admit()
        prefilling = [r for r in self.pool if r.state is RequestState.PREFILLING]
        running = [r for r in self.pool if r.state is RequestState.RUNNING]
        deltas: list[Delta] = []
        stats: list[StepStats] = []
        # Interleave: never two prefill steps in a row while sequences are decoding.
        if prefilling and (not running or not self._last_was_prefill):
            deltas, stats = self._prefill_step(prefilling, t0)
        elif running:
            deltas, stats = self._decode_step(running, t0)
        pending, self._pending = self._pending, []
        return pending + deltas, stats

    def _admit(self) -> None:
        now = time.monotonic()
        while self.waiting and len(self.pool) < self.config.pool_size and self.engine.num_free_slots > 0:
            req = self.waiting.popleft()
            self.num_left_waiting += 1
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            params = req.params
            if self.config.speculation != "fixed" and params.seed is not None and not params.greedy:
                # Under a timing-driven policy k varies from run to run, and with it which random numbers a
                # sampled row uses: a seeded request decodes without drafts, so its seed reproduces exactly.
                params = replace(params, use_speculation=False)
            try:
                self.engine.add(seq_id, req.prompt_token_ids, params)
            except Exception as e:  # this request's fault or not, it must not stop the loop
                self._pending.append(self._finish(req, "error", _message(e, req)))
                continue
            req.seq_id = seq_id
            req.stop_rule = StopRule.build(req.params, self.engine.eos_token_ids, self.engine.max_model_len)
            req.state = RequestState.PREFILLING
            req.first_scheduled_time = now
            self.pool.append(req)
            self._by_seq[seq_id] = req

    def _prefill_step(self, prefilling: list[Request], t0: float) -> tuple[list[Delta], list[StepStats]]:
        n, width = plan_prefill([r.prompt_len - r.num_prefilled for r in prefilling], self.config.max_prefill_tokens)
        reqs = prefilling[:n]
        draft = self.speculation.drafting()  # False: the policy runs without drafts; steps that draft catch up
        ends = {r.seq_id: min(r.prompt_len, r.num_prefilled + width) for r in reqs}  # seq_id -> end of this chunk
        t1 = time.perf_counter()
        self._last_was_prefill = True

        def call(batch: list[Request]) -> StepOutput:
            chunks = tuple(PrefillChunk(r.seq_id, r.num_prefilled, ends[r.seq_id]) for r in batch)
            return self.engine.prefill(PrefillBatch(chunks, draft=draft))

        deltas, stats = [], []
        for batch, out in self._run_isolated(reqs, call):
            fed = sum(ends[r.seq_id] - r.num_prefilled for r in batch)
            for req in batch:
                req.num_prefilled = ends[req.seq_id]
                if req.num_prefilled == req.prompt_len:
                    req.state = RequestState.RUNNING
            new, kept = self._emit(batch, out)
            deltas += new
            stats.append(self._stats(out, t1 - t0, fed, kept))
        return deltas, stats

    def _decode_step(self, running: list[Request], t0: float) -> tuple[list[Delta], list[StepStats]]:
        cands = [Candidate(i, r.length, r.waited, r.order) for i, r in enumerate(running)]
        choice = choose_batch(cands, self.config.max_batch_size, self.config.group_threshold, self.age_threshold)
        chosen = [running[i] for i in choice.keys]
        chosen_ids = {id(r) for r in chosen}
        for r in running:
            r.waited = 0 if id(r) in chosen_ids else r.waited + 1
        k = self.speculation.choose(len(chosen))
        t1 = time.perf_counter()
        self._last_was_prefill = False

        def call(batch: list[Request]) -> StepOutput:
            return self.engine.step(StepBatch(tuple(r.seq_id for r in batch), k))

        deltas, stats = [], []
        runs = self._run_isolated(chosen, call)
        for batch, out in runs:
            new, kept = self._emit(batch, out)
            # The policy weighs k by what a step really costs: its whole wall time (scheduling, forwards,
            # sampling, cutting, deltas); only while a failing row is isolated, each call's own forward time.
            seconds = time.perf_counter() - t0 if len(runs) == 1 else out.draft_s + out.verify_s
            self.speculation.observe(len(batch), out.num_draft_tokens, kept, seconds, out.catchup_s)
            deltas += new
            stats.append(self._stats(out, t1 - t0, 0, kept))
        return deltas, stats

    def _run_isolated(
        self, reqs: list[Request], call: Callable[[list[Request]], StepOutput]
    ) -> list[tuple[list[Request], StepOutput]]:
        """Run `call(reqs)`. If it raises, bisect: rerun each half as its own call, down to single requests,
        so only the request(s) whose rows fail are failed and every batchmate runs on with the output it
        would have had (the engine advances a sequence only after a call succeeds; rerunning rewrites the
        same K/V, and sampling is keyed by position, not by batch)."""
        try:
            return [(reqs, call(reqs))]
        except Exception as e:
            if len(reqs) == 1:
                req = reqs[0]
                log.exception("engine call failed for request %s; failing it alone", req.request_id)
                self._pending.append(self._finish(req, "error", _message(e, req)))
                return []
            log.warning("engine call over %d requests failed (%s); isolating the failing row", len(reqs), type(e).__name__)
            mid = len(reqs) // 2
            return self._run_isolated(reqs[:mid], call) + self._run_isolated(reqs[mid:], call)

    # ------------------------------------------------------------------ outputs

    def _emit(self, reqs: list[Request], out: StepOutput) -> tuple[list[Delta], int]:
        """Cut each row's sampled tokens by its stopping rule and turn them into deltas. Returns the deltas
        and the number of tokens kept."""
        deltas, num_kept = [], 0
        for req, so in zip(reqs, out.outputs):
            req.num_draft_tokens += so.num_draft_tokens
            req.num_accepted_tokens += so.num_accepted
            if not so.token_ids:  # a prompt chunk that does not complete the prompt
                continue
            kept, reason = req.stop_rule.apply(so.token_ids, req.num_output_tokens, req.length)
            first = req.num_output_tokens == 0
            text, stopped, n = req.add_tokens(kept, reason is not None)
            kept = kept[:n]  # a stop string ends the output at the token that completes it
            num_kept += len(kept)
            if stopped or reason is not None:
                deltas.append(self._finish(req, "stop" if stopped else reason, None, kept, text))
            else:
                deltas.append((req, self._output(req, kept, text, first)))
        return deltas, num_kept

    def _finish(self, req: Request, reason: str, error: str | None, token_ids=(), text: str = "") -> Delta:
        if req.seq_id is not None:
            self.engine.free(req.seq_id)
            self._by_seq.pop(req.seq_id, None)
            req.seq_id = None
        if req in self.pool:
            self.pool.remove(req)
        req.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        req.finish_reason, req.error = reason, error
        if not text and req.sent_chars < len(req.text):  # flush text held back for stop strings
            text = req.text[req.sent_chars :]
            req.sent_chars = len(req.text)
        first = req.num_output_tokens == len(token_ids)
        return req, self._output(req, tuple(token_ids), text, first)

    def _output(self, req: Request, token_ids, text: str, first: bool) -> RequestOutput:
        queue_time = None
        if first and req.first_scheduled_time is not None:
            queue_time = req.first_scheduled_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id,
            token_ids=tuple(token_ids),
            text=text,
            finished=req.finished,
            finish_reason=req.finish_reason if req.finished else None,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=req.num_output_tokens,
            error=req.error,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            queue_time_s=queue_time,
        )

    def _stats(self, out: StepOutput, schedule_s: float, prompt_tokens: int, num_tokens: int) -> StepStats:
        return StepStats(
            kind=out.kind,
            batch_size=out.batch_size,
            num_draft_tokens=out.num_draft_tokens,
            num_proposed_tokens=sum(o.num_draft_tokens for o in out.outputs),
            num_drafts=sum(1 for o in out.outputs if o.num_draft_tokens > 0),
            accepted_per_position=out.accepted_per_position,
            num_tokens=num_tokens,
            num_prompt_tokens=prompt_tokens,
            schedule_s=schedule_s,
            draft_s=out.draft_s,
            verify_s=out.verify_s,
        )


def _message(e: Exception, req: Request) -> str:
    """What the client is told: an exspec error names the problem; anything else is an internal error whose
    details go to the log only."""
    if isinstance(e, ExspecError):
        return str(e)
    return INTERNAL_ERROR

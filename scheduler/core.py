"""The EXSPEC sliding pool, synchronous: admit, prefill, choose a batch, run one engine step, emit deltas.

`SchedulerCore` does no threading and no asyncio: `AsyncScheduler` drives it from a worker thread and
`generate_offline` from a plain loop, so the online server and offline generation share one scheduler.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol

from exspec.errors import ExspecError
from exspec.engine.params import SamplingParams
from exspec.engine.sequence import Sequence
from exspec.engine.types import PrefillBatch, PrefillChunk, StepBatch, StepOutput
from exspec.scheduler.policy import Candidate, SpeculationPolicy, age_threshold_for, choose_batch
from exspec.scheduler.request import IncrementalDetokenizer, Request, RequestState
from exspec.scheduler.types import RequestOutput, SchedulerConfig, StepStats

log = logging.getLogger("exspec.scheduler")


class EngineProtocol(Protocol):
    """What the scheduler needs from an engine (`engine.SpecEngine`, or a fake in tests)."""

    tokenizer: Any
    max_model_len: int
    has_draft: bool
    num_slots: int
    num_free_slots: int

    def check_prompt(self, prompt_token_ids: list[int]) -> None: ...
    def add(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence: ...
    def free(self, seq: Sequence) -> None: ...
    def prefill(self, batch: PrefillBatch) -> StepOutput: ...
    def step(self, batch: StepBatch) -> StepOutput: ...


Delta = tuple[Request, RequestOutput]


class SchedulerCore:
    def __init__(self, engine: EngineProtocol, config: SchedulerConfig) -> None:
        if config.pool_size > engine.num_slots:
            raise ExspecError(
                f"pool_size ({config.pool_size}) exceeds the engine's KV slots ({engine.num_slots}): "
                "raise max_num_seqs or lower pool_size"
            )
        try:
            self.age_threshold = age_threshold_for(config.max_wait_steps, config.pool_size, config.max_batch_size)
        except ValueError as e:
            raise ExspecError(str(e)) from e
        self.engine = engine
        self.config = config
        k_max = config.num_speculative_tokens if engine.has_draft else 0
        self.speculation = SpeculationPolicy(config.speculation, k_max)
        self.waiting: deque[Request] = deque()
        self.pool: list[Request] = []  # admitted: prefilling or running, in arrival order
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

    def abort_all(self) -> list[Delta]:
        ids = [r.request_id for r in (*self.waiting, *self.pool)]
        return [d for d in (self.abort(i) for i in ids) if d is not None]

    # ------------------------------------------------------------------ one step

    def step(self) -> tuple[list[Delta], StepStats | None]:
        """Schedule and run one engine call. Returns the deltas it produced and its statistics."""
        t0 = time.perf_counter()
        self._admit()
        prefilling = [r for r in self.pool if r.state is RequestState.PREFILLING]
        running = [r for r in self.pool if r.state is RequestState.RUNNING]
        deltas, stats = [], None
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
            try:
                req.seq = self.engine.add(req.prompt_token_ids, req.params)
            except ExspecError as e:
                self._pending.append(self._finish(req, "error", str(e)))
                continue
            req.state = RequestState.PREFILLING
            req.first_scheduled_time = now
            self.pool.append(req)

    def _prefill_step(self, prefilling: list[Request], t0: float) -> tuple[list[Delta], StepStats | None]:
        budget = self.config.max_prefill_tokens
        chunks, reqs = [], []
        for req in prefilling:
            if budget <= 0:
                break
            seq = req.seq
            end = min(seq.prompt_len, seq.num_prefilled + budget)
            chunks.append(PrefillChunk(seq, seq.num_prefilled, end))
            reqs.append(req)
            budget -= end - seq.num_prefilled
        t1 = time.perf_counter()
        self._last_was_prefill = True
        out = self._run(reqs, lambda: self.engine.prefill(PrefillBatch(tuple(chunks))))
        if out is None:
            return [], None
        for req, chunk in zip(reqs, chunks):
            if chunk.end >= chunk.seq.prompt_len and not req.finished:
                req.state = RequestState.RUNNING
        deltas = self._emit(reqs, out)
        return deltas, self._stats(out, t1 - t0, sum(c.end - c.start for c in chunks))

    def _decode_step(self, running: list[Request], t0: float) -> tuple[list[Delta], StepStats | None]:
        cands = [Candidate(i, r.seq.length, r.waited, r.order) for i, r in enumerate(running)]
        choice = choose_batch(
            cands,
            self.config.max_batch_size,
            self.config.group_threshold,
            self.age_threshold,
            force_mixed=self.config.force_mixed,
        )
        chosen = [running[i] for i in choice.keys]
        chosen_ids = {id(r) for r in chosen}
        for r in running:
            r.waited = 0 if id(r) in chosen_ids else r.waited + 1
        k = self.speculation.choose(len(chosen))
        batch = StepBatch(tuple(r.seq for r in chosen), k, force_mixed=self.config.force_mixed)
        t1 = time.perf_counter()
        self._last_was_prefill = False
        out = self._run(chosen, lambda: self.engine.step(batch))
        if out is None:
            return [], None
        num_tokens = sum(len(o.new_token_ids) for o in out.outputs)
        self.speculation.observe(len(chosen), out.num_draft_tokens, num_tokens, out.draft_s + out.verify_s)
        deltas = self._emit(chosen, out)
        return deltas, self._stats(out, t1 - t0, 0)

    def _run(self, reqs: list[Request], call) -> StepOutput | None:
        """Run an engine call; if it raises, fail exactly the requests of that batch and carry on."""
        try:
            return call()
        except Exception as e:  # a bad step must not take the server down
            log.exception("engine step failed; failing %d request(s)", len(reqs))
            msg = f"internal error in the engine step: {type(e).__name__}: {e}"
            self._pending.extend(d for d in (self.abort(r.request_id, "error", msg) for r in reqs) if d)
            return None

    # ------------------------------------------------------------------ outputs

    def _emit(self, reqs: list[Request], out: StepOutput) -> list[Delta]:
        deltas = []
        for req, so in zip(reqs, out.outputs):
            req.num_draft_tokens += so.num_draft_tokens
            req.num_accepted_tokens += so.num_accepted
            engine_done = so.finish_reason is not None
            if not so.new_token_ids and not engine_done:
                continue
            text, stopped = req.add_tokens(so.new_token_ids, engine_done)
            first = req.num_output_tokens == len(so.new_token_ids)
            if stopped or engine_done:
                deltas.append(self._finish(req, "stop" if stopped else so.finish_reason, None, so.new_token_ids, text))
            else:
                deltas.append((req, self._output(req, so.new_token_ids, text, first)))
        return deltas

    def _finish(self, req: Request, reason: str, error: str | None, token_ids=(), text: str = "") -> Delta:
        if req.seq is not None:
            self.engine.free(req.seq)
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

    def _stats(self, out: StepOutput, schedule_s: float, prompt_tokens: int) -> StepStats:
        return StepStats(
            kind=out.kind,
            batch_size=out.batch_size,
            num_draft_tokens=out.num_draft_tokens,
            num_proposed_tokens=sum(o.num_draft_tokens for o in out.outputs),
            accepted_per_position=out.accepted_per_position,
            num_tokens=sum(len(o.new_token_ids) for o in out.outputs),
            num_prompt_tokens=prompt_tokens,
            schedule_s=schedule_s,
            draft_s=out.draft_s,
            verify_s=out.verify_s,
        )

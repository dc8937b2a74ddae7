"""The EXSPEC sliding pool, synchronous: admit, prefill, choose a batch, run one engine step, emit deltas.

`SchedulerCore` does no threading and no asyncio: `AsyncScheduler` drives it from a worker thread and
`generate_offline` from a plain loop, so the online server and offline generation share one scheduler.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, PrefillChunk, StepBatch, StepOutput
from exspec.errors import CapacityError, ConfigError, ExspecError, InvalidRequestError
from exspec.scheduler import policies
from exspec.scheduler.policies import SpeculationPolicy
from exspec.scheduler.policy import Candidate, PrefillCost, age_threshold_for, choose_batch, plan_prefill
from exspec.scheduler.request import IncrementalDetokenizer, Request, RequestState
from exspec.scheduler.stopping import StopRule
from exspec.scheduler.types import RequestOutput, SchedulerConfig, StepStats

log = logging.getLogger("exspec.scheduler")

PREFILL_TIME_SHARE = 0.5  # of the engine's time that waiting prompts get while sequences decode
MIN_STEP_S = 1e-6  # a step reported as taking no time is charged this much (equal costs: steps alternate)
MIN_PREFILL_CHUNK = 16  # tokens a prefill step may always take, whatever max_prefill_chunk_s allows
# The prefill seconds running rows may wait between two decode steps are max_prefill_chunk_s per token each row got in
# its last decode step, up to this many: a step that drafts gives a row several tokens, so the same wait per token
# lets prefill run longer (at a fixed bound, a drafting step's longer wall time left prompts less of the engine: the
# demo target at concurrency 4, lookup against k = 0, median time to first token 1.26x, docs/BENCHMARKS.md section 7).
PREFILL_BOUND_SCALE = 2.0
# ...and a stream's gap between two chunks (that prefill, then its next decode step, taken as long as its last) is held
# within this many max_prefill_chunk_s, by cutting the prefill, but never below one max_prefill_chunk_s nor below what
# the time share owes prefill for that step (where a decode step alone is longer than the rest, the share wins).
# 0.41 s at the default 0.15 s: issue 22 asks for 0.5 s, and a chunk cut at the measured prefill speed overshoots by up
# to 20%. Beside lookup's k = 4 steps at B = 8 (0.15-0.2 s) on the demo target, the longest gaps were 0.52-0.53 s with
# the per-token bound alone, 0.48-0.50 s at a scale of 3 and 0.46-0.49 s at 2.75 (the long prompt's first token 6%
# later than with the per-token bound alone: smaller chunks of a long context cost more per token); docs/BENCHMARKS.md
# section 7.
STREAM_GAP_SCALE = 2.75
PREFILL_SPEED_DECAY = 0.3  # weight of the newest prefill step in the measured seconds per prefill token


class EngineProtocol(Protocol):
    """What the scheduler needs from an engine (`exspec.engine.SpecEngine`, or a fake in tests): sequences
    are named by the scheduler's ids; the engine's per-sequence state stays private."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_draft: bool  # steps can draft: a draft model, or n-gram lookup
    has_draft_model: bool  # the drafts come from a draft model
    num_slots: int  # sequence metadata rows (max_num_seqs)
    num_free_slots: int
    block_size: int  # positions per KV block
    num_blocks: int  # KV blocks a sequence can be given (the null block excluded)
    num_free_blocks: int

    def blocks_needed(self, seq_id: int | None, length: int) -> int:
        """New blocks the sequence must be given to hold positions [0, length); seq_id None: a sequence not yet
        added (ceil(length / block_size)). 0 when it already holds them. `add` takes the prompt's blocks; `step`
        first takes each row's `blocks_needed(seq_id, length + k)`, or raises CapacityError changing nothing."""
        ...

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
        self, engine: EngineProtocol, config: SchedulerConfig, speculation: SpeculationPolicy | None = None,
        *, prefill_first: bool = False,
    ) -> None:
        """`speculation`: a policy carried over from an earlier core, with what it measured (a server's one
        scheduler keeps its policy across requests; an offline caller running batch after batch may too).
        `prefill_first`: an offline run's order, where no stream waits for its next token: a prompt in the pool is
        prefilled before any row decodes, so every admitted row is there to fill the decode batches, to the end
        (with prefill's time share instead, a closed batch's late long prompt decoded alone after the others had
        finished: 80 decode steps against 62 for 8 prompts at B = 4 on the 350m pair, docs/BENCHMARKS.md section 2,
        session 32)."""
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
        self.prefill_first = prefill_first
        k_max = config.num_speculative_tokens if engine.has_draft else 0
        self.speculation = speculation or policies.create(config.speculation, k_max, engine.has_draft_model)
        self.waiting: deque[Request] = deque()
        self.pool: list[Request] = []  # admitted: prefilling or running, in arrival order
        self._by_seq: dict[int, Request] = {}  # engine sequence id -> request, while admitted
        self._next_seq_id = 0
        self._prefill_credit = 0.0  # seconds of engine time prefill may still take before decode's turn
        self._decode_credit = 0.0  # the credit right after the last decode step (0: prefill was not waiting)
        self._prefill_since_decode = 0.0  # engine seconds of prefill since the last decode step
        self._tokens_per_row = 1.0  # tokens a row got in the last decode step, mean over its rows (>= 1: drafts)
        # the last decode step's engine seconds (its wall time is ~1 ms more on the CPU; reported times only, so that a
        # test on a simulated clock does not depend on the machine's speed)
        self._decode_s = 0.0
        self._prefill_s_per_token = 0.0  # measured prefill speed (padding included); 0: not measured yet
        self._prefill_cost = PrefillCost()  # a prefill step's seconds against its padded tokens (plan_prefill)
        self._pending: list[Delta] = []  # deltas of requests that failed outside a step's results
        self.num_left_waiting = 0  # requests that left `waiting` (admitted or aborted): monotonic
        self.num_preemptions = 0  # running sequences sent back to `waiting` to be recomputed: monotonic
        self._unreported_preemptions = 0  # not yet in a StepStats
        self._seed_rng = random.Random(0)  # seeds of sampled requests that gave none (kept across preemptions)

    # ------------------------------------------------------------------ calibration

    def calibrate(self, prompts: list[list[int]]) -> int:
        """Before serving (nothing admitted yet): run the policy's calibration steps (`SpeculationPolicy.calibration`)
        on sequences of these prompts, greedy, and report each to the policy as a decode step; then free them. The
        rows are the first prompts, as many as the largest batch size asks for (fewer prompts: fewer rows). The
        first step at each batch size runs unreported (a first forward of a shape pays one-off costs). Stops early
        where a row would pass max_model_len or the KV blocks run short. The prompts are prefilled in forwards of at
        most max_prefill_tokens (rows x width), as served prompts are. A row that has written
        `calibration_answer_tokens` tokens starts again from its prompt (a new sequence), so that acceptance is
        measured on answer-length text. Returns the steps reported."""
        if self.pool or self.waiting:
            raise RuntimeError("calibrate runs before any request is admitted")
        plan = self.speculation.calibration(self.config.max_batch_size)
        rows = min(len(prompts), max((b for b, _ in plan), default=0))
        if not plan or rows == 0:
            return 0
        prompts = [list(p) for p in prompts[:rows]]
        ids: list[int] = [-1] * rows
        lengths = [len(p) for p in prompts]
        reported, added = 0, []
        params = SamplingParams(max_tokens=self.engine.max_model_len, temperature=0.0)

        def start(rows_: list[int]) -> None:
            """Add these rows' prompts as new sequences (freeing what they held) and prefill them."""
            for i in rows_:
                if ids[i] in added:
                    self.engine.free(ids[i])
                    added.remove(ids[i])
                ids[i] = self._next_seq_id
                self._next_seq_id += 1
                self.engine.add(ids[i], prompts[i], params)
                added.append(ids[i])
            for chunks in _prefill_chunks([ids[i] for i in rows_], [len(prompts[i]) for i in rows_],
                                          self.config.max_prefill_tokens):
                out = self.engine.prefill(PrefillBatch(chunks, draft=True))
                self.speculation.observe_prefill(sum(c.end - c.start for c in chunks), out.draft_s)
            for i in rows_:
                lengths[i] = len(prompts[i]) + 1  # the first token, sampled at the end of the prompt

        cap = self.config.calibration_answer_tokens
        try:
            start(list(range(rows)))
            warm: set[int] = set()
            for b, k in plan:
                # rows that wrote `cap` tokens start again: acceptance measured on answer-like text, not on loops
                start([i for i in range(b) if lengths[i] - len(prompts[i]) >= cap])
                batch = ids[:b]
                if max(lengths[:b]) + k + 2 >= self.engine.max_model_len:
                    break
                for step_k in ([0] if b not in warm else []) + [k]:
                    t0 = time.perf_counter()
                    out = self.engine.step(StepBatch(tuple(batch), step_k))
                    seconds = time.perf_counter() - t0
                    for i, o in enumerate(out.outputs):
                        lengths[i] += len(o.token_ids)
                    if b in warm:
                        self._observe(out, sum(len(o.token_ids) for o in out.outputs), seconds)
                        reported += 1
                    warm.add(b)
        except CapacityError:
            pass  # the KV blocks ran short: what was measured stays
        finally:
            for sid in added:
                self.engine.free(sid)
        if reported:
            self.speculation.calibrated()
        return reported

    # ------------------------------------------------------------------ queue

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.pool)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the engine's KV blocks held by sequences (vLLM's kv_cache_usage_perc), 0..1."""
        return 1.0 - self.engine.num_free_blocks / self.engine.num_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.pool)

    def check_fits(self, prompt_token_ids: list[int]) -> None:
        """Raise InvalidRequestError if this prompt needs more KV blocks than the whole cache has."""
        need = self.engine.blocks_needed(None, len(prompt_token_ids))
        if need > self.engine.num_blocks:
            raise InvalidRequestError(self._never_fits(len(prompt_token_ids), need))

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
        # Prefill runs when nothing decodes; while rows decode, when its time share allows or the decode batch has
        # free places (fewer running rows than max_batch_size), and in either case only while the running rows have
        # waited less than `_chunk_bound` of prefill since their last step (no bound where it is 0): a decode step
        # costs about the same with more rows (on a GPU, 4 rows cost what 32 do), so filling it first is throughput,
        # and the time bound keeps a running stream's gap within a decode step and that bound. An offline run
        # (prefill_first) prefills whenever it can.
        prefill = bool(prefilling) and (
            self.prefill_first or not running or (
                (self._prefill_credit >= 0.0 or len(running) < self.config.max_batch_size) and self._may_fill()
            )
        )
        if prefill:  # while rows decode, a step takes what is left of the bound
            spent = self._prefill_since_decode if running else 0.0
            deltas, stats = self._prefill_step(prefilling, t0, self._prefill_budget(bool(running), spent))
        elif running:
            deltas, stats = self._decode_step(running, t0)
        seconds = sum(s.draft_s + s.verify_s for s in stats)  # the step's engine time, as the engine reports it
        self._share_time(bool(prefilling and running), prefill, seconds)
        self._prefill_since_decode = self._prefill_since_decode + seconds if prefill else 0.0
        rows = sum(s.batch_size for s in stats)
        if not prefill and rows:
            self._tokens_per_row = max(1.0, sum(s.num_tokens for s in stats) / rows)
            self._decode_s = seconds
            self._decode_credit = max(0.0, self._prefill_credit)
        pending, self._pending = self._pending, []
        return pending + deltas, stats

    def _share_time(self, contended: bool, was_prefill: bool, seconds: float) -> None:
        """Prefill gets its share of time, not of steps. While prompts wait to be prefilled and sequences
        decode, each decode step earns prefill share / (1 - share) of its engine time as credit and each
        prefill step spends its own; prefill runs while the credit is >= 0. So waiting prompts get
        PREFILL_TIME_SHARE of the engine's time however long a decode step is (drafting makes it longer), and a
        running sequence waits between two decode steps at most the larger of `_chunk_bound`'s gap-held bound and the
        credit its last step earned (about: a chunk is cut at the measured prefill speed). The credit never carries more
        than one step's earning (what prefill could not take before the next decode step is not saved for later): with
        the bound at least the earning, the share holds and so does the bound. Times are the engine's reported forward
        seconds."""
        if not contended:  # nothing to share: the next contention starts even
            self._prefill_credit = 0.0
            return
        seconds = max(MIN_STEP_S, seconds)
        if was_prefill:
            self._prefill_credit -= seconds
        else:
            earned = seconds * PREFILL_TIME_SHARE / (1.0 - PREFILL_TIME_SHARE)
            self._prefill_credit = min(self._prefill_credit + earned, earned)

    def _admit(self) -> None:
        """Admit waiting requests in FIFO order while a slot, room in the pool and the KV blocks of the
        request's prompt are free. The head is never overtaken by a smaller prompt (a long prompt is not
        starved); and the blocks the admitted sequences need for their next step at k = 0 stay reserved, so
        admitting never forces a preemption. A preempted request, back at the head, is re-added with its
        generated tokens appended to its prompt, and recomputed."""
        now = time.monotonic()
        reserved = None  # computed once the head's prompt fits at all
        while self.waiting and len(self.pool) < self.config.pool_size and self.engine.num_free_slots > 0:
            req = self.waiting[0]
            need = self.engine.blocks_needed(None, req.length)  # its prompt, and what it generated if preempted
            if need > self.engine.num_blocks:  # even an empty cache cannot hold it: no reason to wait
                self.waiting.popleft()
                self.num_left_waiting += 1
                self._pending.append(self._finish(req, "error", self._never_fits(req.length, need)))
                continue
            if reserved is None:
                reserved = self._reserved_blocks()
            if need + reserved > self.engine.num_free_blocks:
                break  # admission waits for blocks: running sequences finish or are preempted
            self.waiting.popleft()
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            try:
                self.engine.add(seq_id, req.prompt_token_ids + req.output_token_ids, self._engine_params(req))
            except CapacityError as e:  # the engine disagrees with its own count: wait, unless nothing can free
                if self.pool:
                    self.waiting.appendleft(req)
                    break
                self.num_left_waiting += 1
                self._pending.append(self._finish(req, "error", _message(e, req)))
                continue
            except Exception as e:  # this request's fault or not, it must not stop the loop
                self.num_left_waiting += 1
                self._pending.append(self._finish(req, "error", _message(e, req)))
                continue
            self.num_left_waiting += 1
            req.seq_id = seq_id
            req.num_recomputed = req.num_output_tokens
            if self._wants_prompt_logprobs(req):  # from the start (again, if preempted while prefilling)
                req.prompt_logprobs = []
            if req.stop_rule is None:
                req.stop_rule = StopRule.build(req.params, self.engine.eos_token_ids, self.engine.max_model_len)
            req.state = RequestState.PREFILLING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.pool.append(req)
            self._by_seq[seq_id] = req
            reserved += self.engine.blocks_needed(seq_id, req.length + 1)

    def _engine_params(self, req: Request) -> SamplingParams:
        """The parameters the engine is given for `req`: on a re-add after a preemption, such that it continues
        exactly where it was (the same seed; min_tokens and max_tokens counted from its new, longer prompt)."""
        params = req.params
        if self.speculation.k_varies and params.seed is not None and not params.greedy:
            # Under a policy whose k varies from run to run, so does which random numbers a sampled row
            # uses: a seeded request decodes without drafts, so its seed reproduces exactly.
            params = replace(params, use_speculation=False)
        if params.seed is None and not params.greedy:
            # A seed of the scheduler's rather than one the engine draws, so that a re-add samples on with it
            # (the request still counts as unseeded above: it speculates).
            if req.engine_seed is None:
                req.engine_seed = self._seed_rng.getrandbits(63)
            params = replace(params, seed=req.engine_seed)
        if params.prompt_logprobs is not None and not self._wants_prompt_logprobs(req):
            params = replace(params, prompt_logprobs=None)  # re-added after its prompt's were delivered
        done = req.num_output_tokens
        if done:  # (the penalties count the recomputed output as output)
            params = replace(params, max_tokens=params.max_tokens - done, min_tokens=max(params.min_tokens - done, 0),
                             recomputed=done)
        return params

    @staticmethod
    def _wants_prompt_logprobs(req: Request) -> bool:
        """The request asked for prompt logprobs and has not received them all (a re-add after a preemption
        during its prefill computes them again; one after it does not)."""
        return req.params.prompt_logprobs is not None and req.num_output_tokens == 0

    def _reserved_blocks(self) -> int:
        """Blocks the admitted sequences need for their next step at k = 0 (a prefilling one: its first step,
        when its pending token, sampled at the end of the prompt, is written)."""
        return sum(
            self.engine.blocks_needed(r.seq_id, r.length + (r.state is RequestState.PREFILLING)) for r in self.pool
        )

    def _never_fits(self, length: int, need: int) -> str:
        return (f"a prompt of {length} tokens needs {need} KV blocks of {self.engine.block_size} positions; "
                f"the KV cache has {self.engine.num_blocks} in all")

    def _may_fill(self) -> bool:
        """Whether a prefill step may run to fill free places of the decode batch: right after a decode step (one
        chunk, as ever), then while a chunk of MIN_PREFILL_CHUNK tokens at the measured speed still fits in what is
        left of `_chunk_bound` since the running rows' last step (always where it is 0: no bound)."""
        bound, spent = self._chunk_bound(), self._prefill_since_decode
        return bound <= 0 or spent == 0.0 or spent + MIN_PREFILL_CHUNK * self._prefill_s_per_token <= bound

    def _chunk_bound(self) -> float:
        """Seconds of prefill the running rows may wait between two decode steps (0: no bound): max_prefill_chunk_s per
        token each got in its last decode step, up to PREFILL_BOUND_SCALE times it, and no more than keeps that wait
        and a decode step as long as the last within STREAM_GAP_SCALE times it, but at least max_prefill_chunk_s; and
        never less than the time share's credit after that step (a step longer than the bound earns more: prefill
        keeps its share, and the gap is then two such steps)."""
        chunk_s = self.config.max_prefill_chunk_s
        if chunk_s <= 0:
            return 0.0
        per_token = chunk_s * min(PREFILL_BOUND_SCALE, self._tokens_per_row)
        return max(min(per_token, max(chunk_s, STREAM_GAP_SCALE * chunk_s - self._decode_s)), self._decode_credit)

    def _prefill_budget(self, contended: bool, spent: float = 0.0) -> int:
        """Tokens (rows x width) the next prefill step may take: max_prefill_tokens, cut while sequences decode
        to about `_chunk_bound` less `spent` (prefill seconds they have already waited) at the measured
        prefill speed (so a running stream waits at most about that long), but never below MIN_PREFILL_CHUNK
        (the prompt still moves)."""
        budget = self.config.max_prefill_tokens
        bound = self._chunk_bound()
        if contended and bound > 0 and self._prefill_s_per_token > 0:
            fits = int((bound - spent) / self._prefill_s_per_token)
            budget = min(budget, max(MIN_PREFILL_CHUNK, fits))
        return budget

    def _prefill_step(self, prefilling: list[Request], t0: float, budget: int) -> tuple[list[Delta], list[StepStats]]:
        overhead = self._prefill_cost.overhead_tokens(self.config.max_prefill_tokens)
        rows, width = plan_prefill([r.prompt_len - r.num_prefilled for r in prefilling], budget, overhead)
        reqs = [prefilling[i] for i in rows]
        draft = self.speculation.drafting()  # False: the policy runs without drafts; steps that draft catch up
        ends = {r.seq_id: min(r.prompt_len, r.num_prefilled + width) for r in reqs}  # seq_id -> end of this chunk
        # Chunks that complete their prompts may carry drafts the prefill forward verifies (the engine's fused
        # prefill, where every chunk completes its prompt): k as the policy runs for the batch they join.
        k = 0
        if draft:
            running = sum(1 for r in self.pool if r.state is RequestState.RUNNING)
            k = self.speculation.prefill_k(min(self.config.max_batch_size, running + len(reqs)))
        t1 = time.perf_counter()

        def call(batch: list[Request]) -> StepOutput:
            chunks = tuple(PrefillChunk(r.seq_id, r.num_prefilled, ends[r.seq_id]) for r in batch)
            return self.engine.prefill(PrefillBatch(chunks, draft=draft, num_draft_tokens=k))

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
            self._measure_prefill(out.draft_s + out.verify_s, len(batch) * (width + out.num_draft_tokens))
            self.speculation.observe_prefill(fed, out.draft_s if draft else 0.0)
        return deltas, stats

    def _measure_prefill(self, seconds: float, tokens: int) -> None:
        """Seconds per prefill token (rows x width: padding costs what a token costs), decayed."""
        if seconds <= 0 or tokens <= 0:
            return
        self._prefill_cost.observe(tokens, seconds)
        rate = seconds / tokens
        old = self._prefill_s_per_token
        self._prefill_s_per_token = rate if old == 0 else old + PREFILL_SPEED_DECAY * (rate - old)

    def _decode_step(self, running: list[Request], t0: float) -> tuple[list[Delta], list[StepStats]]:
        cands = [Candidate(i, r.length, r.waited, r.order) for i, r in enumerate(running)]
        choice = choose_batch(cands, self.config.max_batch_size, self.config.group_threshold, self.age_threshold)
        chosen = [running[i] for i in choice.keys]
        chosen_ids = {id(r) for r in chosen}
        for r in running:
            r.waited = 0 if id(r) in chosen_ids else r.waited + 1
        # rows with nothing to propose (n-gram lookup without a match, opted out) gain nothing from this step's k
        k = self.speculation.choose(len(chosen), sum(r.drafts_next for r in chosen))
        chosen, k = self._fit_growth(chosen, k)
        if not chosen:
            return [], []
        t1 = time.perf_counter()

        def call(batch: list[Request]) -> StepOutput:
            return self.engine.step(StepBatch(tuple(r.seq_id for r in batch), k))

        deltas, stats = [], []
        runs = self._run_isolated(chosen, call)
        for batch, out in runs:
            new, kept = self._emit(batch, out)
            # The policy weighs k by what a step really costs: its whole wall time (scheduling, forwards,
            # sampling, cutting, deltas); only while a failing row is isolated, each call's own forward time.
            seconds = time.perf_counter() - t0 if len(runs) == 1 else out.draft_s + out.verify_s
            self._observe(out, kept, seconds)
            deltas += new
            stats.append(self._stats(out, t1 - t0, 0, kept))
        return deltas, stats

    def _observe(self, out: StepOutput, num_tokens: int, seconds: float) -> None:
        """Report a decode step to the speculation policy: `num_tokens` kept of it in `seconds`."""
        self.speculation.observe(out.batch_size, out.num_draft_tokens, num_tokens, seconds, out.catchup_s,
                                 out.accepted_per_position, sum(1 for o in out.outputs if o.num_draft_tokens))
        if out.shadow_proposed:
            self.speculation.observe_proposals(out.shadow_proposed, out.shadow_accepted)

    def _fit_growth(self, chosen: list[Request], k: int) -> tuple[list[Request], int]:
        """Make the KV blocks the step needs (each row's positions up to length + k) fit the free ones, so the
        engine step never runs short: keep the largest k up to the policy's whose growth fits; when even k = 0
        does not fit, preempt the most recently arrived admitted sequence (vLLM v1's order), chosen or not,
        and try again. A sequence alone in the pool that cannot grow by one token ends with "length": the KV
        cache holds no longer sequence (a configuration whose max_model_len fits never gets there)."""
        while chosen:
            free = self.engine.num_free_blocks
            for kk in range(k, -1, -1):
                if sum(self.engine.blocks_needed(r.seq_id, r.length + kk) for r in chosen) <= free:
                    return chosen, kk
            victim = max(self.pool, key=lambda r: r.order)
            if len(self.pool) == 1:
                log.warning("request %s cannot grow past %d tokens: the KV cache has %d blocks of %d positions",
                            victim.request_id, victim.length, self.engine.num_blocks, self.engine.block_size)
                self._pending.append(self._finish(victim, "length", None))
                return [], 0
            self._preempt(victim)
            chosen = [r for r in chosen if r is not victim]
        return chosen, k

    def _preempt(self, req: Request) -> None:
        """Free a sequence's KV blocks and put it back at the head of the waiting queue (recompute preemption,
        as vLLM v1): it is re-added later with its generated tokens appended to its prompt. Its stream only
        pauses: the tokens, text and stopping state it has are kept, so it continues exactly where it was."""
        self.engine.free(req.seq_id)
        self._by_seq.pop(req.seq_id, None)
        req.seq_id = None
        self.pool.remove(req)
        req.state = RequestState.WAITING
        req.num_prefilled = 0
        req.waited = 0
        self.waiting.appendleft(req)  # victims go newest first, so the oldest ends at the head
        self.num_preemptions += 1
        self._unreported_preemptions += 1
        log.debug("preempted request %s at %d tokens", req.request_id, req.length)

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
            req.drafts_next = so.drafts_next
            if so.prompt_logprobs is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(so.prompt_logprobs)
            if not so.token_ids:  # a prompt chunk that does not complete the prompt
                continue
            kept, reason = req.stop_rule.apply(so.token_ids, req.num_output_tokens, req.length)
            first = req.num_output_tokens == 0
            text, stopped, n = req.add_tokens(kept, reason is not None)
            kept = kept[:n]  # a stop string ends the output at the token that completes it
            logprobs = so.logprobs[: len(kept)] if so.logprobs is not None else None  # kept is a prefix
            num_kept += len(kept)
            if stopped or reason is not None:
                deltas.append(self._finish(req, "stop" if stopped else reason, None, kept, text, logprobs))
            else:
                deltas.append((req, self._output(req, kept, text, first, logprobs)))
        return deltas, num_kept

    def _finish(self, req: Request, reason: str, error: str | None, token_ids=(), text: str = "",
                logprobs=None) -> Delta:
        if req.seq_id is not None:
            self.engine.free(req.seq_id)
            self._by_seq.pop(req.seq_id, None)
            req.seq_id = None
        if req in self.pool:
            self.pool.remove(req)
        req.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        self.speculation.observe_finished(req.prompt_len, req.num_output_tokens)  # what its draft prefill bought
        req.finish_reason, req.error = reason, error
        if not text and req.sent_chars < len(req.text):  # flush text held back for stop strings
            text = req.text[req.sent_chars :]
            req.sent_chars = len(req.text)
        first = req.num_output_tokens == len(token_ids)
        return req, self._output(req, tuple(token_ids), text, first, logprobs)

    def _output(self, req: Request, token_ids, text: str, first: bool, logprobs=None) -> RequestOutput:
        queue_time = prompt_logprobs = None
        if first and req.first_scheduled_time is not None:
            queue_time = req.first_scheduled_time - req.arrival_time
        if first and token_ids and req.prompt_logprobs is not None:
            prompt_logprobs = tuple(req.prompt_logprobs)
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _stats(self, out: StepOutput, schedule_s: float, prompt_tokens: int, num_tokens: int) -> StepStats:
        preempted, self._unreported_preemptions = self._unreported_preemptions, 0
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
            num_preemptions=preempted,
        )


def _message(e: Exception, req: Request) -> str:
    """What the client is told: an exspec error names the problem; anything else is an internal error whose
    details go to the log only."""
    if isinstance(e, ExspecError):
        return str(e)
    return INTERNAL_ERROR


def _prefill_chunks(ids: list[int], lengths: list[int], budget: int) -> list[tuple[PrefillChunk, ...]]:
    """Whole prompts prefilled in forwards of at most `budget` tokens (rows x widest chunk): rows in order, as many
    per forward as fit; a prompt longer than the budget alone, in chunks of `budget`."""
    batches, group = [], []
    for sid, n in zip(ids, lengths):
        if n > budget:
            batches += [(PrefillChunk(sid, s, min(s + budget, n)),) for s in range(0, n, budget)]
            continue
        if group and (len(group) + 1) * max(n, *(c.end for c in group)) > budget:
            batches.append(tuple(group))
            group = []
        group.append(PrefillChunk(sid, 0, n))
    if group:
        batches.append(tuple(group))
    return batches

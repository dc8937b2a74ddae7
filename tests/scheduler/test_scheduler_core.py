"""SchedulerCore and AsyncScheduler with a fake engine: admission, back-pressure, cancellation,
failures, stop strings and incremental detokenisation."""

import asyncio
import types

import pytest

from exspec.errors import ExspecError, InvalidRequestError
from exspec.engine.params import SamplingParams
from tests.support.fake_engine import FakeEngine
from exspec.scheduler import AsyncScheduler, QueueFullError, SchedulerClosedError, SchedulerConfig, SchedulerCore
from exspec.scheduler.core import INTERNAL_ERROR
from exspec.scheduler.request import IncrementalDetokenizer, Request


def run_all(core, max_steps=10_000):
    deltas = []
    for _ in range(max_steps):
        if not core.has_work():
            return deltas
        d, _ = core.step()
        deltas.extend(d)
    raise AssertionError("did not finish")


def req(i, prompt_len=4, max_tokens=5, **kw):
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw), order=i)


def test_pool_never_exceeds_w_and_everything_finishes():
    eng = FakeEngine(num_slots=16)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=4, max_wait_steps=4))
    for i in range(10):
        core.add(req(i, prompt_len=3 + i % 3))
    seen_max = 0
    while core.has_work():
        core.step()
        seen_max = max(seen_max, core.num_running, eng.num_used)
        assert all(len(b.seq_ids) <= 2 for b in eng.batches)
    assert seen_max == 4
    assert eng.num_used == 0


def test_outputs_follow_engine_tokens_and_finish_reason():
    eng = FakeEngine(accept=lambda s, k: 2)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=3))
    core.add(req(0, prompt_len=4, max_tokens=7))
    deltas = run_all(core)
    tokens = [t for _, d in deltas for t in d.token_ids]
    assert tokens == [FakeEngine.token_at(p) for p in range(4, 11)]
    last = deltas[-1][1]
    assert last.finished and last.finish_reason == "length" and last.completion_tokens == 7
    assert sum(1 for _, d in deltas if d.finished) == 1
    assert deltas[0][1].queue_time_s is not None and deltas[0][1].queue_time_s >= 0


def test_prefill_is_chunked_and_interleaved_with_decoding():
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=1, pool_size=4, max_prefill_tokens=8))
    core.add(req(0, prompt_len=3, max_tokens=50))
    core.step()  # prefill of request 0
    core.add(req(1, prompt_len=30, max_tokens=5))
    kinds = []
    for _ in range(8):
        _, stats = core.step()
        kinds.append(stats[0].kind)
    # A 30-token prompt with an 8-token budget takes 4 prefill steps. The decode batch is full (B = 1), so
    # steps reporting equal times (here none) share the time one for one: never two prefill steps in a row while
    # 0 decodes.
    assert kinds.count("prefill") == 4
    assert all(not (a == b == "prefill") for a, b in zip(kinds, kinds[1:]))
    assert all(len(p.chunks) * max(c.end - c.start for c in p.chunks) <= 8 for p in eng.prefills)  # padded


def test_a_closed_batch_fills_the_decode_batch_before_decoding():
    """8 prompts of unequal lengths (not padded into one prefill step) in a pool of 2B at B = 4: prefill runs step
    after step until 4 rows can decode (prefill here reports no time, so the running rows' bound on waiting is never
    reached), and the first decode step has 4 rows, not the 1 or 2 the first prefill steps made ready."""
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=8, max_prefill_tokens=512))
    for i, n in enumerate((10, 30, 50, 70, 90, 110, 130, 150)):
        core.add(req(i, prompt_len=n, max_tokens=20))
    first_decode, prefills = None, 0
    while first_decode is None:
        _, stats = core.step()
        if stats[0].kind == "prefill":
            prefills += 1
        else:
            first_decode = stats[0].batch_size
    assert prefills >= 2 and first_decode == 4, (prefills, first_decode)


def test_abort_frees_slot_at_step_boundary():
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2))
    core.add(req(0, max_tokens=100))
    core.add(req(1, max_tokens=100))
    core.add(req(2, max_tokens=100))  # waits: pool is full
    for _ in range(4):
        core.step()
    assert eng.num_used == 2
    d = core.abort("0")
    assert d[1].finished and d[1].finish_reason == "abort"
    assert eng.num_used == 1
    d = core.abort("2")  # still waiting: leaves the queue
    assert d[1].finish_reason == "abort" and core.num_waiting == 0
    assert core.abort("nope") is None
    core.abort("1")
    assert eng.num_used == 0 and not core.has_work()


@pytest.mark.engine_faults
def test_engine_failure_fails_only_that_batch():
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=1, pool_size=2, max_wait_steps=2))
    core.add(req(0, max_tokens=4))
    core.add(req(1, max_tokens=4))
    core.step()  # prefill both
    eng.fail_next = True
    deltas, stats = core.step()
    assert stats == []
    failed = [d for _, d in deltas if d.finish_reason == "error"]
    assert len(failed) == 1 and failed[0].error == INTERNAL_ERROR  # details in the log, not to the client
    rest = run_all(core)
    assert rest[-1][1].finish_reason == "length"
    assert eng.num_used == 0


def test_stop_token_ids_and_use_speculation_reach_the_engine():
    eng = FakeEngine(accept=lambda s, k: k)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=3, speculation="fixed"))
    core.add(req(0, max_tokens=8, use_speculation=False))
    core.add(req(1, max_tokens=8))
    deltas = run_all(core)
    by = {}
    for _, d in deltas:
        by.setdefault(d.request_id, []).append(d)
    assert by["0"][-1].num_accepted_tokens == 0 and by["1"][-1].num_accepted_tokens > 0


def test_pool_larger_than_engine_slots_is_rejected():
    with pytest.raises(Exception, match="pool_size"):
        SchedulerCore(FakeEngine(num_slots=4), SchedulerConfig(max_batch_size=2, pool_size=8))


class CharTokenizer:
    """Token id = one byte; decode is UTF-8 with replacement, like a byte-level BPE on partial input."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_incremental_detokenizer_handles_split_multibyte_characters():
    text = "h\u00e9llo \u65e5\u672c \U0001f600!"
    data = list(text.encode())
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("a")])
    out = ""
    for i in range(0, len(data), 2):  # two bytes per "step": splits every multi-byte character somewhere
        piece = detok.add(data[i : i + 2], final=i + 2 >= len(data))
        assert "\ufffd" not in piece
        out += piece
    assert out == text


def test_stop_strings_are_cut_and_never_streamed_partially():
    r = Request("x", [104], SamplingParams(max_tokens=50, stop=("STOP",)), order=0)
    r.detok = IncrementalDetokenizer(CharTokenizer(), [104])
    streamed = ""
    stopped = False
    for chunk in ["abc S", "TO", "P tail"]:
        piece, stopped, _ = r.add_tokens(tuple(chunk.encode()), engine_finished=False)
        streamed += piece
        if stopped:
            break
    assert stopped and streamed == "abc " and r.text == "abc "


async def test_async_queue_full_abort_and_shutdown():
    eng = FakeEngine(num_slots=2, max_model_len=10**9)  # never "length": only the abort can end them
    sched = AsyncScheduler(eng, SchedulerConfig(max_batch_size=1, pool_size=1, max_waiting=2, max_wait_steps=1))
    with pytest.raises(SchedulerClosedError):  # not started yet
        sched.submit([1], SamplingParams())
    await sched.start()
    with pytest.raises(InvalidRequestError):
        sched.submit([], SamplingParams())
    streams = [sched.submit([1, 2], SamplingParams(max_tokens=100000), request_id=f"r{i}") for i in range(2)]
    # The worker admits one into the pool; fill the queue again until it refuses.
    with pytest.raises(QueueFullError):
        for i in range(2, 10):
            streams.append(sched.submit([1, 2], SamplingParams(max_tokens=100000), request_id=f"r{i}"))
    first = await streams[0].__anext__()
    assert first.token_ids and not first.finished
    for s in streams:
        sched.abort(s.request_id)
    for s in streams:
        outs = [o async for o in s]
        assert outs and outs[-1].finish_reason == "abort"
    # the worker frees the aborted rows on its next turn: wait for that, not for a fixed time (a loaded machine)
    for _ in range(3000):
        if eng.num_used == 0 and sched.num_waiting == 0 and sched.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert eng.num_used == 0 and sched.num_waiting == 0 and sched.num_running == 0
    await sched.shutdown(timeout=1)
    assert not sched.is_alive
    with pytest.raises(SchedulerClosedError):
        sched.submit([1], SamplingParams())


async def test_shutdown_lets_running_requests_finish_then_aborts_the_rest(monkeypatch):
    """The drain's clock is the test's: its deadline passes once `short` has finished, however slow the machine,
    and then `endless` is aborted."""
    from exspec.scheduler import async_scheduler

    eng = FakeEngine(num_slots=4, max_model_len=10**9)
    sched = AsyncScheduler(eng, SchedulerConfig(max_batch_size=2, pool_size=2, max_wait_steps=1))
    await sched.start()
    short = sched.submit([1, 2, 3], SamplingParams(max_tokens=3))
    endless = sched.submit([1, 2, 3], SamplingParams(max_tokens=10**9))

    async def read(stream):
        return [o async for o in stream]

    short_reader = asyncio.create_task(read(short))
    clock = types.SimpleNamespace(monotonic=lambda: float("inf") if short_reader.done() else 0.0)
    monkeypatch.setattr(async_scheduler, "time", clock)
    await sched.shutdown(timeout=1.0)
    assert (await short_reader)[-1].finish_reason == "length"
    assert [o async for o in endless][-1].finish_reason == "abort"
    assert eng.num_used == 0


async def test_step_listeners_see_every_step():
    eng = FakeEngine(accept=lambda s, k: 1)
    sched = AsyncScheduler(eng, SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=2))
    seen = []
    sched.add_step_listener(seen.append)
    await sched.start()
    outs = [o async for o in sched.submit([5, 6], SamplingParams(max_tokens=6))]
    await sched.shutdown(1)
    assert sum(o.completion_tokens > 0 for o in outs[-1:]) == 1
    kinds = [s.kind for s in seen]
    assert kinds[0] == "prefill" and "grouped" in kinds
    assert sum(s.num_tokens for s in seen) == 6


def test_seeded_sampling_decodes_without_drafts_unless_k_is_fixed():
    """Under a timing-driven policy the k schedule varies between runs; a seeded sampled request must still
    reproduce, so it decodes without drafts there (and speculates under `fixed`)."""
    for mode, speculating in (("auto", False), ("adaptive", False), ("fixed", True)):
        eng = FakeEngine(accept=lambda s, k: k)
        core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=3, speculation=mode))
        core.add(req(0, max_tokens=8, temperature=0.8, seed=7))
        core.add(req(1, max_tokens=8, temperature=0.8))
        core.step()
        assert eng.seqs[0].params.use_speculation is speculating, mode
        assert eng.seqs[1].params.use_speculation is True, mode


def test_prefill_steps_are_bounded_by_padded_tokens_and_chunk_long_prompts():
    """A long prompt beside short ones is chunked rather than padding every row to its length; every
    prompt is prefilled exactly once, in FIFO order of first chunks."""
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=8, pool_size=8, max_prefill_tokens=64))
    lens = [5, 200, 6, 7, 4, 90]
    for i, n in enumerate(lens):
        core.add(req(i, prompt_len=n, max_tokens=1))
    while core.has_work():
        core.step()
    fed: dict[int, int] = {}
    for p in eng.prefills:
        widths = [c.end - c.start for c in p.chunks]
        assert len(widths) * max(widths) <= 64
        for c in p.chunks:
            assert c.start == fed.get(c.seq_id, 0)  # each chunk continues the last
            fed[c.seq_id] = c.end
    assert sorted(fed.values()) == sorted(lens)
    real = sum(lens)
    padded = sum(len(p.chunks) * max(c.end - c.start for c in p.chunks) for p in eng.prefills)
    assert padded <= 1.5 * real


@pytest.mark.parametrize("k", [0, 4])
def test_prompts_skip_the_draft_only_when_the_policy_expects_no_drafts(k):
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2, speculation="fixed", num_speculative_tokens=k))
    core.add(req(0, prompt_len=5, max_tokens=3))
    while core.has_work():
        core.step()
    assert [p.draft for p in eng.prefills] == [k > 0]


def test_the_policy_observes_acceptance_per_position_and_the_rows_that_drafted():
    from exspec.scheduler.policies.fixed import FixedPolicy

    class Recording(FixedPolicy):
        def __init__(self):
            super().__init__(3)
            self.seen = []

        def observe(self, batch_size, k, num_tokens, seconds, catchup_s=0.0, accepted=(), drafting_rows=None):
            self.seen.append((batch_size, k, accepted, drafting_rows))

    eng = FakeEngine(accept=lambda seq, k: 2)
    policy = Recording()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=3,
                                              speculation="fixed"), speculation=policy)
    core.add(req(0, max_tokens=9))
    core.add(req(1, max_tokens=9, use_speculation=False))  # proposes no drafts: not a drafting row
    run_all(core)
    assert policy.seen and policy.seen[0] == (2, 3, (1, 1, 0), 1)


@pytest.mark.parametrize("k", [0, 3])
def test_the_policy_observes_prefills_and_finished_requests(k):
    """What the draft's prefill costs per generated token: each prefill step's prompt tokens and its draft seconds
    (0 when prompts skip the draft), and each finished request's prompt and output lengths."""
    from dataclasses import replace

    from exspec.scheduler.policies.fixed import FixedPolicy

    class DraftTimed(FakeEngine):
        def prefill(self, batch):
            out = super().prefill(batch)
            fed = sum(c.end - c.start for c in batch.chunks)
            return replace(out, draft_s=0.001 * fed if batch.draft else 0.0)

    class Recording(FixedPolicy):
        def __init__(self):
            super().__init__(k)
            self.prefills, self.finished = [], []

        def observe_prefill(self, num_tokens, draft_seconds):
            self.prefills.append((num_tokens, draft_seconds))

        def observe_finished(self, prompt_tokens, output_tokens):
            self.finished.append((prompt_tokens, output_tokens))

    policy = Recording()
    core = SchedulerCore(DraftTimed(), SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=k,
                                                       speculation="fixed"), speculation=policy)
    core.add(req(0, prompt_len=5, max_tokens=3))
    core.add(req(1, prompt_len=7, max_tokens=4))
    run_all(core)
    assert sum(n for n, _ in policy.prefills) == 12
    assert sum(s for _, s in policy.prefills) == pytest.approx(0.012 if k else 0.0)
    assert sorted(policy.finished) == [(5, 3), (7, 4)]


def _planned_batches(plan):
    """The engine steps calibrate runs for a plan: an unreported k = 0 step first at each batch size."""
    steps, seen = [], set()
    for b, k in plan:
        if b not in seen:
            steps.append((b, 0))
            seen.add(b)
        steps.append((b, k))
    return steps


def test_calibrate_runs_the_policys_steps_before_serving_and_frees_everything():
    eng = FakeEngine(num_slots=16, accept=lambda seq, k: 0)  # a draft that never agrees
    # rows never restart here (test_calibrate_restarts_rows_at_answer_length)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=8, calibration_answer_tokens=10**6))
    free = eng.num_free_blocks
    plan = core.speculation.calibration(4)
    assert plan and max(b for b, _ in plan) == 4
    assert core.calibrate([[5 + i] * (3 + i) for i in range(6)]) == len(plan)
    assert [(len(x.seq_ids), x.num_draft_tokens) for x in eng.batches] == _planned_batches(plan)
    assert all(x.seq_ids == tuple(s for s, *_ in eng.added[: len(x.seq_ids)]) for x in eng.batches)  # the first rows
    assert len(eng.added) == 4 and sorted(eng.freed) == [s for s, *_ in eng.added]
    assert not eng.seqs and eng.num_free_blocks == free
    summary = core.speculation.summary()
    assert sorted(summary) == [1, 2, 3, 4]
    # the summary counts live steps only; what the calibration measured decides: a draft that never agrees, k = 0
    assert all(s["steps_by_k"] == {} and s["best_k"] == 0 for s in summary.values())
    assert core.speculation.acceptance()[0] < 0.1
    # then requests are served as usual
    reqs = [req(i) for i in range(3)]
    for r in reqs:
        core.add(r)
    run_all(core)
    assert all(r.finish_reason == "length" and r.num_output_tokens == 5 for r in reqs)
    assert [s for s, *_ in eng.added[4:]] == [4, 5, 6] and not eng.seqs  # ids after the calibration's


def test_calibrate_restarts_rows_at_answer_length():
    """A calibration row that has written `calibration_answer_tokens` tokens starts again from its prompt (a new
    sequence): the policy measures acceptance on answer-length text, not on the loops a small model's greedy text
    falls into over hundreds of tokens. Every step of the plan still runs; everything is freed."""
    eng = FakeEngine(num_slots=16, accept=lambda seq, k: 0)  # one token a row a step
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=3, pool_size=6, calibration_answer_tokens=5))
    plan = core.speculation.calibration(3)
    prompts = [[5 + i] * (3 + i) for i in range(3)]
    assert core.calibrate(prompts) == len(plan)
    assert [(len(x.seq_ids), x.num_draft_tokens) for x in eng.batches] == _planned_batches(plan)
    steps_of = {}
    for x in eng.batches:
        for sid in x.seq_ids:
            steps_of[sid] = steps_of.get(sid, 0) + 1
    # checked before each entry of the plan: the prefill's token + 4 steps' = 5 written, then a new sequence; one step
    # more where an entry also runs its batch size's first (unreported) step
    assert max(steps_of.values()) <= 5 and sorted(steps_of.values())[len(steps_of) // 2] == 4
    assert len(eng.added) > 3 and sorted(eng.freed) == sorted(s for s, *_ in eng.added) and not eng.seqs
    prompt_of = {s: list(p) for s, p, *_ in eng.added}
    assert all(prompt_of[x.seq_ids[i]] == prompts[i] for x in eng.batches for i in range(len(x.seq_ids)))  # row i
    with pytest.raises(ExspecError, match="calibration_answer_tokens must be >= 1"):
        SchedulerConfig(calibration_answer_tokens=0)


def test_calibrate_prefills_in_forwards_of_at_most_max_prefill_tokens():
    """A large batch size must not become one huge prefill forward (B x prompt tokens on a GPU)."""
    eng = FakeEngine(num_slots=16)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=8, pool_size=8, max_prefill_tokens=24))
    prompts = [[5] * n for n in (10, 12, 30, 7, 7, 7, 11, 3)]  # one longer than the budget
    assert core.calibrate(prompts) > 0
    assert len(eng.prefills) > 1
    for batch in eng.prefills:
        widths = [c.end - c.start for c in batch.chunks]
        assert len(widths) * max(widths) <= 24 and batch.draft
    fed = {}
    for batch in eng.prefills:
        for c in batch.chunks:
            assert c.start == fed.get(c.seq_id, 0)  # in order, each chunk where the last ended
            fed[c.seq_id] = c.end
    assert fed == {sid: len(p) for sid, p, _ in eng.added}  # each whole prompt (rows restarted: new sequences)
    assert sorted({tuple(p) for _, p, _ in eng.added}) == sorted({tuple(p) for p in prompts})


def test_calibrate_stops_before_max_model_len_and_when_blocks_run_short():
    eng = FakeEngine(num_slots=8, max_model_len=40)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=4))
    plan = core.speculation.calibration(2)
    steps = core.calibrate([[7] * 10, [8] * 12])
    assert 0 < steps < len(plan) and not eng.seqs  # 12 + 1 + steps' tokens reach 40 long before the plan's end
    # (FakeEngine.step asserts every row is shorter than max_model_len)

    eng = FakeEngine(num_slots=8, block_size=4, num_blocks=12)  # room for the prompts and a few steps
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=4))
    steps = core.calibrate([[7] * 10, [8] * 12])
    assert 0 < steps < len(plan) and not eng.seqs and eng.num_free_blocks == 12
    with pytest.raises(RuntimeError):
        core.add(req(0))
        core.calibrate([[1, 2, 3]])


async def test_async_scheduler_calibrates_before_its_loop_starts():
    sched = AsyncScheduler(FakeEngine(num_slots=8, accept=lambda seq, k: 0), SchedulerConfig(max_batch_size=4, pool_size=4))
    best = sched.calibrate([[3] * 5] * 4)  # the k chosen per bucket (from the fake's meaningless step times)
    assert sorted(best) == [1, 2, 3, 4] and all(0 <= k <= 4 for k in best.values())
    await sched.start()
    try:
        with pytest.raises(RuntimeError):
            sched.calibrate([[3] * 5])
    finally:
        await sched.shutdown(1.0)


def test_prefill_steps_carry_the_policys_k_for_the_batch_they_join():
    """A prefill step asks the policy for k (`prefill_k`, given the decode batch its rows join) and hands it to the
    engine, which verifies that many drafts in the prefill forward where every chunk completes its prompt; none
    when prompts skip the draft (`drafting()` False) or the policy says 0."""
    from exspec.scheduler.policies.fixed import FixedPolicy

    class Asked(FixedPolicy):
        def __init__(self, k, drafts=True):
            super().__init__(k)
            self.asked, self.drafts = [], drafts

        def prefill_k(self, batch_size):
            self.asked.append(batch_size)
            return self.k_max - 1

        def drafting(self):
            return self.drafts

    for drafts in (True, False):
        eng, policy = FakeEngine(), Asked(3, drafts)
        core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=3,
                                                  speculation="fixed", max_prefill_tokens=8), speculation=policy)
        for i in range(3):
            core.add(req(i, prompt_len=6, max_tokens=5))
        run_all(core)
        assert [b.num_draft_tokens for b in eng.prefills] == ([2] * len(eng.prefills) if drafts else [0] * 3)
        # one 6-token prompt a step (max_prefill_tokens 8): the batch each joins has 1, 2, 3 rows
        assert policy.asked == ([1, 2, 3] if drafts else [])
    # the policies' own answers: fixed runs k_max, the base class none, auto the k its bucket runs
    from exspec.scheduler.policies import SpeculationPolicy, create

    assert create("fixed", 4).prefill_k(8) == 4 and create("fixed", 0).prefill_k(1) == 0
    assert SpeculationPolicy.prefill_k(create("adaptive", 4), 1) == 0 and create("adaptive", 4).prefill_k(1) == 0
    auto = create("auto", 4)
    assert auto.prefill_k(1) == 0  # nothing measured: the safe incumbent
    auto._bucket(1).best = 3
    assert auto.prefill_k(1) == 3 and auto.prefill_k(8) == 0


def test_an_offline_summary_counts_a_fused_prefills_drafts():
    """A fused prefill verifies drafts with the prompts: the run's acceptance counts them (a 4-token answer from a
    prefill with 3 drafts, all accepted: 4 tokens from one row's one verify, no decode step at all)."""
    from exspec.scheduler import generate_offline

    eng = FakeEngine(accept=lambda seq, k: k, fused_prefill=True)
    cfg = SchedulerConfig(max_batch_size=1, pool_size=1, num_speculative_tokens=3, speculation="fixed")
    results, summary = generate_offline(eng, [[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0.0)], cfg)
    assert [b.num_draft_tokens for b in eng.prefills] == [3] and len(results[0].token_ids) == 4
    assert summary.steps == {"grouped": 0, "mixed": 0, "prefill": 1}
    assert summary.mean_acceptance_length == 4.0 and summary.acceptance_rate == 1.0
    assert summary.num_decode_tokens == 0 and summary.decode_seconds == 0.0  # decode figures stay decode only


async def test_deltas_queued_before_a_read_leave_as_one():
    """A loaded event loop reads a stream less often than the engine steps: what queued up meanwhile is one delta
    (tokens and text joined, the latest totals and finish, the first delta's queue time), so the server writes one
    SSE event for it; a delta read as soon as it came stays alone."""
    from exspec.scheduler import RequestStream
    from exspec.scheduler.types import RequestOutput

    def delta(ids, text, done=False, queue_time=None):
        return RequestOutput("r", ids, text, done, "length" if done else None, 4, 0, queue_time_s=queue_time)

    stream = RequestStream("r")
    stream._push(delta((1,), "a", queue_time=0.5))
    assert await stream.__anext__() == delta((1,), "a", queue_time=0.5)
    for d in (delta((2, 3), "bc"), delta((4,), "d"), delta((5,), "e", done=True)):
        stream._push(d)
    merged = await stream.__anext__()
    assert (merged.token_ids, merged.text, merged.finished, merged.finish_reason) == ((2, 3, 4, 5), "bcde", True, "length")
    assert merged.queue_time_s is None
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    stream = RequestStream("s")
    for d in (delta((1,), "a", queue_time=0.25), delta((2,), "b")):
        stream._push(d)
    assert [(o.token_ids, o.text, o.queue_time_s) async for o in _until_finished(stream, 1)] == [((1, 2), "ab", 0.25)]
    stream = RequestStream("e")  # an error is never merged into the text before it: the reader reports it alone
    failed = RequestOutput("e", (), "", True, "error", 4, 2, error="boom")
    for d in (delta((1,), "a"), delta((2,), "b"), failed):
        stream._push(d)
    assert [(o.token_ids, o.finish_reason) async for o in _until_finished(stream, 2)] == [((1, 2), None), ((), "error")]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def _until_finished(stream, reads):
    for _ in range(reads):
        yield await stream.__anext__()


@pytest.mark.parametrize("min_group_size, rows", [(0, 4), (2, 2)])
def test_a_same_length_group_runs_alone_only_when_it_fills_the_batch_by_default(min_group_size, rows):
    """A mixed step costs about what a grouped one of as many rows does (its path only changes positions and the mask),
    while a step of half the rows costs far more than half: by default (min_group_size 0: B) a group of 2 of 8 waiting
    rows does not run alone at B = 4, the four longest-waiting run mixed. min_group_size 2 keeps the old rule."""
    eng = FakeEngine(num_slots=16)
    config = SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=0, speculation="fixed",
                             min_group_size=min_group_size)
    assert config.group_threshold == (min_group_size or 4)
    core = SchedulerCore(eng, config)
    for i, n in enumerate((4, 4, 5, 6, 7, 8, 9, 10)):  # one same-length pair, the others each alone
        core.add(req(i, prompt_len=n, max_tokens=3))
    while not eng.batches:
        core.step()
    assert len(eng.prefills) == 1  # every prompt in the pool before the first decode step
    first = eng.batches[0]
    assert len(first.seq_ids) == rows
    run_all(core)


def _logprobs_by_request(deltas):
    """request id -> (tokens, logprobs) joined over its deltas; logprobs None where every delta had None."""
    by: dict[str, tuple[list, list | None]] = {}
    for _, d in deltas:
        ids, lps = by.setdefault(d.request_id, ([], None))
        ids.extend(d.token_ids)
        if d.logprobs is not None:
            lps = (lps or []) + list(d.logprobs)
        else:
            assert not d.token_ids or lps is None, "a request's deltas either all carry logprobs or none does"
        by[d.request_id] = (ids, lps)
    return by


@pytest.mark.parametrize("stop", [(), ("\x10",)])
def test_logprobs_follow_the_kept_tokens(stop):
    """Each kept token keeps its own logprobs through speculative steps of several tokens, max_tokens, an EOS
    and a stop string cutting a step short; a request that asks for none gets None."""
    eng = FakeEngine(accept=lambda s, k: 3, tokenizer=CharTokenizer(), eos_positions={17})
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=3))
    core.add(req(0, prompt_len=4, max_tokens=9, logprobs=2, stop=stop))  # token_at(6) == 16 == "\x10"
    core.add(req(1, prompt_len=4, max_tokens=30, logprobs=0))  # EOS at position 17
    core.add(req(2, prompt_len=4, max_tokens=9))
    by = _logprobs_by_request(run_all(core))
    ids, lps = by["0"]
    assert len(ids) == (3 if stop else 9)  # the stop string's token is the last one kept
    assert lps == [FakeEngine.logprob_at(4 + i, t, 2) for i, t in enumerate(ids)]
    ids, lps = by["1"]
    assert ids[-1] == 2 and len(ids) == 14
    assert lps == [FakeEngine.logprob_at(4 + i, t, 0) for i, t in enumerate(ids)]
    assert by["2"][1] is None and len(by["2"][0]) == 9


def test_merged_deltas_join_logprobs():
    from exspec.engine.types import TokenLogprob
    from exspec.scheduler.types import RequestOutput, merge_deltas

    a, b = TokenLogprob(-0.5, ((7, -0.5),)), TokenLogprob(-1.5, ((8, -0.25),))
    first = RequestOutput("r", (7,), "x", False, None, 1, 1, logprobs=(a,))
    then = RequestOutput("r", (8,), "y", True, "stop", 1, 2, logprobs=(b,))
    assert merge_deltas(first, then).logprobs == (a, b)
    flush = RequestOutput("r", (), "", True, "stop", 1, 1)  # a finish with no tokens (held-back text flushed)
    assert merge_deltas(first, flush).logprobs == (a,)
    plain = RequestOutput("r", (7,), "x", False, None, 1, 1)
    assert merge_deltas(plain, RequestOutput("r", (8,), "y", True, "stop", 1, 2)).logprobs is None

"""A failure stays with the request that caused it: admission, prefill and step faults fail only the
responsible request; batchmates finish with exactly the tokens they would have had; a dead step loop
answers every open stream at once."""

import asyncio

import pytest

from exspec.engine.params import SamplingParams
from exspec.scheduler import AsyncScheduler, SchedulerConfig, SchedulerCore, generate_offline
from exspec.scheduler.core import INTERNAL_ERROR
from exspec.scheduler.request import Request
from tests.support.fake_engine import FakeEngine

pytestmark = pytest.mark.engine_faults


def _run(core):
    finals = {}
    for _ in range(10_000):
        if not core.has_work():
            return finals
        deltas, _ = core.step()
        for req, out in deltas:
            if out.finished:
                finals[req.request_id] = (out, list(req.output_token_ids))
    raise AssertionError("did not finish")


def _reqs(n, max_tokens=12):
    return [Request(str(i), list(range(1, 4 + i)), SamplingParams(max_tokens=max_tokens), order=i) for i in range(n)]


def test_a_failing_row_fails_alone_and_batchmates_keep_their_outputs():
    clean = SchedulerCore(FakeEngine(accept=lambda s, k: 1), SchedulerConfig(max_batch_size=8, pool_size=8, num_speculative_tokens=3))
    for r in _reqs(8):
        clean.add(r)
    expected = _run(clean)

    eng = FakeEngine(accept=lambda s, k: 1)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=8, pool_size=8, num_speculative_tokens=3))
    for r in _reqs(8):
        core.add(r)
    core.step()  # prefill everything
    eng.fail_ids = {5}  # request "5" got engine sequence id 5: every batch holding it raises
    got = _run(core)
    assert got["5"][0].finish_reason == "error" and got["5"][0].error == INTERNAL_ERROR
    for rid, (out, tokens) in expected.items():
        if rid != "5":
            assert got[rid][0].finish_reason == out.finish_reason == "length"
            assert got[rid][1] == tokens
    assert eng.num_used == 0


def test_an_engine_error_while_admitting_fails_only_that_request():
    eng = FakeEngine()
    original = eng.add

    def add(seq_id, ids, params):
        if params.max_tokens == 7:
            raise OverflowError("Overflow when unpacking long long")  # what a huge top_k used to do
        return original(seq_id, ids, params)

    eng.add = add
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4))
    core.add(Request("bad", [1, 2, 3], SamplingParams(max_tokens=7), order=0))
    core.add(Request("good", [1, 2, 3], SamplingParams(max_tokens=5), order=1))
    got = _run(core)
    assert got["bad"][0].finish_reason == "error" and "Overflow" not in got["bad"][0].error
    assert got["good"][0].finish_reason == "length" and len(got["good"][1]) == 5
    assert eng.num_used == 0


def test_a_failing_prefill_row_fails_alone():
    eng = FakeEngine()
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4))
    for r in _reqs(4, max_tokens=3):
        core.add(r)
    eng.fail_ids = {2}
    got = _run(core)
    assert [got[str(i)][0].finish_reason for i in range(4)] == ["length", "length", "error", "length"]


async def test_a_dead_step_loop_answers_every_stream_at_once():
    eng = FakeEngine(step_seconds=0.0)
    sched = AsyncScheduler(eng, SchedulerConfig(max_batch_size=2, pool_size=2))

    def explode():
        if len(sched._core.waiting) < 5:  # die only once all five are in (else a later submit is refused)
            return [], []
        raise SystemError("the loop itself is broken")

    sched._core.step = explode  # not a request's fault: the loop dies
    await sched.start()
    streams = [sched.submit([1, 2, 3], SamplingParams(max_tokens=50)) for _ in range(5)]
    finals = await asyncio.wait_for(asyncio.gather(*[_last(s) for s in streams]), 5)
    assert all(f.finished and f.finish_reason == "error" for f in finals)
    assert not sched.is_alive and "step loop died" in sched.dead_reason
    await sched.shutdown(1)


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_offline_run_survives_a_failing_row_with_real_models(models):
    """The fault-injection test on a real pair: one request's rows always raise; every other request's
    output is exactly the target's own greedy output."""
    from tests.support.models import random_prompts

    engine = models.engine("llama", "noisy", max_num_seqs=8)
    prompts = random_prompts([5, 9, 5, 12, 7, 5], seed=77)
    params = [SamplingParams(max_tokens=16) for _ in prompts]
    real_step = engine.step

    def step(batch):
        if 3 in batch.seq_ids:  # the 4th request admitted gets sequence id 3
            raise RuntimeError("injected fault in one row")
        return real_step(batch)

    engine.step = step
    results, _ = generate_offline(engine, prompts, params, SchedulerConfig(max_batch_size=6, pool_size=8, num_speculative_tokens=3))
    assert results[3].finish_reason == "error"
    for i, (p, r) in enumerate(zip(prompts, results)):
        if i != 3:
            assert r.token_ids == models.reference("llama", p, 16), f"request {i}"
    assert engine.num_free_slots == engine.num_slots

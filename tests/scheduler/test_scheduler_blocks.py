"""The scheduler over paged KV (issue 19), with the fake engine's exact block accounting: admission waits for
a prompt's blocks in FIFO order, memory follows the tokens held, a step's growth is made to fit (k lowered
first, then the most recently arrived sequence preempted and recomputed later), and every output is exactly
what it is with blocks to spare: greedy and seeded tokens, min_tokens, stop ids, streamed text, usage."""

import pytest

from exspec.engine.params import SamplingParams
from exspec.errors import CapacityError, InvalidRequestError
from exspec.scheduler import AsyncScheduler, SchedulerConfig, SchedulerCore
from exspec.scheduler.request import Request
from tests.support.fake_engine import EOS, FakeEngine


class CharTokenizer:
    """Token id = one character (the fake's tokens 10..59 and EOS)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + i) for i in ids if not (skip_special_tokens and i == EOS))


def req(i, prompt_len=4, max_tokens=5, **kw):
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw), order=i)


def step_until(core, done, max_steps=1000):
    deltas = []
    for _ in range(max_steps):
        if done():
            return deltas
        deltas += core.step()[0]
    raise AssertionError("condition not reached")


def run_all(core, max_steps=10_000):
    return step_until(core, lambda: not core.has_work(), max_steps)


def fixed(k=0, batch=4, pool=8):
    return SchedulerConfig(max_batch_size=batch, pool_size=pool, num_speculative_tokens=k, speculation="fixed")


def test_admission_waits_for_a_prompts_blocks_in_fifo_order():
    eng = FakeEngine(block_size=4, num_blocks=10)
    core = SchedulerCore(eng, fixed())
    core.add(req(0, prompt_len=30, max_tokens=3))  # 8 blocks
    core.add(req(1, prompt_len=12, max_tokens=3))  # 3 blocks: 2 are left, it waits
    core.add(req(2, prompt_len=4, max_tokens=3))  # 1 block would fit, but it does not overtake request 1
    core.step()
    assert [r.request_id for r in core.pool] == ["0"] and [r.request_id for r in core.waiting] == ["1", "2"]
    deltas = run_all(core)
    assert [len(prompt) for _, prompt, _ in eng.added] == [30, 12, 4]  # admitted in arrival order
    finals = {d.request_id: d for _, d in deltas if d.finished}
    assert all(d.finish_reason == "length" and d.completion_tokens == 3 for d in finals.values())
    assert core.num_preemptions == 0 and eng.num_free_blocks == eng.num_blocks


def test_admission_leaves_the_blocks_admitted_sequences_need_next():
    """Admitting must not force a preemption at the very next step: the block request 0 needs to write its
    pending token stays free, so request 1 waits instead of being admitted and preempted at once."""
    eng = FakeEngine(block_size=4, num_blocks=3)
    core = SchedulerCore(eng, fixed())
    core.add(req(0, prompt_len=4, max_tokens=3))  # 1 block; its first step writes position 4: a 2nd block
    core.step()
    core.add(req(1, prompt_len=8, max_tokens=3))  # 2 blocks: free, but one of them is request 0's next
    core.step()
    assert [r.request_id for r in core.waiting] == ["1"]
    deltas = run_all(core)
    assert core.num_preemptions == 0
    assert [d.completion_tokens for _, d in deltas if d.finished] == [3, 3]


def test_blocks_in_use_follow_the_tokens_held():
    eng = FakeEngine(num_slots=8, block_size=16, num_blocks=64)
    core = SchedulerCore(eng, fixed(k=3, pool=8))
    lens = [5, 100, 17]
    for i, n in enumerate(lens):
        core.add(req(i, prompt_len=n, max_tokens=40))
    core.step()  # admits all three and prefills them
    assert eng.num_used_blocks == 1 + 7 + 2  # ceil(len / 16): the prompts' tokens, not slots x max_model_len
    assert core.kv_cache_usage == pytest.approx(10 / 64)
    for _ in range(5):
        core.step()
    # each sequence holds the blocks for its tokens and the k positions its last step wrote, no more
    held = sum(-(-(r.length - 1 + 3) // 16) for r in core.pool)
    assert eng.num_used_blocks == held
    run_all(core)
    assert eng.num_used_blocks == 0 and core.kv_cache_usage == 0


def _mixed_requests():
    """Greedy, seeded and unseeded sampling, min_tokens against EOS, stop ids, stop strings, prompts of 1 to
    several blocks: every kind of state a preemption must carry over."""
    reqs = []
    for i in range(16):
        kw = {"max_tokens": 6 + (7 * i) % 19}
        if i % 4 == 1:
            kw.update(temperature=0.8, seed=1000 + i)
        elif i % 4 == 3:
            kw.update(temperature=0.8)  # unseeded: the scheduler's seed, drawn at first admission (FIFO)
        if i % 3 == 0:  # EOS is sampled at position 24: prompts of 20 tokens and more meet it early
            kw.update(min_tokens=min(5, kw["max_tokens"]))
        if i % 5 == 2:
            kw.update(stop_token_ids=(40,))
        if i % 7 == 4:
            kw.update(stop=("HB",))
        reqs.append(req(i, prompt_len=1 + (5 * i) % 23, **kw))
    return reqs


def _run_mixed(num_blocks):
    eng = FakeEngine(num_slots=16, block_size=4, num_blocks=num_blocks, tokenizer=CharTokenizer(),
                     accept=lambda seq, k: seq.length % (k + 1), eos_positions={24})
    core = SchedulerCore(eng, fixed(k=3, batch=4, pool=16))
    for r in _mixed_requests():
        core.add(r)
    deltas = run_all(core)
    by_id: dict[str, list] = {}
    for _, d in deltas:
        by_id.setdefault(d.request_id, []).append(d)
    assert eng.num_free_blocks == eng.num_blocks and eng.num_used == 0
    return core, eng, by_id


def test_exhausted_blocks_preempt_and_every_output_is_unchanged():
    """16 requests through a cache of 14 blocks of 4 positions (the longest sequence needs 12, k = 3
    included): all complete, no error, each with exactly the tokens, text, finish reason and usage it has
    with blocks to spare, streamed seamlessly."""
    _, _, expected = _run_mixed(num_blocks=1000)
    core, eng, got = _run_mixed(num_blocks=14)
    assert core.num_preemptions >= 3  # the test exercises preemption,
    recomputed = [prompt for _, prompt, _ in eng.added if prompt != list(range(1, len(prompt) + 1))]
    assert len(recomputed) >= 3  # of sequences that had generated tokens,
    assert any(b.num_draft_tokens < 3 for b in eng.batches)  # and k was lowered on the way
    assert got.keys() == expected.keys()
    for rid, exp in expected.items():
        deltas = got[rid]
        final, exp_final = deltas[-1], exp[-1]
        assert final.finished and sum(d.finished for d in deltas) == 1, rid
        assert final.finish_reason == exp_final.finish_reason != "error", rid
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == [t for d in exp for t in d.token_ids], rid
        assert "".join(d.text for d in deltas) == "".join(d.text for d in exp), rid
        assert final.completion_tokens == len(tokens) == exp_final.completion_tokens
        assert {d.prompt_tokens for d in deltas} == {exp_final.prompt_tokens}  # the client's prompt, always
        assert deltas[0].queue_time_s is not None and all(d.queue_time_s is None for d in deltas[1:])


def _three_running(eng, prompt_lens=(4, 4, 4)):
    core = SchedulerCore(eng, fixed())
    for i, n in enumerate(prompt_lens):
        core.add(req(i, prompt_len=n, max_tokens=30))
    core.step()  # admit and prefill all three
    assert [r.request_id for r in core.pool] == ["0", "1", "2"]
    return core


def test_preemption_takes_the_most_recently_arrived_first_and_requeues_it_at_the_head():
    eng = FakeEngine(block_size=1)  # every step needs a new block per row
    core = _three_running(eng, prompt_lens=(4, 4, 1))
    core.add(req(3, prompt_len=4, max_tokens=30))  # a newer request, still waiting
    eng.withheld = eng.num_free_blocks  # no block free: the step must preempt until it fits
    _, stats = core.step()
    assert [s.num_preemptions for s in stats] == [2]  # for the metrics
    # Newest first: request 2 frees 1 block, short of the 2 that requests 0 and 1 need; request 1 frees 4.
    assert eng.freed == [2, 1]
    assert [r.request_id for r in core.waiting] == ["1", "2", "3"]  # oldest preempted at the head
    assert [r.request_id for r in core.pool] == ["0"] and eng.batches[-1].seq_ids == (0,)
    assert core.num_preemptions == 2 and core.num_waiting == 3
    eng.withheld = 0
    deltas = run_all(core)
    finals = {d.request_id: d for _, d in deltas if d.finished}
    assert all(d.finish_reason == "length" and d.completion_tokens == 30 for d in finals.values())
    readded = [(len(prompt), p.max_tokens, p.recomputed) for _, prompt, p in eng.added[3:5]]
    assert readded == [(4 + 1, 30 - 1, 1), (1 + 1, 30 - 1, 1)]  # prompt + the token generated, recomputed


def test_k_is_lowered_before_anything_is_preempted():
    eng = FakeEngine(block_size=4)
    core = SchedulerCore(eng, fixed(k=3))
    for i in range(2):
        core.add(req(i, prompt_len=3, max_tokens=8))  # one block each; length 4 after the prefill
    core.step()
    eng.withheld = eng.num_free_blocks  # k = 0 needs no new block (positions 0..3), any k > 0 one per row
    core.step()
    assert eng.batches[-1].num_draft_tokens == 0 and eng.batches[-1].seq_ids == (0, 1)
    assert core.num_preemptions == 0
    eng.withheld -= 2  # two blocks: k = 3 fits again
    core.step()
    assert eng.batches[-1].num_draft_tokens == 3


def test_the_seed_survives_a_preemption_and_unseeded_requests_still_speculate():
    eng = FakeEngine(block_size=1)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=2))  # auto
    core.add(req(0, prompt_len=6, max_tokens=12))  # greedy, oldest: never preempted here
    core.add(req(1, prompt_len=4, max_tokens=12, temperature=0.8, seed=7))
    core.add(req(2, prompt_len=4, max_tokens=12, temperature=0.8))  # unseeded: the scheduler gives a seed
    deltas = step_until(core, lambda: len(core.pool) == 3 and all(r.num_output_tokens >= 3 for r in core.pool))
    for _ in range(2):  # no block free, twice: the newest running sequence is preempted each time
        eng.withheld += eng.num_free_blocks
        deltas += core.step()[0]
    assert eng.freed == [2, 1]
    eng.withheld = 0
    deltas += run_all(core)
    tokens = {}
    for _, d in deltas:
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
    seeded = [p for _, _, p in eng.added if p.temperature > 0 and p.seed == 7]
    unseeded = [p for _, _, p in eng.added if p.temperature > 0 and p.seed != 7]
    assert len(seeded) == len(unseeded) == 2  # added, preempted, re-added
    assert all(not p.use_speculation for p in seeded)  # seeded under a timing-driven policy: no drafts
    assert all(p.use_speculation for p in unseeded)  # still counts as unseeded: it speculates
    assert unseeded[0].seed is not None and unseeded[0].seed == unseeded[1].seed
    for rid, seed in (("1", 7), ("2", unseeded[0].seed)):
        assert tokens[rid] == [FakeEngine.token_at(p, seed) for p in range(4, 16)], rid


def test_min_tokens_continues_across_a_preemption():
    """EOS is sampled at positions 6 and 12. With min_tokens = 6 the one at 6 is suppressed (2 tokens
    generated), the one at 12 ends the request. Preempted after 3 tokens and re-added with a 7-token prompt,
    the engine counts from 7: min_tokens must reach it as 3, or the EOS at 12 would be suppressed too."""

    def run(preempt):
        eng = FakeEngine(block_size=1, eos_positions={6, 12})
        core = SchedulerCore(eng, fixed(k=0))
        core.add(req(0, prompt_len=20, max_tokens=30))  # older; its positions never hit an EOS position
        core.add(req(1, prompt_len=4, max_tokens=20, min_tokens=6))
        deltas = []
        if preempt:
            deltas += step_until(core, lambda: len(core.pool) == 2 and core.pool[1].num_output_tokens == 3)
            eng.withheld = eng.num_free_blocks
            deltas += core.step()[0]
            assert eng.freed == [1] and core.num_preemptions == 1
            eng.withheld = 0
        deltas += run_all(core)
        return eng, [d for _, d in deltas if d.request_id == "1"]

    _, expected = run(preempt=False)
    eng, got = run(preempt=True)
    assert [len(prompt) for _, prompt, _ in eng.added] == [20, 4, 7]
    assert eng.added[-1][2].min_tokens == 3
    tokens = [t for d in got for t in d.token_ids]
    assert tokens == [t for d in expected for t in d.token_ids] and tokens[-1] == EOS and len(tokens) == 9
    assert got[-1].finish_reason == expected[-1].finish_reason == "stop"


def test_an_aborted_preempted_request_leaves_the_queue():
    eng = FakeEngine(block_size=1)
    core = _three_running(eng)
    eng.withheld = eng.num_free_blocks
    core.step()
    assert [r.request_id for r in core.waiting] == ["2"] and eng.freed == [2]
    _, out = core.abort("2")
    assert out.finished and out.finish_reason == "abort" and out.completion_tokens == 1
    assert not core.waiting and eng.freed == [2]  # freed once, at the preemption


def test_a_prompt_that_can_never_fit_errors_at_once_and_does_not_block_the_queue():
    eng = FakeEngine(block_size=4, num_blocks=3)
    core = SchedulerCore(eng, fixed())
    core.add(req(0, prompt_len=13, max_tokens=2))  # 4 blocks: more than the whole cache
    core.add(req(1, prompt_len=4, max_tokens=2))
    deltas = run_all(core, max_steps=20)
    finals = {d.request_id: d for _, d in deltas if d.finished}
    assert finals["0"].finish_reason == "error" and "KV blocks" in finals["0"].error
    assert finals["0"].completion_tokens == 0
    assert finals["1"].finish_reason == "length" and finals["1"].completion_tokens == 2
    with pytest.raises(InvalidRequestError, match="needs 4 KV blocks"):
        core.check_fits(list(range(13)))


async def test_submit_refuses_a_prompt_that_can_never_fit():
    eng = FakeEngine(block_size=4, num_blocks=3)
    sched = AsyncScheduler(eng, fixed())
    await sched.start()
    try:
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            sched.submit(list(range(1, 14)), SamplingParams(max_tokens=2))
        assert sched.num_waiting == 0
    finally:
        await sched.shutdown(1)


def test_a_sequence_that_outgrows_the_whole_cache_ends_with_length():
    eng = FakeEngine(block_size=4, num_blocks=3)  # 12 positions in all
    core = SchedulerCore(eng, fixed(k=2))
    core.add(req(0, prompt_len=4, max_tokens=50))
    deltas = run_all(core, max_steps=50)
    tokens = [t for _, d in deltas for t in d.token_ids]
    assert deltas[-1][1].finish_reason == "length"
    assert tokens == [FakeEngine.token_at(p) for p in range(4, 13)]  # the pending token sits at position 12
    assert eng.num_free_blocks == 3 and core.num_preemptions == 0


def test_an_engine_capacity_error_at_add_makes_the_request_wait_never_fail():
    """Should the engine refuse a prompt the scheduler counted as fitting, the request waits for blocks
    while others run (no error reaches the client); with nothing running that could free any, it fails
    alone, at once (no hang)."""
    eng = FakeEngine(block_size=4)
    refusals = {"1": 2, "2": 10**9}  # request id -> adds the engine refuses
    original = eng.add

    def add(seq_id, ids, params):
        rid = {12: "1", 13: "2"}.get(len(ids), "0")
        if refusals.get(rid, 0) > 0:
            refusals[rid] -= 1
            raise CapacityError("no KV blocks, says the engine")
        return original(seq_id, ids, params)

    eng.add = add
    core = SchedulerCore(eng, fixed())
    core.add(req(0, prompt_len=4, max_tokens=6))
    core.add(req(1, prompt_len=12, max_tokens=3))
    finals = {d.request_id: d for _, d in run_all(core) if d.finished}
    assert finals["0"].finish_reason == finals["1"].finish_reason == "length" and refusals["1"] == 0
    core.add(req(2, prompt_len=13, max_tokens=3))  # alone, and always refused
    finals = {d.request_id: d for _, d in run_all(core, max_steps=5) if d.finished}
    assert finals["2"].finish_reason == "error" and "KV blocks" in finals["2"].error


def test_prompt_logprobs_arrive_once_across_chunks_and_preemptions():
    """A prompt prefilled in chunks gets its prompt logprobs, one per prompt token, on its first delta only; a
    request preempted while prefilling computes them again from the start, and one preempted after its prefill
    is re-added without asking for them (its recomputed prompt holds generated tokens)."""
    from tests.support.fake_engine import PROMPT_TOKEN

    eng = FakeEngine(block_size=1)
    # B = 1: request 0's decode steps interleave with request 1's prefill chunks (of 4 tokens)
    config = SchedulerConfig(max_batch_size=1, pool_size=4, num_speculative_tokens=0, speculation="fixed",
                             max_prefill_tokens=4)
    core = SchedulerCore(eng, config)
    core.add(req(0, prompt_len=3, max_tokens=30, prompt_logprobs=2))
    deltas = step_until(core, lambda: core.pool and core.pool[0].num_output_tokens > 0)
    core.add(req(1, prompt_len=12, max_tokens=30, prompt_logprobs=1))
    deltas += step_until(core, lambda: len(core.pool) == 2 and 0 < core.pool[1].num_prefilled < 12)
    eng.withheld = eng.num_free_blocks  # the next decode step preempts the newest (request 1, still prefilling)
    deltas += step_until(core, lambda: core.num_preemptions > 0)
    eng.withheld = 0
    deltas += step_until(core, lambda: len(core.pool) == 2 and all(r.num_output_tokens for r in core.pool))
    eng.withheld = eng.num_free_blocks  # now request 1 is preempted after its prefill
    deltas += step_until(core, lambda: core.num_preemptions > 1)
    eng.withheld = 0
    deltas += run_all(core)
    for rid, n, length in (("0", 2, 3), ("1", 1, 12)):
        mine = [d for _, d in deltas if d.request_id == rid]
        with_prompt = [d for d in mine if d.prompt_logprobs is not None]
        assert len(with_prompt) == 1 and with_prompt[0] is next(d for d in mine if d.token_ids)
        assert with_prompt[0].prompt_logprobs == (None,) + tuple(
            FakeEngine.logprob_at(p, PROMPT_TOKEN, n) for p in range(1, length))
        assert mine[-1].completion_tokens == 30
    readds_1 = [(len(prompt), p.prompt_logprobs) for _, prompt, p in eng.added if len(prompt) >= 12]
    assert readds_1[0] == (12, 1) and (12, 1) in readds_1[1:]  # again from the start after the first preemption
    assert any(n > 12 and lp is None for n, lp in readds_1)  # not after the second

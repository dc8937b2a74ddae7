"""Prefill gets its share of the engine's time, not of its steps (issue 22), model-free: a fake engine whose
steps report fixed durations, and a simulated clock that advances by exactly what each step reports (no
wall clock anywhere)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exspec.engine.params import SamplingParams
from exspec.scheduler import SchedulerConfig, SchedulerCore
from exspec.scheduler import core as scheduler_core
from exspec.scheduler.core import PREFILL_BOUND_SCALE, PREFILL_TIME_SHARE
from exspec.scheduler.request import Request
from tests.support.fake_engine import FakeEngine

PREFILL_S_PER_TOKEN = 0.0001  # a prefill chunk of 512 tokens reports 51.2 ms
DECODE_S = 0.010  # a decode step without drafts
DRAFT_S = 0.010  # each draft token adds this to a decode step (k = 4: 50 ms, 5x a plain step)


def _bound_s(k: int, chunk_s: float = 0.15) -> float:
    """The prefill seconds running rows may wait between two decode steps: chunk_s per token a row got in its last
    step (TimedEngine accepts every draft: k + 1 tokens), up to PREFILL_BOUND_SCALE x chunk_s."""
    return chunk_s * min(PREFILL_BOUND_SCALE, k + 1)


class TimedEngine(FakeEngine):
    """FakeEngine whose prefill reports time proportional to the tokens (padding included) and whose
    decode step reports DECODE_S + k * draft_s (DRAFT_S unless given)."""

    def __init__(self, prefill_s_per_token: float = PREFILL_S_PER_TOKEN, accept=lambda s, k: k, draft_s=DRAFT_S, **kw):
        super().__init__(step_seconds=lambda n, k: DECODE_S + k * draft_s, accept=accept, **kw)
        self.prefill_s_per_token = prefill_s_per_token

    def prefill(self, batch):
        out = super().prefill(batch)
        width = max(c.end - c.start for c in batch.chunks) + out.num_draft_tokens  # a fused prefill verifies k more
        return replace(out, draft_s=0.0, verify_s=len(batch.chunks) * width * self.prefill_s_per_token)


def _req(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(str(i), [1 + (j % 90) for j in range(prompt_len)], SamplingParams(max_tokens=max_tokens,
                                                                                     ignore_eos=True), order=i)


class Run:
    """Drives a core step by step on the simulated clock; records when each request emitted tokens and how
    the engine's time went to prefill and decode while both had work."""

    def __init__(self, k: int, prefill_s_per_token: float = PREFILL_S_PER_TOKEN, accept=lambda s, k: k,
                 draft_s: float = DRAFT_S, **cfg):
        self.engine = TimedEngine(prefill_s_per_token, accept, draft_s, num_slots=128, max_model_len=10_000)
        config = SchedulerConfig(num_speculative_tokens=k, speculation="fixed", **cfg)
        self.core = SchedulerCore(self.engine, config)
        self.now = 0.0
        self.emitted: dict[str, list[float]] = {}  # request id -> simulated time of each delta with tokens
        self.contended = {"prefill": 0.0, "decode": 0.0}  # engine seconds while prompts waited and rows ran

    def add(self, req: Request) -> None:
        self.core.add(req)

    def step(self) -> None:
        prefilling = any(r.num_prefilled < r.prompt_len for r in (*self.core.waiting, *self.core.pool))
        running = any(r.num_output_tokens > 0 for r in self.core.pool)
        deltas, stats = self.core.step()
        seconds = sum(s.draft_s + s.verify_s for s in stats)
        self.now += seconds
        if prefilling and running:
            self.contended["prefill" if stats[0].kind == "prefill" else "decode"] += seconds
        for req, out in deltas:
            if out.token_ids:
                self.emitted.setdefault(req.request_id, []).append(self.now)

    def until(self, done, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("did not get there")

    def ttft(self, ids) -> list[float]:
        return [self.emitted[i][0] for i in ids]


def _burst(k: int) -> Run:
    """8 streams running, then a burst of 48 prompts of 100 to 300 tokens (a pool that holds them all)."""
    run = Run(k, max_batch_size=8, pool_size=64, max_prefill_tokens=512)
    for i in range(8):
        run.add(_req(i, 20, 10_000))
    run.until(lambda: len(run.emitted) == 8)
    start = run.now
    burst = [str(100 + i) for i in range(48)]
    for i, rid in enumerate(burst):
        run.add(_req(int(rid), 100 + (i * 37) % 200, 8))
    run.until(lambda: all(r in run.emitted for r in burst))
    run.start = start
    run.burst = burst
    return run


def test_prefill_gets_its_share_of_time_whatever_a_decode_step_costs():
    for k in (0, 4):
        run = _burst(k)
        prefill, decode = run.contended["prefill"], run.contended["decode"]
        share = prefill / (prefill + decode)
        # Within one step of the exact share: the last decode step or prefill chunk may overshoot.
        slack = max(DECODE_S + k * DRAFT_S, 512 * PREFILL_S_PER_TOKEN) / (prefill + decode)
        assert abs(share - PREFILL_TIME_SHARE) <= slack, (k, share, slack)


def test_a_burst_waits_no_longer_for_its_first_token_with_speculation():
    """Decode steps with k = 4 report 5x the time of k = 0 ones; the burst's time to first token must not
    grow with them (one for one step alternation gave 1.7x the mean here)."""
    plain, spec = _burst(0), _burst(4)
    ttft_plain = [t - plain.start for t in plain.ttft(plain.burst)]
    ttft_spec = [t - spec.start for t in spec.ttft(spec.burst)]
    mean_plain, mean_spec = sum(ttft_plain) / len(ttft_plain), sum(ttft_spec) / len(ttft_spec)
    # At most one speculative decode step more (the step running when the burst arrived, say).
    assert mean_spec <= mean_plain + DECODE_S + 4 * DRAFT_S, (mean_plain, mean_spec)
    assert max(ttft_spec) <= max(ttft_plain) + DECODE_S + 4 * DRAFT_S, (max(ttft_plain), max(ttft_spec))


def _long_prompt_beside_streams(k: int, prefill_s_per_token: float = PREFILL_S_PER_TOKEN, draft_s: float = DRAFT_S,
                                **cfg) -> tuple[Run, float]:
    """8 streams decoding, then a 4000-token prompt (request "99") run until its first token; returns the run
    and the simulated time the prompt arrived."""
    run = Run(k, prefill_s_per_token, draft_s=draft_s, max_batch_size=8, pool_size=16, max_prefill_tokens=512, **cfg)
    for i in range(8):
        run.add(_req(i, 20, 10_000))
    run.until(lambda: len(run.emitted) == 8)
    start = run.now
    run.add(_req(99, 4000, 4))
    run.until(lambda: "99" in run.emitted)
    return run, start


@pytest.mark.parametrize("k", [0, 4])
def test_running_streams_keep_a_bounded_gap_while_a_long_prompt_is_prefilled(k):
    """8 streams run; a 4000-token prompt arrives (8 chunks of 512 tokens). No running stream waits more
    than one decode step's worth of prefill plus one chunk between two decode steps, and the long prompt
    still gets its share: its first token comes within twice its prefill time plus one decode step."""
    run, start = _long_prompt_beside_streams(k)
    run.until(lambda: run.now >= run.emitted["99"][0] + 0.1)  # and a little past it
    decode = DECODE_S + k * DRAFT_S
    chunk = 512 * PREFILL_S_PER_TOKEN
    bound = decode + (decode + chunk)  # a decode step, then at most its credit of prefill plus one chunk
    for i in range(8):
        times = [t for t in run.emitted[str(i)] if t >= start]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) <= bound + 1e-9, (i, max(gaps), bound)
    prefill_s = 4000 / 512 * chunk
    assert run.emitted["99"][0] - start <= prefill_s / PREFILL_TIME_SHARE + decode + 1e-9


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("s_per_token", [PREFILL_S_PER_TOKEN, 0.002])
def test_a_decode_batch_with_free_places_is_filled_first_within_the_gap_bound(k, s_per_token):
    """A pool of max_batch_size rows (as `exspec bench` runs target-ar): a row finishes and a 1200-token prompt
    (3 chunks of 512) takes its place. While the decode batch has that free place, prefill runs before the 3
    rows decode again for as long as they have waited less than max_prefill_chunk_s (0.15 s) of prefill:
    - a fast prefill (0.1 ms a token, 51 ms a chunk, a GPU's side of the trade): the three chunks run back to
      back (the third cut to what is left of the bound), no 3-row decode step between them;
    - a slow one (2 ms a token, a CPU's): each chunk is cut to about 0.15 s, then the rows decode once.
    Either way a running row waits at most max_prefill_chunk_s of prefill between two decode steps."""
    run = Run(k, s_per_token, max_batch_size=4, pool_size=4, max_prefill_tokens=512)
    for i, max_tokens in enumerate((4, 200, 200, 200)):
        run.add(_req(i, 20, max_tokens))
    run.add(_req(4, 1200, 20))  # admitted when row 0 finishes
    streak, worst, long_chunks, waited, longest = 0, 0, 0, 0.0, 0.0
    while run.core.has_work():
        awaiting = any(r.num_prefilled < r.prompt_len for r in run.core.pool)  # admitted, not prefilled yet
        decoding = any(r.num_output_tokens for r in run.core.pool)
        _, stats = run.core.step()
        if stats and stats[0].kind == "prefill":
            streak = 0
            if decoding:  # the long prompt's chunk, while rows decode: they wait for it
                long_chunks += 1
                waited += stats[0].verify_s
                longest = max(longest, waited)
        else:
            waited = 0.0
            if stats and awaiting and stats[0].batch_size < 4:
                streak += 1
                worst = max(worst, streak)
    cut = _bound_s(k) / s_per_token  # tokens of one cut chunk
    if s_per_token == PREFILL_S_PER_TOKEN:
        assert (long_chunks, worst) == (3, 0), (long_chunks, worst)
    else:
        assert long_chunks >= 1200 / cut and worst == 1, (long_chunks, worst)
    # the bound: a further step only while a chunk of MIN_PREFILL_CHUNK tokens still fits in it, cut to what is left
    assert longest <= _bound_s(k) + 1e-9, longest


@pytest.mark.parametrize("k", [0, 4])
def test_a_slow_prefill_is_cut_to_seconds_while_streams_run(k):
    """A device where a prefill chunk of max_prefill_tokens takes 1 s (2 ms a token; SmolLM2 on one CPU core
    is about 3 to 6 ms): while 8 streams run, a 4000-token prompt is prefilled in chunks of about
    max_prefill_chunk_s at the measured speed, so no stream waits more than a decode step, its credit of prefill
    and one such chunk between two tokens; with the cut off, the same arrival leaves a gap over 1 s."""
    slow = 0.002
    decode = DECODE_S + k * DRAFT_S

    def longest_gap(chunk_s: float) -> float:
        run, start = _long_prompt_beside_streams(k, slow, max_prefill_chunk_s=chunk_s)
        assert run.emitted["99"][0] - start <= 4000 * slow / PREFILL_TIME_SHARE + 2 * (decode + chunk_s) + 0.05
        gaps = []
        for i in range(8):
            times = [t for t in run.emitted[str(i)] if start <= t <= run.emitted["99"][0]]
            gaps += [b - a for a, b in zip(times, times[1:])]
        return max(gaps)

    chunk_s = 0.15
    assert longest_gap(chunk_s) <= decode + (decode + _bound_s(k, chunk_s)) + 1e-9
    assert longest_gap(0.0) >= 512 * slow


class ChunkLog(TimedEngine):
    """TimedEngine that records, for every prefill chunk of the long prompt (the only one past 20 tokens),
    its length and whether rows were already decoding."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.decode_steps = 0
        self.long_chunks: list[tuple[int, bool]] = []  # (tokens, rows were decoding)

    def prefill(self, batch):
        for c in batch.chunks:
            if c.end > 20:
                self.long_chunks.append((c.end - c.start, self.decode_steps > 0))
        return super().prefill(batch)

    def step(self, batch):
        self.decode_steps += 1
        return super().step(batch)


@pytest.mark.parametrize("k", [0, 4])
def test_an_offline_run_does_not_cut_prefill_chunks_for_streams(k):
    """max_prefill_chunk_s bounds a stream's gap between two tokens; an offline run has no stream. With a slow
    prefill (2 ms a token: a 0.15 s cut is 75 tokens), a 2000-token prompt beside 8 decoding rows is
    prefilled in chunks of max_prefill_tokens by generate_offline (before the rows decode: it prefills first), in
    cut chunks between decode steps by the same core driven as a server drives it; the outputs are the same."""
    from exspec.scheduler.offline import generate_offline

    config = SchedulerConfig(max_batch_size=8, pool_size=16, max_prefill_tokens=512, max_prefill_chunk_s=0.15,
                             num_speculative_tokens=k, speculation="fixed")
    prompts = [[1 + (j % 90) for j in range(n)] for n in [20] * 8 + [2000]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in [3000] * 8 + [4]]  # rows outlive the prompt

    offline = ChunkLog(0.002, num_slots=128, max_model_len=10_000)
    results, _ = generate_offline(offline, prompts, params, config)

    served = ChunkLog(0.002, num_slots=128, max_model_len=10_000)
    core = SchedulerCore(served, config)
    reqs = [Request(str(i), list(p), sp, order=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()

    beside = [n for n, decoding in served.long_chunks if decoding]
    assert beside and max(beside) <= _bound_s(k) / 0.002, served.long_chunks  # cut while rows decode
    # whole chunks, the last one the rest, and all before any row decodes (an offline run prefills first)
    assert min(n for n, _ in offline.long_chunks[:-1]) == 512, offline.long_chunks
    assert not any(decoding for _, decoding in offline.long_chunks), offline.long_chunks
    assert [r.token_ids for r in results] == [r.output_token_ids for r in reqs]


class StepLog(TimedEngine):
    """TimedEngine that records each decode step's rows."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows: list[int] = []

    def step(self, batch):
        self.rows.append(len(batch.seq_ids))
        return super().step(batch)


@pytest.mark.parametrize("k", [0, 4])
def test_an_offline_closed_batch_keeps_its_decode_batches_full(k):
    """8 prompts in a pool of 8 at B = 4, one of them 2000 tokens (4 chunks of 512 at 2 ms a token): an offline
    run prefills first, so the long prompt is ready with the others and every decode step has 4 rows until fewer
    than 4 are left. With prefill's time share instead (a server's order) its chunks trail the other rows' decoding
    and it decodes alone at the end (the 350m pair did so in a closed batch: docs/BENCHMARKS.md section 2, session
    32)."""
    from exspec.scheduler.offline import generate_offline

    config = SchedulerConfig(max_batch_size=4, pool_size=8, max_prefill_tokens=512, num_speculative_tokens=k,
                             speculation="fixed")
    prompts = [[1 + (j % 90) for j in range(n)] for n in [20, 2000] + [20] * 6]
    params = [SamplingParams(max_tokens=32, ignore_eos=True)] * 8
    engine = StepLog(0.002, num_slots=16, max_model_len=10_000)
    results, _ = generate_offline(engine, prompts, params, config)
    assert all(len(r.token_ids) == 32 for r in results)
    full = engine.rows[: len(engine.rows) - 3]  # the last steps may have fewer rows left to run
    assert min(full) == 4, engine.rows
    if k == 0:  # 8 rows x 31 decode tokens in steps of 4
        assert len(engine.rows) == 62, engine.rows


def _prompts_beside_a_stream(run: Run, prompt_len: int) -> tuple[list[float], list[float]]:
    """One stream (request "0") decodes at B = 4; after its third chunk three prompts of `prompt_len` tokens arrive.
    Returns the times of the stream's chunks from their arrival on, and the prompts' times to first token."""
    run.add(_req(0, 20, 10_000))
    run.until(lambda: len(run.emitted.get("0", ())) >= 3)
    start = run.now
    for i in (1, 2, 3):
        run.add(_req(i, prompt_len, 4))
    run.until(lambda: all(str(i) in run.emitted for i in (1, 2, 3)))
    return [t for t in run.emitted["0"] if t >= start], [run.emitted[str(i)][0] - start for i in (1, 2, 3)]


@pytest.mark.parametrize("k", [0, 4])
def test_filling_free_places_stops_before_the_gap_bound(k):
    """One stream runs at B = 4; three 60-token prompts arrive (2 ms a token: 0.12 s each). After a decode step one
    prompt is prefilled (0.12 s); a further fill step would need at least MIN_PREFILL_CHUNK tokens (0.032 s), past
    max_prefill_chunk_s (0.15 s), so the stream decodes first: it never waits more than 0.15 s of prefill (a rule that
    filled while any time was left took a 16-token chunk there: 0.152 s)."""
    times, _ = _prompts_beside_a_stream(Run(k, 0.002, max_batch_size=4, pool_size=8, max_prefill_tokens=512), 60)
    gaps = [b - a for a, b in zip(times, times[1:])]
    decode = DECODE_S + k * DRAFT_S
    assert max(gaps) <= decode + _bound_s(k) + 1e-9, (max(gaps), decode)


def test_the_prefill_bound_follows_the_tokens_a_decode_step_gave(monkeypatch):
    """One stream at k = 2 beside three 200-token prompts (2 ms a token) in a batch with free places. When each decode
    step gives the stream 3 tokens (its drafts accepted), prefill may take PREFILL_BOUND_SCALE (2) x max_prefill_chunk_s
    between two of its steps rather than 1 x, so the prompts reach their first tokens sooner than at a fixed bound; the
    stream's wait between two decode steps stays within a step and 2 x 0.15 s, and its time per token within what
    plain decoding would give it (a decode step and 0.15 s)."""

    def run(scale: float) -> tuple[float, float, float]:
        monkeypatch.setattr(scheduler_core, "PREFILL_BOUND_SCALE", scale)
        r = Run(2, 0.002, accept=lambda s, k: 2, max_batch_size=4, pool_size=8, max_prefill_tokens=512)
        times, ttfts = _prompts_beside_a_stream(r, 200)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return sum(ttfts) / 3, max(gaps), (times[-1] - times[0]) / (3 * (len(times) - 1))  # 3 tokens a step

    fixed_ttft, fixed_gap, _ = run(1.0)
    ttft, gap, per_token = run(PREFILL_BOUND_SCALE)
    decode = DECODE_S + 2 * DRAFT_S
    assert fixed_gap <= decode + 0.15 + 1e-9 < gap <= decode + 2 * 0.15 + 1e-9, (fixed_gap, gap)
    assert ttft < 0.9 * fixed_ttft, (ttft, fixed_ttft)  # 0.87 s against 0.99 s
    assert per_token <= DECODE_S + 0.15, per_token


@pytest.mark.parametrize("draft_s", [0.05, 0.0725])
def test_a_long_drafting_step_leaves_less_prefill_so_the_gap_holds(monkeypatch, draft_s):
    """Issue 22's case as lookup runs it on the demo target: 8 streams at B = 8 whose k = 4 steps take 0.21 s and
    give each row 5 tokens, beside a 4000-token prompt prefilled at 2 ms a token. The per-token bound alone allows
    2 x 0.15 s of prefill between two decode steps, so a stream's gap reaches a step and 0.3 s (0.51 s); held within
    STREAM_GAP_SCALE (2.75) x 0.15 s, prefill is cut to what the time share owes (0.21 s: the bound, 0.2 s, is less),
    the gap stays within 0.42 s (plus the k = 4 positions the prompt's last chunk verifies) and the prompt gets its
    half of the engine. With 0.3 s steps the gap cannot be held without taking prefill's share: the share wins, the
    gap is two steps (0.6 s, as without the gap bound), and the prompt still gets half the engine's time."""
    slow, chunk_s = 0.002, 0.15
    decode = DECODE_S + 4 * draft_s

    def run(gap_scale: float) -> tuple[float, float]:
        monkeypatch.setattr(scheduler_core, "STREAM_GAP_SCALE", gap_scale)
        r, start = _long_prompt_beside_streams(4, slow, draft_s, max_prefill_chunk_s=chunk_s)
        gaps = []
        for i in range(8):
            times = [t for t in r.emitted[str(i)] if start <= t <= r.emitted["99"][0]]
            gaps += [b - a for a, b in zip(times, times[1:])]
        return max(gaps), r.emitted["99"][0] - start

    held = scheduler_core.STREAM_GAP_SCALE
    unheld_gap, _ = run(float("inf"))
    gap, ttft = run(held)
    bound = max(chunk_s, held * chunk_s - decode)  # 0.2 s, 0.15 s
    owed = decode * PREFILL_TIME_SHARE / (1 - PREFILL_TIME_SHARE)  # the credit one decode step earns: 0.21 s, 0.3 s
    assert unheld_gap >= decode + 2 * chunk_s - 1e-9, unheld_gap
    assert gap <= decode + max(bound, owed) + 4 * slow + 1e-9, (gap, bound, owed)
    assert ttft <= 4000 * slow / PREFILL_TIME_SHARE + 2 * (decode + chunk_s), ttft
    if draft_s == 0.05:
        assert gap < unheld_gap - 0.08, (gap, unheld_gap)  # 0.42 s against 0.51 s

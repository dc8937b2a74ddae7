"""The scheduler on tiny real models: random arrivals stay token-identical to the target alone;
cancellation frees everything; `exspec generate` is token-identical on 100+ mixed prompts."""

import asyncio
import json
import random

import pytest

from tests.support.models import random_prompts
from exspec.engine.params import SamplingParams
from exspec.scheduler import AsyncScheduler, SchedulerConfig, generate_offline
from exspec.scheduler.policies.fixed import FixedPolicy
from exspec.cli.main import main as cli_main


async def test_64_random_arrivals_are_token_identical(models):
    engine = models.engine("llama", "noisy", max_num_seqs=16)
    # fixed k: `auto` chooses k from measured step times, so whether it drafts at all would depend on the machine
    sched = AsyncScheduler(engine, SchedulerConfig(max_batch_size=4, pool_size=16, num_speculative_tokens=3,
                                                   speculation="fixed"))
    steps = []
    sched.add_step_listener(steps.append)
    await sched.start()
    rng = random.Random(7)
    jobs = [(random_prompts([rng.randint(1, 60)], seed=100 + i)[0], rng.randint(1, 40)) for i in range(64)]

    async def one(i, prompt, max_tokens):
        await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over half a second
        stream = sched.submit(prompt, SamplingParams(max_tokens=max_tokens), request_id=f"r{i}")
        tokens = []
        async for out in stream:
            tokens.extend(out.token_ids)
        return tokens, out.finish_reason

    results = await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(jobs)))
    await sched.shutdown(5)
    for (prompt, max_tokens), (tokens, reason) in zip(jobs, results):
        assert tokens == models.reference("llama", prompt, max_tokens)
        assert reason in ("length", "stop")
    assert engine.allocator.num_used == 0
    kinds = {s.kind for s in steps}
    assert "prefill" in kinds and kinds & {"grouped", "mixed"}
    assert sum(sum(s.accepted_per_position) for s in steps) > 0  # speculation really ran


async def test_cancel_mid_stream_frees_everything(models):
    engine = models.engine("qwen3", "noisy", max_num_seqs=4)
    sched = AsyncScheduler(engine, SchedulerConfig(max_batch_size=2, pool_size=4, num_speculative_tokens=2))
    await sched.start()
    long = sched.submit(random_prompts([10], seed=1)[0], SamplingParams(max_tokens=250, ignore_eos=True))
    other = sched.submit(random_prompts([5], seed=2)[0], SamplingParams(max_tokens=8))
    first = await long.__anext__()
    assert first.token_ids
    sched.abort(long.request_id)
    rest = [o async for o in long]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert [o async for o in other][-1].finish_reason in ("length", "stop")
    for _ in range(3000):  # the worker frees the aborted row on its next turn: wait for that, not a fixed time
        if sched.num_running == 0 and sched.num_waiting == 0 and engine.allocator.num_used == 0:
            break
        await asyncio.sleep(0.01)
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert engine.allocator.num_used == 0
    await sched.shutdown(1)


@pytest.mark.parametrize("force_mixed", [False, True])
def test_offline_grouped_and_mixed_are_identical(models, force_mixed):
    engine = models.engine("mistral", "noisy", max_num_seqs=16, force_mixed=force_mixed)
    rng = random.Random(3)
    prompts = random_prompts([rng.choice([3, 3, 4, 4, 9]) for _ in range(24)], seed=5)
    params = [SamplingParams(max_tokens=rng.randint(4, 24)) for _ in prompts]
    cfg = SchedulerConfig(max_batch_size=4, pool_size=16, num_speculative_tokens=4, speculation="fixed")  # k = 4 drafted
    results, summary = generate_offline(engine, prompts, params, cfg)
    for p, sp, r in zip(prompts, params, results):
        assert r.token_ids == models.reference("mistral", p, sp.max_tokens)
    if force_mixed:
        assert summary.grouped_fraction == 0.0
    else:
        assert summary.grouped_fraction > 0.0
    assert summary.mean_acceptance_length > 1.0


class _FlippingPolicy(FixedPolicy):
    """A policy whose answers flip on a fixed schedule: prompts prefilled with and without the draft, steps
    with k = 0 and k > 0 in between, so every catch-up path of the engine runs under the scheduler."""

    def __init__(self) -> None:
        super().__init__(4)
        self.calls = 0

    def drafting(self) -> bool:
        self.calls += 1
        return self.calls % 3 == 0

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        self.calls += 1
        return (0, 0, 3, 0, 4, 1)[self.calls % 6]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompts_prefilled_without_the_draft_stay_token_identical_under_the_scheduler(models, arch):
    engine = models.engine(arch, "noisy", max_num_seqs=8)
    prompts = random_prompts([1 + (i * 37) % 90 for i in range(20)], seed=11)
    max_tokens = [1 + (i * 7) % 30 for i in range(20)]
    policy = _FlippingPolicy()
    cfg = SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=4, max_prefill_tokens=64)
    results, summary = generate_offline(engine, prompts, [SamplingParams(max_tokens=m) for m in max_tokens], cfg,
                                        speculation=policy)
    for prompt, m, r in zip(prompts, max_tokens, results):
        assert r.token_ids == models.reference(arch, prompt, m)
    assert summary.num_accepted_tokens > 0  # drafts ran, caught up after prefills without the draft


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gpt2"])
def test_exspec_generate_matches_target_on_100_prompts(models, arch, tmp_path):
    """Issue 2's bar: `exspec generate` at batch 8, k = 4 on 100+ mixed-length prompts."""
    target, draft = models.dirs(arch)
    rng = random.Random(11)
    prompts = random_prompts([rng.randint(1, 120) for _ in range(104)], seed=21)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    dst = tmp_path / "out.jsonl"
    rc = cli_main([
        "generate", "--model", str(target), "--draft-model", str(draft), "--input", str(src),
        "--output", str(dst), "--max-tokens", "16", "--max-batch-size", "8",
        "--num-speculative-tokens", "4", "--max-model-len", "256", "--no-progress",
    ])
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(prompts)))
    for p, row in zip(prompts, rows):
        assert row["token_ids"] == models.reference(arch, p, 16), row["index"]
        assert row["finish_reason"] in ("length", "stop")


def test_generate_bad_input_exits_2_and_writes_nothing(models, tmp_path, capsys):
    target, _ = models.dirs("llama")
    dst = tmp_path / "out.jsonl"
    cases = {
        "not json": '{"prompt": "x"\n',
        "no prompt": '{"text": "x"}\n',
        "bad ids": '{"prompt_token_ids": [1, "a"]}\n',
        "too long": json.dumps({"prompt_token_ids": list(range(5, 300))}) + "\n",
    }
    for name, line in cases.items():
        src = tmp_path / "in.jsonl"
        src.write_text('{"prompt_token_ids": [5, 6]}\n' + line)
        rc = cli_main(["generate", "--model", str(target), "--input", str(src), "--output", str(dst),
                       "--max-model-len", "64", "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2, name
        assert "error:" in err and "Traceback" not in err, name
        assert not dst.exists(), name
    rc = cli_main(["generate", "--model", str(tmp_path / "missing"), "--input", str(src), "--output", str(dst)])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


class _RecordingFixed(FixedPolicy):
    """Fixed k, recording what the scheduler tells it before each decode step and what the step reports after."""

    def __init__(self, k_max: int) -> None:
        super().__init__(k_max)
        self.told, self.seen = [], []

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        self.told.append((batch_size, drafting_rows))
        return self.k_max

    def observe(self, batch_size, k, num_tokens, seconds, catchup_s=0.0, accepted=(), drafting_rows=None) -> None:
        self.seen.append((batch_size, k, drafting_rows))


def test_the_policy_is_told_which_rows_will_draft_by_lookup(models):
    """speculative_method "ngram": before each decode step the policy hears how many of the chosen rows will propose
    drafts (the engine's SeqOutput.drafts_next, from the lookup it ran when the row's last call committed), and the step
    then reports exactly that many rows drafting; a step where none do runs k = 0. Outputs stay the target's."""
    import dataclasses

    from exspec.engine import SpecEngine
    from tests.engine.test_ngram import repetitive_prompts

    cfg = dataclasses.replace(models.config("llama"), draft_model=None, speculative_method="ngram", max_num_seqs=8)
    engine = SpecEngine(cfg, pair=dataclasses.replace(models.pair("llama"), draft=None))
    rng = random.Random(3)
    prompts = repetitive_prompts(6, seed=8) + [rng.sample(range(4, 200), n) for n in (4, 7, 5, 9, 6, 8)]
    max_tokens = [rng.randint(8, 30) for _ in prompts]
    policy = _RecordingFixed(3)
    results, _ = generate_offline(engine, prompts, [SamplingParams(max_tokens=m) for m in max_tokens],
                                  SchedulerConfig(max_batch_size=4, pool_size=8, num_speculative_tokens=3),
                                  speculation=policy)
    for prompt, m, r in zip(prompts, max_tokens, results):
        assert list(r.token_ids) == models.reference("llama", prompt, m)
    assert len(policy.told) == len(policy.seen) > 0
    for (b, told), (b2, k, drafted) in zip(policy.told, policy.seen):
        assert b == b2 and drafted == told and k == (3 if told else 0)
    assert any(t == 0 for _, t in policy.told) and any(0 < t < b for b, t in policy.told)

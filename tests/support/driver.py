"""Driving the engine directly in tests (no scheduler): admit by id, prefill, step until done.

`Seq` is the test's record of one sequence: the tokens the engine sampled, cut by the scheduler's
`StopRule` (the one place where stopping is decided), and a window onto the engine's private state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence as Seq_
from dataclasses import dataclass, field

from exspec.engine import PrefillBatch, PrefillChunk, SamplingParams, SpecEngine, StepBatch, StepOutput
from exspec.scheduler.stopping import StopRule

_ids = itertools.count()


@dataclass(eq=False)
class Seq:
    engine: SpecEngine
    seq_id: int
    token_ids: list[int]  # prompt + kept generated tokens
    prompt_len: int
    params: SamplingParams
    rule: StopRule
    finish_reason: str | None = None
    stop_token_id: int | None = None
    new_token_ids: tuple[int, ...] = field(default=())  # kept from the last call

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def slot(self) -> int:
        state = self.engine._seqs.get(self.seq_id)
        return state.slot if state is not None else -1

    @property
    def draft_len(self) -> int:
        return self.engine._seqs[self.seq_id].draft_len

    def take(self, sampled: tuple[int, ...]) -> None:
        kept, reason = self.rule.apply(sampled, len(self.output_token_ids), self.length)
        self.token_ids.extend(kept)
        self.new_token_ids = kept
        if reason is not None:
            self.finish_reason = reason
            if reason == "stop":
                self.stop_token_id = kept[-1]


def admit(engine: SpecEngine, prompt: Seq_[int], params: SamplingParams) -> Seq:
    seq_id = next(_ids)
    engine.add(seq_id, list(prompt), params)
    rule = StopRule.build(params, engine.eos_token_ids, engine.max_model_len)
    return Seq(engine, seq_id, list(prompt), len(prompt), params, rule)


def prefill(engine: SpecEngine, chunks: Seq_[tuple[Seq, int, int]], draft: bool = True, k: int = 0) -> StepOutput:
    """Prefill (seq, start, end) chunks in one call (`draft`: feed the draft too; `k`: drafts the prefill forward
    may verify, where every chunk completes its prompt); record the tokens of completed prompts."""
    chunks_ = tuple(PrefillChunk(s.seq_id, a, b) for s, a, b in chunks)
    out = engine.prefill(PrefillBatch(chunks_, draft=draft, num_draft_tokens=k))
    for (s, _, _), o in zip(chunks, out.outputs):
        if o.token_ids:
            s.take(o.token_ids)
    return out


def step(engine: SpecEngine, seqs: Seq_[Seq], k: int) -> StepOutput:
    out = engine.step(StepBatch(tuple(s.seq_id for s in seqs), k))
    for s, o in zip(seqs, out.outputs):
        s.take(o.token_ids)
    return out


def check_step_contract(out: StepOutput, seqs: list[Seq], k: int) -> None:
    """Invariants every step output must satisfy, whatever the models."""
    assert [o.seq_id for o in out.outputs] == [s.seq_id for s in seqs]
    assert out.batch_size == len(seqs)
    assert len(out.accepted_per_position) == out.num_draft_tokens <= k
    assert list(out.accepted_per_position) == sorted(out.accepted_per_position, reverse=True)
    for o, s in zip(out.outputs, seqs):
        assert 0 <= o.num_accepted <= o.num_draft_tokens <= out.num_draft_tokens
        assert len(o.token_ids) == o.num_accepted + 1  # the engine never cuts: a + 1 tokens
        assert 1 <= len(s.new_token_ids) <= len(o.token_ids)
        assert s.new_token_ids == o.token_ids[: len(s.new_token_ids)]
        if not s.finished:  # nothing cut unless the sequence ended
            assert s.new_token_ids == o.token_ids
    for i, n in enumerate(out.accepted_per_position):
        assert n == sum(o.num_accepted > i for o in out.outputs)


def run_to_end(
    engine: SpecEngine,
    prompts: Seq_[Seq_[int]],
    params: SamplingParams | Seq_[SamplingParams],
    k: int | Callable[[int], int],
    *,
    before_step: Callable[[SpecEngine, list[Seq]], None] | None = None,
    free: bool = True,
    prefill_draft: bool = True,
    prefill_k: int = 0,
) -> tuple[list[Seq], list[StepOutput]]:
    """Admit every prompt, prefill them in one batch (the draft too unless prefill_draft is False; `prefill_k`:
    drafts its forward verifies), step until all finish. k may be a function of the step index. Returns the
    sequences (in prompt order) and every step's output (prefill first)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [admit(engine, p, prm) for p, prm in zip(prompts, params)]
    first = prefill(engine, [(s, 0, s.prompt_len) for s in seqs], draft=prefill_draft, k=prefill_k)
    assert first.kind == "prefill"
    if prefill_k:
        check_step_contract(first, seqs, prefill_k)
    else:
        assert all(len(o.token_ids) == 1 for o in first.outputs)
    outs = [first]
    live = [s for s in seqs if not s.finished]
    n_steps = 0
    while live:
        if before_step is not None:
            before_step(engine, live)
        kk = k(n_steps) if callable(k) else k
        out = step(engine, live, kk)
        check_step_contract(out, live, kk)
        outs.append(out)
        live = [s for s in live if not s.finished]
        n_steps += 1
        assert n_steps < 10_000
    if free:
        for s in seqs:
            engine.free(s.seq_id)
    return seqs, outs


def serve(
    engine: SpecEngine,
    prompts: Seq_[Seq_[int]],
    params: SamplingParams | Seq_[SamplingParams],
    k: int,
    max_batch: int,
) -> tuple[list[Seq], list[StepOutput], dict[int, int]]:
    """Continuous batching: keep up to max_batch sequences live, admitting (and prefilling together) new
    prompts as soon as finished ones free their slots. Returns the sequences in prompt order, every
    step's output, and the slot each sequence held (seq_id -> slot)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    queue = list(zip(prompts, params))
    done: list[Seq] = []
    live: list[Seq] = []
    outs: list[StepOutput] = []
    slots: dict[int, int] = {}
    while queue or live:
        new = []
        while queue and len(live) + len(new) < max_batch:
            prompt, prm = queue.pop(0)
            new.append(admit(engine, prompt, prm))
            slots[new[-1].seq_id] = new[-1].slot
        if new:
            outs.append(prefill(engine, [(s, 0, s.prompt_len) for s in new]))
            live += new
        if any(not s.finished for s in live):
            running = [s for s in live if not s.finished]
            out = step(engine, running, k)
            check_step_contract(out, running, k)
            outs.append(out)
        for s in [s for s in live if s.finished]:
            engine.free(s.seq_id)
            done.append(s)
        live = [s for s in live if not s.finished]
    return sorted(done, key=lambda s: s.seq_id), outs, slots

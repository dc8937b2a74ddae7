"""Driving the engine directly in tests: admit, prefill, step until done (no scheduler)."""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

from exspec.engine import PrefillBatch, PrefillChunk, SamplingParams, Sequence, SpecEngine, StepBatch, StepOutput

def check_step_contract(out: StepOutput, seqs: list[Sequence], k: int) -> None:
    """Invariants every step output must satisfy, whatever the models."""
    assert [o.seq_id for o in out.outputs] == [s.seq_id for s in seqs]
    assert out.batch_size == len(seqs)
    assert len(out.accepted_per_position) == out.num_draft_tokens <= k
    assert list(out.accepted_per_position) == sorted(out.accepted_per_position, reverse=True)
    for o, s in zip(out.outputs, seqs):
        assert 0 <= o.num_accepted <= o.num_draft_tokens <= out.num_draft_tokens
        assert 1 <= len(o.new_token_ids) <= o.num_accepted + 1
        if o.finish_reason is None:  # nothing truncated: exactly a + 1 tokens
            assert len(o.new_token_ids) == o.num_accepted + 1
        assert o.finish_reason == s.finish_reason
        assert tuple(s.token_ids[s.length - len(o.new_token_ids) :]) == o.new_token_ids
    for i, n in enumerate(out.accepted_per_position):
        assert n == sum(o.num_accepted > i for o in out.outputs)


def run_to_end(
    engine: SpecEngine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    k: int | Callable[[int], int],
    *,
    force_mixed: bool = False,
    before_step: Callable[[SpecEngine, list[Sequence]], None] | None = None,
    free: bool = True,
) -> tuple[list[Sequence], list[StepOutput]]:
    """Admit every prompt, prefill them in one batch, step until all finish. k may be a function of the
    step index. Returns the sequences (in prompt order) and every step's output (prefill first)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [engine.add(list(p), prm) for p, prm in zip(prompts, params)]
    first = engine.prefill(PrefillBatch(tuple(PrefillChunk(s, 0, s.prompt_len) for s in seqs)))
    assert first.kind == "prefill"
    assert all(len(o.new_token_ids) == 1 for o in first.outputs)
    outs = [first]
    live = [s for s in seqs if not s.finished]
    step = 0
    while live:
        if before_step is not None:
            before_step(engine, live)
        kk = k(step) if callable(k) else k
        out = engine.step(StepBatch(tuple(live), kk, force_mixed=force_mixed))
        check_step_contract(out, live, kk)
        outs.append(out)
        live = [s for s in live if not s.finished]
        step += 1
        assert step < 10_000
    if free:
        for s in seqs:
            engine.free(s)
    return seqs, outs


def serve(
    engine: SpecEngine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    k: int,
    max_batch: int,
) -> tuple[list[Sequence], list[StepOutput], dict[int, int]]:
    """Continuous batching: keep up to max_batch sequences live, admitting (and prefilling together) new
    prompts as soon as finished ones free their slots. Returns the sequences in prompt order, every
    step's output, and the slot each sequence held (seq_id -> slot)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    queue = list(zip(prompts, params))
    done: list[Sequence] = []
    live: list[Sequence] = []
    outs: list[StepOutput] = []
    slots: dict[int, int] = {}
    while queue or live:
        new = []
        while queue and len(live) + len(new) < max_batch:
            prompt, prm = queue.pop(0)
            new.append(engine.add(list(prompt), prm))
            slots[new[-1].seq_id] = new[-1].slot
        if new:
            outs.append(engine.prefill(PrefillBatch(tuple(PrefillChunk(s, 0, s.prompt_len) for s in new))))
            live += new
        if any(not s.finished for s in live):
            running = [s for s in live if not s.finished]
            out = engine.step(StepBatch(tuple(running), k))
            check_step_contract(out, running, k)
            outs.append(out)
        for s in [s for s in live if s.finished]:
            engine.free(s)
            done.append(s)
        live = [s for s in live if not s.finished]
    return sorted(done, key=lambda s: s.seq_id), outs, slots

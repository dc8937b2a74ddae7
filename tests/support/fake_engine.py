"""A model-free engine for scheduler tests: same protocol as SpecEngine, deterministic fake tokens."""

from __future__ import annotations

import itertools

from exspec.errors import CapacityError, InvalidRequestError
from exspec.engine.params import SamplingParams
from exspec.engine.sequence import Sequence
from exspec.engine.types import PrefillBatch, SeqOutput, StepBatch, StepOutput


class FakeEngine:
    """Emits token (length % 50) + 10 at each position; accepts `accept(seq, k)` drafts per step.

    Records every batch it is given, so tests can check what the scheduler chose.
    """

    def __init__(self, num_slots=16, max_model_len=512, has_draft=True, accept=None, tokenizer=None, step_seconds=0.0):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.has_draft = has_draft
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        self._ids = itertools.count()
        self.accept = accept or (lambda seq, k: 0)
        self.step_seconds = step_seconds  # reported draft+verify time, for the speculation policy
        self.batches: list[StepBatch] = []
        self.prefills: list[PrefillBatch] = []
        self.fail_next = False

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def check_prompt(self, ids):
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt too long")

    def add(self, ids, params: SamplingParams) -> Sequence:
        self.check_prompt(ids)
        if not self._free:
            raise CapacityError("no slot")
        return Sequence(next(self._ids), list(ids), len(ids), params, 0, self._free.pop())

    def free(self, seq):
        if seq.slot >= 0:
            self._free.append(seq.slot)
            seq.slot = -1

    @staticmethod
    def token_at(position: int) -> int:
        return position % 50 + 10

    def _emit(self, seq: Sequence, n: int) -> tuple[int, ...]:
        room = min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.length)
        new = tuple(self.token_at(seq.length + i) for i in range(min(n, room)))
        seq.token_ids.extend(new)
        if seq.num_generated >= seq.params.max_tokens or seq.length >= self.max_model_len:
            seq.finish_reason = "length"
        return new

    def prefill(self, batch: PrefillBatch) -> StepOutput:
        self.prefills.append(batch)
        outs = []
        for c in batch.chunks:
            c.seq.num_prefilled = c.end
            new = self._emit(c.seq, 1) if c.end == c.seq.prompt_len else ()
            outs.append(SeqOutput(c.seq.seq_id, new, 0, 0, c.seq.finish_reason))
        return StepOutput(tuple(outs), "prefill", len(outs), 0, (), 0.0, self.step_seconds)

    def step(self, batch: StepBatch) -> StepOutput:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.batches.append(batch)
        k = batch.num_draft_tokens
        grouped = not batch.force_mixed and len({s.length for s in batch.seqs}) == 1
        outs, per_pos = [], [0] * k
        for seq in batch.seqs:
            a = min(self.accept(seq, k), k) if seq.params.use_speculation else 0
            for i in range(a):
                per_pos[i] += 1
            new = self._emit(seq, a + 1)
            outs.append(SeqOutput(seq.seq_id, new, k, a, seq.finish_reason))
        secs = self.step_seconds(len(batch.seqs), k) if callable(self.step_seconds) else self.step_seconds
        return StepOutput(tuple(outs), "grouped" if grouped else "mixed", len(outs), k, tuple(per_pos), 0.0, secs)

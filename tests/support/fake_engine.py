"""A model-free engine for scheduler tests: same protocol as SpecEngine (sequence ids in, sampled tokens
out, no stopping decisions), deterministic fake tokens."""

from __future__ import annotations

from dataclasses import dataclass

from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, SeqOutput, StepBatch, StepOutput
from exspec.errors import CapacityError, InvalidRequestError


@dataclass
class FakeSeq:
    seq_id: int
    prompt_len: int
    params: SamplingParams
    slot: int
    length: int  # prompt + sampled tokens
    num_prefilled: int = 0


class FakeEngine:
    """Emits token (position % 50) + 10 at each position; accepts `accept(seq, k)` drafts per step.

    Records every batch it is given, so tests can check what the scheduler chose.
    """

    model_name = "fake-model"
    vocab_size = 100
    eos_token_ids = (2,)

    def __init__(self, num_slots=16, max_model_len=512, has_draft=True, accept=None, tokenizer=None, step_seconds=0.0):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.has_draft = has_draft
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        self.seqs: dict[int, FakeSeq] = {}
        self.accept = accept or (lambda seq, k: 0)
        self.step_seconds = step_seconds  # reported draft+verify time, for the speculation policy
        self.batches: list[StepBatch] = []
        self.prefills: list[PrefillBatch] = []
        self.fail_next = False
        self.fail_ids: set[int] = set()  # a step or prefill holding any of these ids raises

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

    def check_params(self, params: SamplingParams) -> None:
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(f"top_k must be in [0, {self.vocab_size}]")

    def add(self, seq_id, ids, params: SamplingParams) -> None:
        self.check_prompt(ids)
        if not self._free:
            raise CapacityError("no slot")
        self.seqs[seq_id] = FakeSeq(seq_id, len(ids), params, self._free.pop(), len(ids))

    def free(self, seq_id):
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._free.append(seq.slot)

    @staticmethod
    def token_at(position: int) -> int:
        return position % 50 + 10

    def _emit(self, seq: FakeSeq, n: int) -> tuple[int, ...]:
        new = tuple(self.token_at(seq.length + i) for i in range(n))
        seq.length += n
        return new

    def _maybe_fail(self, ids) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        if self.fail_ids & set(ids):
            raise RuntimeError("injected failure for one row")

    def prefill(self, batch: PrefillBatch) -> StepOutput:
        self._maybe_fail([c.seq_id for c in batch.chunks])
        self.prefills.append(batch)
        outs = []
        for c in batch.chunks:
            seq = self.seqs[c.seq_id]
            assert c.start == seq.num_prefilled < c.end <= seq.prompt_len
            seq.num_prefilled = c.end
            new = self._emit(seq, 1) if c.end == seq.prompt_len else ()
            outs.append(SeqOutput(c.seq_id, new, 0, 0))
        return StepOutput(tuple(outs), "prefill", len(outs), 0, (), 0.0, self.step_seconds if not callable(self.step_seconds) else 0.0)

    def step(self, batch: StepBatch) -> StepOutput:
        self._maybe_fail(batch.seq_ids)
        self.batches.append(batch)
        seqs = [self.seqs[i] for i in batch.seq_ids]
        assert all(s.length < self.max_model_len and s.num_prefilled == s.prompt_len for s in seqs)
        k = batch.num_draft_tokens if self.has_draft else 0
        grouped = len({s.length for s in seqs}) == 1
        outs, per_pos = [], [0] * k
        for seq in seqs:
            row_k = min(k, self.max_model_len - 1 - seq.length) if seq.params.use_speculation else 0
            a = min(self.accept(seq, k), row_k)
            for i in range(a):
                per_pos[i] += 1
            outs.append(SeqOutput(seq.seq_id, self._emit(seq, a + 1), row_k, a))
        secs = self.step_seconds(len(seqs), k) if callable(self.step_seconds) else self.step_seconds
        return StepOutput(tuple(outs), "grouped" if grouped else "mixed", len(outs), k, tuple(per_pos), 0.0, secs)

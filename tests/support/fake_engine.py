"""A model-free engine for scheduler tests: same protocol as SpecEngine (sequence ids in, sampled tokens
out, no stopping decisions), deterministic fake tokens, KV blocks accounted exactly as the engine contract
says (issue 19): `add` takes the prompt's blocks, `step` first gives each row the blocks for
`length + k` positions (raising CapacityError before changing anything when they are short), `free` returns
a sequence's blocks."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from exspec.engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, SeqOutput, StepBatch, StepOutput, TokenLogprob
from exspec.errors import CapacityError, InvalidRequestError

EOS = 2
PROMPT_TOKEN = 1000  # the token the fake's prompt logprobs name (it does not keep prompts)


@dataclass
class FakeSeq:
    seq_id: int
    prompt_len: int
    params: SamplingParams
    slot: int
    length: int  # prompt + sampled tokens
    seed: int  # the request's seed, or one drawn at add (as SpecEngine does)
    num_blocks: int = 0  # KV blocks held: positions [0, num_blocks * block_size)
    num_prefilled: int = 0


class FakeEngine:
    """Emits token (position % 50) + 10 at each position of a greedy sequence, and a token of (seed, position)
    for a sampled one (`token_at`); EOS instead at `eos_positions`, unless the sequence has generated fewer
    than min_tokens tokens, counted from its own prompt as the engine counts them. Accepts `accept(seq, k)`
    drafts per step.

    Records every batch, every add (`added`: seq_id, prompt, params) and every free, so tests can check what the
    scheduler chose. `withheld` blocks are kept out of the free count, as if something else held them.
    """

    model_name = "fake-model"
    vocab_size = 100
    eos_token_ids = (EOS,)

    def __init__(self, num_slots=16, max_model_len=512, has_draft=True, accept=None, tokenizer=None, step_seconds=0.0,
                 block_size=16, num_blocks=None, eos_positions=(), fused_prefill=False):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.has_draft = has_draft
        self.has_draft_model = has_draft  # a draft model's steps, not n-gram lookup's
        self.fused_prefill = fused_prefill  # verify a prefill batch's num_draft_tokens as the engine does (else: ignore them)
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        self.block_size = block_size
        # Default: every slot can hold a whole sequence (the engine's slot length at the largest k).
        pool_len = EngineConfig.token_pool_length(max_model_len, MAX_SPECULATIVE_TOKENS)
        self.num_blocks = num_blocks if num_blocks is not None else num_slots * -(-pool_len // block_size)
        self.withheld = 0
        self.eos_positions = frozenset(eos_positions)
        self.seqs: dict[int, FakeSeq] = {}
        self.accept = accept or (lambda seq, k: 0)
        self.step_seconds = step_seconds  # reported draft+verify time, for the speculation policy
        self.batches: list[StepBatch] = []
        self.prefills: list[PrefillBatch] = []
        self.added: list[tuple[int, list[int], SamplingParams]] = []
        self.freed: list[int] = []
        self.fail_next = False
        self.fail_ids: set[int] = set()  # a step or prefill holding any of these ids raises
        self._seed_rng = random.Random(0)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks - self.withheld

    @property
    def num_used_blocks(self) -> int:
        return sum(s.num_blocks for s in self.seqs.values())

    def blocks_needed(self, seq_id: int | None, length: int) -> int:
        held = self.seqs[seq_id].num_blocks if seq_id is not None else 0
        return max(0, -(-length // self.block_size) - held)

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
        need = self.blocks_needed(None, len(ids))
        if need > self.num_free_blocks:
            raise CapacityError(f"{need} KV blocks needed, {self.num_free_blocks} free")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        self.seqs[seq_id] = FakeSeq(seq_id, len(ids), params, self._free.pop(), len(ids), seed, need)
        self.added.append((seq_id, list(ids), params))

    def free(self, seq_id):
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._free.append(seq.slot)
            self.freed.append(seq_id)

    @staticmethod
    def token_at(position: int, seed: int | None = None) -> int:
        """The token a greedy sequence (seed None) or a sampled one with this seed gets at `position`."""
        if seed is None:
            return position % 50 + 10
        return random.Random(seed * 1_000_003 + position).randrange(10, 60)

    @staticmethod
    def logprob_at(position: int, token: int, n: int) -> TokenLogprob:
        """The logprobs reported for `token` at `position`: -position / 1000, and n alternatives token + 1 ...
        token + n at -0.1, -0.2, ..."""
        return TokenLogprob(-position / 1000, tuple((token + j, -j / 10) for j in range(1, n + 1)))

    def _emit(self, seq: FakeSeq, n: int) -> SeqOutput:
        """The next n tokens (and their `logprob_at` where the sequence asks for logprobs), as a SeqOutput with
        no drafts; the caller sets those."""
        seed = None if seq.params.greedy else seq.seed
        new = []
        for pos in range(seq.length, seq.length + n):
            stop_allowed = pos - seq.prompt_len >= seq.params.min_tokens
            new.append(EOS if pos in self.eos_positions and stop_allowed else self.token_at(pos, seed))
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = tuple(self.logprob_at(seq.length + i, t, seq.params.logprobs) for i, t in enumerate(new))
        seq.length += n
        return SeqOutput(seq.seq_id, tuple(new), 0, 0, logprobs)

    def _maybe_fail(self, ids) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        if self.fail_ids & set(ids):
            raise RuntimeError("injected failure for one row")

    def prefill(self, batch: PrefillBatch) -> StepOutput:
        self._maybe_fail([c.seq_id for c in batch.chunks])
        self.prefills.append(batch)
        # a fused prefill (the engine's): where every chunk completes its prompt, k drafts verified with it
        completes = all(c.end == self.seqs[c.seq_id].prompt_len for c in batch.chunks)
        k = batch.num_draft_tokens if self.fused_prefill and self.has_draft and batch.draft and completes else 0
        need = sum(self.blocks_needed(c.seq_id, self.seqs[c.seq_id].prompt_len + k) for c in batch.chunks) if k else 0
        if need > self.num_free_blocks:
            k = 0  # no blocks for the drafts' positions: prefill without them (as the engine's _fused_plan)
        outs, per_pos = [], [0] * k
        for c in batch.chunks:
            seq = self.seqs[c.seq_id]
            assert c.start == seq.num_prefilled < c.end <= seq.prompt_len <= seq.num_blocks * self.block_size
            seq.num_prefilled = c.end
            prompt_logprobs = None
            if seq.params.prompt_logprobs is not None:  # the engine's rule: the chunk's logits predict start + 1 ..
                n = seq.params.prompt_logprobs
                prompt_logprobs = ((None,) if c.start == 0 else ()) + tuple(
                    self.logprob_at(p, PROMPT_TOKEN, n) for p in range(c.start + 1, min(c.end, seq.prompt_len - 1) + 1))
            if c.end < seq.prompt_len:
                outs.append(SeqOutput(c.seq_id, (), 0, 0, prompt_logprobs=prompt_logprobs))
                continue
            row_k = min(k, self.max_model_len - 1 - seq.prompt_len) if seq.params.use_speculation else 0
            seq.num_blocks += self.blocks_needed(seq.seq_id, seq.prompt_len + row_k)
            a = min(self.accept(seq, row_k), row_k) if row_k else 0
            for i in range(a):
                per_pos[i] += 1
            outs.append(replace(self._emit(seq, a + 1), num_draft_tokens=row_k, num_accepted=a,
                                prompt_logprobs=prompt_logprobs))
        return StepOutput(tuple(outs), "prefill", len(outs), k, tuple(per_pos), 0.0,
                          self.step_seconds if not callable(self.step_seconds) else 0.0)

    def step(self, batch: StepBatch) -> StepOutput:
        self._maybe_fail(batch.seq_ids)
        seqs = [self.seqs[i] for i in batch.seq_ids]
        assert all(s.length < self.max_model_len and s.num_prefilled == s.prompt_len for s in seqs)
        k = batch.num_draft_tokens if self.has_draft else 0
        # The blocks for the positions this step writes, [length - 1, length + k), for the whole batch or none.
        growth = [self.blocks_needed(s.seq_id, s.length + k) for s in seqs]
        if sum(growth) > self.num_free_blocks:
            raise CapacityError(f"the step needs {sum(growth)} KV blocks, {self.num_free_blocks} free")
        self.batches.append(batch)
        for seq, n in zip(seqs, growth):
            seq.num_blocks += n
        grouped = len({s.length for s in seqs}) == 1
        outs, per_pos = [], [0] * k
        for seq in seqs:
            row_k = min(k, self.max_model_len - 1 - seq.length) if seq.params.use_speculation else 0
            a = min(self.accept(seq, k), row_k)
            for i in range(a):
                per_pos[i] += 1
            outs.append(replace(self._emit(seq, a + 1), num_draft_tokens=row_k, num_accepted=a))
        secs = self.step_seconds(len(seqs), k) if callable(self.step_seconds) else self.step_seconds
        return StepOutput(tuple(outs), "grouped" if grouped else "mixed", len(outs), k, tuple(per_pos), 0.0, secs)

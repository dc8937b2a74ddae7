"""Any engine seen through a small KV cache: `BlockBudget(engine, num_blocks)` accounts blocks exactly as the
engine contract of issue 19 says (`add` takes the prompt's blocks, `step` first takes each row's growth to
`length + k` or raises CapacityError changing nothing, `free` returns them), whatever the engine holds
itself. The scheduler then admits, lowers k and preempts as if the cache were that small, while the engine
computes for real: a test of preemption and recompute on real models, with any engine."""

from __future__ import annotations

from exspec.engine.types import PrefillBatch, StepBatch, StepOutput
from exspec.errors import CapacityError


class BlockBudget:
    def __init__(self, engine, num_blocks: int, block_size: int = 16) -> None:
        self.engine = engine
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[int, int] = {}  # seq_id -> blocks held
        self._length: dict[int, int] = {}  # seq_id -> the engine's length (prompt + sampled, pending included)

    def __getattr__(self, name):  # everything else is the engine's
        return getattr(self.engine, name)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - sum(self._held.values())

    def blocks_needed(self, seq_id: int | None, length: int) -> int:
        held = self._held[seq_id] if seq_id is not None else 0
        return max(0, -(-length // self.block_size) - held)

    def add(self, seq_id: int, prompt_token_ids: list[int], params) -> None:
        need = self.blocks_needed(None, len(prompt_token_ids))
        if need > self.num_free_blocks:
            raise CapacityError(f"{need} KV blocks needed, {self.num_free_blocks} free")
        self.engine.add(seq_id, prompt_token_ids, params)
        self._held[seq_id], self._length[seq_id] = need, len(prompt_token_ids)

    def free(self, seq_id: int) -> None:
        self.engine.free(seq_id)
        self._held.pop(seq_id, None)
        self._length.pop(seq_id, None)

    def prefill(self, batch: PrefillBatch) -> StepOutput:
        out = self.engine.prefill(batch)
        for so in out.outputs:
            self._length[so.seq_id] += len(so.token_ids)
        return out

    def step(self, batch: StepBatch) -> StepOutput:
        growth = {i: self.blocks_needed(i, self._length[i] + batch.num_draft_tokens) for i in batch.seq_ids}
        if sum(growth.values()) > self.num_free_blocks:
            raise CapacityError(f"the step needs {sum(growth.values())} KV blocks, {self.num_free_blocks} free")
        out = self.engine.step(batch)
        for so in out.outputs:
            self._held[so.seq_id] += growth[so.seq_id]
            self._length[so.seq_id] += len(so.token_ids)
        return out

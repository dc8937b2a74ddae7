"""The typed contract between a scheduler and the engine: what one step runs and what it returns."""

from __future__ import annotations

from dataclasses import dataclass

from exspec.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position of the chunk (== seq.num_prefilled)
    end: int  # one past its last position; end == seq.prompt_len completes the prompt


@dataclass(frozen=True)
class PrefillBatch:
    chunks: tuple[PrefillChunk, ...]  # distinct sequences, each still prefilling


@dataclass(frozen=True)
class StepBatch:
    seqs: tuple[Sequence, ...]  # distinct, prefilled, unfinished sequences
    num_draft_tokens: int  # k for this step; 0 decodes without speculation
    force_mixed: bool = False  # run the mixed-length path even if every length is equal (benchmarks)


@dataclass(frozen=True)
class SeqOutput:
    seq_id: int
    new_token_ids: tuple[int, ...]  # tokens appended this step (after EOS/stop/length truncation)
    num_draft_tokens: int  # draft tokens proposed for this sequence this step
    num_accepted: int  # of those, accepted by the target (before truncation)
    finish_reason: str | None  # "stop" | "length" if the sequence finished this step


@dataclass(frozen=True)
class StepOutput:
    outputs: tuple[SeqOutput, ...]  # one per sequence of the batch, same order
    kind: str  # "grouped" | "mixed" | "prefill"
    batch_size: int
    num_draft_tokens: int  # k used
    accepted_per_position: tuple[int, ...]  # [k]: sequences whose i-th draft token was accepted
    draft_s: float  # seconds drafting (catch-up + k draft forwards)
    verify_s: float  # seconds in the target forward and acceptance

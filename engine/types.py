"""The typed contract between a scheduler and the engine, keyed by sequence id.

The scheduler names sequences by id and says what to run; the engine keeps every per-sequence detail
(slot, lengths, cache bounds) private and answers, per id, with the tokens it sampled. The scheduler alone
decides when a sequence stops (EOS, stop ids, max_tokens, max_model_len) and then frees it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillChunk:
    seq_id: int
    start: int  # first prompt position of the chunk (== how much of the prompt is already prefilled)
    end: int  # one past its last position; end == the prompt's length completes the prompt


@dataclass(frozen=True)
class PrefillBatch:
    chunks: tuple[PrefillChunk, ...]  # distinct sequences, each still prefilling
    draft: bool = True  # feed the chunks to the draft too. False leaves the draft behind: the first step
    # that drafts for a sequence catches its draft up (a scheduler that expects no drafts saves the work)
    num_draft_tokens: int = 0  # k > 0: where every chunk completes its prompt and feeds the draft, the draft then
    # proposes k tokens and the target's prefill forward verifies them with the prompt (up to k + 1 tokens a row)


@dataclass(frozen=True)
class StepBatch:
    seq_ids: tuple[int, ...]  # distinct, prefilled sequences shorter than max_model_len
    num_draft_tokens: int  # k for this step; 0 decodes without speculation. Rows near the end of the
    # context, and rows that opted out of speculation, propose fewer (down to none)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (raw logits), and the n most likely tokens'."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first; n = the request's logprobs


@dataclass(frozen=True)
class SeqOutput:
    seq_id: int
    token_ids: tuple[int, ...]  # sampled this call: a + 1 after a step; the first token when a prompt
    # completes; () for a prompt chunk that does not complete it. Not cut at EOS or limits (the scheduler cuts)
    num_draft_tokens: int  # draft tokens proposed for this sequence this step
    num_accepted: int  # of those, accepted by the target
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, when the sequence asked for them
    # prefill, when the sequence asked for prompt_logprobs: one per prompt token this chunk's logits predict (the
    # chunk [start, end) predicts tokens start + 1 .. end, less the first generated one), led by None for token 0
    # when start is 0; in order over a prompt's chunks, one per prompt token
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # whether the sequence proposes drafts in its next step if it gets k > 0: False where it opted out of
    # speculation, and with n-gram lookup where its tokens so far match nothing (the engine looked it up at this call)
    drafts_next: bool = True


@dataclass(frozen=True)
class StepOutput:
    outputs: tuple[SeqOutput, ...]  # one per sequence of the batch, same order
    kind: str  # "grouped" | "mixed" | "prefill"
    batch_size: int
    num_draft_tokens: int  # k used
    accepted_per_position: tuple[int, ...]  # [k]: sequences whose i-th draft token was accepted
    draft_s: float  # seconds drafting (catch-up + k draft forwards)
    verify_s: float  # seconds in the target forward and acceptance
    catchup_s: float = 0.0  # of draft_s: feeding the draft tokens it skipped (a prompt prefilled without the
    # draft, steps without drafts): paid once per token, not a steady cost of this step's k
    # a step without drafts, n-gram lookup: rows (that may speculate) whose lookup proposed a first token, and of
    # those, rows where it was the token the target chose (acceptance of a first draft, measured at no cost)
    shadow_proposed: int = 0
    shadow_accepted: int = 0

"""One sequence's host-side state: its tokens, its KV slots and how far each cache is valid."""

from __future__ import annotations

from dataclasses import dataclass, field

from exspec.engine.params import SamplingParams


@dataclass(eq=False)
class Sequence:
    """A prompt and its continuation, owned by the engine from `add` until `free`.

    Cache invariants (positions are token indices, 0-based):
    - `token_ids[-1]` is *pending*: the last token, not yet fed to the target. The target's KV is
      valid for positions [0, len(token_ids) - 1) once prefill is complete.
    - The draft's KV is valid for positions [0, draft_len); draft_len <= len(token_ids) - 1.
      The draft is caught up (fed positions draft_len..len-1) at the start of every drafting phase.
    - Positions at or past these bounds hold stale K/V from rejected drafts or padding: they are
      never read (the mask stops at the query's own position) and are overwritten before use.
    """

    seq_id: int  # unique per engine
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int  # number of prompt tokens
    params: SamplingParams
    seed: int  # per-sequence RNG seed (drawn if the request gave none)
    slot: int  # index into both models' KV slot pools
    num_prefilled: int = 0  # prompt tokens already in both caches (chunked prefill)
    draft_len: int = 0  # draft KV valid for positions [0, draft_len)
    finish_reason: str | None = None  # "stop" | "length" once finished
    stop_token_id: int | None = field(default=None)  # the EOS / stop id that ended it, if any

    @property
    def length(self) -> int:
        """Tokens in the sequence, pending last token included."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

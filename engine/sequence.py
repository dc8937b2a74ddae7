"""One sequence's host-side state inside the engine: its slot (metadata row) and how far each cache is valid. Private to
the engine: the scheduler only ever sees the sequence's id."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.params import SamplingParams


@dataclass(eq=False)
class SeqState:
    """A sequence from `SpecEngine.add` until `free`. Its tokens live in the engine's `token_buf[slot]`.

    Cache invariants (positions are token indices, 0-based):
    - the token at `length - 1` is *pending*: the last token, not yet fed to the target. The target's KV is
      valid for positions [0, length - 1) once the prompt is prefilled.
    - The draft's KV is valid for positions [0, draft_len); draft_len <= length - 1 (0 until a prompt chunk is
      fed to it: a prefill may leave the draft out). The draft is caught up (fed positions draft_len..length-1)
      at the start of every drafting step.
    - Positions at or past these bounds hold stale K/V from rejected drafts or padding: they are never read
      (the mask stops at the query's own position) and are overwritten before use.
    """

    slot: int  # the sequence's metadata row: token_buf, sampling parameters, block table row
    prompt_len: int  # number of prompt tokens
    params: SamplingParams
    seed: int  # per-sequence RNG seed (drawn if the request gave none)
    length: int  # tokens in token_buf[slot]: prompt + every token sampled so far (pending one included)
    num_prefilled: int = 0  # prompt tokens already in both caches (chunked prefill)
    draft_len: int = 0  # draft KV valid for positions [0, draft_len)
    # speculative_method "ngram": the length of the suffix the row's lookup matched at its last commit (prefill or
    # step; 0: nothing matched, so its next step drafts nothing for it); -1 before any
    lookup_n: int = -1
    stop_ids: torch.Tensor | None = None  # [n] long on device: EOS and stop ids (min_tokens suppresses them)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: ids [m] long, values [m] float, on device

    @property
    def num_generated(self) -> int:
        return self.length - self.prompt_len

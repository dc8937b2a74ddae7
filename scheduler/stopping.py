"""The token-level stopping rules, in one place: EOS ids, stop ids, max_tokens, max_model_len, min_tokens.
(Stop strings act on text: `Request.add_tokens`.) The engine samples; only this decides where a sequence ends."""

from __future__ import annotations

from dataclasses import dataclass

from exspec.engine.params import SamplingParams


@dataclass(frozen=True)
class StopRule:
    stop_ids: frozenset[int]  # EOS ids (unless ignore_eos) and the request's stop_token_ids
    max_tokens: int  # generated tokens at most
    min_tokens: int  # stop ids do not end the sequence before this many tokens
    max_model_len: int  # prompt + generated tokens at most

    @classmethod
    def build(cls, params: SamplingParams, eos_token_ids, max_model_len: int) -> StopRule:
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        return cls(eos | frozenset(params.stop_token_ids), params.max_tokens, params.min_tokens, max_model_len)

    def apply(self, new_ids, num_generated: int, length: int) -> tuple[tuple[int, ...], str | None]:
        """Cut `new_ids` (sampled after `num_generated` tokens, at sequence length `length`): returns the tokens
        kept and "stop" | "length" if the sequence ends with them. Nothing after a stopping token is kept."""
        room = min(self.max_tokens - num_generated, self.max_model_len - length)
        kept: list[int] = []
        for tok in new_ids[: max(room, 0)]:
            kept.append(tok)
            if tok in self.stop_ids and num_generated + len(kept) >= self.min_tokens:
                return tuple(kept), "stop"
        if num_generated + len(kept) >= self.max_tokens or length + len(kept) >= self.max_model_len:
            return tuple(kept), "length"
        return tuple(kept), None

"""A request's lifecycle and its text: incremental detokenisation and stop strings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from exspec.engine.params import SamplingParams
from exspec.scheduler.stopping import StopRule


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot yet (or preempted: its blocks freed, to be recomputed)
    PREFILLING = "prefilling"  # has a slot; prompt (partly) not in the caches yet
    RUNNING = "running"  # decoding
    FINISHED = "finished"  # stop / length / error
    ABORTED = "aborted"  # cancelled (client gone, shutdown)


REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is the decoded output.

    Decodes a short window of tokens twice (with and without the newest tokens) and emits the difference,
    so that tokenizers that drop a leading space when decoding a fragment see a little context. Text is emitted
    as soon as its characters are complete: a multi-byte UTF-8 character split across tokens (and across
    speculative steps) decodes to a trailing U+FFFD until a later token completes it, and that tail is held
    back (the complete text before it is not). On the last call (`final`) an incomplete tail is dropped, never
    emitted as U+FFFD (as tokenizers' DecodeStream does): an output cut by max_tokens inside an emoji ends
    before it, streamed or not. So the text after n tokens, and where a stop string is found, do not depend on
    how the tokens were grouped into calls.
    """

    CONTEXT = 5  # prompt tokens used as left context

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.emitted = 0  # characters already emitted past the window's prefix while its tail is incomplete

    def add(self, new_ids: list[int] | tuple[int, ...], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        incomplete = full.endswith(REPLACEMENT_CHAR)
        complete = full.rstrip(REPLACEMENT_CHAR) if incomplete else full
        start = len(prefix) + self.emitted
        piece = complete[start:] if len(complete) > start else ""
        if incomplete and not final:
            self.emitted += len(piece)  # the window stays open until the character completes
        elif len(full) > len(prefix):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.emitted = 0
        return piece

    def save(self) -> tuple[int, int, int, int]:
        """The state `restore` returns to (the ids added after it are forgotten)."""
        return len(self.ids), self.prefix_offset, self.read_offset, self.emitted

    def restore(self, saved: tuple[int, int, int, int]) -> None:
        n, self.prefix_offset, self.read_offset, self.emitted = saved
        del self.ids[n:]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    order: int  # arrival order
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    seq_id: int | None = None  # the engine's handle once admitted (a KV slot is held while it is set)
    stop_rule: StopRule | None = None  # set at admission
    num_prefilled: int = 0  # tokens of the engine's prompt (`prompt_len`) already in its caches
    num_recomputed: int = 0  # generated tokens re-fed as prompt at the latest admission (after a preemption)
    engine_seed: int | None = None  # the seed the engine samples with when the request gave none (sampled only)
    first_scheduled_time: float | None = None
    waited: int = 0  # consecutive decode steps not chosen (aging)
    finish_reason: str | None = None
    error: str | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""  # all output text so far (stop strings cut)
    sent_chars: int = 0  # how much of `text` has been streamed
    output_token_ids: list[int] = field(default_factory=list)  # generated tokens kept (cut at stop / length)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafts_next: bool = True  # the engine's word (SeqOutput.drafts_next): it proposes drafts in its next decode step
    prompt_logprobs: list | None = None  # TokenLogprob | None per prompt token received so far (prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def prompt_len(self) -> int:
        """Tokens the engine prefills: the prompt, and after a preemption also the tokens generated before it
        (recomputed). The client's prompt is `prompt_token_ids`."""
        return len(self.prompt_token_ids) + self.num_recomputed

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def length(self) -> int:
        """Tokens in the sequence: prompt + generated (the engine's length while the request runs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def add_tokens(self, token_ids: tuple[int, ...], engine_finished: bool) -> tuple[str, bool, int]:
        """Append new tokens; return (text to stream now, stopped by a stop string, tokens kept).

        A stop string ends the output at the token that completes it: the tokens after it in the same
        speculative step are dropped, so the kept tokens (and `usage`) do not depend on how many tokens a step
        delivered. Found on the whole step first; only a hit replays that step one token at a time."""
        if not self.params.stop or len(token_ids) <= 1:
            return (*self._add(token_ids, engine_finished), len(token_ids))
        saved = self._save()
        out, stopped = self._add(token_ids, engine_finished)
        if not stopped:
            return out, False, len(token_ids)
        self._restore(saved)
        out = ""
        for i, token in enumerate(token_ids):
            piece, stopped = self._add((token,), engine_finished and i == len(token_ids) - 1)
            out += piece
            if stopped:
                return out, True, i + 1
        return out, stopped, len(token_ids)

    def _add(self, token_ids: tuple[int, ...], engine_finished: bool) -> tuple[str, bool]:
        self.output_token_ids.extend(token_ids)
        piece = self.detok.add(token_ids, final=engine_finished) if self.detok else ""
        stops = self.params.stop
        stopped = False
        if stops and piece:
            start = max(0, len(self.text) - max(len(s) for s in stops) + 1)
            self.text += piece
            hits = [i for i in (self.text.find(s, start) for s in stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]  # the stop string itself is not returned (OpenAI)
                stopped = True
        else:
            self.text += piece
        done = stopped or engine_finished
        # Hold back a tail that could still be the start of a stop string.
        hold = 0 if done or not stops else max(len(s) for s in stops) - 1
        end = max(self.sent_chars, len(self.text) - hold)
        out = self.text[self.sent_chars : end]
        self.sent_chars = end
        return out, stopped

    def _save(self) -> tuple:
        return len(self.output_token_ids), self.text, self.sent_chars, self.detok.save() if self.detok else None

    def _restore(self, saved: tuple) -> None:
        n, self.text, self.sent_chars, detok = saved
        del self.output_token_ids[n:]
        if self.detok is not None:
            self.detok.restore(detok)

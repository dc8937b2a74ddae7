"""The engine's per-token logprobs (`TokenLogprob`: the target's log-probability of each emitted token and of the n
most likely tokens) in OpenAI's two shapes: the completions API's lists and the chat API's `content` entries.

A token's text is its id decoded alone (special tokens included, as vLLM shows them), so a token holding part of a
multi-byte character reads U+FFFD there; `bytes` are that text's UTF-8 bytes, as vLLM's. JSON has no infinity: a
log-probability below FLOOR (or NaN) is sent as FLOOR, vLLM's -9999.0."""

from __future__ import annotations

from collections.abc import Sequence

from exspec.scheduler import TokenLogprob
from exspec.server.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > FLOOR else FLOOR  # NaN > FLOOR is False too


class TokenTexts:
    """Token id -> its text, decoded once per id (at most the vocabulary's size of entries)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = "" if self.tokenizer is None else self.tokenizer.decode([token_id])
        return text


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], texts: TokenTexts,
                        offset: int = 0) -> CompletionLogprobs:
    """The completions API's logprobs of these tokens (None: an echoed prompt's first token, nothing predicts it);
    `offset`: the text offset of the first (the lengths of the token texts before it, in a stream)."""
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = []
    for text, lp in zip(tokens, logprobs):
        if lp is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for t, v in (*lp.top, (None, lp.logprob)):  # most likely first: a text two ids share keeps the larger value
            top.setdefault(text if t is None else texts(t), _finite(v))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[None if lp is None else _finite(lp.logprob)
                                                             for lp in logprobs],
                              top_logprobs=tops, text_offset=offsets)


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """The chat API's logprobs of these tokens: one `content` entry each, with its n alternatives."""
    content = [
        ChatTokenLogprob(**_entry(texts(tok), lp.logprob),
                         top_logprobs=[ChatTopLogprob(**_entry(texts(t), v)) for t, v in lp.top])
        for tok, lp in zip(token_ids, logprobs)
    ]
    return ChatLogprobs(content=content)

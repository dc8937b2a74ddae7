"""OpenAI protocol models: the request bodies exspec accepts and the response objects it returns.

Requests ignore unknown fields (`extra="ignore"`), so clients written for OpenAI or vLLM work unchanged.
Fields exspec cannot honour yet (logprobs, penalties, ...) are accepted by the model and refused with a
400 by `unsupported_fields()`, naming the field, rather than silently ignored.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share. None means "not given": defaults are applied by the server."""

    model: str | None = None
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    use_speculation: bool = True  # exspec extension: False decodes this request without drafts
    return_token_ids: bool = False  # vLLM extension: each choice also carries its token ids
    # Accepted so that the refusal can name them (see unsupported_fields).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _common_unsupported(self) -> list[str]:
        bad = []
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.repetition_penalty not in (None, 1.0):
            bad.append("repetition_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (one prompt each).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # default 16, as OpenAI
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported_fields(self) -> list[str]:
        bad = self._common_unsupported()
        if self.logprobs is not None:
            bad.append("logprobs")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart | dict] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported_fields(self) -> list[str]:
        bad = self._common_unsupported()
        if self.logprobs:
            bad.append("logprobs")
        if self.top_logprobs is not None:
            bad.append("top_logprobs")
        return bad


# ---------------------------------------------------------------------------------------------- responses


def _omitted_if_none():
    """An optional response field left out of the JSON when unset (OpenAI omits them too)."""
    return Field(default=None, exclude_if=lambda v: v is None)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()  # only with return_token_ids
    prompt_token_ids: list[int] | None = _omitted_if_none()  # only with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = _omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "exspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def body_json(self) -> str:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump_json()

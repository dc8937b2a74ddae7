"""OpenAI protocol models: the request bodies exspec accepts and the response objects it returns.

Requests ignore unknown fields (`extra="ignore"`), so clients written for OpenAI or vLLM work unchanged.
Every field is bounded here as far as a static bound goes: integers within int64 (except `seed`, any
integer, reduced by the server), no NaN or infinity, no lone UTF-16 surrogates in any string. Bounds that
depend on the model or on the server's settings (vocabulary, `--max-n`, ...) are checked by
`server/limits.py`. Fields exspec cannot honour (tools, ...) are accepted by the model
and refused with a 400 by `unsupported_fields()`, naming the field, rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema

from exspec.server.config import INT64_MAX

INT64_MIN = -INT64_MAX - 1


def _no_lone_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate at character {e.start} (not valid Unicode)") from None
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]  # every string a request carries

_PROMPT_KINDS = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def _prompt(value: Any) -> str | list:
    """The prompt's shape, in time independent of a token-id list's length: a million token ids cost ~1 s
    through a pydantic union of four list types, and would still cost ~0.1 s to type-check here. The
    server checks a token-id prompt's length first and then each id (type and range), so a too-long list
    is refused without ever being walked."""
    if isinstance(value, str):
        return _no_lone_surrogates(value)
    if isinstance(value, list):
        if not value:
            return value  # refused by the server: "prompt must not be empty"
        first = value[0]
        if type(first) is int:
            return value  # token ids: each checked by the server (server/limits.py check_token_ids)
        if isinstance(first, str) and set(map(type, value)) == {str}:
            return [_no_lone_surrogates(x) for x in value]
        if isinstance(first, list) and set(map(type, value)) == {list}:
            return value  # token-id lists: each checked by the server
    raise ValueError(f"prompt must be {_PROMPT_KINDS}")


_IDS = {"type": "array", "items": {"type": "integer"}}
Prompt = Annotated[
    Any,
    PlainValidator(_prompt),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, _IDS,
                              {"type": "array", "items": _IDS}]}),
]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share. None means "not given": defaults are applied by the server."""

    model: Text | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)  # OpenAI's default: 1.0; < 1e-5: greedy
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)  # vLLM extension; -1 or 0: off
    seed: int | None = None  # any integer: reduced modulo 2**63 by the server
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Count] | None = None  # vLLM extension
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)  # vLLM extension
    use_speculation: bool = True  # exspec extension: False decodes this request without drafts
    return_token_ids: bool = False  # vLLM extension: each choice also carries its token ids
    # Accepted so that the refusal can name them (see unsupported_fields).
    frequency_penalty: float | None = None  # OpenAI's, [-2, 2]; bounds: engine/params.py
    presence_penalty: float | None = None  # OpenAI's, [-2, 2]
    repetition_penalty: float | None = None  # vLLM's extension, (0, 10], 1: off
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None

    def engine_logprobs(self) -> int | None:
        """The engine's `logprobs`: None for none, else the alternatives per token."""
        raise NotImplementedError

    def engine_prompt_logprobs(self) -> int | None:
        """The engine's `prompt_logprobs` (completions' echo with logprobs)."""
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists (one prompt each).
    # Token ids are checked against the vocabulary by the server (a 400 naming the range).
    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)  # default 16, as OpenAI
    echo: bool = False
    logprobs: Count | None = None  # alternatives per token (the chosen token's logprob always); bound: server/limits.py
    best_of: int | None = Field(default=None, ge=1, le=INT64_MAX)
    suffix: Text | None = None

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def unsupported_fields(self) -> list[str]:
        bad = []
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(_Request):
    type: Literal["text"]
    text: Text


def _not_text(kind: str) -> str:
    if kind == "text":
        raise ValueError("a text part needs a valid string `text`")
    return kind


class OtherPart(_Request):
    """A content part that is not text (image_url, input_audio, ...): refused by the server, by name."""

    type: Annotated[Text, AfterValidator(_not_text)]


class ChatMessage(_Request):
    role: Text
    content: Text | list[TextPart | OtherPart] | None = None
    name: Text | None = None


_NO_TOOL = (None, "none", "auto")  # tool_choice / function_call values that mean nothing without tools


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)  # takes precedence
    logprobs: bool | None = None
    top_logprobs: Count | None = None  # alternatives per token, with logprobs: true; bound: server/limits.py
    # Not supported: refused with a 400 unless they mean "nothing" (see unsupported_fields).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_fields(self) -> list[str]:
        bad = []
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in _NO_TOOL:
            bad.append("tool_choice")
        if self.functions:
            bad.append("functions")
        if self.function_call not in _NO_TOOL:
            bad.append("function_call")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            bad.append("response_format")
        return bad


# ---------------------------------------------------------------------------------------------- responses


def _omitted_if_none():
    """An optional response field left out of the JSON when unset (OpenAI omits them too)."""
    return Field(default=None, exclude_if=lambda v: v is None)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) logprobs of a choice or a chunk: one entry per token in each list."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first token of an echoed prompt (nothing predicts it)
    # the n most likely tokens and the chosen one (vLLM's convention), keyed by text: ids that decode alike share
    # one entry, the more likely one's
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # each token's offset in the choice's text, token texts counted as decoded alone


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    """An error answered with OpenAI's error object, an HTTP status and, optionally, headers (Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def body_json(self) -> str:
        """The body as JSON text; ASCII-only, so a message quoting odd input always encodes."""
        return json.dumps(self.body(), separators=(",", ":"))

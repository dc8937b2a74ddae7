"""The scheduler as the server sees it: a `typing.Protocol`, so the server never reaches into the engine
and tests can serve a fake scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from exspec.scheduler import SamplingParams
from exspec.scheduler.types import RequestOutput, StepStats


class RequestStreamProtocol(Protocol):
    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class SchedulerProtocol(Protocol):
    """What `build_app` uses; `exspec.scheduler.AsyncScheduler` implements it."""

    @property
    def model_name(self) -> str: ...  # the model's own name (the target directory's)

    @property
    def max_model_len(self) -> int: ...  # prompt + generated tokens per sequence, at most

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer: encode, decode, apply_chat_template

    @property
    def vocab_size(self) -> int: ...  # token ids are in [0, vocab_size)

    @property
    def is_alive(self) -> bool: ...  # the step loop runs

    @property
    def is_accepting(self) -> bool: ...  # alive and not shutting down

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def kv_slots_used_ratio(self) -> float: ...  # sequence slots (metadata rows) in use, 0..1

    @property
    def kv_cache_usage_perc(self) -> float: ...  # KV blocks held by sequences, 0..1

    async def start(self) -> None: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStreamProtocol: ...

    def abort(self, request_id: str) -> None: ...

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None: ...

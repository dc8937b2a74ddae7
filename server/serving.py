"""OpenAI completions and chat completions on top of the scheduler: requests become scheduler submissions
(one per prompt x choice), their delta streams become OpenAI responses or SSE chunks.

The server only submits, reads streams and aborts, through `SchedulerProtocol`. Tokenizing, chat templates
and echo's detokenizing of large inputs run in a small thread pool, so one big request never stalls the
event loop (and with it every other stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field

from exspec.scheduler import SamplingParams, TokenLogprob
from exspec.scheduler.types import QueueFullError, RequestOutput, SchedulerClosedError
from exspec.server import limits
from exspec.server.config import ServerConfig
from exspec.server.lifecycle import Lifecycle, ServerKilled
from exspec.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from exspec.server.metrics import RequestTimer, ServerMetrics
from exspec.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TextPart,
    UsageInfo,
)
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from exspec.errors import InvalidRequestError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS_CAP = 1024  # chat default: the model length left, at most this
OFFLOAD_CHARS = 16_384  # text (or token ids) longer than this is tokenized (decoded) off the event loop
OFFLOAD_THREADS = 2
logger = logging.getLogger("exspec.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class _Choice:
    """What one scheduler request (one choice) has produced so far."""

    index: int  # the choice's index in the response
    prompt_ids: list[int]
    timer: RequestTimer  # request-level metrics of this choice
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, where the request asked for them
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # one per prompt token, for echo with logprobs
    text_offset: int = 0  # a completions stream's: the text_offset of the next token

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.completion_tokens = out.completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error


class _Generation:
    """The scheduler requests behind one HTTP request. Whatever ends the HTTP request (completion, client
    disconnect, cancellation), every request not yet finished is aborted, so its KV slot is freed."""

    def __init__(self, scheduler, metrics: ServerMetrics, base_id: str, arrival: float,
                 background: set[asyncio.Task]) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.base_id = base_id
        self.background = background  # the app's set of reaper tasks (a reference to each, until done)
        self.arrival = arrival
        self.choices: list[_Choice] = []
        self._streams: list = []  # RequestStream per choice, same order
        self._finished: set[int] = set()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> None:
        index = len(self.choices)
        try:
            stream = self.scheduler.submit(prompt_ids, params, request_id=f"{self.base_id}-{index}")
        except BaseException:
            self.abort_unfinished()
            raise
        self.choices.append(_Choice(index, prompt_ids, self.metrics.request_timer(self.arrival)))
        self._streams.append(stream)

    def abort_unfinished(self) -> None:
        """Abort every choice not finished; a reaper task reads each one's last delta for the metrics."""
        for i, stream in enumerate(self._streams):
            if i not in self._finished:
                self._finished.add(i)
                self.scheduler.abort(stream.request_id)
                task = asyncio.get_running_loop().create_task(self._reap(i))
                self.background.add(task)
                task.add_done_callback(self.background.discard)

    async def _reap(self, i: int) -> None:
        async for out in self._streams[i]:
            self.choices[i].timer.observe(out)

    async def deltas(self) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Every choice's deltas, merged in arrival order; ends when every choice has finished."""
        source = self._single() if len(self._streams) == 1 else self._merged()
        try:
            async with aclosing(source):
                async for item in source:
                    yield item
        finally:
            self.abort_unfinished()

    def _record(self, i: int, out: RequestOutput) -> _Choice:
        choice = self.choices[i]
        choice.timer.observe(out)
        choice.add(out)
        if out.finished:
            self._finished.add(i)
        return choice

    async def _single(self) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        async for out in self._streams[0]:
            yield self._record(0, out), out

    async def _merged(self) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self._streams))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            async for out in self._streams[i]:
                queue.put_nowait((self._record(i, out), out))
        except Exception as e:  # surfaced by the consumer, never lost in a task
            queue.put_nowait(e)
        queue.put_nowait(None)

    async def collect(self) -> list[_Choice]:
        async for _ in self.deltas():
            pass
        return self.choices

    def usage(self, prompts: list[list[int]]) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(c.completion_tokens for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def _sse_error(err: APIError) -> str:
    return "data: " + err.body_json() + "\n\n"


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


class OpenAIServing:
    """The two generation endpoints. Holds no per-request state."""

    def __init__(self, scheduler, metrics: ServerMetrics, model_name: str, config: ServerConfig,
                 lifecycle: Lifecycle) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.model_name = model_name
        self.config = config
        self.lifecycle = lifecycle
        self.tokenizer = scheduler.tokenizer
        self.max_model_len = scheduler.max_model_len
        self.vocab_size = scheduler.vocab_size
        self.token_chars = limits.max_token_chars(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' token strings
        self.background: set[asyncio.Task] = set()  # reapers of aborted requests
        self._pool = ThreadPoolExecutor(OFFLOAD_THREADS, thread_name_prefix="exspec-tokenize")

    def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def unavailable(self, why: str) -> APIError:
        return APIError(503, why, type="service_unavailable",
                        headers={"Retry-After": str(self.config.retry_after_unavailable_s)})

    # ------------------------------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_common(req, req.unsupported_fields())
        limits.check_completion_prompts(req, self.config)
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        limits.check_min_tokens(req, max_tokens)
        prompts = await self._completion_prompts(req, max_tokens)
        prompt_texts = await self._echo_texts(req, prompts)
        gen = self._submit(req, prompts, max_tokens, f"cmpl-{_request_id(request)}", arrival)
        if req.stream:
            return self._streaming(self._completion_chunks(req, gen, prompts, prompt_texts))
        choices = await self._collect(gen, request)
        out = []
        for c in choices:
            text = "".join(c.text)
            if req.echo:
                text = prompt_texts[c.index // req.n] + text
            ids = c.token_ids if req.return_token_ids else None
            logprobs = None
            if req.logprobs is not None:  # with echo, the prompt's tokens first
                prompt = ([], ())
                if req.echo:  # they come with a choice's first tokens: one aborted before has none (None each)
                    ok = len(c.prompt_logprobs) == len(c.prompt_ids)
                    prompt = (c.prompt_ids, c.prompt_logprobs if ok else (None,) * len(c.prompt_ids))
                logprobs = completion_logprobs([*prompt[0], *c.token_ids], [*prompt[1], *c.logprobs],
                                               self.token_texts)
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                        token_ids=ids, prompt_token_ids=c.prompt_ids if req.return_token_ids else None))
        body = CompletionResponse(id=gen.base_id, model=self.model_name, choices=out, usage=gen.usage(prompts))
        return JSONResponse(body.model_dump())

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_common(req, req.unsupported_fields())
        limits.check_messages(req, self.config)
        ids = await self._chat_prompt(req)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if asked is None:
            left = self.max_model_len - len(ids)
            if left < 1:
                self._check_length(ids, 1, "messages")
            max_tokens = min(left, CHAT_DEFAULT_MAX_TOKENS_CAP)
        else:
            max_tokens = asked
        self._check_length(ids, max_tokens, "messages")
        limits.check_min_tokens(req, max_tokens)
        gen = self._submit(req, [ids], max_tokens, f"chatcmpl-{_request_id(request)}", arrival)
        if req.stream:
            return self._streaming(self._chat_chunks(req, gen, [ids]))
        choices = await self._collect(gen, request)
        out = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content="".join(c.text)),
                logprobs=chat_logprobs(c.token_ids, c.logprobs, self.token_texts) if req.logprobs else None,
                finish_reason=c.finish_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=c.prompt_ids if req.return_token_ids else None,
            )
            for c in choices
        ]
        body = ChatCompletionResponse(id=gen.base_id, model=self.model_name, choices=out, usage=gen.usage([ids]))
        return JSONResponse(body.model_dump())

    # ------------------------------------------------------------------------------------- requests in

    def _check_common(self, req, unsupported: list[str]) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        if unsupported:
            raise APIError(400, f"{unsupported[0]} is not supported yet by exspec", param=unsupported[0],
                           code="unsupported_parameter")
        limits.check_sampling(req, self.config, self.vocab_size)
        limits.check_logprobs(req, self.vocab_size)

    async def _off_loop(self, size: int, fn: Callable, *args):
        """fn(*args), in the thread pool when `size` (characters or ids) is large, else right here."""
        if size <= OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _completion_prompts(self, req: CompletionRequest, max_tokens: int) -> list[list[int]]:
        """Token ids of each prompt, each checked: length, then every id in the vocabulary."""
        p = req.prompt
        if isinstance(p, str) or isinstance(p[0], str):
            texts = [p] if isinstance(p, str) else p
            for t in texts:
                limits.check_fits_in_tokens(len(t), self.max_model_len, self.token_chars, "prompt")
            prompts = [await self._off_loop(len(t), self._encode, t) for t in texts]
        elif isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = p
        for ids in prompts:
            self._check_length(ids, max_tokens, "prompt")
            limits.check_token_ids(ids, self.vocab_size, "prompt")
        return prompts

    async def _echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text, for echo (ids checked already, so decoding cannot fail on them)."""
        if not req.echo:
            return ["" for _ in prompts]
        if isinstance(req.prompt, str):
            return [req.prompt]
        if isinstance(req.prompt[0], str):
            return list(req.prompt)
        return [await self._off_loop(len(ids), self.tokenizer.decode, ids) for ids in prompts]

    async def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages, chars = [], 0
        for i, m in enumerate(req.messages):
            content = m.content
            if content is None:
                content = ""
            elif isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, TextPart):
                        raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                            f"{part.type!r}", param="messages")
                    parts.append(part.text)
                content = "\n".join(parts)
            chars += len(content)
            messages.append({"role": m.role, "content": content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        limits.check_fits_in_tokens(chars, self.max_model_len, self.token_chars, "messages")
        return await self._off_loop(chars, self._render_chat, messages)

    def _render_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may reject roles or orderings (jinja raise_exception)
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        return self._encode(text, add_special_tokens=False)

    def _check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty: give at least one token", param=param)
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param="max_tokens" if len(ids) < self.max_model_len else param,
                code="context_length_exceeded",
            )

    def _params(self, req, max_tokens: int, choice: int, logit_bias: tuple) -> SamplingParams:
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=limits.engine_temperature(req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            seed=limits.engine_seed(req.seed, choice),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            use_speculation=req.use_speculation,
            stop=req.stop_strings(),
            logprobs=req.engine_logprobs(),
            prompt_logprobs=req.engine_prompt_logprobs(),
            logit_bias=logit_bias,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        )

    def _submit(self, req, prompts: list[list[int]], max_tokens: int, base_id: str, arrival: float) -> _Generation:
        gen = _Generation(self.scheduler, self.metrics, base_id, arrival, self.background)
        logit_bias = limits.engine_logit_bias(req, self.config, self.vocab_size)  # checked and converted once
        try:
            params = [self._params(req, max_tokens, i, logit_bias) for i in range(req.n)]
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from e
        try:
            for ids in prompts:
                for p in params:
                    gen.submit(ids, p)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="prompt") from e
        except QueueFullError as e:
            raise APIError(429, f"the server is busy: {e}", type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from e
        except SchedulerClosedError as e:
            raise self.unavailable(f"the server is not accepting requests: {e}") from e
        return gen

    # ------------------------------------------------------------------------------------- responses out

    def _generation_failed(self, gen: _Generation, error: str | None) -> APIError:
        logger.error("generation %s failed: %s", gen.base_id, error)
        return APIError(500, f"generation failed: internal error (request id {gen.base_id})", type="internal_error")

    async def _collect(self, gen: _Generation, request: Request) -> list[_Choice]:
        """All choices, finished; a client that disconnects first aborts them, and so does a second signal."""
        self.lifecycle.open_requests += 1
        collect = asyncio.create_task(gen.collect())
        watch = asyncio.create_task(_wait_for_disconnect(request))
        killed = asyncio.create_task(self.lifecycle.killed.wait())
        try:
            await asyncio.wait({collect, watch, killed}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                gen.abort_unfinished()
                if killed.done():
                    raise self.unavailable("the server is shutting down")
                raise APIError(499, "client disconnected", type="client_closed_request")
            choices = collect.result()
        finally:
            for t in (collect, watch, killed):
                t.cancel()
            self.lifecycle.open_requests -= 1
        failed = [c for c in choices if c.finish_reason == "error"]
        if failed:
            raise self._generation_failed(gen, failed[0].error)
        return choices

    @staticmethod
    def _streaming(chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)

    async def _sse_events(self, req, gen: _Generation, prompts, opening: list[str], render, usage_event):
        """The SSE body: the opening events, one event per delta with something to say (`render`), the usage
        event when asked for, then [DONE]. However it ends (a client disconnect cancels it), every choice
        not finished is aborted. A second signal ends it with an error event and [DONE]."""
        self.lifecycle.open_requests += 1
        try:
            async for event in self._sse_body(req, gen, prompts, opening, render, usage_event):
                yield event
            yield "data: [DONE]\n\n"
        finally:
            self.lifecycle.open_requests -= 1

    async def _sse_body(self, req, gen: _Generation, prompts, opening: list[str], render, usage_event):
        try:
            for event in opening:
                yield event
            failed = None
            async with aclosing(self.lifecycle.until_killed(gen.deltas())) as items:  # it closes the deltas
                async for choice, out in items:
                    if out.finished and out.finish_reason == "error":
                        failed = out.error
                        break
                    if out.text or out.finished or (out.token_ids and (req.return_token_ids or out.logprobs)):
                        yield render(choice, out)
            if failed is not None:
                yield _sse_error(self._generation_failed(gen, failed))
            elif req.include_usage():
                yield usage_event(gen.usage(prompts))
        except ServerKilled:
            yield _sse_error(self.unavailable("the server is shutting down: this stream was ended early"))
        except Exception:  # the status line is sent already: report it in the stream
            logger.exception("streaming %s failed", gen.base_id)
            yield _sse_error(APIError(500, f"internal server error (request id {gen.base_id})",
                                      type="internal_error"))
        finally:
            gen.abort_unfinished()

    def _completion_chunks(self, req: CompletionRequest, gen: _Generation, prompts, prompt_texts):
        created = int(time.time())

        def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return _sse(CompletionResponse(id=gen.base_id, created=created, model=self.model_name,
                                           choices=choices, usage=usage))

        def logprobs_of(choice: _Choice, token_ids, logprobs) -> CompletionLogprobs | None:
            if req.logprobs is None:
                return None
            out = completion_logprobs(token_ids, logprobs, self.token_texts, choice.text_offset)
            choice.text_offset += sum(map(len, out.tokens))
            return out

        def echo(choice: _Choice, prompt_logprobs=()) -> str:
            logprobs = logprobs_of(choice, choice.prompt_ids, prompt_logprobs)
            return event([CompletionChoice(index=choice.index, text=prompt_texts[choice.index // req.n],
                                           logprobs=logprobs)])

        # echo with logprobs: a choice's prompt event waits for its prompt logprobs, on its first delta
        echo_later = req.echo and req.logprobs is not None
        echoed: set[int] = set()

        def render(choice: _Choice, out: RequestOutput) -> str:
            before = ""
            if echo_later and choice.index not in echoed:
                echoed.add(choice.index)
                lps = out.prompt_logprobs or ()
                if len(lps) != len(choice.prompt_ids):  # they come with its first tokens: aborted before, none
                    lps = (None,) * len(choice.prompt_ids)
                before = echo(choice, lps)
            ids = list(out.token_ids) if req.return_token_ids else None
            finish = out.finish_reason if out.finished else None
            logprobs = logprobs_of(choice, out.token_ids, out.logprobs or ())
            return before + event([CompletionChoice(index=choice.index, text=out.text, logprobs=logprobs,
                                                    finish_reason=finish, token_ids=ids)])

        opening = [echo(c) for c in gen.choices] if req.echo and not echo_later else []
        return self._sse_events(req, gen, prompts, opening, render, lambda usage: event([], usage))

    def _chat_chunks(self, req: ChatCompletionRequest, gen: _Generation, prompts):
        created = int(time.time())

        def event(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=gen.base_id, created=created, model=self.model_name,
                                            choices=choices, usage=usage))

        def render(choice: _Choice, out: RequestOutput) -> str:
            delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
            ids = list(out.token_ids) if req.return_token_ids else None
            finish = out.finish_reason if out.finished else None
            logprobs = chat_logprobs(out.token_ids, out.logprobs or (), self.token_texts) if req.logprobs else None
            return event([ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                          token_ids=ids)])

        # The first chunk of each choice carries the role, as OpenAI's do.
        opening = [event([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                   for c in gen.choices]
        return self._sse_events(req, gen, prompts, opening, render, lambda usage: event([], usage))

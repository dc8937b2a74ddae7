"""The online scheduler: an asyncio front (submit, stream, abort) over `SchedulerCore` running in one
dedicated worker thread, so the event loop never blocks on a forward pass."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from exspec.errors import InvalidRequestError
from exspec.engine.params import SamplingParams
from exspec.scheduler.core import Delta, EngineProtocol, SchedulerCore
from exspec.scheduler.request import Request
from exspec.scheduler.types import (QueueFullError, RequestOutput, SchedulerClosedError, SchedulerConfig, StepStats,
                                    merge_deltas)

log = logging.getLogger("exspec.scheduler")


class RequestStream:
    """Async iterator over one request's deltas; ends after the delta with finished=True."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._held: RequestOutput | None = None  # an error delta taken from the queue, read next
        self._done = False

    def _push(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._held is not None:
            out, self._held = self._held, None
        else:
            out = await self._queue.get()
        # Deltas that queued up while the reader was busy (a loaded event loop) leave as one, so the per-delta cost
        # downstream (an SSE event: its JSON, a socket write) is paid once per read, not once per engine step. An
        # error stays a delta of its own: a reader reports it instead of its delta's text.
        while not out.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if later.finish_reason == "error":
                self._held = later
                break
            out = merge_deltas(out, later)
        self._done = out.finished
        return out


class AsyncScheduler:
    """submit() -> RequestStream; abort(); shutdown(). Thread-safe hand-off through a queue to the worker."""

    def __init__(self, engine: EngineProtocol, config: SchedulerConfig) -> None:
        self.engine = engine
        self.config = config
        self._core = SchedulerCore(engine, config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Request) | ("abort", id) | ("abort_all",)
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Callable[[StepStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._submitted = 0  # requests ever submitted (written on the event loop only)
        self._order = 0
        self._accepting = True
        self._dead: str | None = None  # why the step loop died

    # ------------------------------------------------------------------ public API

    def calibrate(self, prompts: list[list[int]]) -> dict[int, int]:
        """Before `start`: the policy's calibration steps on these prompts (`SchedulerCore.calibrate`). Returns the
        k the policy then chooses per batch-size bucket ({} when it calibrates nothing)."""
        if self._thread is not None:
            raise RuntimeError("calibrate runs before the step loop starts")
        if not self._core.calibrate(prompts):
            return {}
        return {b: s["best_k"] for b, s in self._core.speculation.summary().items() if "best_k" in s}

    async def start(self) -> None:
        """Start the step-loop worker thread (once; later calls do nothing)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._worker, name="exspec-step-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None and not self._stop.is_set()

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def num_waiting(self) -> int:
        """Submitted and not yet admitted to the pool (nor aborted while waiting), preempted ones included."""
        return self._submitted - self._core.num_left_waiting + self._core.num_preemptions

    @property
    def num_running(self) -> int:
        """Admitted to the pool: prefilling or decoding."""
        return self._core.num_running

    # The typed interface the server uses (it never reaches into the engine).

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def dead_reason(self) -> str | None:
        """Why the step loop died, if it did (/health reports it)."""
        return self._dead

    @property
    def kv_slots_used_ratio(self) -> float:
        return (self.engine.num_slots - self.engine.num_free_slots) / self.engine.num_slots

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction of the KV blocks held by sequences, 0..1 (vLLM's name, and like vLLM's a fraction)."""
        return self._core.kv_cache_usage

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        if not self.is_accepting:
            raise SchedulerClosedError(self._dead or "the server is shutting down and accepts no new requests")
        self.engine.check_prompt(prompt_token_ids)
        self.engine.check_params(params)
        self._core.check_fits(prompt_token_ids)
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if self.num_waiting >= self.config.max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
                )
            self._submitted += 1
            self._order += 1
            order = self._order
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        req = Request(request_id, list(prompt_token_ids), params, order, arrival_time=time.monotonic())
        self._inbox.put(("add", req))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._inbox.put(("abort", request_id))
            self._wake.set()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let admitted and queued requests finish within `timeout`; abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._streams and self.is_alive:
            self._inbox.put(("abort_all",))
            self._wake.set()
            for _ in range(250):  # the worker finishes its current step first
                if not self._streams:
                    break
                await asyncio.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # ------------------------------------------------------------------ worker thread

    def _worker(self) -> None:
        core = self._core
        try:
            while not self._stop.is_set():
                deltas = self._drain_inbox()
                if not core.has_work():
                    self._post(deltas, [])
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                step_deltas, stats = core.step()
                self._post(deltas + step_deltas, stats)
        except BaseException as e:  # the loop itself broke (requests cannot do this): fail everything at once
            log.exception("the step loop died")
            self._dead = f"the step loop died ({type(e).__name__}); the server must be restarted"
            self._loop.call_soon_threadsafe(self._fail_all_streams, self._dead)

    def _drain_inbox(self) -> list[Delta]:
        deltas: list[Delta] = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return deltas
            if msg[0] == "add":
                self._core.add(msg[1])
            elif msg[0] == "abort":
                d = self._core.abort(msg[1])
                if d is not None:
                    deltas.append(d)
            else:
                deltas.extend(self._core.abort_all())

    def _post(self, deltas: list[Delta], stats: list[StepStats]) -> None:
        if not deltas and not stats:
            return
        self._loop.call_soon_threadsafe(self._deliver, [out for _, out in deltas], stats)

    def _fail_all_streams(self, error: str) -> None:
        """On the event loop, after the step loop died: every stream still open (queued, running, or still
        in the inbox) gets its final delta, an error, at once."""
        for request_id, stream in list(self._streams.items()):
            stream._push(RequestOutput(request_id, (), "", True, "error", 0, 0, error=error))
        self._streams.clear()

    def _deliver(self, outs: list[RequestOutput], stats: list[StepStats]) -> None:
        """On the event loop: hand deltas to their streams, call step listeners."""
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._push(out)
            if out.finished:
                del self._streams[out.request_id]
        for st in stats:
            for fn in self._listeners:
                try:
                    fn(st)
                except Exception:  # a metrics bug must not stop delivery
                    log.exception("step listener failed")

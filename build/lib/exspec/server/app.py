"""The FastAPI app: OpenAI routes, health, metrics, API-key check, error objects, start and drain.

`build_app(scheduler, settings)` is the only entry point; everything an app needs lives on it (no module
globals), so a test can run several apps in one process.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from exspec.errors import InvalidRequestError
from exspec.server.metrics import ServerMetrics
from exspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from exspec.server.serving import OpenAIServing
from exspec.server.settings import ServeSettings

logger = logging.getLogger("exspec.server")


class Lifecycle:
    """Starts the scheduler with the app and drains it exactly once, whoever asks first (SIGTERM or the
    ASGI lifespan's shutdown)."""

    def __init__(self, scheduler, timeout: float) -> None:
        self.scheduler = scheduler
        self.timeout = timeout
        self._drain: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.scheduler.start()

    def drain_threadsafe(self, on_done) -> bool:
        """From a signal handler or another thread: begin draining, call on_done() on the loop when done.
        False if the app has not started (nothing to drain)."""
        if self._loop is None or self._loop.is_closed():
            return False

        def begin() -> None:
            self.begin_drain().add_done_callback(lambda _: on_done())

        self._loop.call_soon_threadsafe(begin)
        return True

    def begin_drain(self) -> asyncio.Task:
        """Stop admitting (new requests get 503), let running ones finish within the timeout, then abort
        them. Call on the event loop; returns the drain's task (the same one on every call)."""
        if self._drain is None:
            logger.info("draining: no new requests; running ones get %.0f s to finish", self.timeout)
            self._drain = asyncio.get_running_loop().create_task(self.scheduler.shutdown(self.timeout))
        return self._drain

    async def drain(self) -> None:
        await asyncio.shield(self.begin_drain())


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error_response(APIError(400, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                        type="internal_error"))


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    return check


def build_app(scheduler, settings: ServeSettings) -> FastAPI:
    """An OpenAI-compatible app over `scheduler` (an AsyncScheduler, not yet started: the app's lifespan
    starts it and drains it)."""
    model_name = settings.served_model_name or scheduler.model_name
    metrics = ServerMetrics(model_name)
    metrics.bind_scheduler(scheduler)
    lifecycle = Lifecycle(scheduler, settings.shutdown_timeout)
    serving = OpenAIServing(scheduler, metrics, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.drain()
            serving.cancel_background()

    app = FastAPI(title="exspec", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.model_name = model_name
    _install_error_handlers(app)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(settings.api_key))])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completions(body, request)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=scheduler.max_model_len)])

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.is_alive:
            return _error_response(APIError(503, "the step loop is not running", type="service_unavailable"))
        if not scheduler.is_accepting:
            return _error_response(APIError(503, "shutting down", type="service_unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app

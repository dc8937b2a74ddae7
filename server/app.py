"""The FastAPI app: OpenAI routes, health, metrics, error objects, start and drain.

`build_app(scheduler, config)` is the only entry point; everything an app needs lives on it (no module
globals), so a test can run several apps in one process. The edge middleware (server/edge.py) runs
before any route: request ids, the API key, the body limits.
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from exspec.errors import InvalidRequestError
from exspec.server.config import ServerConfig
from exspec.server.edge import EdgeMiddleware, OffLoopJSONRoute
from exspec.server.lifecycle import Lifecycle
from exspec.server.metrics import ServerMetrics
from exspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from exspec.server.scheduler_api import SchedulerProtocol
from exspec.server.serving import OpenAIServing

logger = logging.getLogger("exspec.server")


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting odd input (a lone surrogate) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    return _AsciiJSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        if len(parts) == 5:  # a union of several types reports every branch: the first few say enough
            break
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # exc.headers carries Allow on a 405
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id(request)
        logger.exception("unhandled error in %s %s (request id %s)", request.method, request.url.path, rid)
        # Starlette answers this one outside the edge middleware: the request id header is set here.
        return error_response(APIError(500, f"internal server error (request id {rid})", type="internal_error",
                                       headers={"X-Request-Id": rid}))


def build_app(scheduler: SchedulerProtocol, config: ServerConfig) -> FastAPI:
    """An OpenAI-compatible app over `scheduler` (not yet started: the app's lifespan starts it and drains
    it). The server talks to the scheduler only through `SchedulerProtocol`."""
    model_name = config.served_model_name or scheduler.model_name
    metrics = ServerMetrics(model_name)
    metrics.bind_scheduler(scheduler)
    lifecycle = Lifecycle(scheduler, config.shutdown_timeout)
    serving = OpenAIServing(scheduler, metrics, model_name, config, lifecycle)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await lifecycle.start()
        try:
            yield
        finally:
            await lifecycle.drain()
            serving.close()

    app = FastAPI(title="exspec", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.model_name = model_name
    app.state.config = config
    _install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, config=config)

    v1 = APIRouter(prefix="/v1", route_class=OffLoopJSONRoute)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completions(body, request)

    def card() -> ModelCard:
        return ModelCard(id=model_name, max_model_len=scheduler.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @v1.get("/models/{model_id:path}", responses={404: {"description": "no such model"}})
    async def model(model_id: str) -> ModelCard:
        if model_id != model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")
        return card()

    app.include_router(v1)

    @app.get("/health", responses={503: {"description": "the step loop is not running, or shutting down"}})
    async def health() -> Response:
        if not scheduler.is_alive:
            return error_response(serving.unavailable("the step loop is not running"))
        if not scheduler.is_accepting:
            return error_response(serving.unavailable("shutting down"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app

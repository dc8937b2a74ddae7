"""A pure ASGI middleware at the server's edge, before any route runs: a request id on every response,
the API key checked before the body is read, and the body read with a size limit (413) and a time limit
(408), counting bytes as they arrive and honouring Content-Length. The app then gets the whole body
at once, so no route ever waits on a slow sender; `OffLoopJSONRoute` parses a large body in a thread."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

import pydantic_core
from fastapi.routing import APIRoute
from starlette.requests import Request

from exspec.server.config import ServerConfig
from exspec.server.protocol import APIError

PROTECTED_PREFIX = "/v1"  # paths that need the API key (when one is set)


class EdgeMiddleware:
    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        self.read_timeout = config.body_read_timeout
        self.api_key = config.api_key.encode() if config.api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        send = _add_header(send, b"x-request-id", request_id.encode())
        headers = dict(scope["headers"])  # lower-case names (ASGI); a repeated header: the last one
        if self.api_key is not None and _is_protected(scope["path"]) and not self._authorized(headers):
            err = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
            await send_error(send, err, close=True)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await send_error(send, APIError(400, "Content-Length is not a number"), close=True)
                return
            if int(length) > self.max_body:
                await send_error(send, self._too_large(), close=True)
                return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and length is None:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return  # answered already, or the client left
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body} bytes (server limit --max-body-bytes)",
                        code="request_too_large")

    async def _read_body(self, receive, send) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await send_error(send, APIError(
                    408, f"the request body took longer than {self.read_timeout:g} s to arrive "
                         "(server limit --body-read-timeout)", code="request_timeout"), close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await send_error(send, self._too_large(), close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def _replay(body: bytes, receive):
    """A receive() that hands the app the buffered body first, then the connection's own messages
    (a disconnect, for the routes that watch for one)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _add_header(send, name: bytes, value: bytes):
    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (name, value)]}
        await send(message)

    return wrapped


async def send_error(send, err: APIError, close: bool = False) -> None:
    """Answer with OpenAI's error object straight from ASGI (no route ran)."""
    body = err.body_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:  # the rest of the body is never read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


OFFLOAD_JSON_BYTES = 64 * 1024  # bodies larger than this are parsed in a worker thread


def _parse_large_json(body: bytes):
    """pydantic-core's parser: twice as fast as json.loads on big bodies (both hold the GIL while parsing,
    so the event loop waits that long even though this runs in a thread). Errors become JSONDecodeError,
    which FastAPI answers as invalid JSON (400)."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        raise json.JSONDecodeError(str(e), "", 0) from None


class _OffLoopJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFFLOAD_JSON_BYTES:
                self._json = await asyncio.to_thread(_parse_large_json, body)
            else:
                self._json = json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """A route whose JSON body, when large, is parsed off the event loop by a faster parser (a few MB of
    JSON take 0.1-0.3 s to parse on a busy core)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(_OffLoopJSONRequest(request.scope, request.receive))

        return route_handler

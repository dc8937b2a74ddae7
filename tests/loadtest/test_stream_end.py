"""The load test's client counts a stream as completed only when it ends with `data: [DONE]`: a stream cut
short (a proxy or a replica dying, tests/deploy/) that closes cleanly is a visible failure, not a success.
Through httpx's MockTransport: no server, no socket."""

from __future__ import annotations

import json

import httpx
import pytest

from exspec.loadtest.client import RequestInput, send_request

CHUNK = json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": None}]})
LAST = json.dumps({"choices": [{"index": 0, "text": "b", "token_ids": [6], "finish_reason": "length"}]})


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


async def _send(body: bytes):
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1/v1") as client:
        return await send_request(client, "/completions", {"return_token_ids": True}, RequestInput(0, [1, 2], 2),
                                  "completions")


@pytest.mark.parametrize("events, ok", [
    ((CHUNK, LAST, "[DONE]"), True),  # the control: a whole stream
    ((CHUNK, LAST), False),  # finished, but [DONE] never came
    ((CHUNK,), False),  # cut mid-stream
])
async def test_a_stream_without_done_is_a_failure(events, ok):
    res = await _send(_sse(*events))
    assert res.success is ok
    if ok:
        assert res.token_ids == [5, 6] and res.error == ""
    else:
        assert "without data: [DONE]" in res.error


async def test_an_error_event_is_reported_as_such():
    res = await _send(_sse(CHUNK, json.dumps({"error": {"message": "shutting down"}}), "[DONE]"))
    assert not res.success and res.error == "shutting down"

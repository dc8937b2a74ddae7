"""Faults no request may turn into a crash: a scheduler that raises, a generation that fails mid-way, a
step loop that died. A fake scheduler with AsyncScheduler's interface, behind a real uvicorn; no model."""

from __future__ import annotations

import asyncio
import threading
import httpx
import openai
import pytest

from exspec.scheduler.types import RequestOutput, StepStats
from exspec.server.app import build_app
from exspec.server.config import ServerConfig
from exspec.server.serving import OFFLOAD_CHARS
from tests.support.server_fixtures import serve_in_thread
from tests.support.tiny_models import build_tokenizer

BOOM, FAIL_MIDWAY = 13, 14  # first prompt token that makes the fake raise / fail its generation


class FakeStream:
    def __init__(self, request_id: str, outputs: list[RequestOutput]) -> None:
        self.request_id = request_id
        self._outputs = outputs

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for out in self._outputs:
            await asyncio.sleep(0)
            yield out


class SlowTokenizer:
    """The tiny tokenizer, but encoding a text of SLOW_CHARS or more blocks until the test releases it
    (blocking without the GIL, as a Rust tokenizer does), and records the thread it ran on."""

    SLOW_CHARS = OFFLOAD_CHARS + 1

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.chat_template = tokenizer.chat_template
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str, **kwargs):
        if len(text) >= self.SLOW_CHARS:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.release.wait(10)
            return [5] * 2000  # longer than the fake's max_model_len: a 400, after tokenizing
        return self._tok.encode(text, **kwargs)


class FakeScheduler:
    """Deterministic deltas, no engine: "ab" then "cd" and length; or "ab" then a failed step."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = SlowTokenizer(tokenizer)
        self.model_name = "fake"
        self.max_model_len = 1024  # long enough that a SLOW_CHARS text passes the characters-per-token bound
        self.vocab_size = len(tokenizer)
        self.is_alive = True
        self.is_accepting = True
        self.num_running = self.num_waiting = 0
        self.kv_slots_used_ratio = self.kv_cache_usage_perc = 0.0
        self.aborted: list[str] = []
        self.listeners = []

    async def start(self) -> None:
        pass

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.is_accepting = self.is_alive = False

    def add_step_listener(self, fn) -> None:
        self.listeners.append(fn)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def submit(self, prompt_token_ids, params, request_id=None) -> FakeStream:
        if prompt_token_ids[0] == BOOM:
            raise RuntimeError("the fake scheduler exploded")
        n = len(prompt_token_ids)
        first = RequestOutput(request_id, (40, 41), "ab", False, None, n, 2, queue_time_s=0.001)
        if prompt_token_ids[0] == FAIL_MIDWAY:
            last = RequestOutput(request_id, (), "", True, "error", n, 2, error="internal error in the engine step")
        else:
            last = RequestOutput(request_id, (42, 43), "cd", True, "length", n, 4)
        for fn in self.listeners:
            fn(StepStats("grouped", 1, 2, 2, 1, (1, 0), 2, 0, 0.001, 0.002, 0.003))
        return FakeStream(request_id, [first, last])


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("fake-tok"))
    scheduler = FakeScheduler(tokenizer)
    with serve_in_thread(build_app(scheduler, ServerConfig())) as (base, server, thread):
        yield base, scheduler


def test_fake_happy_path(fake):
    base, _ = fake
    r = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(
        model="fake", prompt=[5, 6], max_tokens=4)
    assert r.choices[0].text == "abcd" and r.usage.completion_tokens == 4


def test_an_exception_is_a_500_error_object_and_the_server_lives_on(fake):
    base, _ = fake
    r = httpx.post(base + "/v1/completions", json={"prompt": [BOOM, 1], "max_tokens": 4})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_error"
    # a generic message naming the request id; the exception's details stay in the server log
    assert "exploded" not in err["message"] and r.headers["x-request-id"] in err["message"]
    assert httpx.post(base + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}).status_code == 200


def test_failed_generation_non_stream_is_500(fake):
    base, _ = fake
    r = httpx.post(base + "/v1/completions", json={"prompt": [FAIL_MIDWAY, 1], "max_tokens": 4})
    assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]
    assert "engine step" not in r.json()["error"]["message"]


def test_failed_generation_stream_sends_an_error_event(fake):
    base, _ = fake
    body = {"prompt": [FAIL_MIDWAY, 1], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert '"text":"ab"' in events[0]
    assert '"error"' in events[-2] and r.headers["x-request-id"] in events[-2]
    assert "engine step" not in events[-2]
    assert events[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="generation failed"):
        for _ in client.completions.create(model="fake", prompt=[FAIL_MIDWAY, 1], max_tokens=4, stream=True):
            pass


def test_n_choices_with_one_failing_submit_aborts_the_others(fake):
    base, scheduler = fake
    before = len(scheduler.aborted)
    r = httpx.post(base + "/v1/completions", json={"prompt": [[5, 6], [BOOM, 1]], "max_tokens": 4, "n": 2})
    assert r.status_code == 500
    assert len(scheduler.aborted) == before + 2  # both choices of the first prompt


def test_health_turns_503_when_the_step_loop_dies(fake):
    base, scheduler = fake
    assert httpx.get(base + "/health").status_code == 200
    scheduler.is_alive = False
    try:
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and "step loop" in r.json()["error"]["message"]
    finally:
        scheduler.is_alive = True


def test_tokenizing_a_long_prompt_does_not_block_the_event_loop(fake):
    """While a long prompt is being tokenized (held inside the tokenizer until the test lets go), the event
    loop still answers /health. Were the tokenizer called on the loop, that /health could not be answered
    before the release, and would time out."""
    base, scheduler = fake
    tok = scheduler.tokenizer
    long_text = "ab " * (SlowTokenizer.SLOW_CHARS // 3 + 1)
    bodies = [("/v1/completions", {"prompt": long_text, "max_tokens": 4}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4})]
    for path, body in bodies:
        tok.entered.clear()
        tok.release.clear()
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(httpx.post(base + path, json=body, timeout=30)))
        t.start()
        try:
            assert tok.entered.wait(10)
            assert httpx.get(base + "/health", timeout=5).status_code == 200
        finally:
            tok.release.set()
            t.join(30)
        assert result[0].status_code == 400 and "maximum context length" in result[0].json()["error"]["message"]
    assert len(tok.threads) == 2 and all(name.startswith("exspec-tokenize") for name in tok.threads)

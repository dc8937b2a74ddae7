"""The OpenAI-compatible server end to end: a real uvicorn over tiny models, the official `openai` client
(sync and async, streaming and not), outputs equal to the target's own greedy output, errors, metrics,
disconnects and draining."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from exspec.server.metrics import METRIC_NAMES
from tests.support.gates import gated, signalling, wait_until
from tests.support.server_fixtures import running_server
from tests.support.tiny_models import build_pair

MAX_LEN = 128


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("server-models"), "llama")


@pytest.fixture(scope="module")
def srv(pair):
    target, draft = pair
    with running_server(target, draft, max_model_len=MAX_LEN, max_batch_size=4, pool_size=8,
                        num_speculative_tokens=3) as s:
        yield s


@pytest.fixture(scope="module")
def tok(srv):
    return srv.engine.tokenizer


@pytest.fixture(scope="module")
def reference(pair):
    """Greedy continuation of the target alone (Hugging Face generate, batch 1), memoised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=2, pad_token_id=3)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return greedy


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
async def aclient(srv):
    async with openai.AsyncOpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 300) for _ in range(rng.randrange(3, 12))] for _ in range(count)]


def _text(tok, ids: list[int]) -> str:
    """The text the server returns for these output ids: their decode, less an incomplete UTF-8 tail (random
    tiny models emit stray bytes; an unfinished character at the end is dropped, never sent as U+FFFD)."""
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def _scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base_url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# ------------------------------------------------------------------------------------------ happy paths


def test_models_and_health(srv, client):
    models = client.models.list().data
    assert [m.id for m in models] == [srv.model_name] == ["llama-target"]
    assert models[0].max_model_len == MAX_LEN
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_completions_match_target_greedy(srv, client, tok, reference):
    prompts = _prompts(2, seed=1)
    r = client.completions.create(model=srv.model_name, prompt=prompts, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and len(r.choices) == 2
    for prompt, choice in zip(prompts, sorted(r.choices, key=lambda c: c.index)):
        ref = reference(prompt, 12)
        assert choice.token_ids == ref
        assert choice.text == _text(tok, ref)
        assert choice.finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == sum(len(reference(p, 12)) for p in prompts)


def test_completions_stream_matches_non_stream(srv, client, reference):
    prompt = _prompts(3, seed=2)[2]
    ref = reference(prompt, 16)
    chunks = list(client.completions.create(
        model=srv.model_name, prompt=prompt, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert all(c.object == "text_completion" for c in chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(ref)
    body = chunks[:-1]
    assert [t for c in body for t in c.choices[0].token_ids] == ref
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    plain = client.completions.create(model=srv.model_name, prompt=prompt, max_tokens=16, temperature=0)
    assert "".join(c.choices[0].text for c in body) == plain.choices[0].text


def test_string_prompt_echo_stop_and_default_max_tokens(srv, client, tok, reference):
    text = "The quick brown fox"
    ids = tok.encode(text)
    ref = reference(ids, 16)  # 16: OpenAI's default max_tokens for completions
    r = client.completions.create(model=srv.model_name, prompt=text, temperature=0, echo=True,
                                  extra_body={"ignore_eos": False})
    full = _text(tok, ref)
    assert r.choices[0].text == text + full
    # a stop string from the middle of that output: the text ends just before its first occurrence
    at = next(i for i in range(2, len(full) - 1) if full[i: i + 2].isascii() and full[i: i + 2].isalnum())
    stop = full[at: at + 2]
    cut = client.completions.create(model=srv.model_name, prompt=text, temperature=0, stop=["@@never@@", stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_chat_matches_target_greedy(srv, aclient, tok, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello world!"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    ref = reference(ids, 10)
    r = await aclient.chat.completions.create(model=srv.model_name, messages=messages, max_tokens=10,
                                              temperature=0, extra_body={"return_token_ids": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == ref
    assert r.choices[0].message.content == _text(tok, ref)
    assert r.usage.prompt_tokens == len(ids)

    stream = await aclient.chat.completions.create(
        model=srv.model_name, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(ref)


def test_n_choices_are_independent_and_seeded(srv, client, reference):
    prompt = _prompts(1, seed=3)[0]
    greedy = client.completions.create(model=srv.model_name, prompt=prompt, max_tokens=8, temperature=0, n=3,
                                       extra_body={"return_token_ids": True})
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2]
    assert all(c.token_ids == reference(prompt, 8) for c in greedy.choices)

    kw = dict(model=srv.model_name, prompt=prompt, max_tokens=8, temperature=1.0,
              extra_body={"return_token_ids": True, "top_k": -1})  # -1: off, as in vLLM
    many = client.completions.create(n=3, seed=100, **kw)
    for choice in many.choices:
        alone = client.completions.create(n=1, seed=100 + choice.index, **kw)
        assert choice.token_ids == alone.choices[0].token_ids


async def test_32_concurrent_streams(srv, aclient, reference):
    prompts = _prompts(8, seed=4)

    async def one(i: int):
        prompt = prompts[i % len(prompts)]
        stream = await aclient.completions.create(model=srv.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        ids = [t async for c in stream for t in (c.choices[0].token_ids or [])]
        return prompt, ids

    results = await asyncio.gather(*(one(i) for i in range(32)))
    for prompt, ids in results:
        assert ids == reference(prompt, 8)
    assert srv.wait_idle()


# ------------------------------------------------------------------------------------------ disconnects


def test_disconnect_mid_stream_frees_the_slot(srv):
    before = _scrape(srv.base_url).get(("exspec_request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert srv.scheduler.num_running == 1
    # the connection is closed: the request must be aborted and its KV slot freed
    assert srv.wait_idle()
    assert srv.engine.allocator.num_used == 0
    after = _scrape(srv.base_url)[("exspec_request_success_total", (("finished_reason", "abort"),))]
    assert after == before + 1


def test_disconnect_mid_stream_is_an_abort_not_an_error(srv, monkeypatch, caplog):
    """The client leaves while its stream waits for the next delta (steps held by a gate): the request is
    aborted quietly, with no 'streaming ... failed' error logged (the pending read of the next delta used to be
    left running, and closing the delta generator under it raised 'aclose(): asynchronous generator is already
    running')."""
    gate, aborted = threading.Event(), threading.Event()
    gate.set()
    monkeypatch.setattr(srv.engine, "step", gated(srv.engine.step, gate))
    monkeypatch.setattr(srv.scheduler, "abort", signalling(srv.scheduler.abort, aborted))
    body = {"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 4, "temperature": 0, "ignore_eos": True, "stream": True}
    caplog.set_level("WARNING", logger="exspec")
    try:
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            assert next(line for line in resp.iter_lines() if line.startswith("data:"))
            gate.clear()  # no further delta can come: the server waits for one when the client leaves
        assert aborted.wait(30), "the server did not abort the request of a client that left"
    finally:
        gate.set()
    assert srv.wait_idle(30)
    errors = [r for r in caplog.records if r.levelname == "ERROR" or "Traceback" in r.getMessage()]
    assert not errors, [r.getMessage() for r in errors]


def test_disconnect_while_waiting_for_non_stream_response(srv, monkeypatch):
    """Steps are held until the server has aborted the request: the answer cannot come before the client
    leaves, and the request must end as an abort (not run to its length) however fast the machine is."""
    key = ("exspec_request_success_total", (("finished_reason", "abort"),))
    before = _scrape(srv.base_url).get(key, 0)
    gate, aborted = threading.Event(), threading.Event()
    monkeypatch.setattr(srv.engine, "step", gated(srv.engine.step, gate))
    monkeypatch.setattr(srv.scheduler, "abort", signalling(srv.scheduler.abort, aborted))
    submitted = threading.Event()
    monkeypatch.setattr(srv.scheduler, "submit", signalling(srv.scheduler.submit, submitted))
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 4, "temperature": 0, "ignore_eos": True})
    port = int(srv.base_url.rsplit(":", 1)[1])
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head.encode() + body.encode())
            # the client leaves once the server holds its request, which no step can answer (they are held)
            assert submitted.wait(30), "the server never submitted the request"
        assert aborted.wait(30), "the server did not abort the request of a client that left"
    finally:
        gate.set()
    assert srv.wait_idle(30)
    assert _scrape(srv.base_url)[key] == before + 1


# ------------------------------------------------------------------------------------------ errors


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/completions", {}, "prompt"),  # required field missing: 400, not FastAPI's 422
        ("/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/completions", {"prompt": []}, "prompt"),
        ("/completions", {"prompt": "hi", "max_tokens": 0}, None),
        ("/completions", {"prompt": "hi", "temperature": -1}, None),
        ("/completions", {"prompt": [1, 2, 99999]}, "prompt"),  # id outside the vocabulary
        ("/completions", {"prompt": list(range(10, 10 + MAX_LEN - 8)), "max_tokens": 16}, "max_tokens"),
        ("/completions", {"prompt": list(range(10, 10 + MAX_LEN))}, "prompt"),
        ("/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
         "top_logprobs"),
        ("/chat/completions", {"messages": []}, "messages"),
        ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_LEN}, None),
    ],
)
def test_bad_requests_are_400(srv, path, body, param):
    err = _err(httpx.post(srv.v1 + path, json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_invalid_json_and_unknown_fields(srv):
    _err(httpx.post(srv.v1 + "/completions", content=b"{nope", headers={"content-type": "application/json"}), 400)
    r = httpx.post(srv.v1 + "/completions", json={"prompt": [5, 6], "max_tokens": 2, "whatever": {"x": 1}})
    assert r.status_code == 200


def test_openai_client_sees_errors(srv, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model=srv.model_name, prompt="hi", max_tokens=2, suffix="!")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=srv.model_name, prompt=list(range(10, 130)), max_tokens=16)
    assert httpx.get(srv.base_url + "/health").status_code == 200  # none of it hurt the server


def test_unknown_route_is_an_error_object(srv):
    _err(httpx.get(srv.base_url + "/v1/nothing"), 404)


# ------------------------------------------------------------------------------------------ metrics


def test_metrics_move_with_requests(srv, client):
    assert srv.wait_idle()
    before = _scrape(srv.base_url)
    prompt = _prompts(1, seed=5)[0]
    r = client.completions.create(model=srv.model_name, prompt=prompt, max_tokens=10, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    after = _scrape(srv.base_url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("exspec_prompt_tokens_total") == 2 * len(prompt)  # each choice prefills its own copy
    assert moved("exspec_generation_tokens_total") == r.usage.completion_tokens == 20
    assert moved("exspec_request_success_total", (("finished_reason", "length"),)) == 2
    assert moved("exspec_e2e_request_latency_seconds_count") == 2
    assert moved("exspec_time_to_first_token_seconds_count") == 2
    assert moved("exspec_request_queue_time_seconds_count") == 2
    assert moved("exspec_inter_token_latency_seconds_count") == 2 * 9
    assert moved("exspec_scheduler_steps_total", (("kind", "prefill"),)) >= 1
    decode_steps = sum(moved("exspec_scheduler_steps_total", (("kind", k),)) for k in ("grouped", "mixed"))
    assert decode_steps >= 1
    assert moved("exspec_step_duration_seconds_count", (("phase", "verify"),)) == decode_steps + moved(
        "exspec_scheduler_steps_total", (("kind", "prefill"),))
    assert moved("exspec_batch_size_count") == decode_steps
    by_k = {k: moved("exspec_decode_steps_total", (("k", str(k)),)) for k in range(4)}
    assert sum(by_k.values()) == decode_steps and by_k[3] >= 1  # fixed k = 3: every step drafts (k <= 3)
    drafted = moved("exspec_spec_decode_num_draft_tokens_total")
    accepted = moved("exspec_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    per_pos = sum(moved("exspec_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))
                  for i in range(3))
    assert per_pos == accepted
    assert moved("exspec_acceptance_length_count") == decode_steps
    assert after[("exspec_num_requests_running", ())] == 0
    assert after[("exspec_kv_slots_used_ratio", ())] == 0


def test_metric_names_are_the_exported_families(srv):
    text = httpx.get(srv.base_url + "/metrics").text
    families = {
        f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)
    }
    assert families == set(METRIC_NAMES)
    assert "_created" not in text


# ------------------------------------------------------------------------------------------ auth, 429, 503


def test_api_key_queue_full_and_drain(pair):
    """One tiny server (1 slot, 1 waiting place, an API key): 401, 429, then 503 while draining."""
    target, draft = pair
    with running_server(target, draft, max_model_len=MAX_LEN, max_batch_size=1, pool_size=1, max_waiting=1,
                        api_key="sekret", served_model_name="tiny", shutdown_timeout=30) as s:
        assert _err(httpx.get(s.v1 + "/models"), 401)["code"] == "invalid_api_key"
        _err(httpx.get(s.v1 + "/models", headers={"Authorization": "Bearer wrong"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.v1, api_key="wrong", max_retries=0).models.list()
        assert httpx.get(s.base_url + "/health").status_code == 200  # no key needed
        assert httpx.get(s.base_url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=s.v1, api_key="sekret", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        gate = threading.Event()  # steps are held until the drain has begun: the pool and the queue stay full
        s.engine.step = gated(s.engine.step, gate)

        long = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
        headers = {"Authorization": "Bearer sekret"}
        results: dict[str, list[str]] = {}

        def stream(name: str) -> None:
            with httpx.stream("POST", s.v1 + "/completions", json=long, headers=headers, timeout=60) as r:
                results[name] = [line for line in r.iter_lines() if line.startswith("data:")]

        running = threading.Thread(target=stream, args=("running",))
        running.start()
        wait_until(lambda: s.scheduler.num_running == 1, what="the first request to be admitted")
        waiting = threading.Thread(target=stream, args=("waiting",))
        waiting.start()
        wait_until(lambda: s.scheduler.num_waiting == 1, what="the second request to queue")
        with pytest.raises(openai.RateLimitError) as busy:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert busy.value.response.headers["retry-after"] == "1"

        # SIGTERM's path: stop admitting, let both finish, then stop.
        assert s.app.state.lifecycle.drain_threadsafe(on_done=lambda: setattr(s.server, "should_exit", True))
        wait_until(lambda: not s.scheduler.is_accepting, what="the drain to begin")
        health = httpx.get(s.base_url + "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
        gate.set()
        running.join(60)
        waiting.join(60)
        s.thread.join(30)
        assert not s.thread.is_alive()  # the drain ended the server
    for name in ("running", "waiting"):
        assert results[name][-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in results[name][-2]


def test_drain_timeout_aborts_running_requests(pair):
    """Steps are held from the start until the drain (timeout 0) has asked for the abort: the request cannot
    finish first, however fast the machine is."""
    target, draft = pair
    with running_server(target, draft, max_model_len=MAX_LEN, max_batch_size=1, pool_size=1,
                        shutdown_timeout=0) as s:
        gate = threading.Event()
        s.engine.step = gated(s.engine.step, gate)
        body = {"prompt": [5, 6, 7], "max_tokens": MAX_LEN - 4, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.v1 + "/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            wait_until(lambda: s.scheduler.num_running == 1, what="the request to be admitted")
            s.app.state.lifecycle.drain_threadsafe(on_done=lambda: None)
            # shutdown(0) stops admitting, then queues the abort (which the worker may already have taken, if it
            # was still prefilling: then the request is aborted already)
            sch = s.scheduler
            wait_until(lambda: not sch.is_accepting and (not sch._inbox.empty() or sch.num_running == 0),
                       what="the drain's abort")
            gate.set()
            rest = [line for line in r.iter_lines() if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"abort"' in rest[-2]
        assert s.engine.allocator.num_used == 0

"""OpenAI's sampling-side fields over HTTP, through the official `openai` client, with speculation on (k = 3) and a
draft that rarely agrees, so the tokens come from verifies, corrections and bonuses: logprobs (the completions API's
`logprobs: n`, the chat API's `logprobs: true` / `top_logprobs: n`, echo's prompt logprobs as lm-eval asks for them),
streamed and not, against the target's own log-probabilities (one Hugging Face forward over the prompt and the
output the server returned); logit_bias; the presence, frequency and repetition penalties."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

# test_server.py's tiny llama pair and server (k = 3), this module's own instances (module scope)
from tests.server.test_server import pair, srv  # noqa: F401

ATOL = 1e-4


@pytest.fixture(scope="module")
def ref_logprobs(pair):
    """prompt, output ids -> log_softmax of the target's logits at each output position ([len(output), V])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()

    def ref(prompt: list[int], output: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]

    return ref


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


PROMPTS = [[11, 57, 203, 9, 140], [77, 31, 250, 18, 66, 90, 12]]


def _text_of(tok, token_id: int) -> str:
    return tok.decode([token_id])


def _check_top(tok, ref_row: torch.Tensor, pairs, n: int) -> None:
    """pairs: (token text, logprob) of the n alternatives: the n largest values, each the value of a token with
    that text (tiny tokenizers decode many ids to the same text)."""
    values = [v for _, v in pairs]
    assert len(pairs) == n
    assert values == sorted(values, reverse=True)
    best = ref_row.topk(n).values.tolist()
    assert all(abs(a - b) < ATOL for a, b in zip(values, best))
    for text, v in pairs:
        ids = torch.nonzero((ref_row - v).abs() < ATOL).flatten().tolist()
        assert any(_text_of(tok, i) == text for i in ids), (text, v)


def test_completions_logprobs(srv, client, ref_logprobs):
    tok = srv.engine.tokenizer
    r = client.completions.create(model=srv.model_name, prompt=PROMPTS, max_tokens=10, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    for prompt, choice in zip(PROMPTS, sorted(r.choices, key=lambda c: c.index)):
        ids, lp = choice.token_ids, choice.logprobs
        assert len(ids) == 10
        ref = ref_logprobs(prompt, ids)
        assert lp.tokens == [_text_of(tok, t) for t in ids]
        assert all(abs(a - ref[j, t].item()) < ATOL for j, (a, t) in enumerate(zip(lp.token_logprobs, ids)))
        assert all(abs(a - ref[j].max().item()) < ATOL for j, a in enumerate(lp.token_logprobs))  # greedy
        offsets = [0]
        for text in lp.tokens[:-1]:
            offsets.append(offsets[-1] + len(text))
        assert lp.text_offset == offsets
        for j, top in enumerate(lp.top_logprobs):
            assert lp.tokens[j] in top  # the chosen token is always there (vLLM)
            # keyed by text: ids that decode alike (tiny tokenizers: many to U+FFFD) share the more likely's entry
            assert len(top) <= 4
            assert abs(max(top.values()) - ref[j].max().item()) < ATOL
            for text, v in top.items():
                same_text = [i for i in range(ref.shape[1]) if _text_of(tok, i) == text]
                assert abs(v - max(ref[j, i].item() for i in same_text)) < ATOL, (text, v)


def test_completions_stream_logprobs_equal_non_stream(srv, client):
    kw = dict(model=srv.model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0.8, seed=5, logprobs=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    ids = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert ids == whole.token_ids
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in lps for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in lps for o in lp.text_offset] == whole.logprobs.text_offset
    got = [v for lp in lps for v in lp.token_logprobs]
    assert all(abs(a - b) < ATOL for a, b in zip(got, whole.logprobs.token_logprobs, strict=True))


def test_chat_logprobs_streamed_and_not(srv, client, ref_logprobs):
    tok = srv.engine.tokenizer
    messages = [{"role": "user", "content": "hello there"}]
    kw = dict(model=srv.model_name, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids) == r.usage.completion_tokens == 8
    ref = ref_logprobs(choice.prompt_token_ids, choice.token_ids)
    for j, (entry, t) in enumerate(zip(content, choice.token_ids)):
        assert entry.token == _text_of(tok, t)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - ref[j, t].item()) < ATOL
        _check_top(tok, ref[j], [(e.token, e.logprob) for e in entry.top_logprobs], 4)
        assert all(e.bytes == list(e.token.encode("utf-8")) for e in entry.top_logprobs)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < ATOL for a, b in zip(streamed, content))


def test_logprobs_are_null_unless_asked_for(srv):
    r = httpx.post(srv.v1 + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}, timeout=60).json()
    assert "logprobs" in r["choices"][0] and r["choices"][0]["logprobs"] is None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["logprobs"] is None
    # logprobs: 0 is the chosen token alone
    r = httpx.post(srv.v1 + "/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "logprobs": 0},
                   timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=60).json()
    assert [e["top_logprobs"] for e in r["choices"][0]["logprobs"]["content"]] == [[], []]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400s_naming_the_field(srv, path, body, param):
    r = httpx.post(srv.v1 + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert srv.wait_idle()


def _score(client, srv, prompts, n=1, stream=False):
    """lm-evaluation-harness's loglikelihood request (its `local-completions` model): token-id prompts, echo,
    logprobs 1, max_tokens 1, greedy; returns the choices in prompt order (streamed: rebuilt from the chunks)."""
    kw = dict(model=srv.model_name, prompt=prompts, max_tokens=1, temperature=0, logprobs=n, echo=True,
              extra_body={"ignore_eos": True})
    if not stream:
        return sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    by: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got = by.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                          "text_offset": []})
            got["text"] += c.text
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    got[key] += getattr(c.logprobs, key)
    return [by[i] for i in sorted(by)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(srv, client, ref_logprobs, stream):
    """Prompt tokens first (the first with None), each with the target's log-probability given the tokens before
    it, then the generated token: lm-eval's loglikelihood (the sum over the continuation's tokens) and is-greedy
    (each token's value the largest of its top_logprobs) read off it, the same streamed or not."""
    tok = srv.engine.tokenizer
    contexts, continuations = [[11, 57, 203], [77, 31, 250, 18]], [[9, 140, 5], [66, 90]]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    choices = _score(client, srv, prompts, stream=stream)
    for prompt, ctx, cont, choice in zip(prompts, contexts, continuations, choices):
        lp = choice if stream else choice.logprobs.model_dump()
        text = choice["text"] if stream else choice.text
        assert text.startswith(tok.decode(prompt))
        assert lp["tokens"][: len(prompt)] == [_text_of(tok, t) for t in prompt]
        assert len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        output = [next(i for i in range(tok.vocab_size) if _text_of(tok, i) == lp["tokens"][-1])]
        ref = ref_logprobs(prompt[:1], prompt[1:] + output)  # row j: the token at position j + 1
        for j, t in enumerate(prompt[1:]):
            assert abs(lp["token_logprobs"][j + 1] - ref[j, t].item()) < ATOL, j
        score = sum(lp["token_logprobs"][len(ctx): len(prompt)])
        assert abs(score - sum(ref[j - 1, prompt[j]].item() for j in range(len(ctx), len(prompt)))) < 1e-3
        greedy = all(v == max(top.values()) for v, top in zip(lp["token_logprobs"][len(ctx): len(prompt)],
                                                                lp["top_logprobs"][len(ctx): len(prompt)]))
        assert greedy == all(ref[j - 1].argmax().item() == prompt[j] for j in range(len(ctx), len(prompt)))
        offsets = [0]
        for t in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(t))
        assert lp["text_offset"] == offsets


def test_logit_bias_over_http(srv, client):
    """OpenAI's logit_bias (token ids as decimal strings, -100 to 100): a +100 token is the whole greedy output,
    a -100 one never appears, with speculation on; bad keys and values are 400s naming logit_bias."""
    kw = dict(model=srv.model_name, prompt=PROMPTS[1], max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].token_ids
    forced = client.completions.create(logit_bias={"123": 100}, **kw).choices[0].token_ids
    assert forced == [123] * 8
    banned = client.completions.create(logit_bias={str(plain[0]): -100}, **kw).choices[0].token_ids
    assert plain[0] not in banned
    chat = client.chat.completions.create(model=srv.model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logit_bias={"123": 100},
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    assert chat.choices[0].token_ids == [123] * 4
    for bias in ({"abc": 1}, {"-3": 1}, {str(srv.engine.vocab_size): 1}, {"5": 100.5}, {"5": 1, "05": 2}):
        r = httpx.post(srv.v1 + "/completions", json={"prompt": "a", "logit_bias": bias}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bias, r.text)


def test_penalties_over_http(srv, client, pair):
    """presence / frequency_penalty (OpenAI) and repetition_penalty (vLLM): greedy outputs equal a penalised greedy
    loop over the target alone; out-of-range values are 400s naming the field."""
    from transformers import AutoModelForCausalLM

    from tests.support.penalties import penalised

    model = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    kw = dict(model=srv.model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.3})
    got = client.completions.create(frequency_penalty=0.8, presence_penalty=0.4, **kw).choices[0].token_ids
    ids = list(PROMPTS[0])
    with torch.inference_mode():
        for _ in range(12):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(penalised(logits, ids, ids[len(PROMPTS[0]):], 1.3, 0.8, 0.4).argmax()))
    assert got == ids[len(PROMPTS[0]):]
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("repetition_penalty", 11)):
        r = httpx.post(srv.v1 + "/completions", json={"prompt": "a", field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert srv.wait_idle()

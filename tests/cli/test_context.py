"""Issue 12: a GPT-2-shaped pair (learned positions) runs on its own defaults, and its whole context is
usable: no length flag, prompts that end a few tokens before the limit, outputs identical to the target alone."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from exspec.cli.flags import settings_from_args
from exspec.cli.main import build_parser
from exspec.cli.main import main as cli_main
from tests.support.models import random_prompts
from tests.support.server_fixtures import serve_in_thread
from tests.support.tiny_models import build_pair

POSITIONS = 64  # the models' learned position limit
EOS = 2


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("gpt2-64"), "gpt2", positions=POSITIONS)


@pytest.fixture(scope="module")
def reference(gpt2_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_pair[0], dtype=torch.float32).eval()

    def ref(prompt: list[int], max_new: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                 eos_token_id=[EOS], pad_token_id=3)
        return out[0, len(prompt):].tolist()

    return ref


# Prompts from short to one token short of the limit; each may generate up to the limit.
LENGTHS = [5, 30, 55, 58, 60, 61, 62, 63]


def test_generate_with_no_length_flags_fills_the_context(gpt2_pair, reference, tmp_path, caplog):
    target, draft = gpt2_pair
    prompts = random_prompts(LENGTHS, seed=64)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    rc = cli_main(["generate", "--model", str(target), "--draft-model", str(draft), "--input", str(src),
                   "--output", str(dst), "--max-tokens", "100", "--num-speculative-tokens", "6",
                   "--max-batch-size", "8", "--no-progress"])  # one batch: near-limit rows beside k = 6 rows
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    for p, row in zip(prompts, rows):
        ref = reference(p, POSITIONS - len(p))
        assert row["token_ids"] == ref, f"prompt of {len(p)} tokens"
        if EOS not in ref:
            assert row["finish_reason"] == "length" and len(p) + len(ref) == POSITIONS
    # Every engine call succeeded (failure isolation would otherwise rerun rows alone and hide a crash).
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]


def test_serve_advertises_and_serves_the_models_own_limit(gpt2_pair, reference):
    from exspec.cli.serve import build_server

    target, draft = gpt2_pair
    args = build_parser("serve").parse_args(["serve", "--model", str(target), "--draft-model", str(draft),
                                             "--num-speculative-tokens", "4", "--max-batch-size", "2"])
    server = build_server(settings_from_args(args))
    with serve_in_thread(server.config.app) as (base, _, _):
        models = httpx.get(base + "/v1/models").json()["data"]
        assert models[0]["max_model_len"] == POSITIONS
        for prompt in random_prompts([57, 61, 63], seed=65):
            body = {"model": models[0]["id"], "prompt": prompt, "max_tokens": POSITIONS - len(prompt), "temperature": 0,
                    "return_token_ids": True}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference(prompt, POSITIONS - len(prompt))
        too_long = {"model": models[0]["id"], "prompt": random_prompts([POSITIONS], seed=66)[0], "max_tokens": 1}
        assert httpx.post(base + "/v1/completions", json=too_long, timeout=60).status_code == 400


def test_generate_chat_template_encodes_text_as_a_user_turn(tmp_path, reference, gpt2_pair):
    """`exspec generate --chat-template`: a text prompt goes through the tokenizer's chat template, as
    /v1/chat/completions does; the output is the target's greedy continuation of exactly those ids."""
    from transformers import AutoTokenizer

    target, draft = gpt2_pair
    tok = AutoTokenizer.from_pretrained(target)
    text = "the cat sat"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    assert ids != tok.encode(text)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": text}) + "\n")
    rc = cli_main(["generate", "--model", str(target), "--draft-model", str(draft), "--input", str(src),
                   "--output", str(dst), "--max-tokens", "8", "--chat-template", "--no-progress"])
    assert rc == 0
    assert json.loads(dst.read_text())["token_ids"] == reference(ids, 8)

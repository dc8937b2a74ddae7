"""A .gguf file (or a directory holding one) wherever a model goes on the command line: `exspec generate`,
`exspec serve` and `exspec bench` take it through --model / --draft-model and their EXSPEC_* variables, with
outputs token-identical to the Hugging Face directory it was written from."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from exspec.cli.main import main as cli_main
from tests.support.gguf_files import tiny_gguf
from tests.support.server_fixtures import serve_in_thread

PROMPTS = ["Hello world!", "Caf\u00e9 \u65e5\u672c\u8a9e \U0001f600", "The quick brown fox"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("EXSPEC_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("gguf-cli"))


def _generate(tmp_path, name: str, *model_args: str) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = cli_main(["generate", *model_args, "--input", str(src), "--output", str(dst), "--max-tokens", "24",
                   "--chat-template", "--max-model-len", "256", "--max-batch-size", "2", "--no-progress"])
    assert rc == 0
    return [json.loads(line) for line in dst.read_text().splitlines()]


def test_generate_on_a_gguf_equals_its_hf_directory(tiny, tmp_path, monkeypatch):
    hf, gguf = tiny
    ref = _generate(tmp_path, "hf", "--model", str(hf), "--draft-model", str(hf))
    assert len(ref) == len(PROMPTS) and any(len(r["token_ids"]) == 24 for r in ref)
    assert _generate(tmp_path, "file", "--model", str(gguf), "--draft-model", str(gguf)) == ref
    # the EXSPEC_* variables, and a directory holding the one .gguf
    monkeypatch.setenv("EXSPEC_MODEL", str(gguf.parent))
    monkeypatch.setenv("EXSPEC_DRAFT_MODEL", str(gguf))
    assert _generate(tmp_path, "env") == ref
    # converted once, into $EXSPEC_CACHE/gguf/<sha256>
    assert len([p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".")]) == 1


def test_serve_a_gguf_named_after_its_file(tiny, tmp_path):
    from exspec.cli.main import build_parser
    from exspec.cli.flags import settings_from_args
    from exspec.cli.serve import build_server

    hf, gguf = tiny
    ref = _generate(tmp_path, "hf", "--model", str(hf), "--draft-model", str(hf))
    settings = settings_from_args(build_parser("serve").parse_args(
        ["serve", "--model", str(gguf), "--draft-model", str(gguf), "--max-model-len", "256", "--max-batch-size", "2"]))
    app = build_server(settings).config.app
    assert app.state.model_name == "tiny-llama.F32"
    with serve_in_thread(app) as (base, _, _):
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama.F32", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 24,
            "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["token_ids"], choice["message"]["content"]) == (ref[1]["token_ids"], ref[1]["text"])


def test_bench_takes_a_gguf(tiny, tmp_path):
    hf, gguf = tiny
    out = tmp_path / "bench"
    rc = cli_main(["bench", "--model", str(gguf), "--mode", "forward", "--batch-sizes", "1", "--kv-lens", "8",
                   "--repeats", "1", "--no-warmup", "--no-progress", "--output", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and all(r["batch_size"] == 1 for r in rows)


def test_a_directory_with_several_gguf_files_is_refused(tiny, tmp_path, capsys):
    hf, gguf = tiny
    many = tmp_path / "many"
    many.mkdir()
    for name in ("one.gguf", "two.gguf"):
        shutil.copy(gguf, many / name)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    for command in (["serve"], ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o")]):
        assert cli_main([*command, "--model", str(many)]) == 2
        assert "holds 2 .gguf files (one.gguf, two.gguf) and no config.json" in capsys.readouterr().err

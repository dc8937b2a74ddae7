"""The built-in demo pair, built at `scale="test"` (tiny models, a few steps: seconds), fully offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from exspec.demo import DemoBuildError, build, measure, threads
from exspec.demo import EOS_ID, MARKER, build_demo_pair, cached_pair, default_demo_dir, ensure_demo_pair
from exspec.demo.tokenizer import chat_ids
from exspec.cli import main as cli


def cli_main(argv: list[str]) -> int:
    return cli.main(argv)


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path / "cache"))
    # Subcommands whose modules are not written yet would stop the parser from being built.
    present = {n: v for n, v in cli.COMMANDS.items() if importlib.util.find_spec(v[0]) is not None}
    monkeypatch.setattr(cli, "COMMANDS", present)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_demo_pair(tmp_path_factory.mktemp("demo") / "pair", seed=0, progress=False, scale="test")


def _greedy(model_dir: Path, text: str, n: int = 12) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([chat_ids(tok, text)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_default_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path / "x"))
    assert default_demo_dir() == tmp_path / "x"
    assert default_demo_dir("tiny") == tmp_path / "x" / "tiny"  # each pair its own place: one never replaces another
    monkeypatch.delenv("EXSPEC_CACHE")
    assert default_demo_dir() == Path.home() / ".cache" / "exspec" / "demo"
    assert default_demo_dir("smollm2") == default_demo_dir()


def test_pair_loads_with_auto_classes_and_chat_template(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = pair
    for d in pair:
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d)
        assert tok.chat_template
        assert tok.eos_token == "<|end|>" and tok.eos_token_id == EOS_ID
        assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
        assert model.config.vocab_size >= len(tok)
        text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False)
        assert text == "<|user|>Hi there<|end|><|assistant|>"
        ids = chat_ids(tok, "Hi there")
        assert tok.decode(ids) == text
    assert AutoTokenizer.from_pretrained(target_dir).get_vocab() == AutoTokenizer.from_pretrained(draft_dir).get_vocab()
    t = AutoModelForCausalLM.from_pretrained(target_dir)
    d = AutoModelForCausalLM.from_pretrained(draft_dir)
    assert sum(p.numel() for p in t.parameters()) > sum(p.numel() for p in d.parameters())


def test_same_seed_same_weights_and_greedy_output(pair, tmp_path):
    again = build_demo_pair(tmp_path / "again", seed=0, progress=False, scale="test")
    for a, b in zip(pair, again):
        wa, wb = _weights(a), _weights(b)
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    out = _greedy(pair[0], "Explain the json module.")
    assert out == _greedy(pair[0], "Explain the json module.") == _greedy(again[0], "Explain the json module.")
    other = build_demo_pair(tmp_path / "other", seed=1, progress=False, scale="test")
    assert not torch.equal(_weights(pair[0])["lm_head.weight"], _weights(other[0])["lm_head.weight"])


def test_weights_do_not_depend_on_build_threads(pair, tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "build_threads", lambda limit: 2)
    two = build_demo_pair(tmp_path / "two", seed=0, progress=False, scale="test")
    assert json.loads((tmp_path / "two" / MARKER).read_text())["build_threads"] == 2
    for a, b in zip(pair, two):
        wa, wb = _weights(a), _weights(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_pair_runs_in_the_engine(pair):
    out = measure.measure_acceptance(*pair, num_prompts=2, max_tokens=6, k=3, batch_size=2)
    assert 1.0 <= out["mean_acceptance_length"] <= 4.0
    ag = measure.measure_agreement(*pair, num_prompts=2, max_tokens=6)
    assert 0.0 <= ag["agreement"] <= 1.0 and ag["positions"] > 0
    assert out["outputs"] == ag["continuations"]  # the engine reproduces the target's greedy output


def test_ensure_reuses_the_cache(monkeypatch):
    target, draft = ensure_demo_pair(progress=False, scale="test")
    assert target.parent == default_demo_dir("test")
    marker = default_demo_dir("test") / MARKER
    stamp = marker.stat().st_mtime_ns

    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a cached pair")

    monkeypatch.setattr(build, "_build_into", no_rebuild)
    assert ensure_demo_pair(progress=False, scale="test") == (target, draft)
    assert marker.stat().st_mtime_ns == stamp
    assert build.demo_target(progress=False, scale="test") == target  # the cached pair's target


def test_smollm2_target_alone_is_its_gguf_conversion_without_a_draft(smollm2, monkeypatch):
    """Served with n-gram lookup (the default without --model) the SmolLM2 demo needs no draft: with no pair built,
    `demo_target` is the GGUF file's cached conversion, and nothing is trained."""
    monkeypatch.setenv("EXSPEC_CACHE", str(smollm2.cache))  # the session's conversion, no pair in it
    monkeypatch.setattr(build, "_build_imitation_into", lambda *a, **k: pytest.fail("built the pair"))
    assert build.demo_target(progress=False) == smollm2.dir


def test_incomplete_cache_is_rebuilt(tmp_path):
    out = tmp_path / "pair"
    build_demo_pair(out, progress=False, scale="test")
    (out / MARKER).unlink()  # as if the build stopped before its last write
    assert cached_pair(out, scale="test") is None
    build_demo_pair(out, progress=False, scale="test")
    assert cached_pair(out, scale="test") is not None
    assert not list(out.glob(".build-*"))  # no temporary directory left behind
    assert cached_pair(out, scale="full") is None  # another scale or seed is not a cache hit
    assert cached_pair(out, seed=1, scale="test") is None


def test_foreign_directory_is_not_overwritten(tmp_path):
    out = tmp_path / "pair"
    (out / "target").mkdir(parents=True)
    (out / "target" / "mine.txt").write_text("keep me")
    with pytest.raises(DemoBuildError, match="not written by exspec"):
        build_demo_pair(out, progress=False, scale="test")
    assert (out / "target" / "mine.txt").read_text() == "keep me"


def test_cli_builds_then_reports_the_cache(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["demo-models", "--out", str(out), "--scale", "test", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"target: {out / 'target'}" in printed and f"draft:  {out / 'draft'}" in printed
    assert cli_main(["demo-models", "--out", str(out), "--scale", "test"]) == 0
    assert "cached demo pair" in capsys.readouterr().err


def test_cli_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli_main(["demo-models", "--out", str(blocker / "sub"), "--scale", "test", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "exspec demo-models: error:" in err and "cannot create the output directory" in err
    assert cli_main(["demo-models", "--out", str(tmp_path / "ok"), "--seed", "-1", "--scale", "test"]) == 2

"""`exspec demo-models --show`: where the target, draft and tokenizer are, and whether they are built,
without building anything (a tool needing a tokenizer path reads the `tokenizer:` line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exspec.cli import main as cli


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path / "cache"))


def _show(capsys, *argv: str) -> tuple[dict[str, str], str]:
    assert cli.main(["demo-models", "--show", "--scale", "test", *argv]) == 0
    captured = capsys.readouterr()
    fields = dict(line.split(":", 1) for line in captured.out.splitlines())
    return {k: v.strip() for k, v in fields.items()}, captured.err


def test_show_before_and_after_a_build(tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    out = tmp_path / "pair"
    fields, err = _show(capsys, "--out", str(out))
    assert fields == {"target": str(out / "target"), "draft": str(out / "draft"), "tokenizer": str(out / "target"),
                      "built": "no"}
    assert "exspec demo-models" in err
    assert not out.exists()  # --show builds nothing

    assert cli.main(["demo-models", "--out", str(out), "--scale", "test", "--quiet"]) == 0
    capsys.readouterr()
    fields, err = _show(capsys, "--out", str(out))
    assert fields["built"] == "yes" and err == ""
    tok = AutoTokenizer.from_pretrained(fields["tokenizer"])  # usable as is, e.g. guidellm --processor DIR
    assert tok.eos_token == "<|end|>" and tok.chat_template

    fields, err = _show(capsys, "--out", str(out), "--seed", "1")  # another seed is another pair
    assert fields["built"] == "no" and "seed 0" in err and "seed 1" in err

    # --demo / EXSPEC_DEMO pick the pair as for serve (Settings): another scale is another pair
    monkeypatch.setenv("EXSPEC_DEMO", "tiny")
    assert cli.main(["demo-models", "--show", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "scale 'test' is there" in err and "scale 'tiny'" in err
    assert cli.main(["demo-models", "--show", "--out", str(out), "--demo", "smollm2"]) == 0  # a flag wins
    assert "scale 'smollm2'" in capsys.readouterr().err
    monkeypatch.setenv("EXSPEC_DEMO", "huge")
    assert cli.main(["demo-models", "--show", "--out", str(out)]) == 2
    assert "--demo / EXSPEC_DEMO: demo must be one of smollm2, tiny, got 'huge'" in capsys.readouterr().err


def test_show_uses_the_default_cache_dir(tmp_path, capsys):
    fields, _ = _show(capsys)  # a pair other than the default one: its own folder, so neither replaces the other
    assert Path(fields["target"]) == tmp_path / "cache" / "test" / "target"
    assert fields["tokenizer"] == fields["target"]
    for argv, where in ((["--demo", "smollm2"], tmp_path / "cache"), (["--tiny"], tmp_path / "cache" / "tiny")):
        assert cli.main(["demo-models", "--show", *argv]) == 0
        out = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
        assert Path(out["target"].strip()) == where / "target" and Path(out["draft"].strip()) == where / "draft"


def test_show_with_force_is_refused(tmp_path, capsys):
    assert cli.main(["demo-models", "--show", "--force", "--out", str(tmp_path / "x")]) == 2
    assert "--show builds nothing" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_target_only_prepares_the_target_and_no_draft_where_one_is_trained(tmp_path, capsys):
    """`exspec demo-models --target-only` (the Docker images' build step): the target the demo serves by default.
    A pair whose target is trained here (the test scale, as tiny) is built whole; SmolLM2's target is only converted
    (tests/demo/test_demo_models.py, `demo_target`)."""
    out = tmp_path / "pair"
    assert cli.main(["demo-models", "--target-only", "--out", str(out), "--scale", "test", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"target: {out / 'target'}"
    assert cli.main(["demo-models", "--target-only", "--out", str(out), "--scale", "test", "--quiet"]) == 0  # cached
    assert capsys.readouterr().out.strip() == f"target: {out / 'target'}"
    assert cli.main(["demo-models", "--target-only", "--force", "--out", str(out), "--scale", "test"]) == 2
    assert "--target-only" in capsys.readouterr().err

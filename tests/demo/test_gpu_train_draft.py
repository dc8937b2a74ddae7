"""scripts/gpu_train_draft.py (the SmolLM2 draft trained on a GPU) end to end at tiny shapes on the CPU: a tiny
target stands in for SmolLM2; seconds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..support.tiny_models import build_pair

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_train_draft", ROOT / "scripts" / "gpu_train_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trains_both_variants_and_writes_their_weights_in_files_the_device_tool_brings_back(tmp_path, monkeypatch):
    target, _ = build_pair(tmp_path / "pair", "llama", draft_same=True)
    script = _script()
    monkeypatch.setattr(script, "SHARD_BYTES", 4096)  # tiny tensors: force the cuts a 25 MiB embedding needs
    out = tmp_path / "out"
    assert script.main(["--target", str(target), "--out", str(out), "--device", "cpu", "--prompts", "6",
                        "--samples", "1", "--new-tokens", "4", "--gen-batch", "4", "--steps", "4", "--warmup", "1",
                        "--batch-size", "4", "--evals", "2", "--tiny"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["train_prompts"] == 6 and result["train_tokens"] > 6  # greedy + one sampled continuation each
    assert result["train_sequences"] == 12
    assert result["heldout_positions"] > 0
    for variant in ("trained", "frozen"):
        curve = result[variant]["curve"]
        assert [c[0] for c in curve] == [2, 4] and all(0.0 <= c[3] <= 1.0 for c in curve)
        files = result[variant]["files"]
        assert files and all((out / f).stat().st_size <= 4096 + 1024 for f in files)  # header beside the limit
        tensors = {}
        for f in files:
            for k, v in load_file(out / f).items():
                tensors.setdefault(k, []).append(v)
        assert all(v[0].dtype == torch.bfloat16 for v in tensors.values())
        assert "lm_head.weight" not in tensors  # tied: never saved apart
        # trained: the embedding too, cut along its rows into several files; frozen: the layers only
        if variant == "trained":
            emb = torch.cat(tensors["model.embed_tokens.weight"])
            vocab = json.loads((target / "config.json").read_text())["vocab_size"]
            assert len(tensors["model.embed_tokens.weight"]) > 1 and emb.shape[0] == vocab
        else:
            assert "model.embed_tokens.weight" not in tensors
        assert any(".layers.0." in k for k in tensors)


def test_training_stops_at_its_budget_with_a_measured_point(tmp_path):
    target, _ = build_pair(tmp_path / "pair", "llama", draft_same=True)
    out = tmp_path / "out"
    assert _script().main(["--target", str(target), "--out", str(out), "--device", "cpu", "--prompts", "4",
                           "--samples", "0", "--new-tokens", "4", "--gen-batch", "4", "--steps", "50", "--warmup", "1",
                           "--batch-size", "2", "--evals", "10", "--variants", "frozen", "--train-budget-s", "0",
                           "--tiny"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert [c[0] for c in result["frozen"]["curve"]] == [1] and "trained" not in result  # stopped after step 1

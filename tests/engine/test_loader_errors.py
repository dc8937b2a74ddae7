"""`load_model_pair` fails with a `ModelLoadError` whose message names the problem, never with a raw
transformers traceback or, worse, a silently wrong model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tests.support import tiny_models

from exspec.engine import EngineConfig, ModelLoadError
from exspec.engine.loader import load_model_pair


def load(target, draft=None):
    return load_model_pair(EngineConfig(model=target, draft_model=draft))


def test_valid_pair_loads(models):
    target, draft = models.dirs("llama")
    pair = load(target, draft)
    assert pair.vocab_size == 320 and pair.eos_token_ids == (2,) and pair.name == "llama-target"


def test_path_that_does_not_exist(tmp_path, models):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match=r"target model path .*no-such-model.* does not exist"):
        load(missing)
    target, _ = models.dirs("llama")
    with pytest.raises(ModelLoadError, match=r"draft model path .*no-such-model.* does not exist"):
        load(target, missing)


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load(f)


def test_directory_without_config_json(tmp_path, models):
    target, _ = models.dirs("llama")
    empty = tmp_path / "weights-only"
    shutil.copytree(target, empty)
    (empty / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load(empty)


def test_config_json_that_is_not_json(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        load(d)


def test_unknown_model_type(tmp_path):
    d = tmp_path / "unknown"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ModelLoadError, match="cannot read its config"):
        load(d)


def _save_base_model(config, out_dir, tokenizer_dir):
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def test_bert_encoder_is_not_a_causal_lm(tmp_path, models):
    from transformers import BertConfig

    target, _ = models.dirs("llama")
    cfg = BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    bert = _save_base_model(cfg, tmp_path / "bert-encoder", target)
    with pytest.raises(ModelLoadError, match=r"bert-encoder.*BertModel.*not a causal LM"):
        load(bert)
    with pytest.raises(ModelLoadError, match=r"draft model .*bert-encoder.*not a causal LM"):
        load(target, bert)


def test_decoder_body_without_lm_head_is_not_a_causal_lm(tmp_path, models):
    """A Llama saved with AutoModel has no output head: loading it as a causal LM would invent a random
    one and generate garbage."""
    target, _ = models.dirs("llama")
    body = _save_base_model(tiny_models.make_config("llama", 320), tmp_path / "llama-body", target)
    with pytest.raises(ModelLoadError, match=r"LlamaModel.*not a causal LM"):
        load(body)


def test_draft_and_target_tokenizers_differ(tmp_path, models):
    target, draft = models.dirs("llama")
    other = tmp_path / "other-draft"
    shutil.copytree(draft, other)
    for f in other.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    tiny_models.build_tokenizer(other, vocab_size=300)
    with pytest.raises(ModelLoadError, match="draft and target tokenizers differ") as err:
        load(target, other)
    assert "300 vs 320 tokens" in str(err.value)

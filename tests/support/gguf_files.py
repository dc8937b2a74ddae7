"""GGUF files the tests write themselves (with the `gguf` package, as llama.cpp's converter does): a tiny
Llama's float32 weights and its byte-level BPE tokenizer (vocabulary, merges, special ids, chat template) as
GGUF metadata, so transformers' GGUF loader rebuilds the same model and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 320  # the tiny tokenizer's size: the model's rows, one per token


def build_tiny_llama(root: Path) -> Path:
    """root/hf: a tiny random Llama (tests/support/tiny_models.py's tokenizer and shape) whose config values all
    survive GGUF's float32 metadata (rms_norm_eps = 2**-20), so its GGUF converts back to the same model."""
    from transformers import AutoTokenizer

    from exspec.engine.random_model import random_causal_lm
    from tests.support import tiny_models

    tok_dir = root / "tok"
    tiny_models.build_tokenizer(tok_dir, VOCAB)
    cfg = tiny_models.make_config("llama", VOCAB, layers=2)
    cfg.rms_norm_eps = 2.0**-20
    torch.manual_seed(1)
    model = random_causal_lm(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # decisive greedy outputs, as tiny_models does
    out = root / "hf"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
    return out


def tiny_gguf(root: Path) -> tuple[Path, Path]:
    """(root/hf, root/gguf/tiny-llama.F32.gguf): the tiny Llama of build_tiny_llama and its GGUF, the only
    .gguf in its directory."""
    hf = build_tiny_llama(root)
    (root / "gguf").mkdir()
    return hf, write_llama_gguf(hf, root / "gguf" / "tiny-llama.F32.gguf")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves); transformers' GGUF loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, out: Path, *, architecture: str = "llama") -> Path:
    """Write the Llama in hf_dir (config, weights, tokenizer) as a float32 GGUF file at `out`.
    `architecture` other than "llama" writes the same tensors under another general.architecture (for errors)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]

    w = gguf.GGUFWriter(str(out), architecture)
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be 0..n-1"
    special = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values()}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for hf_name, tensor in state.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = tensor.to(torch.float32).numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        w.add_tensor(gguf_name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

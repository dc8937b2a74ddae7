"""Randomly initialised causal LMs of a given shape: the one builder behind the demo pair before training
(demo/train.py), the benchmark's synthetic pairs (bench/synthetic.py) and the tests' tiny models
(tests/support/tiny_models.py).

The weights come from torch's global RNG: seed it first (`torch.manual_seed`); the same seed, shape and
dtype give the same tensors. transformers is imported lazily.
"""

from __future__ import annotations

from typing import Any

import torch


def causal_lm_config(
    arch: str,
    vocab_size: int,
    *,
    layers: int,
    hidden: int,
    heads: int,
    positions: int,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    **extra: Any,
):
    """A transformers config of this shape: `arch` "llama" (or another of its family: "mistral", "qwen3", ...,
    which take the same fields) or "gpt2" (no `intermediate` / `kv_heads`: 4 x hidden, every head). `extra`
    goes to the config as given (special token ids, rope_theta, tie_word_embeddings, ...)."""
    from transformers import AutoConfig

    if arch == "gpt2":
        if intermediate is not None or kv_heads is not None:
            raise ValueError("gpt2 has no intermediate or kv_heads of its own")
        return AutoConfig.for_model(
            "gpt2", vocab_size=vocab_size, n_layer=layers, n_embd=hidden, n_head=heads, n_positions=positions, **extra
        )
    if intermediate is None or kv_heads is None:
        raise ValueError(f"{arch} needs intermediate and kv_heads")
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        **extra,
    )


def random_causal_lm(config, dtype: torch.dtype | None = None, attn_implementation: str | None = None):
    """The causal LM of `config`, initialised from torch's global RNG (in `dtype` from the start: an 8B model
    never exists in float32)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_config(config, **kwargs)

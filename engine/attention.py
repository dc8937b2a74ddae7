"""The edge between exspec and transformers: exspec's attention entry points, registered as `attn_implementation`s.

The engine owns its forward contract: a forward is `model.base_model(input_ids, position_ids, attention_mask,
use_cache=False, exspec_attention=AttentionCall(...))`. The model's own modules compute everything (embeddings,
learned or rotary positions, norms, MLPs, the Q/K/V projections); no transformers `Cache` is passed and nothing is
set on any object between forwards. The one keyword `exspec_attention` carries the forward's `AttentionCall` (the
model's `KVPools`, the `ForwardMeta`, the backend and its plan) down to every attention layer, where the registered
entry point below writes the layer's new K/V into the pools (`module.layer_idx`) and reads them back:

- `exspec_sdpa` (attn_implementation "sdpa" in EngineConfig): the call's backend (engine/backends/) reads the pools
  where they lie. Without a call (a plain forward over given K/V, e.g. scripts/bench_verify_ratio.py) it is PyTorch
  SDPA with native grouped-query attention under an explicit mask: transformers' own `sdpa` copies K/V once per
  layer and forward (`repeat_kv`) whenever a mask is passed to a grouped-query model, and exspec always passes one.
  On the CPU, `scaled_dot_product_attention(..., enable_gqa=True)` takes the mask directly: same numbers, 1.4x to
  2.4x less attention time on the demo pair's shapes. On CUDA the fallback is transformers' `sdpa`: there a masked
  GQA call falls back to the slow math kernel.
- `exspec_eager` (attn_implementation "eager"): each row's K/V gathered out of the pools, then the model family's
  own `eager_attention_forward` (its module's), under the runner's float mask.

Everything transformers-specific about attention lives here: which function the model calls (registration), the
keyword that reaches it, `module.layer_idx`, the model's own eager function.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from exspec.engine.backends import AttentionBackend
from exspec.engine.kv_cache import ForwardMeta, KVPools, gather_kv
from exspec.errors import ModelLoadError

NAME = "exspec_sdpa"
EAGER_NAME = "exspec_eager"


@dataclass(frozen=True)
class AttentionCall:
    """One forward's attention, built once and shared by every layer: where K/V are written and read (the pools
    through `meta`), and how they are read (`backend` with its `plan`; None: gathered for the eager function)."""

    pools: KVPools
    meta: ForwardMeta
    backend: AttentionBackend | None
    plan: Any


def _write(module: torch.nn.Module, call: AttentionCall, key: torch.Tensor, value: torch.Tensor):
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise ModelLoadError(f"{type(module).__name__} has no layer_idx: exspec cannot tell which layer's pools it writes")
    return call.pools.write(layer_idx, key, value, call.meta.slot_mapping)


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    key: torch.Tensor,  # [B, kv_heads, Q or kv_len, head_dim]: this forward's K/V (with a call), else all keys
    value: torch.Tensor,  # [B, kv_heads, Q or kv_len, head_dim]
    attention_mask: torch.Tensor | None,  # [B or 1, 1, Q, kv_len] bool, or None (plain causal)
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    exspec_attention: AttentionCall | None = None,  # set: write key/value into its pools, read through its backend
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([B, Q, heads, head_dim], None)
    if exspec_attention is not None:
        call = exspec_attention
        k_pool, v_pool = _write(module, call, key, value)  # [num_blocks + 1, block_size, kv_heads, head_dim]
        return call.backend.forward(query, k_pool, v_pool, call.plan, scaling), None
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and q_len > 1)
    if causal and kv_len > q_len:  # only a cache-less forward may take the is_causal shortcut
        raise ValueError("exspec_sdpa: a causal forward over a cache needs an explicit mask")
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def eager_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    key: torch.Tensor,  # [B, kv_heads, Q or kv_len, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [B or 1, 1, Q, kv_len] float (added to the scores)
    dropout: float = 0.0,
    scaling: float | None = None,
    exspec_attention: AttentionCall | None = None,
    **kwargs,
):
    """The model family's own eager attention (the `eager_attention_forward` of the module's modeling file) over
    each row's K/V gathered out of the pools."""
    if exspec_attention is not None:
        call = exspec_attention
        k_pool, v_pool = _write(module, call, key, value)
        key, value = gather_kv(k_pool, call.meta), gather_kv(v_pool, call.meta)  # [B, kv_heads, kv_len, head_dim]
    own = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        raise ModelLoadError(f"{type(module).__module__} has no eager_attention_forward: use attn_implementation sdpa")
    return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> str:
    """Make `exspec_sdpa` a valid `attn_implementation` (idempotent); returns its name."""
    AttentionInterface.register(NAME, gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def register_eager() -> str:
    """Make `exspec_eager` a valid `attn_implementation` (idempotent); returns its name."""
    AttentionInterface.register(EAGER_NAME, eager_forward)
    AttentionMaskInterface.register(EAGER_NAME, eager_mask)
    return EAGER_NAME


def attach(model: torch.nn.Module) -> str:
    """Make `model` call exspec's entry points (idempotent): `exspec_eager` for a model set to eager attention,
    `exspec_sdpa` for any other (sdpa, flash, ...: the engine's backend reads the pools). The loader loads models
    with them already; a model built elsewhere (a `ModelPair` handed to the engine) is switched here. Returns the
    name now in use."""
    current = model.config._attn_implementation
    if current in (NAME, EAGER_NAME):
        return current
    name = register_eager() if current == "eager" else register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - every transformers PreTrainedModel has it
        model.config._attn_implementation = name
    return name


"""Load a target/draft pair of Hugging Face causal LMs and their one shared tokenizer, with clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from exspec.engine.config import EngineConfig
from exspec.engine.gguf import model_name, resolve_model_path
from exspec.engine.packed_linear import prepack_linears
from exspec.errors import ModelLoadError


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    vocab_size: int  # logits are cut to this many ids: the vocabulary both models share
    eos_token_ids: tuple[int, ...]  # every EOS id the target declares (config, generation config, tokenizer)
    name: str  # the target directory's name (a GGUF target: its file's stem)


def _check_dir(path: Path, role: str) -> None:
    if not path.exists():
        raise ModelLoadError(f"{role} path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{role} path {str(path)!r} is not a directory")
    cfg = path / "config.json"
    if not cfg.exists():
        raise ModelLoadError(f"{role} directory {str(path)!r} holds no config.json: it is not a Hugging Face model")
    try:
        json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{role} config {str(cfg)!r} is not valid JSON: {e}") from e


def _load_model(path: Path, role: str, cfg: EngineConfig) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_dir(path, role)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises ValueError/OSError/KeyError for unknown model types
        raise ModelLoadError(f"{role} {str(path)!r}: cannot read its config ({type(e).__name__}: {e})") from e
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and not any(_is_causal_lm_class(a) for a in architectures):
        # e.g. an encoder or a decoder body saved with AutoModel: from_pretrained would invent a random head
        raise ModelLoadError(
            f"{role} {str(path)!r} is a {', '.join(architectures)} ({hf_config.model_type!r}), not a causal LM: "
            "it has no language-model head"
        )
    from exspec.engine.attention import register, register_eager

    # exspec's entry points (engine/attention.py): they write each layer's K/V into the engine's pools and read them
    attn = register() if cfg.attn_implementation == "sdpa" else register_eager()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=cfg.torch_dtype, attn_implementation=attn)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ModelLoadError(
                f"{role} {str(path)!r} is a {type(hf_config).__name__} ({hf_config.model_type!r}), not a causal LM"
            ) from e
        raise ModelLoadError(f"{role} {str(path)!r}: cannot load the model ({e})") from e
    except OSError as e:
        raise ModelLoadError(f"{role} {str(path)!r}: cannot load the weights ({e})") from e
    if getattr(model.config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{role} {str(path)!r} is an encoder-decoder model, not a decoder-only causal LM")
    model = model.to(cfg.device).eval()
    prepack_linears(model, cfg.gemm)  # oneDNN-prepacked weights for multi-row forwards on the CPU (engine/packed_linear.py)
    return model


def _is_causal_lm_class(name: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    return any(name == v or (isinstance(v, tuple) and name in v) for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _load_tokenizer(path: Path, role: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"{role} {str(path)!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from e


def _eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [model.config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
    if getattr(model, "generation_config", None) is not None:
        sources.append(model.generation_config.eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def _check_head(model: torch.nn.Module, vocab_size: int, role: str) -> None:
    """exspec runs `base_model` and applies the output embedding itself (to compute logits only where
    needed). Check once, on a few tokens, that this reproduces the model's own logits."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 6, device=device)[None, :] % vocab_size
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[..., :vocab_size].float()
        hidden = model.base_model(input_ids=ids).last_hidden_state
        ours = model.get_output_embeddings()(hidden)[..., :vocab_size].float()
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            ours = torch.tanh(ours / cap) * cap
    if not torch.allclose(ref, ours, rtol=1e-3, atol=1e-3 * max(1.0, ref.abs().max().item())):
        raise ModelLoadError(
            f"{role}: its output head transforms logits in a way exspec does not reproduce "
            f"({type(model).__name__} is not supported yet)"
        )


def load_model_pair(cfg: EngineConfig) -> ModelPair:
    # exspec.cli.settings.resolve() has already turned a .gguf into its converted directory; a caller that builds an
    # EngineConfig itself may still hand one here (a directory passes through unchanged)
    target_dir = resolve_model_path(Path(cfg.model))
    target = _load_model(target_dir, "target model", cfg)
    tokenizer = _load_tokenizer(target_dir, "target model")
    vocab = len(tokenizer)
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if target_vocab < vocab:
        raise ModelLoadError(
            f"target model has {target_vocab} output logits but its tokenizer has {vocab} tokens"
        )
    draft = None
    shared_vocab = target_vocab
    if cfg.draft_model is not None:
        draft_dir = resolve_model_path(Path(cfg.draft_model))
        draft = _load_model(draft_dir, "draft model", cfg)
        draft_tok = _load_tokenizer(draft_dir, "draft model")
        if draft_tok.get_vocab() != tokenizer.get_vocab():
            raise ModelLoadError(
                "draft and target tokenizers differ (different vocabularies): speculative decoding needs one "
                f"shared tokenizer ({len(draft_tok)} vs {vocab} tokens)"
            )
        draft_vocab = draft.get_output_embeddings().weight.shape[0]
        if draft_vocab < vocab:
            raise ModelLoadError(f"draft model has {draft_vocab} output logits but the tokenizer has {vocab} tokens")
        # Padded embedding matrices (rows past the tokenizer) may differ in size: ids the shared
        # tokenizer cannot produce are cut from both models' logits. If the target's own matrix is
        # larger than the draft's, its extra ids are cut too: they decode to nothing.
        shared_vocab = min(target_vocab, draft_vocab)
        _check_head(draft, shared_vocab, "draft model")
    _check_head(target, shared_vocab, "target model")
    return ModelPair(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        vocab_size=shared_vocab,
        eos_token_ids=_eos_ids(target, tokenizer),
        name=model_name(target_dir),
    )

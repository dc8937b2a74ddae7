"""Tiny random models and a tokenizer trained offline, saved to a directory and loaded back through
`from_pretrained`, exactly as a user's model is."""

from __future__ import annotations

from pathlib import Path

import torch

from exspec.demo.tokenizer import train_bpe
from exspec.engine.random_model import causal_lm_config, random_causal_lm

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them. "
    "A small draft model proposes k tokens; the target model checks all of them in one forward pass. "
    "Hello world! Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600 emoji. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: , . ; : ! ? ( ) [ ] { } - + = * /. "
)


def build_tokenizer(out_dir: Path, vocab_size: int = 320):
    fast = train_bpe([_CORPUS] * 20, vocab_size, SPECIALS, eos_token="</s>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out_dir)
    return fast


def make_config(
    arch: str, vocab_size: int, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, positions: int = 1024
):
    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    if arch == "gpt2":
        # Untied: a tied head scaled below would make the model repeat its last input token.
        return causal_lm_config("gpt2", vocab_size, layers=layers, hidden=hidden, heads=heads, positions=positions,
                                **common)
    extra = {"sliding_window": None} if arch == "mistral" else {"head_dim": hidden // heads} if arch == "qwen3" else {}
    return causal_lm_config(arch, vocab_size, layers=layers, hidden=hidden, intermediate=hidden * 2, heads=heads,
                            kv_heads=kv_heads, positions=positions, **common, **extra)


def build_model(arch: str, out_dir: Path, tokenizer_dir: Path, seed: int, vocab_size: int, **kw) -> Path:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    model = random_causal_lm(make_config(arch, vocab_size, **kw))
    # Random init is near-uniform: sharpen the head so greedy outputs are decisive and EOS appears.
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(8.0)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def build_pair(
    root: Path, arch: str, draft_same: bool = False, draft_vocab_pad: int = 0, vocab_size: int = 320, **kw
):
    """Write root/tok, root/<arch>-target and root/<arch>-draft; return (target_dir, draft_dir)."""
    tok_dir = root / "tok"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(tok_dir, vocab_size)
    target = build_model(arch, root / f"{arch}-target", tok_dir, seed=1, vocab_size=vocab_size, layers=2, **kw)
    if draft_same:
        return target, target
    draft = build_model(
        arch, root / f"{arch}-draft", tok_dir, seed=2, vocab_size=vocab_size + draft_vocab_pad, layers=1, **kw
    )
    return target, draft


def main(argv=None) -> None:
    """Write a random pair for benchmarks: python tests/tiny_models.py OUT [--arch llama] [--layers 4 ...]."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--arch", default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--draft-hidden", type=int, default=64)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=2000)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(a.out / "tok", a.vocab)
    build_model(a.arch, a.out / "target", a.out / "tok", seed=1, vocab_size=a.vocab, layers=a.layers, hidden=a.hidden)
    build_model(
        a.arch, a.out / "draft", a.out / "tok", seed=2, vocab_size=a.vocab, layers=a.draft_layers, hidden=a.draft_hidden
    )
    print(a.out / "target", a.out / "draft")


if __name__ == "__main__":
    main()

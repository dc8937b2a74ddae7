"""The demo pair's tokenizer: byte-level BPE trained on the corpus, with the chat specials and template."""

from __future__ import annotations

from exspec.demo.recipe import DemoBuildError

SPECIALS = ["<unk>", "<s>", "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
UNK_ID, BOS_ID, PAD_ID, EOS_ID = 0, 1, 2, 3  # ids of the first four specials
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_bpe(texts, vocab_size: int, specials: list[str], *, eos_token: str, chat_template: str,
              model_max_length: int | None = None):
    """A byte-level BPE trained on `texts` with `specials` first (ids 0, 1, ...), wrapped as a transformers fast
    tokenizer with <s> / eos_token / <unk> / <pad> and a chat template. The one trainer behind the demo pair, the
    synthetic benchmark pairs and the tests' tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=eos_token, unk_token="<unk>", pad_token="<pad>", **extra
    )
    fast.chat_template = chat_template
    return fast


def train_tokenizer(texts: list[str], vocab_size: int):
    """The demo pair's tokenizer: byte-level BPE with the chat specials."""
    fast = train_bpe(texts, vocab_size, SPECIALS, eos_token="<|end|>", chat_template=CHAT_TEMPLATE, model_max_length=4096)
    ids = fast.convert_tokens_to_ids(SPECIALS[:4])
    if ids != [UNK_ID, BOS_ID, PAD_ID, EOS_ID]:
        raise DemoBuildError(f"unexpected special token ids {ids}")
    return fast


def encode_corpus(tokenizer, texts: list[str]):
    """All texts' token ids, concatenated in order: [N] long tensor."""
    import torch

    enc = tokenizer.backend_tokenizer.encode_batch(texts)
    return torch.tensor([t for e in enc for t in e.ids], dtype=torch.long)  # [N]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn in the chat template, with the assistant's generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)

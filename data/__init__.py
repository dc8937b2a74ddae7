"""`exspec.data`: the bundled question sets (package data, see README.md here) and prompt sources shared by
`exspec bench`, the load test and the demo-pair builder: SpecBench, MT-Bench (`turns[0]`) and random.

Kept free of torch and transformers: a tokenizer is passed in by the caller when token ids are needed.
`exspec.data.reference` holds the greedy reference file format shared by the load test and `exspec bench`.
"""

from __future__ import annotations

import json
import random
from importlib import resources

from exspec.errors import DatasetError

DATASETS = {  # name -> file shipped in this package
    "specbench": "spec_bench_questions.jsonl",
    "mtbench": "mt_bench_questions.jsonl",
}
# Words for the random dataset when no tokenizer is given: plain ASCII, so any tokenizer can encode them.
_WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have not but all "
    "model token draft target batch step cache speculative decoding verify accept length time server"
).split()


def read_rows(name: str) -> list[dict]:
    """Every row of a bundled dataset, in file order."""
    if name not in DATASETS:
        raise DatasetError(f"dataset must be one of {sorted(DATASETS)} here, got {name!r}")
    path = resources.files(__name__).joinpath(DATASETS[name])
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read {str(path)!r}: {e}") from e


def all_questions(name: str) -> list[str]:
    """`turns[0]` of every question of a bundled dataset, in file order."""
    rows = read_rows(name)
    path = DATASETS[name]
    questions = [r["turns"][0] for r in rows if r.get("turns")]
    if not questions:
        raise DatasetError(f"{str(path)!r} holds no questions")
    return questions


def load_questions(name: str, num_prompts: int) -> list[str]:
    """`turns[0]` of `num_prompts` questions of a bundled dataset, evenly spaced over the file (so a small
    sample still covers every category), repeated in order if more are asked for than the file holds."""
    if num_prompts < 1:
        raise DatasetError(f"the number of prompts must be >= 1, got {num_prompts}")
    questions = all_questions(name)
    if num_prompts <= len(questions):
        return evenly_spaced(questions, num_prompts)
    return [questions[i % len(questions)] for i in range(num_prompts)]


def evenly_spaced(items: list, count: int) -> list:
    """`count` items evenly spaced over the list (all of them, in order, if it holds fewer)."""
    n = len(items)
    return list(items) if count >= n else [items[i * n // count] for i in range(count)]


def encode_prompts(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids of each text: as a single user turn through the tokenizer's chat template, or encoded plain
    (with the tokenizer's special tokens, as `exspec generate` and the server's /v1/completions do)."""
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise DatasetError("--chat-template asked for, but the tokenizer has no chat template")
    out = []
    for text in texts:
        if chat_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            out.append(list(tokenizer.encode(rendered, add_special_tokens=False)))
        else:
            out.append(list(tokenizer.encode(text)))
    return out


CALIBRATION_PROMPT_TOKENS = 256  # calibration prompts are the questions no longer than this


def calibration_prompts(tokenizer, rows: int, max_model_len: int) -> list[list[int]]:
    """What a speculation policy calibrates on before serving (`exspec serve`; `exspec bench` for its `exspec`
    method, as served): the first `rows` SpecBench questions of at most CALIBRATION_PROMPT_TOKENS tokens and half of
    max_model_len (the rest is room for the steps), in the chat template when the tokenizer has one (fewer if
    fewer fit)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    limit = min(CALIBRATION_PROMPT_TOKENS, max_model_len // 2)
    out: list[list[int]] = []
    for question in all_questions("specbench"):
        if len(out) == rows:
            break
        ids = encode_prompts(tokenizer, [question], chat)[0]
        if 0 < len(ids) <= limit:
            out.append(ids)
    return out


def random_prompts(num_prompts: int, input_len: int, seed: int, vocab_size: int | None = None) -> list:
    """Random prompts of `input_len` tokens (token-id lists, ids in [16, vocab_size), when the vocabulary is
    known) or of `input_len` words (text) otherwise."""
    if num_prompts < 1 or input_len < 1:
        raise DatasetError(f"random prompts need num_prompts >= 1 and input_len >= 1, got {num_prompts}, {input_len}")
    rng = random.Random(seed)
    if vocab_size is not None:
        lo = min(16, vocab_size - 1)
        return [[rng.randrange(lo, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num_prompts)]

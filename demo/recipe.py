"""What decides the demo pair's weights besides the seed and the corpus: model shapes and training recipes."""

from __future__ import annotations

from dataclasses import dataclass

from exspec.errors import DemoBuildError

FORMAT_VERSION = 4  # bump when anything that changes the weights changes: older caches are rebuilt, never reused


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # hidden size
    layers: int  # decoder layers
    intermediate: int  # SwiGLU width
    heads: int  # attention heads (head_dim = hidden // heads)
    kv_heads: int  # key/value heads (grouped-query attention)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that decides the pair's weights, besides the seed and the corpus."""

    vocab_size: int  # BPE vocabulary, specials included
    target: ModelShape
    draft: ModelShape
    seq_len: int  # training window in tokens
    batch_size: int  # windows per step
    steps: int  # optimizer steps (target and draft step together)
    lr: float  # peak AdamW learning rate of both models; linear warm-up, cosine decay to lr / 10
    warmup: int  # warm-up steps
    corpus_chars: int  # the corpus is cut to about this many characters
    distill_prompts: int  # prompts the target continues for the draft's second phase
    distill_new_tokens: int  # tokens the target generates per prompt (greedy for half, sampled for half)
    distill_steps: int  # draft-only steps on those continuations
    threads: int  # torch intra-op threads at most while building (fewer when the cores are busy; see threads.py)


RECIPES = {
    # The toy pair (`exspec demo-models --tiny`, `--demo tiny`): both models trained here from nothing.
    "tiny": DemoRecipe(
        vocab_size=2048,
        target=ModelShape(hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2),
        draft=ModelShape(hidden=128, layers=1, intermediate=384, heads=2, kv_heads=1),
        seq_len=128,
        batch_size=8,
        steps=480,
        lr=3e-3,
        warmup=30,
        corpus_chars=1_200_000,
        distill_prompts=192,
        distill_new_tokens=64,
        distill_steps=400,
        threads=2,
    ),
    # Seconds, for tests: same code path, tiny models.
    "test": DemoRecipe(
        vocab_size=384,
        target=ModelShape(hidden=32, layers=2, intermediate=64, heads=2, kv_heads=1),
        draft=ModelShape(hidden=16, layers=1, intermediate=32, heads=1, kv_heads=1),
        seq_len=64,
        batch_size=4,
        steps=8,
        lr=3e-3,
        warmup=2,
        corpus_chars=40_000,
        distill_prompts=4,
        distill_new_tokens=8,
        distill_steps=3,
        threads=1,
    ),
}


@dataclass(frozen=True)
class ImitationRecipe:
    """The real pair: a pretrained target (SmolLM2-135M-Instruct) and a draft distilled here to imitate it
    (demo/imitate.py). Everything that decides the draft's weights besides the seed and the target."""

    draft: ModelShape  # the draft's shape (vocabulary, tokens and RoPE: the target's)
    train_prompts: int  # held-in chat prompts the target continues (SpecBench first turns, then docs questions)
    new_tokens: int  # greedy tokens the target writes per training prompt
    heldout_prompts: int  # held-out prompts (measure.py's SpecBench questions) for the recorded agreement
    heldout_new_tokens: int  # greedy tokens per held-out prompt
    topk: int  # teacher log-probabilities kept per generated position
    generate_batch: int  # prompts per target generate() call
    steps: int  # draft AdamW steps
    batch_size: int  # sequences per step
    lr: float  # peak learning rate (linear warm-up, cosine decay to lr / 10)
    warmup: int  # warm-up steps
    threads: int  # torch intra-op threads at most (fewer when the cores are busy; see threads.py)


DEFAULT_DEMO = "smollm2"  # what `exspec demo-models` and `exspec serve` without --model build (--demo)
DEFAULT_SCALE = DEFAULT_DEMO
IMITATION_RECIPES = {
    "smollm2": ImitationRecipe(
        draft=ModelShape(hidden=256, layers=2, intermediate=768, heads=4, kv_heads=4),
        train_prompts=128,
        new_tokens=96,
        heldout_prompts=16,
        heldout_new_tokens=48,
        topk=32,
        generate_batch=32,
        steps=240,
        batch_size=8,
        lr=2e-3,
        warmup=10,
        threads=2,
    ),
}
SCALES = (*IMITATION_RECIPES, *RECIPES)
# Where a demo pair's drafts come from when the user does not say (--speculative-method): SmolLM2's trained draft agrees
# with it on 10% of held-out tokens and does not pay on a CPU (`auto` runs k = 0), while n-gram lookup in its own
# tokens proposes the right token at 36% of them and decodes 1.22x faster at B = 1 (docs/BENCHMARKS.md section 5,
# session 37). The others: their draft model.
DEMO_SPECULATIVE_METHOD = {"smollm2": "ngram"}
DEMO_PAIRS = ("smollm2", "tiny")  # the scales a user may pick (--demo); "test" is for the tests


def recipe_for(scale: str) -> DemoRecipe | ImitationRecipe:
    """The recipe of `scale`, or DemoBuildError naming the allowed scales."""
    if scale in IMITATION_RECIPES:
        return IMITATION_RECIPES[scale]
    if scale not in RECIPES:
        raise DemoBuildError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    return RECIPES[scale]

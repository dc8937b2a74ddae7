"""Tiny model pairs for the tests, and the reference they are compared with.

Tiny random model pairs are built offline with `tiny_models.py` (once per session, lazily, into
`tmp_path_factory` directories) and loaded back through `from_pretrained`, exactly as a user's model is.
`Models.reference` is what every greedy equivalence test compares against: the target model alone,
`generate(do_sample=False)` at batch 1 in fp32.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch

from exspec.engine import EngineConfig, ModelPair, SpecEngine
from exspec.engine.loader import load_model_pair
from tests.support import tiny_models

torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CI machine

ARCHS = ("llama", "qwen3", "mistral", "gpt2")
# EXSPEC_TEST_COMPILE=1: every engine a test builds through `Models` runs with EngineConfig.compile (the draft's and
# the verify's forwards compiled at static shapes), and every compile-on equivalence case runs (tests/engine/conftest.py).
TEST_COMPILE = os.environ.get("EXSPEC_TEST_COMPILE", "") not in ("", "0")
VOCAB = 320  # tiny_models' default vocabulary
EOS = 2  # "</s>": eos_token_id of every tiny model


class RolledHead(torch.nn.Module):
    """An output head whose logits are the wrapped head's, rolled by one id: its argmax is always the
    wrapped model's argmax + 1, so a draft built on the target's own body never agrees with the target."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.inner = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.roll(self.inner(hidden), shifts=1, dims=-1)


def _patched_make_config(make_config, variant: str):
    """tiny_models ties GPT-2's head to its input embedding and then scales the head by 8: the model then
    just repeats its last input token, which makes every GPT-2 equivalence test trivially true. Untie it.
    The "window" variant gives the models an 8-token sliding window."""

    def make(arch, *args, **kwargs):
        cfg = make_config(arch, *args, **kwargs)
        if arch == "gpt2":
            cfg.tie_word_embeddings = False
        if variant == "window":
            cfg.sliding_window = 8
        return cfg

    return make


class Models:
    """Model pairs built once per session; loaded pairs and greedy references cached."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[tuple[str, str], tuple[Path, Path]] = {}
        self._pairs: dict[tuple[str, str], ModelPair] = {}
        self._ref_models: dict[tuple[str, str], torch.nn.Module] = {}
        self._refs: dict[tuple, tuple[int, list[int]]] = {}  # key -> (max_new_tokens run, output)
        self._eos: dict[tuple, list[list[int]]] = {}
        self.compile = TEST_COMPILE  # EngineConfig.compile of the engines built here (tests/engine/conftest.py sets it)

    # ------------------------------------------------------------------ building and loading

    def dirs(self, arch: str, variant: str = "draft") -> tuple[Path, Path]:
        """(target_dir, draft_dir). variant: "draft" (a different, 1-layer random draft), "same" (the
        draft is the target), "pad" (like "draft" with 16 padded rows in the draft's embedding matrices),
        "window" (like "draft", both models with an 8-token sliding window: a different target)."""
        key = (arch, variant)
        if key not in self._dirs:
            root = self.root / variant
            options = {"draft": {}, "same": {"draft_same": True}, "pad": {"draft_vocab_pad": 16}, "window": {}}
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(tiny_models, "make_config", _patched_make_config(tiny_models.make_config, variant))
                self._dirs[key] = tiny_models.build_pair(root, arch, **options[variant])
        return self._dirs[key]

    def config(self, arch: str, variant: str = "draft", **overrides) -> EngineConfig:
        target, draft = self.dirs(arch, variant)
        fields = dict(max_num_seqs=16, max_model_len=320, max_num_speculative_tokens=8, compile=self.compile)
        fields.update(overrides)
        return EngineConfig(model=target, draft_model=draft, **fields)

    def pair(self, arch: str, variant: str = "draft") -> ModelPair:
        """The loaded pair (through `load_model_pair`), shared by every engine of the session: the engine
        keeps its KV state in its own pools, never in the modules."""
        key = (arch, variant)
        if key not in self._pairs:
            if variant == "noisy":
                base = self.pair(arch)
                self._pairs[key] = _with_draft(base, _noisy_copy(base.target, scale=0.15, seed=5))
            elif variant == "disagree":
                base = self.pair(arch)
                draft = copy.deepcopy(base.target)
                draft.lm_head = RolledHead(draft.lm_head)
                self._pairs[key] = _with_draft(base, draft)
            else:
                self._pairs[key] = load_model_pair(self.config(arch, variant))
        return self._pairs[key]

    def engine(self, arch: str, variant: str = "draft", **overrides) -> SpecEngine:
        """A fresh engine (fresh pools and slots) over the session's loaded pair. variant also accepts
        "noisy" (draft = the target with perturbed weights: partial acceptance) and "disagree" (draft = the
        target with its head rolled by one id: never accepted)."""
        dir_variant = variant if variant in ("draft", "same", "pad", "window") else "draft"
        return SpecEngine(self.config(arch, dir_variant, **overrides), pair=self.pair(arch, variant))

    # ------------------------------------------------------------------ the reference

    def reference(
        self,
        arch: str,
        prompt: Seq[int],
        max_new_tokens: int,
        eos_token_ids: Seq[int] = (EOS,),
        min_new_tokens: int = 0,
        target: str = "draft",
    ) -> list[int]:
        """The target alone: `generate(do_sample=False)` at batch 1, fp32. Generated ids only. target: the
        `dirs` variant whose target model to use (all but "window" share one target)."""
        # Greedy output for n tokens is the first n of a longer run: one cached run serves every length.
        target = "window" if target == "window" else "draft"
        key = (arch, tuple(prompt), tuple(eos_token_ids), min_new_tokens, target)
        done, tokens = self._refs.get(key, (0, []))
        if done < max_new_tokens and len(tokens) == done:  # not long enough, and did not stop early
            done = max(max_new_tokens, 24)
            model = self._ref_model(arch, target)
            ids = torch.tensor([list(prompt)])
            extra = {"min_new_tokens": min_new_tokens} if min_new_tokens else {}
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=done,
                    eos_token_id=list(eos_token_ids),
                    pad_token_id=3,
                    **extra,
                )
            tokens = out[0, len(prompt) :].tolist()
            self._refs[key] = (done, tokens)
        return tokens[:max_new_tokens]

    def eos_prompts(self, arch: str, count: int = 2, max_new_tokens: int = 40) -> list[list[int]]:
        """Prompts whose reference output ends with EOS before max_new_tokens. Random models rarely emit
        EOS, so candidates are screened with a cheap batched greedy loop first, then confirmed with
        `reference`."""
        key = (arch, count, max_new_tokens)
        if key not in self._eos:
            model = self._ref_model(arch)
            found: list[list[int]] = []
            for length, seed in ((6, 11), (13, 12), (4, 13), (9, 14)):
                ids = torch.tensor(random_prompts([length] * 128, seed=seed))  # [128, length]
                with torch.inference_mode():
                    for _ in range(max_new_tokens - 1):
                        logits = model(ids, attention_mask=torch.ones_like(ids)).logits
                        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
                for row in ids:
                    gen = row[length:].tolist()
                    if EOS in gen:
                        prompt = row[:length].tolist()
                        ref = self.reference(arch, prompt, max_new_tokens)
                        if ref[-1] == EOS and len(ref) < max_new_tokens:
                            found.append(prompt)
                    if len(found) == count:
                        break
                if len(found) == count:
                    break
            assert len(found) == count, f"{arch}: no prompt found whose greedy output hits EOS"
            self._eos[key] = found
        return [list(p) for p in self._eos[key]]

    def _ref_model(self, arch: str, variant: str = "draft") -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if (arch, variant) not in self._ref_models:
            target_dir, _ = self.dirs(arch, variant)
            model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
            self._ref_models[arch, variant] = model
        return self._ref_models[arch, variant]


def _with_draft(base: ModelPair, draft: torch.nn.Module) -> ModelPair:
    return ModelPair(
        target=base.target,
        draft=draft.eval(),
        tokenizer=base.tokenizer,
        vocab_size=base.vocab_size,
        eos_token_ids=base.eos_token_ids,
        name=base.name,
    )


def _noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The model with gaussian noise (scale x each tensor's std) on every weight: a draft that agrees with
    the target often but not always."""
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return noisy


def random_prompts(lengths: Seq[int], seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """Prompts of the given lengths, ids drawn from [4, vocab) (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]

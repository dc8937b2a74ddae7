"""Greedy output equivalence: compare outputs with the target's own, and tell near-ties from real divergences.

A divergence is the first position where an output's token ids differ from the reference's (the target
alone, greedy). It is a *near-tie* when the reference's top-1 and top-2 logits at that position (the target
run on prompt + reference prefix, in the run's dtype) differ by less than `NEAR_TIE_EPS[dtype]`: batched
kernels reduce in another order, and that can flip an argmax so close. Any other divergence is *real*.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# fp32 keeps ~1e-6 relative error through a forward; bf16/fp16 keep 8/11 bits of mantissa.
NEAR_TIE_EPS = {"float32": 1e-3, "fp32": 1e-3, "bfloat16": 0.05, "bf16": 0.05, "float16": 0.05, "fp16": 0.05}


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts); None when identical."""
    if output == reference:
        return None
    return next((j for j, (a, r) in enumerate(zip(output, reference)) if a != r), min(len(output), len(reference)))


def classify_divergences(outputs: list[list[int]], references: list[list[int]],
                         gap: Callable[[int, list[int]], float], eps: float) -> list[dict]:
    """One {prompt, position, gap, kind} per output that differs from its reference. `gap(i, prefix)` is the
    reference's top-2 logit gap after prompt i + prefix; kind is "near-tie" (gap < eps) or "real"."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, references)):
        j = first_divergence(out, ref)
        if j is None:
            continue
        g = gap(i, ref[:j]) if j < len(ref) else None
        found.append({"prompt": i, "position": j, "gap": g, "kind": "near-tie" if g is not None and g < eps else "real"})
    return found


def top2_gap(model, token_ids: list[int], vocab_size: int) -> float:
    """Top-1 minus top-2 next-token logit of a Hugging Face causal LM after token_ids (one forward, no cache)."""
    import torch

    with torch.inference_mode():
        device = next(model.parameters()).device
        ids = torch.tensor([token_ids], device=device)  # [1, L]
        logits = model(input_ids=ids).logits[0, -1, :vocab_size].float()  # [V]
        top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


class TargetReference:
    """The target alone, greedy, at batch 1, through our engine with k = 0: what every greedy output of a
    speculative server must reproduce token for token."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        from exspec.engine import EngineConfig, load_model_pair

        self.model_dir = Path(model_dir)
        self.device, self.dtype = device, dtype
        self.pair = load_model_pair(EngineConfig(model=self.model_dir, device=device, dtype=dtype))
        self.tokenizer = self.pair.tokenizer

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        from exspec.engine import EngineConfig, SamplingParams, SpecEngine
        from exspec.scheduler import SchedulerConfig, generate_offline

        engine = SpecEngine(
            EngineConfig(model=self.model_dir, device=self.device, dtype=self.dtype, max_num_seqs=1,
                         max_model_len=max(len(p) for p in prompts) + max_tokens + 1, max_num_speculative_tokens=0),
            pair=self.pair,
        )
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)] * len(prompts)
        results, _ = generate_offline(engine, prompts, params,
                                      SchedulerConfig(max_batch_size=1, pool_size=1, max_waiting=10**9,
                                                      num_speculative_tokens=0))
        return [r.token_ids for r in results]

    def compare(self, prompts: list[list[int]], outputs: list[list[int]], references: list[list[int]]) -> list[dict]:
        eps = NEAR_TIE_EPS[self.dtype]
        return classify_divergences(
            outputs, references, lambda i, prefix: top2_gap(self.pair.target, prompts[i] + prefix, self.pair.vocab_size), eps
        )

"""Greedy output equivalence: compare outputs with the target's own, and tell near-ties from real divergences.

A divergence is the first position where an output's token ids differ from the reference's (the target
alone, greedy). It is a *near-tie* when the reference's top-1 and top-2 logits at that position (the target
run on prompt + reference prefix, in the run's dtype) differ by less than `NEAR_TIE_EPS[dtype]`, or by at most two
units in the last place of the top-1 logit in that dtype (`is_near_tie`): batched kernels reduce in another order,
and that can flip an argmax so close. Any other divergence is *real*. The second rule matters in bf16, whose logits
above 8 are 0.0625 apart: on an H100 (docs/BENCHMARKS.md section 0) every divergence 0.05 called real, Hugging Face's
own `generate` of the target alone included, sat at a gap of exactly 0.0625.
"""

from __future__ import annotations

from collections.abc import Callable

# The rule itself lives beside the reference file's check (the load test applies it too); re-exported, one definition.
from exspec.data.reference import (  # noqa: F401
    NEAR_TIE_EPS,
    NEAR_TIE_ULPS,
    SIGNIFICAND_BITS,
    first_divergence,
    is_near_tie,
    ulp,
)


def classify_divergences(outputs: list[list[int]], references: list[list[int]],
                         top2: Callable[[int, list[int]], tuple[float, float]], dtype: str) -> list[dict]:
    """One {prompt, position, gap, top1, kind} per output that differs from its reference. `top2(i, prefix)` is the
    reference's top-1 and top-2 logits after prompt i + prefix; kind is "near-tie" (`is_near_tie` in the run's
    dtype) or "real"."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, references)):
        j = first_divergence(out, ref)
        if j is None:
            continue
        first, g, kind = None, None, "real"
        if j < len(ref):
            first, second = top2(i, ref[:j])
            g = first - second
            kind = "near-tie" if is_near_tie(g, first, dtype) else "real"
        found.append({"prompt": i, "position": j, "gap": g, "top1": first, "kind": kind})
    return found


def top2_logits(model, token_ids: list[int], vocab_size: int) -> tuple[float, float]:
    """The top-1 and top-2 next-token logits of a Hugging Face causal LM after token_ids (one forward, no cache)."""
    import torch

    with torch.inference_mode():
        device = next(model.parameters()).device
        ids = torch.tensor([token_ids], device=device)  # [1, L]
        logits = model(input_ids=ids).logits[0, -1, :vocab_size].float()  # [V]
        top = torch.topk(logits, 2).values
    return float(top[0]), float(top[1])


def top2_gaps_along(model, prompt: list[int], output: list[int], vocab_size: int) -> tuple[list[float], list[float]]:
    """The top-2 logit gap and the top-1 logit before each generated token: gap[j] is top-1 minus top-2 of
    `top2_logits(model, prompt + output[:j])`, top1[j] its top-1, all from one causal forward over
    prompt + output[:-1] (no cache). Two lists of [len(output)] floats: (gaps, top1)."""
    import torch

    if not output:
        return [], []
    with torch.inference_mode():
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + output[:-1]], device=device)  # [1, P + n - 1]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :, :vocab_size].float()  # [n, V]
        top = torch.topk(logits, 2, dim=-1).values  # [n, 2]
        return (top[:, 0] - top[:, 1]).tolist(), top[:, 0].tolist()

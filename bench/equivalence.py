"""Greedy output equivalence: compare outputs with the target's own, and tell near-ties from real divergences.

A divergence is the first position where an output's token ids differ from the reference's (the target
alone, greedy). It is a *near-tie* when the reference's top-1 and top-2 logits at that position (the target
run on prompt + reference prefix, in the run's dtype) differ by less than `NEAR_TIE_EPS[dtype]`: batched
kernels reduce in another order, and that can flip an argmax so close. Any other divergence is *real*.
"""

from __future__ import annotations

from collections.abc import Callable

from exspec.data.reference import first_divergence  # noqa: F401 (re-exported: one definition)

# fp32 keeps ~1e-6 relative error through a forward; bf16/fp16 keep 8/11 bits of mantissa.
NEAR_TIE_EPS = {"float32": 1e-3, "fp32": 1e-3, "bfloat16": 0.05, "bf16": 0.05, "float16": 0.05, "fp16": 0.05}


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


def top2_gaps_along(model, prompt: list[int], output: list[int], vocab_size: int) -> list[float]:
    """The top-2 logit gap before each generated token: gap[j] is `top2_gap(model, prompt + output[:j])`,
    all from one causal forward over prompt + output[:-1] (no cache). [len(output)] floats."""
    import torch

    if not output:
        return []
    with torch.inference_mode():
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + output[:-1]], device=device)  # [1, P + n - 1]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :, :vocab_size].float()  # [n, V]
        top = torch.topk(logits, 2, dim=-1).values  # [n, 2]
        return (top[:, 0] - top[:, 1]).tolist()

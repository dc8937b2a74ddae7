"""The penalties as a reference applies them to the target alone: one position's logits at a time."""

from __future__ import annotations

import torch


def penalised(logits: torch.Tensor, context: list[int], output: list[int], rep: float, freq: float,
              pres: float) -> torch.Tensor:
    """vLLM's penalties on one position's logits [V]: repetition over the whole context (prompt and output), then
    frequency and presence over the output."""
    vocab = logits.shape[-1]
    seen = torch.bincount(torch.tensor(context, dtype=torch.long), minlength=vocab)[:vocab] > 0
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab].float()
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0).float()

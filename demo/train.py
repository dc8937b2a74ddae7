"""Phase 1 of the demo pair: the target learns next-token prediction while the draft, on the same batches,
is distilled from the target's detached distribution (KL(target || draft))."""

from __future__ import annotations

import math
import sys

from exspec.demo.recipe import DemoBuildError, DemoRecipe, ModelShape
from exspec.demo.threads import ThreadTuner
from exspec.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID
from exspec.engine.random_model import causal_lm_config, random_causal_lm


def new_llama(shape: ModelShape, vocab_size: int):
    """A randomly initialised Llama causal LM of this shape (from torch's global RNG)."""
    from transformers import GenerationConfig

    cfg = causal_lm_config(
        "llama", vocab_size, layers=shape.layers, hidden=shape.hidden, intermediate=shape.intermediate,
        heads=shape.heads, kv_heads=shape.kv_heads, positions=4096, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = random_causal_lm(cfg, attn_implementation="sdpa")
    # Saved with the model: greedy by default, and no sampling defaults (top_k=50, ...) that greedy calls
    # would then have to override.
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    return model


def lr_at(step: int, r: DemoRecipe) -> float:
    """Linear warm-up to r.lr over r.warmup steps, then cosine decay to r.lr / 10 at r.steps."""
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def train_pair(tokens, r: DemoRecipe, seed: int, progress: bool, threads: ThreadTuner | None = None):
    """Train the target on next-token prediction and, on the same batches, distil the draft from the
    target's detached distribution. tokens: [N] long. Returns (target, draft, log of (loss, kl) per step)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    target = new_llama(r.target, r.vocab_size)
    draft = new_llama(r.draft, r.vocab_size)
    opts = [
        torch.optim.AdamW(m.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1) for m in (target, draft)
    ]
    gen = torch.Generator().manual_seed(seed)
    span = r.seq_len + 1
    if tokens.numel() <= span:
        raise DemoBuildError(f"the corpus has {tokens.numel()} tokens: too few for windows of {span}")
    windows = torch.arange(span)  # [T + 1]
    log = []
    threads = threads or ThreadTuner(1)
    bar = tqdm(range(r.steps), desc="training target and draft", unit="step", disable=not progress, file=sys.stderr)
    for step in bar:
        with threads.step():
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, r)
            starts = torch.randint(0, tokens.numel() - span, (r.batch_size,), generator=gen)  # [B]
            batch = tokens[starts[:, None] + windows]  # [B, T + 1]
            inp, labels = batch[:, :-1], batch[:, 1:]  # [B, T] each
            t_logits = target(input_ids=inp).logits  # [B, T, V]
            t_loss = F.cross_entropy(t_logits.flatten(0, 1), labels.flatten())
            d_logits = draft(input_ids=inp).logits  # [B, T, V]
            teacher = F.log_softmax(t_logits.detach().flatten(0, 1), dim=-1)  # [B * T, V]
            student = F.log_softmax(d_logits.flatten(0, 1), dim=-1)  # [B * T, V]
            d_loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
            (t_loss + d_loss).backward()
            for m, opt in zip((target, draft), opts):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            log.append((round(t_loss.item(), 4), round(d_loss.item(), 4)))
        bar.set_postfix(target_loss=f"{log[-1][0]:.3f}", draft_kl=f"{log[-1][1]:.3f}", threads=threads.current)
    bar.close()
    return target.eval(), draft.eval(), log

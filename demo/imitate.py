"""The real demo pair's draft: a narrow Llama trained on this CPU to imitate a pretrained target.

The recipe (each part small, each tested on tiny shapes in tests/demo/test_demo_imitate.py):
1. `new_draft`: the target's vocabulary, tokens and RoPE, but `DraftShape`'s width and depth, with a tied head;
   its embedding starts as the target's projected onto the target embedding's top principal directions
   (`project_embedding`), so the draft knows the tokens before it has seen a single step.
2. `target_continuations`: the target continues held-in chat prompts greedily, in batches, and each generated
   position keeps the target's top-`topk` log-probabilities: the teacher's distribution, from the forwards that
   generation runs anyway (no second pass).
3. `distill_draft`: the draft reads prompt + continuation and learns, at every continuation position, the
   teacher's distribution renormalised over its top-k (cross-entropy against soft targets = KL up to a constant).
4. `agreement`: how often the draft's top-1 equals the target's greedy token along held-out continuations.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftShape:
    hidden: int  # draft width (the tied head costs vocab x hidden multiply-adds per token)
    layers: int  # decoder layers
    intermediate: int  # SwiGLU width
    heads: int  # attention heads (head_dim = hidden // heads)
    kv_heads: int  # key/value heads


@dataclass(frozen=True)
class ContinuationSet:
    """Prompts with the target's greedy continuations and its top-k log-probabilities at each generated token."""

    sequences: list  # per prompt: list[int], prompt + continuation (no padding)
    prompt_lens: list  # per prompt: prompt length P (the continuation is sequences[i][P:])
    top_ids: list  # per prompt: LongTensor [n_i, topk], the target's top-k ids before generated token j
    top_logprobs: list  # per prompt: FloatTensor [n_i, topk], their log-probabilities (full-vocabulary softmax)


def project_embedding(embedding, width: int):
    """embedding [V, H] -> [V, width]: coordinates on its top `width` principal directions (uncentred SVD),
    scaled so that rows keep the original's mean norm. Deterministic (no RNG)."""
    import torch

    emb = embedding.detach().float()  # [V, H]
    _, _, vh = torch.linalg.svd(emb, full_matrices=False)  # vh: [H, H], rows = directions, largest first
    proj = emb @ vh[:width].T  # [V, width]
    # SVD's sign per direction is arbitrary: fix it (largest entry positive), so the result is reproducible.
    signs = torch.sign(proj.gather(0, proj.abs().argmax(0, keepdim=True)))  # [1, width]
    proj = proj * signs
    return proj * (emb.norm(dim=1).mean() / proj.norm(dim=1).mean())


def new_draft(target_config, shape: DraftShape, target_embedding=None):
    """A Llama draft sharing the target's vocabulary, special tokens, positions and RoPE, of `shape`, with a
    tied head; its embedding is `project_embedding(target_embedding)` when given (else random, from torch's
    global RNG, like the layers)."""
    import torch
    from exspec.engine.random_model import causal_lm_config, random_causal_lm

    tc = target_config
    cfg = causal_lm_config(
        "llama", tc.vocab_size, layers=shape.layers, hidden=shape.hidden, intermediate=shape.intermediate,
        heads=shape.heads, kv_heads=shape.kv_heads, positions=tc.max_position_embeddings,
        rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        rms_norm_eps=tc.rms_norm_eps, tie_word_embeddings=True, bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )
    draft = random_causal_lm(cfg)
    if target_embedding is not None:
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(project_embedding(target_embedding, shape.hidden))
    draft.tie_weights()
    return draft


def target_continuations(target, prompts: list[list[int]], new_tokens: int, eos_id: int, pad_id: int,
                         topk: int, batch_size: int, progress: bool, desc: str = "target continues prompts",
                         temperature: float = 0.0) -> ContinuationSet:
    """Greedy continuations of `prompts` (token ids) by the target, up to `new_tokens` each (ending at EOS
    when it writes one), with its top-k log-probabilities before each generated token. Batched by similar
    lengths (left padding); returned in the order of `prompts`, on the CPU wherever the target runs.
    temperature > 0: sampled continuations instead (torch's global RNG); the log-probabilities stay the
    target's own (its raw logits, before the temperature)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False})
    config = GenerationConfig(**sampling, max_new_tokens=new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
                              output_logits=True, return_dict_in_generate=True)
    device = next(target.parameters()).device
    n = len(prompts)
    seqs, tops, lps = [None] * n, [None] * n, [None] * n
    order = sorted(range(n), key=lambda i: (len(prompts[i]), i))
    bar = tqdm(total=n, desc=desc, unit="prompt", disable=not progress, file=sys.stderr)
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [b, P]
            mask = torch.zeros((len(rows), width), dtype=torch.long)  # [b, P]
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]):] = 1
            out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
            # The teacher's top-k one generated position at a time: out.logits is n tensors [b, V]; stacking
            # them and their log-softmax would hold two more copies of b x n x V floats (1.2 GB at 32 x 96).
            # Filled where the target runs and copied to the host once (not once a position: one sync a call).
            top_lp = torch.empty(len(rows), len(out.logits), topk, device=device)  # [b, n, topk]
            top_id = torch.empty(len(rows), len(out.logits), topk, dtype=torch.long, device=device)  # [b, n, topk]
            for j, step_logits in enumerate(out.logits):  # step_logits: [b, V]
                top_lp[:, j], top_id[:, j] = F.log_softmax(step_logits.float(), dim=-1).topk(topk, dim=-1)
            top_lp, top_id = top_lp.cpu(), top_id.cpu()
            gen = out.sequences[:, width:].cpu()  # [b, n]
            del out  # its logits go before the next call's arrive
            for r, i in enumerate(rows):
                cont = gen[r].tolist()
                if eos_id in cont:
                    cont = cont[: cont.index(eos_id) + 1]
                seqs[i] = list(prompts[i]) + cont
                tops[i], lps[i] = top_id[r, : len(cont)].clone(), top_lp[r, : len(cont)].clone()
            bar.update(len(rows))
    bar.close()
    return ContinuationSet(seqs, [len(p) for p in prompts], tops, lps)


def _batch(data: ContinuationSet, rows: list[int], pad_id: int):
    """Right-padded inputs and, at each continuation position, the teacher's top-k: (ids [b, T], mask [b, T],
    where [N, 2] (row, position whose output predicts a continuation token), top_ids [N, k], top_lp [N, k])."""
    import torch

    width = max(len(data.sequences[i]) for i in rows) - 1  # the last token is never an input that is scored
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [b, T]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [b, T]
    where, top_ids, top_lp = [], [], []
    for r, i in enumerate(rows):
        seq, p = data.sequences[i], data.prompt_lens[i]
        m = len(seq) - 1
        ids[r, :m] = torch.tensor(seq[:m])
        mask[r, :m] = 1
        n = len(seq) - p  # continuation tokens; position p - 1 + j predicts continuation token j
        pos = torch.arange(p - 1, p - 1 + n)  # [n]
        where.append(torch.stack([torch.full_like(pos, r), pos], dim=1))  # [n, 2]
        top_ids.append(data.top_ids[i])
        top_lp.append(data.top_logprobs[i])
    return ids, mask, torch.cat(where), torch.cat(top_ids), torch.cat(top_lp)


def soft_target_loss(draft, ids, mask, where, top_ids, top_lp):
    """Cross-entropy of the draft against the teacher's top-k distribution (renormalised) at `where`:
    KL(teacher_topk || draft) plus the teacher's entropy. The head runs only at the scored positions."""
    import torch

    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, T, H]
    h = hidden[where[:, 0], where[:, 1]]  # [N, H]
    logq = torch.log_softmax(draft.lm_head(h).float(), dim=-1)  # [N, V]
    p = torch.softmax(top_lp, dim=-1)  # [N, k] renormalised over the top-k
    return -(p * logq.gather(1, top_ids)).sum(-1).mean()


def distill_draft(draft, data: ContinuationSet, *, steps: int, batch_size: int, lr: float, warmup: int,
                  pad_id: int, seed: int, progress: bool, threads=None, after_step=None) -> list[float]:
    """Train the draft's parameters that require gradients for `steps` AdamW steps on random batches of `data`
    (soft_target_loss), on the draft's device; learning rate: linear warm-up, cosine decay to lr / 10.
    `after_step(step, loss)` (steps counted from 1), if given, runs after each step; True stops the training.
    Returns the loss per step."""
    import torch
    from tqdm.auto import tqdm

    from exspec.demo.threads import ThreadTuner

    gen = torch.Generator().manual_seed(seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    device = params[0].device
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    threads = threads or ThreadTuner(1)
    draft.train()
    log: list[float] = []
    bar = tqdm(range(steps), desc="distilling the draft", unit="step", disable=not progress, file=sys.stderr)
    n = len(data.sequences)
    for step in bar:
        with threads.step():
            t = (step - warmup) / max(1, steps - warmup)
            rate = lr * (step + 1) / warmup if step < warmup else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))
            for g in opt.param_groups:
                g["lr"] = rate
            rows = torch.randint(0, n, (min(batch_size, n),), generator=gen).tolist()
            loss = soft_target_loss(draft, *(t.to(device) for t in _batch(data, rows, pad_id)))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            log.append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{log[-1]:.3f}", threads=threads.current)
        if after_step is not None and after_step(step + 1, log[-1]):
            break
    bar.close()
    draft.eval()
    return log


def agreement(draft, data: ContinuationSet, batch_size: int = 8, pad_id: int = 0) -> float:
    """Fraction of continuation positions where the draft's top-1 equals the token the target chose (run on the
    draft's device)."""
    import torch

    agree = total = 0
    device = next(draft.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(data.sequences), batch_size):
            rows = list(range(start, min(start + batch_size, len(data.sequences))))
            ids, mask, where, top_ids, _ = (t.to(device) for t in _batch(data, rows, pad_id))
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, T, H]
            guess = draft.lm_head(hidden[where[:, 0], where[:, 1]]).argmax(-1)  # [N]
            agree += (guess == top_ids[:, 0]).sum().item()
            total += guess.numel()
    return agree / max(total, 1)

"""Phase 2 of the demo pair: the target continues held-in prompts, and the draft is distilled on those
continuations, so it learns to follow what the target itself writes (what speculative decoding asks of it)."""

from __future__ import annotations

import sys

from exspec.demo.recipe import DemoRecipe
from exspec.demo.threads import ThreadTuner
from exspec.demo.tokenizer import EOS_ID, PAD_ID

GENERATE_BATCH = 48  # prompts per generate() call: few calls, little padding (prompts are sorted by length)


def continue_prompts(target, tokenizer, texts: list[str], new_tokens: int, progress: bool) -> list[list[int]]:
    """Each prompt followed by the target's continuation of up to `new_tokens` tokens (ending at EOS when the
    target writes it): greedy for even-numbered prompts, sampled at temperature 1 (no top-k/top-p) for odd
    ones, from torch's global RNG. Returned in the order of `texts`, without padding."""
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    common = dict(max_new_tokens=new_tokens, pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    modes = {
        # Greedy takes no sampling flags at all: transformers warns about any it would ignore.
        False: GenerationConfig(do_sample=False, **common),
        True: GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **common),
    }
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    out: list[list[int]] = [[] for _ in texts]
    bar = tqdm(total=len(texts), desc="target continues prompts", unit="prompt", disable=not progress, file=sys.stderr)
    with torch.inference_mode():
        for sample, config in modes.items():
            # Similar lengths side by side: each batch is left-padded to its longest prompt only.
            order = sorted(range(int(sample), len(texts), 2), key=lambda i: (lengths[i], i))
            for start in range(0, len(order), GENERATE_BATCH):
                rows = order[start : start + GENERATE_BATCH]
                enc = tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True, padding_side="left")
                ids = target.generate(**enc, generation_config=config)  # [b, P + n]
                for i, row in zip(rows, ids.tolist()):
                    out[i] = [t for t in row if t != PAD_ID]
                bar.update(len(rows))
    bar.close()
    return out


def distill_draft(target, draft, sequences: list[list[int]], r: DemoRecipe, seed: int, progress: bool,
                  threads: ThreadTuner | None = None) -> float:
    """Train the draft for r.distill_steps on random windows of the concatenated sequences, to match the
    target's distribution at every position (KL(target || draft)). Returns the last KL."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)  # [N]
    span = min(r.seq_len + 1, tokens.numel() - 1)
    windows = torch.arange(span)  # [T + 1]
    opt = torch.optim.AdamW(draft.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 3)
    threads = threads or ThreadTuner(1)
    draft.train()
    kl = float("nan")
    bar = tqdm(range(r.distill_steps), desc="distilling the draft", unit="step", disable=not progress, file=sys.stderr)
    for step in bar:
        with threads.step():
            for g in opt.param_groups:  # linear decay from lr to lr / 10
                g["lr"] = r.lr * (1 - 0.9 * step / max(1, r.distill_steps - 1))
            starts = torch.randint(0, tokens.numel() - span, (r.batch_size,), generator=gen)  # [B]
            inp = tokens[starts[:, None] + windows][:, :-1]  # [B, T]
            with torch.no_grad():
                teacher = F.log_softmax(target(input_ids=inp).logits.flatten(0, 1), dim=-1)  # [B * T, V]
            student = F.log_softmax(draft(input_ids=inp).logits.flatten(0, 1), dim=-1)  # [B * T, V]
            loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            kl = round(loss.item(), 4)
        bar.set_postfix(draft_kl=f"{kl:.3f}", threads=threads.current)
    bar.close()
    draft.eval()
    return kl

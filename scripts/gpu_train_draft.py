"""Train the SmolLM2 demo pair's draft at a scale this CPU cannot reach: on a GPU, for issue 21 (NOT YET RUN ON A GPU).

On 2 CPU cores the build's draft sees 10.5 k tokens of the target's answers and agrees with it on about 10% of
held-out tokens; more steps, other text, a frequent-token head or a frozen embedding did not move it (docs/
BENCHMARKS.md section 5): the target's own answers are the limit, 117 tokens/s here. A GPU writes them thousands of
times faster. This script, one process:

1. the target: `--target DIR` (a Hugging Face directory) or `--gguf FILE` (SmolLM2's Q4_1 file, converted by
   engine/gguf.py); float32 (the draft imitates the float32 target's greedy choices, as the engine runs it here);
2. held-out: the build's 16 held-out SpecBench prompts, greedy (`demo.corpus.imitation_prompts`, the same split);
3. training data: `--prompts` held-in prompts (SpecBench first turns, then stdlib docs questions), each continued
   greedily once and `--samples` more times sampled at `--temperature` (diversity; no round starts after
   `--gen-budget-s`), keeping the target's top-k
   log-probabilities at every generated token (`demo.imitate.target_continuations`);
4. one draft per `--variants` entry (`trained`: the build's recipe, its embedding trained; `frozen`: the embedding
   stays the projection of the target's, so only the layers, 1.7 M parameters for the build's shape, need shipping),
   `--steps` AdamW steps of `--batch-size` sequences by the build's own `demo.imitate.distill_draft`, within
   `--train-budget-s` each; held-out top-1 agreement (`demo.imitate.agreement`) at each of `--evals`;
5. into `--out`: `result.json` (agreement curves, tokens, seconds), and per variant the draft's weights in bfloat16
   (`frozen`: its non-embedding tensors only), files under 15 MiB (the device tool brings back 16 MiB a file).

Smoke-tested on the CPU at tiny shapes (tests/demo/test_gpu_train_draft.py); the planned GPU calls are in
docs/GPU.md ("The SmolLM2 draft on a GPU").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from exspec.demo.corpus import imitation_prompts
from exspec.demo.imitate import ContinuationSet, DraftShape, agreement, distill_draft, new_draft, target_continuations
from exspec.demo.recipe import IMITATION_RECIPES
from exspec.demo.tokenizer import chat_ids

VARIANTS = ("trained", "frozen")
SHARD_BYTES = 15 << 20


def _merge(sets: list[ContinuationSet]) -> ContinuationSet:
    return ContinuationSet(*(sum((getattr(s, f) for s in sets), []) for f in
                             ("sequences", "prompt_lens", "top_ids", "top_logprobs")))


def train(variant: str, target, data: ContinuationSet, heldout: ContinuationSet, a, pad: int, log) -> tuple:
    """One draft of the build's shape, trained by the build's `distill_draft` on the GPU: (draft, curve [(step,
    seconds, loss, held-out agreement)] at each of --evals, and where --train-budget-s stopped it)."""
    s = IMITATION_RECIPES["smollm2"].draft if not a.tiny else a.tiny_shape
    torch.manual_seed(a.seed)
    draft = new_draft(target.config, DraftShape(s.hidden, s.layers, s.intermediate, s.heads, s.kv_heads),
                      target.model.embed_tokens.weight.detach().float().cpu()).to(a.device)
    if variant == "frozen":
        draft.model.embed_tokens.weight.requires_grad_(False)
    evals, curve, t0 = set(a.evals) | {a.steps}, [], time.perf_counter()

    def after_step(step: int, loss: float) -> bool:
        over = time.perf_counter() - t0 > a.train_budget_s
        if step in evals or over:
            draft.eval()
            held = round(agreement(draft, heldout, 16, pad), 4)
            curve.append((step, round(time.perf_counter() - t0, 1), loss, held))
            draft.train()
            log(f"{variant}: step {step} {curve[-1][1]} s loss {loss} held-out agreement {curve[-1][3]:.1%}"
                + (f" (stopped at its budget, {a.train_budget_s} s)" if over else ""))
        return over

    distill_draft(draft, data, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, pad_id=pad,
                  seed=a.seed, progress=False, after_step=after_step)
    return draft, curve


def save(variant: str, draft, out: Path) -> list[str]:
    """The draft's tensors in bfloat16, in files under SHARD_BYTES (`frozen`: without the embedding)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in draft.state_dict().items()
               if not (variant == "frozen" and k in ("model.embed_tokens.weight", "lm_head.weight"))}
    if variant == "trained":
        tensors.pop("lm_head.weight", None)  # tied to the embedding
    names, shard, size = [], {}, 0
    for k, v in tensors.items():
        b = v.numel() * v.element_size()
        if b > SHARD_BYTES:  # one tensor over the limit (the embedding): cut along its rows
            rows = SHARD_BYTES // (v[0].numel() * v.element_size())
            for i, part in enumerate(v.split(rows)):
                names.append(f"{variant}-{k}-part{i}.safetensors")
                save_file({k: part.contiguous()}, out / names[-1])
            continue
        if size + b > SHARD_BYTES and shard:
            names.append(f"{variant}-{len(names)}.safetensors")
            save_file(shard, out / names[-1])
            shard, size = {}, 0
        shard[k], size = v, size + b
    if shard:
        names.append(f"{variant}-{len(names)}.safetensors")
        save_file(shard, out / names[-1])
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", type=Path, help="the target as a Hugging Face directory")
    src.add_argument("--gguf", type=Path, help="the target as a GGUF file (converted into --out's parent)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=2000, help="held-in prompts the target continues")
    p.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt, beside the greedy one")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--gen-budget-s", type=float, default=180.0, help="no further sampled round starts after this")
    p.add_argument("--variants", default="trained,frozen")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--evals", type=lambda v: [int(x) for x in v.split(",") if x], default=[500, 1000, 2000, 4000])
    p.add_argument("--train-budget-s", type=float, default=120.0, help="per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny draft shape (tests)")
    a = p.parse_args(argv)
    a.tiny_shape = DraftShape(hidden=16, layers=1, intermediate=32, heads=2, kv_heads=1)
    variants = [v for v in a.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad}; one or more of {', '.join(VARIANTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "seconds": {}}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = a.target
    if a.gguf is not None:
        from exspec.engine.gguf import gguf_to_hf_dir

        target_dir = gguf_to_hf_dir(a.gguf, cache_root=a.out.parent / "gguf-cache")
        result["seconds"]["convert"] = round(time.perf_counter() - t0, 1)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(a.device).eval()
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 target's own greedy choices
        torch.backends.cudnn.allow_tf32 = False
    eos, pad = target.config.eos_token_id, target.config.pad_token_id
    log(f"target loaded on {a.device}")
    train_texts, heldout_texts = imitation_prompts(a.seed, a.prompts, 16)
    encode = lambda texts: [chat_ids(tok, t) for t in texts]  # noqa: E731
    torch.manual_seed(a.seed)
    t = time.perf_counter()
    heldout = target_continuations(target, encode(heldout_texts), 48, eos, pad, 1, a.gen_batch, False)
    train_ids = encode(train_texts)
    sets = [target_continuations(target, train_ids, a.new_tokens, eos, pad, a.topk, a.gen_batch, False)]
    for i in range(a.samples):
        if time.perf_counter() - t > a.gen_budget_s:
            log(f"generation past its budget ({a.gen_budget_s} s): {i} of {a.samples} sampled rounds")
            break
        sets.append(target_continuations(target, train_ids, a.new_tokens, eos, pad, a.topk, a.gen_batch, False,
                                         temperature=a.temperature))
    data = _merge(sets)
    tokens = sum(len(q) - p for q, p in zip(data.sequences, data.prompt_lens))
    result["seconds"]["continuations"] = round(time.perf_counter() - t, 1)
    result["train_prompts"], result["train_tokens"] = len(train_texts), tokens
    result["train_sequences"] = len(data.sequences)
    result["heldout_positions"] = sum(len(q) - p for q, p in zip(heldout.sequences, heldout.prompt_lens))
    log(f"{len(data.sequences)} continuations, {tokens} tokens in {result['seconds']['continuations']} s")
    for variant in variants:
        draft, curve = train(variant, target, data, heldout, a, pad, log)
        result[variant] = {"curve": curve, "files": save(variant, draft, a.out)}
    result["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    log(f"done: {a.out / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

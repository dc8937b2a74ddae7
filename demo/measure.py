"""How good the demo pair is as a speculative pair: draft/target agreement, the engine's acceptance length
(through the public offline API, as any user of the engine would run it) and each model's forward latency.

`python -m exspec.demo.measure` builds (or reuses) the pair and prints all three (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from exspec.demo.cache import MODEL_MARKER, default_demo_dir
from exspec.demo.corpus import MEASURE_PROMPTS, spec_bench_prompts
from exspec.demo.tokenizer import chat_ids


def measure_agreement(target_dir: Path, draft_dir: Path, num_prompts: int = MEASURE_PROMPTS, max_tokens: int = 64) -> dict:
    """How often the draft's greedy top-1 equals the target's along the target's own greedy continuations.

    For each prompt (SpecBench `turns[0]` in the chat template), the target generates greedily up to
    max_tokens with Hugging Face `generate` (stopping at EOS); the draft then reads prompt + continuation in
    one forward, and every continuation position counts once (agree: the draft's argmax there is the token
    the target chose). The continuations are the reference the engine's greedy output must equal.
    `lookup_agreement`: the same count for the n-gram lookup (`--speculative-method ngram`, engine/lookup.py, the
    default suffix lengths) in place of the draft, where it proposes nothing counted as a miss; `lookup_proposed`,
    the share of positions where it proposes.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exspec.engine.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN
    from exspec.engine.lookup import propose_ngram

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    eos, pad = target.config.eos_token_id, target.config.pad_token_id
    agree = total = ended = lookup_agree = lookup_proposed = 0
    continuations = []
    with torch.inference_mode():
        for _, text in spec_bench_prompts(num_prompts):
            ids = torch.tensor([chat_ids(tok, text)])  # [1, P]
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=eos, pad_token_id=pad,
            )  # [1, P + n]
            cont = out[0, ids.shape[1]:]  # [n]
            ended += int(cont.numel() > 0 and cont[-1].item() == eos)
            d_logits = draft(input_ids=out).logits[0, ids.shape[1] - 1 : -1]  # [n, V]
            agree += (d_logits.argmax(-1) == cont).sum().item()
            total += cont.numel()
            # the lookup at every continuation position t at once: row t reads the tokens before t (a row's positions
            # from its length on are ignored)
            at = torch.arange(ids.shape[1], out.shape[1])  # [n]
            guess, valid = propose_ngram(out.expand(len(at), -1), at, 1, PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX)  # [n, 1]
            lookup_proposed += int(valid[:, 0].sum())
            lookup_agree += int((valid[:, 0] & (guess[:, 0] == cont)).sum())
            continuations.append(cont.tolist())
    return {
        "agreement": agree / max(total, 1),
        "lookup_agreement": lookup_agree / max(total, 1),
        "lookup_proposed": lookup_proposed / max(total, 1),
        "positions": total,
        "prompts": len(continuations),
        "ended_with_eos": ended,
        "continuations": continuations,
    }


def measure_acceptance(target_dir: Path, draft_dir: Path | None, num_prompts: int = MEASURE_PROMPTS,
                       max_tokens: int = 64, k: int = 4, batch_size: int = 8) -> dict:
    """The engine's greedy mean acceptance length at a fixed k, through `generate_offline`; draft_dir None: n-gram
    lookup (`speculative_method="ngram"`) instead of the draft.

    mean_acceptance_length: tokens emitted per sequence per decode step (1 + accepted draft tokens);
    acceptance_rate: accepted / proposed draft tokens. `outputs` are the generated ids per prompt.
    """
    from transformers import AutoTokenizer

    from exspec.engine import EngineConfig, SamplingParams, SpecEngine
    from exspec.scheduler import SchedulerConfig, generate_offline

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [chat_ids(tok, text) for _, text in spec_bench_prompts(num_prompts)]
    engine = SpecEngine(EngineConfig(
        model=Path(target_dir), draft_model=Path(draft_dir) if draft_dir is not None else None, max_num_seqs=batch_size,
        max_model_len=max(map(len, prompts)) + max_tokens + 1, max_num_speculative_tokens=k,
        speculative_method="draft" if draft_dir is not None else "ngram",
    ))
    sched = SchedulerConfig(max_batch_size=batch_size, pool_size=batch_size, max_waiting=len(prompts),
                            num_speculative_tokens=k, speculation="fixed")
    t0 = time.perf_counter()
    results, summary = generate_offline(engine, prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts), sched)
    return {
        "mean_acceptance_length": summary.mean_acceptance_length,
        "acceptance_rate": summary.acceptance_rate,
        "sequence_steps": summary.num_row_steps,
        "k": k,
        "seconds": time.perf_counter() - t0,
        "outputs": [r.token_ids for r in results],
    }


def measure_forward_latency(model_dirs, batch_sizes=(1, 8), context: int = 32, repeats: int = 60) -> list[dict]:
    """Median seconds of one decode forward (1 new token per row over `context` cached tokens) of each
    model, per batch size, calling the Hugging Face models directly. The models take turns call by call,
    so load from other processes hits both."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in model_dirs]
    results: list[dict] = [{} for _ in models]
    with torch.inference_mode():
        for b in batch_sizes:
            ids = torch.randint(10, models[0].config.vocab_size, (b, context), generator=torch.Generator().manual_seed(0))
            caches = [DynamicCache(config=m.config) for m in models]
            for m, c in zip(models, caches):
                m(input_ids=ids, cache=c, use_cache=True)
            nxt = ids[:, -1:]  # [b, 1]
            times: list[list[float]] = [[] for _ in models]
            for _ in range(repeats + 5):
                for m, c, ts in zip(models, caches, times):
                    t = time.perf_counter()
                    m(input_ids=nxt, cache=c, use_cache=True)
                    ts.append(time.perf_counter() - t)
                    c.crop(-1)  # drop it again: always one new token over the same context
            for res, ts in zip(results, times):
                ts = sorted(ts[5:])
                res[b] = ts[len(ts) // 2]
    return results


def main(argv: list[str] | None = None) -> int:
    from exspec.demo.build import build_demo_pair
    from exspec.demo.recipe import DEFAULT_SCALE, SCALES

    p = argparse.ArgumentParser(prog="python -m exspec.demo.measure", description="Build (or reuse) and measure the demo pair.")
    p.add_argument("--dir", type=Path, default=None, help="pair directory (default: the demo cache)")
    p.add_argument("--scale", default=DEFAULT_SCALE, choices=SCALES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--num-prompts", type=int, default=MEASURE_PROMPTS)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--show", type=int, default=3, help="print this many decoded continuations")
    a = p.parse_args(argv)
    out = a.dir if a.dir is not None else default_demo_dir(a.scale)
    t0 = time.perf_counter()
    target, draft = build_demo_pair(out, seed=a.seed, force=a.force, scale=a.scale)
    print(f"target: {target}\ndraft:  {draft}\n(build or reuse: {time.perf_counter() - t0:.1f} s)")
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    for name, d in (("target", target), ("draft", draft)):
        info = json.loads((d / MODEL_MARKER).read_text())
        print(f"{name}: {info['parameters']:,} parameters")
    lat_t, lat_d = measure_forward_latency([target, draft])
    for b in lat_t:
        print(f"decode forward, batch {b}, 32-token context: target {lat_t[b] * 1e3:.2f} ms, "
              f"draft {lat_d[b] * 1e3:.2f} ms, ratio {lat_t[b] / lat_d[b]:.1f}x")
    ag = measure_agreement(target, draft, a.num_prompts, a.max_tokens)
    print(f"agreement (draft top-1 == target greedy): {ag['agreement']:.1%} over {ag['positions']} positions, "
          f"{ag['prompts']} prompts; {ag['ended_with_eos']} continuations ended with EOS")
    print(f"agreement of the n-gram lookup instead (--speculative-method ngram): {ag['lookup_agreement']:.1%} "
          f"(it proposes at {ag['lookup_proposed']:.1%} of the positions)")
    for name, d in (("draft", draft), ("ngram", None)):
        acc = measure_acceptance(target, d, a.num_prompts, a.max_tokens, k=a.k, batch_size=a.batch_size)
        print(f"engine ({name}), greedy, k={acc['k']}, batch {a.batch_size}: mean acceptance length "
              f"{acc['mean_acceptance_length']:.2f}, acceptance rate {acc['acceptance_rate']:.1%} "
              f"over {acc['sequence_steps']} sequence-steps ({acc['seconds']:.1f} s)")
        same = sum(o == c for o, c in zip(acc["outputs"], ag["continuations"]))
        print(f"engine ({name}) output identical to target greedy (HF generate): {same}/{len(acc['outputs'])}")
    tok = AutoTokenizer.from_pretrained(target)
    for (cat, text), cont in list(zip(spec_bench_prompts(a.num_prompts), ag["continuations"]))[: a.show]:
        print(f"--- [{cat}] {text[:80]!r}\n{tok.decode(cont)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

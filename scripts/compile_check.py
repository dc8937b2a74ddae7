"""Compile (capture) on against off, end to end: the same prompts through the same model pair with
`EngineConfig.compile` off and on, greedy, at each batch size; the outputs compared token by token and the decode
throughput of both, the first (compiling) run timed apart. Writes compile_check.json and compile_check.md.

    python scripts/compile_check.py --synthetic 1b --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --out DIR
    python scripts/compile_check.py --synthetic tiny --batch-sizes 1,2 --max-tokens 8    (a CPU smoke: seconds)

`--compile-mode cudagraph` (CUDA only; run on an H100, 2026-11-27) records the eager forwards into CUDA graphs
directly instead of compiling them. On the CPU compile on is a capturability proof (`aot_eager`), not a speed-up. On CUDA it compiles the static draft
and verify forwards with mode="reduce-overhead" (CUDA graphs); scripts/gpu_check.sh runs it (on an H100, 2026-11-24:
B = 1 identical but for a near-tie, 6.0x, 30.6 s to compile). In fp32 the outputs must be identical; in bf16 a padded bucket
changes GEMM shapes, so outputs may differ at near-ties only: a divergence that is not a near-tie of the reference's
top-2 logits (exspec.bench.equivalence.is_near_tie) fails the check (exit 1). Each engine runs the prompts twice; its second run
(other blocks, freed by the first) is held to the same rule against its first (an H100 gave 1 near-tie in 16 at B = 8).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from exspec.bench.equivalence import first_divergence, is_near_tie, top2_logits
from exspec.bench.synthetic import DEFAULT_CACHE, SHAPES, ensure_synthetic_pair
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.config import COMPILE_MODES
from exspec.engine.loader import load_model_pair
from exspec.scheduler import SchedulerConfig, generate_offline


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _run(engine, prompts, max_tokens, batch, k):
    config = SchedulerConfig(max_batch_size=batch, pool_size=batch, num_speculative_tokens=k, speculation="fixed")
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    results, summary = generate_offline(engine, prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts), config)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return [r.token_ids for r in results], summary, time.perf_counter() - start


def _classify(model, prompts, refs, outs, vocab, half: str | None) -> dict:
    """outs against refs, prompt by prompt: identical, diverging at a near-tie of the reference's top-2 logits
    (half: the bf16/fp16 dtype, near-ties by exspec.bench.equivalence.is_near_tie; None in fp32: none allowed), or a
    real divergence (position and gap)."""
    identical, near_ties, real = 0, 0, []
    for prompt, a, b in zip(prompts, refs, outs):
        pos = first_divergence(b, a)
        if pos is None:
            identical += 1
            continue
        tie, gap = _near_tie(model, prompt, a, pos, vocab, half) if half else (False, float("nan"))
        near_ties += tie
        if not tie:
            real.append({"position": pos, "top2_gap": gap})
    return {"identical": identical, "near_ties": near_ties, "real": real}


def _near_tie(model, prompt, ref, pos, vocab, dtype: str) -> tuple[bool, float]:
    first, second = top2_logits(model, prompt + ref[:pos], vocab)
    return is_near_tie(first - second, first, dtype), first - second


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--synthetic-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompts-per-batch", type=int, default=2, help="prompts = this x B (default: 2)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=COMPILE_MODES[0],
                   help="how compile on makes the forwards fast (EngineConfig.compile_mode; cudagraph: CUDA only)")
    p.add_argument("--out", type=Path, default=Path("compile-check"))
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    target_dir, draft_dir, info = ensure_synthetic_pair(args.synthetic, args.synthetic_cache, device=args.device)
    fields = dict(model=target_dir, draft_model=draft_dir, device=args.device, dtype=dtype,
                  max_num_seqs=max(args.batch_sizes), max_model_len=256 + args.max_tokens,
                  max_num_speculative_tokens=args.num_speculative_tokens)
    pair = load_model_pair(EngineConfig(**fields))
    vocab = pair.vocab_size
    half = dtype if dtype not in ("float32", "fp32") else None
    rng = random.Random(0)
    rows, ok = [], True
    for batch in args.batch_sizes:
        prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 200))] for _ in range(args.prompts_per_batch * batch)]
        out = {}
        for compile_on in (False, True):
            mode = dict(compile=True, compile_mode=args.compile_mode) if compile_on else {}
            started = time.perf_counter()
            engine = SpecEngine(EngineConfig(**fields, **mode), pair=pair)  # cudagraph: every graph captured here
            start_s = time.perf_counter() - started
            first_tokens, _, first_s = _run(engine, prompts, args.max_tokens, batch, args.num_speculative_tokens)
            tokens, summary, wall = _run(engine, prompts, args.max_tokens, batch, args.num_speculative_tokens)
            # The same engine twice: its second run places the rows' blocks differently (blocks freed by the first),
            # so in bf16 attention may sum in another order; a difference there must be a near-tie, as against eager.
            repeat = _classify(pair.target, prompts, first_tokens, tokens, vocab, half)
            ok &= not repeat["real"]
            out[compile_on] = dict(repeat=repeat, tokens=tokens, first_s=first_s, wall_s=wall, start_s=start_s,
                                   decode_s=summary.decode_seconds,
                                   decode_tok_s=summary.num_decode_tokens / summary.decode_seconds if summary.decode_seconds else 0.0,
                                   acceptance=summary.mean_acceptance_length, static_forwards=len(engine._static))
        against = _classify(pair.target, prompts, out[False]["tokens"], out[True]["tokens"], vocab, half)
        ok &= not against["real"]
        row = {"batch": batch, "prompts": len(prompts), "identical": against["identical"],
               "near_ties": against["near_ties"], "real_divergences": against["real"]}
        for on, name in ((False, "off"), (True, "on")):  # each engine's second run against its first
            rep = out[on]["repeat"]
            row[f"{name}_repeat_identical"], row[f"{name}_repeat_near_ties"] = rep["identical"], rep["near_ties"]
            row[f"{name}_repeat_real"] = rep["real"]
        for on, name in ((False, "off"), (True, "on")):
            r = out[on]
            row.update({f"{name}_first_s": round(r["first_s"], 3), f"{name}_wall_s": round(r["wall_s"], 3),
                        f"{name}_decode_tok_s": round(r["decode_tok_s"], 1), f"{name}_acceptance": round(r["acceptance"], 3)})
        row["static_forwards"] = out[True]["static_forwards"]
        row["compile_s"] = round(out[True]["first_s"] - out[True]["wall_s"], 3)  # the first run's extra time
        # the engine's start, on against off (cudagraph: captures every static forward there, inductor: none)
        row["start_extra_s"] = round(out[True]["start_s"] - out[False]["start_s"], 3)
        row["speedup"] = round(out[True]["decode_tok_s"] / out[False]["decode_tok_s"], 3) if out[False]["decode_tok_s"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    env = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "torch": torch.__version__,
           "dtype": dtype, "synthetic": info.get("name"), "k": args.num_speculative_tokens, "max_tokens": args.max_tokens}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_check.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    lines = [f"# compile on vs off: {env['synthetic']} pair, {env['dtype']}, {env['device']}, k = {env['k']}, "
             f"{env['max_tokens']} new tokens per prompt", "",
             "| B | prompts | identical | near-ties | real divergences | repeat off / on: identical, near-ties, real | off tok/s | on tok/s | on / off | compile s (first run extra) | engine start s (on - off) | static forwards |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rep = " / ".join(f"{r[f'{n}_repeat_identical']}, {r[f'{n}_repeat_near_ties']}, {len(r[f'{n}_repeat_real'])}"
                         for n in ("off", "on"))
        lines.append(f"| {r['batch']} | {r['prompts']} | {r['identical']} | {r['near_ties']} | {len(r['real_divergences'])} | {rep} | "
                     f"{r['off_decode_tok_s']} | {r['on_decode_tok_s']} | {r['speedup']} | {r['compile_s']} | {r['start_extra_s']} | {r['static_forwards']} |")
    (args.out / "compile_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

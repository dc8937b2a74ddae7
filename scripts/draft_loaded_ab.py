"""Does a loaded draft cost anything when the policy does not draft? The target alone (`target-ar`), the engine
with its draft at fixed k = 0, and the engine with its draft under `auto` (calibrated first, as `exspec serve`
calibrates), the same prompts through each, in rounds whose order rotates; tokens/s (whole runs), decode and
forward ms per decode step, medians over the rounds. `target-ar-2`, a second engine of the target alone, is the
control: its ratio to `target-ar` is what this machine's noise makes of two identical runs (on the SmolLM2 pair at
B = 8, quiet VM, 4 rounds: 0.995x; a scratch probe of the same kind found two such engines 4.5% apart;
docs/BENCHMARKS.md section 2).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python scripts/draft_loaded_ab.py --pair ~/.cache/exspec/demo

Run on the toy pair, B = 1 (docs/BENCHMARKS.md section 2, session 14): 211.2, 216.9 and 216.5 tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from exspec.data import calibration_prompts, encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.loader import load_model_pair
from exspec.scheduler import SchedulerConfig, generate_offline, policies
from exspec.scheduler.core import SchedulerCore

METHODS = ("target-ar", "target-ar-2", "fixed-k0", "auto")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a directory holding target/ and draft/")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4, help="auto's largest k")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    b, k = args.batch_size, args.k
    cfg = EngineConfig(model=args.pair / "target", draft_model=args.pair / "draft", max_num_seqs=b,
                       max_model_len=args.max_model_len, max_num_speculative_tokens=k)
    pair = load_model_pair(cfg)
    prompts = [p[: args.max_model_len // 2] for p in
               encode_prompts(pair.tokenizer, load_questions("specbench", args.num_prompts), chat_template=True)]
    params = [SamplingParams(max_tokens=args.max_tokens)] * len(prompts)
    runs = {}
    for name in METHODS:
        if name.startswith("target-ar"):
            engine = SpecEngine(replace(cfg, draft_model=None, max_num_speculative_tokens=0), pair=replace(pair, draft=None))
        else:
            engine = SpecEngine(cfg, pair=pair)
        fixed = name != "auto"
        sched = SchedulerConfig(max_batch_size=b, pool_size=b, num_speculative_tokens=0 if fixed else k,
                                **({"speculation": "fixed"} if fixed else {}))
        policy = policies.create(sched.speculation, sched.num_speculative_tokens)
        if not fixed:
            SchedulerCore(engine, sched, policy).calibrate(calibration_prompts(pair.tokenizer, b, args.max_model_len))
        runs[name] = (engine, sched, policy)
        generate_offline(engine, prompts, params, sched, speculation=policy)  # warm-up, untimed
    rows = {name: [] for name in METHODS}
    for r in range(args.rounds):
        for name in METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]:
            engine, sched, policy = runs[name]
            start = time.perf_counter()
            _, s = generate_offline(engine, prompts, params, sched, speculation=policy)
            wall = time.perf_counter() - start
            steps = max(s.steps["grouped"] + s.steps["mixed"], 1)
            rows[name].append((s.num_generated_tokens / wall, 1e3 * s.decode_seconds / steps,
                               1e3 * s.forward_seconds / steps, s.mean_acceptance_length))
    base = statistics.median(x[0] for x in rows["target-ar"])
    for name in METHODS:
        tok_s = statistics.median(x[0] for x in rows[name])
        print(f"{name}: tokens/s {[round(x[0], 1) for x in rows[name]]} median {tok_s:.1f} ({tok_s / base:.3f}x), "
              f"decode ms/step {statistics.median(x[1] for x in rows[name]):.3f}, "
              f"forward ms/step {statistics.median(x[2] for x in rows[name]):.3f}, "
              f"acceptance length {rows[name][-1][3]:.2f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())

"""What `auto` does at one batch size, step by step: calibrated as `exspec serve` calibrates, then `--runs` offline
runs of the bench's chat prompts (pool 4 x B, as `exspec bench` runs `exspec`); prints each run's tokens/s, then
every step of bucket B that drafted or explored: (step, k, E explore / R re-check, ms, catch-up ms, pairs, pair
scale, modelled goodput of k = 1 and 2 over k = 0), and the policy's summary.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python scripts/trace_policy.py --pair ~/.cache/exspec/demo --batch-size 8

Run on the toy pair at B = 8 (docs/BENCHMARKS.md section 2, session 15): a k > 0 re-check's first step, which
catches the draft up on every row, took 22-178 ms against 11 ms for a step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from exspec.data import calibration_prompts, encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.loader import load_model_pair
from exspec.scheduler import SchedulerConfig, generate_offline, policies
from exspec.scheduler.core import SchedulerCore
from exspec.scheduler.policies.auto import size_bucket


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a directory holding target/ and draft/")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4, help="auto's largest k")
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args(argv)
    b, k = args.batch_size, args.k
    cfg = EngineConfig(model=args.pair / "target", draft_model=args.pair / "draft", max_num_seqs=4 * b,
                       max_model_len=args.max_model_len, max_num_speculative_tokens=k)
    pair = load_model_pair(cfg)
    prompts = [p[: args.max_model_len // 2] for p in
               encode_prompts(pair.tokenizer, load_questions("specbench", args.num_prompts), chat_template=True)]
    params = [SamplingParams(max_tokens=args.max_tokens)] * len(prompts)
    engine = SpecEngine(cfg, pair=pair)
    sched = SchedulerConfig(max_batch_size=b, pool_size=4 * b, num_speculative_tokens=k)
    policy = policies.create(sched.speculation, k)
    SchedulerCore(engine, sched, policy).calibrate(calibration_prompts(pair.tokenizer, b, args.max_model_len))
    for size, k_star in sorted((s, policy.plan(s)[0]) for s in policy.summary()):
        print(f"calibrated: bucket {size} k* {k_star}")
    observe, rows = policy.observe, []

    def traced(batch_size, k, num_tokens, seconds, catchup_s=0.0, accepted=(), drafting_rows=None):
        st = policy._bucket(size_bucket(batch_size))
        flag = ("R" if st.rechecking else "E") if st.exploring else ""
        observe(batch_size, k, num_tokens, seconds, catchup_s, accepted, drafting_rows)
        if size_bucket(batch_size) == size_bucket(b) and (k > 0 or flag):
            g = policy.plan(batch_size)[2]
            rows.append((st.steps, k, flag, round(1e3 * seconds, 2), round(1e3 * catchup_s, 2), len(st.paired),
                         round(policy._pair_scale(st.paired), 3), {x: round(g[x] / g[0], 3) for x in (1, 2) if x in g}))

    policy.observe = traced
    for r in range(args.runs):
        start = time.perf_counter()
        _, stats = generate_offline(engine, prompts, params, sched, speculation=policy)
        print(f"run {r}: {stats.num_generated_tokens / (time.perf_counter() - start):.1f} tokens/s")
    for row in rows:
        print(*row)
    print(policy.summary())
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())

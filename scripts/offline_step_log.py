"""Every step of an offline run, in order: what a batch of prompts does under the scheduler and a policy.

One line per run (wall, prefill and decode seconds), then, for the last run, one entry per engine call:
`p<rows>/<prompt tokens>:<ms>` for a prefill step, `<g|m><rows>k<k>/<tokens>:<ms>` for a decode step (grouped or
mixed). The runs share one policy, as `exspec bench` does (the first run is a short warm-up of 8 tokens).

    .venv/bin/python scripts/offline_step_log.py --pair ~/.cache/exspec/synthetic/350m-v1-seed0 --batch-size 8 \
        --speculation auto
    .venv/bin/python scripts/offline_step_log.py --pair ... --batch-size 8 --speculation fixed --k 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from exspec.data import calibration_prompts, encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.scheduler import SchedulerConfig, policies
from exspec.scheduler.core import SchedulerCore
from exspec.scheduler.request import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a directory holding target/ and draft/")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speculation", default="auto")
    ap.add_argument("--k", type=int, default=4, help="k (fixed) or the largest k (auto); 0: the target alone")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--pool-size", type=int, default=0, help="W; 0: every prompt (as the bench, up to 4 x B)")
    ap.add_argument("--calibrate", action="store_true", help="the policy's calibration first, as serve and bench run it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pair = Path(args.pair)
    engine = SpecEngine(EngineConfig(model=pair / "target", draft_model=pair / "draft" if args.k else None,
                                     max_num_seqs=max(args.num_prompts, args.batch_size), max_model_len=2048,
                                     max_num_speculative_tokens=args.k))
    prompts = encode_prompts(engine.tokenizer, load_questions("specbench", args.num_prompts), False)
    print("prompt lengths", [len(p) for p in prompts])
    pool = args.pool_size or max(args.batch_size, len(prompts))
    # max_prefill_chunk_s 0 and prefill first: what generate_offline and the bench run (no stream waits offline)
    cfg = SchedulerConfig(max_batch_size=args.batch_size, pool_size=pool, num_speculative_tokens=args.k,
                          speculation=args.speculation, max_prefill_chunk_s=0.0)
    policy = policies.create(cfg.speculation, args.k)
    if args.calibrate:
        t0 = time.perf_counter()
        SchedulerCore(engine, cfg, policy).calibrate(calibration_prompts(engine.tokenizer, args.batch_size, 2048))
        print(f"calibrated in {time.perf_counter() - t0:.1f} s: k* {({b: v['best_k'] for b, v in policy.summary().items()})}")
    for run in range(args.runs):
        core = SchedulerCore(engine, cfg, policy, prefill_first=True)
        for i, p in enumerate(prompts):
            max_tokens = 8 if run == 0 else args.max_tokens
            core.add(Request(str(i), list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0), order=i))
        log, prefill_s, decode_s, start = [], 0.0, 0.0, time.perf_counter()
        while core.has_work():
            t0 = time.perf_counter()
            _, stats = core.step()
            dt = time.perf_counter() - t0
            for s in stats:
                if s.kind == "prefill":
                    prefill_s += dt
                    log.append(f"p{s.batch_size}k{s.num_draft_tokens}/{s.num_prompt_tokens}:{dt * 1e3:.0f}")
                else:
                    decode_s += dt
                    log.append(f"{s.kind[0]}{s.batch_size}k{s.num_draft_tokens}/{s.num_tokens}:{dt * 1e3:.0f}")
        print(f"run {run}: wall {time.perf_counter() - start:.2f} s, prefill {prefill_s:.2f} s, decode {decode_s:.2f} s")
    print(" ".join(log))
    print("policy:", policy.summary(), "drafting:", policy.drafting())


if __name__ == "__main__":
    main()

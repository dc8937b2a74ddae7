"""What a k = 0 step costs right after drafting steps, by its position in a run of k = 0 steps (and a drafting step's
cost), on one row: the measurement behind `auto`'s `settle_steps` (scheduler/policies/auto.py).

    .venv/bin/python scripts/switch_cost.py --pair ~/.cache/exspec/demo --k 4
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from exspec.data import encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.scheduler import SchedulerConfig
from exspec.scheduler.core import SchedulerCore
from exspec.scheduler.policies.fixed import FixedPolicy
from exspec.scheduler.request import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a directory holding target/ and draft/")
    ap.add_argument("--k", type=int, default=4, help="k of the drafting steps")
    ap.add_argument("--drafting", type=int, default=20, help="drafting steps before each run of k = 0 steps")
    ap.add_argument("--plain", type=int, default=12, help="k = 0 steps in each run")
    ap.add_argument("--cycles", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pair = Path(args.pair)
    engine = SpecEngine(EngineConfig(model=pair / "target", draft_model=pair / "draft", max_num_seqs=1,
                                     max_model_len=2048, max_num_speculative_tokens=args.k))
    schedule = ([args.k] * args.drafting + [0] * args.plain) * args.cycles

    class Scheduled(FixedPolicy):
        at = 0

        def choose(self, batch_size: int) -> int:
            self.at += 1
            return schedule[(self.at - 1) % len(schedule)]

    policy = Scheduled(args.k)
    core = SchedulerCore(engine, SchedulerConfig(max_batch_size=1, pool_size=1, num_speculative_tokens=args.k,
                                                 max_prefill_chunk_s=0.0), policy)
    prompt = encode_prompts(engine.tokenizer, load_questions("specbench", 1), False)[0]
    core.add(Request("0", list(prompt), SamplingParams(max_tokens=2048 - len(prompt) - args.k - 2, temperature=0.0,
                                                       ignore_eos=True), order=0))
    steps = []
    while core.has_work() and policy.at < len(schedule):
        t0 = time.perf_counter()
        _, stats = core.step()
        seconds = time.perf_counter() - t0
        if stats and stats[0].kind != "prefill":
            steps.append((stats[0].num_draft_tokens, seconds))
    by_position, run = collections.defaultdict(list), 0
    for k, seconds in steps:
        if k == 0:
            by_position[run].append(seconds)
            run += 1
        else:
            run = 0
    print("k = 0 step ms by position after drafting:",
          ", ".join(f"{1e3 * statistics.median(v):.2f}" for _, v in sorted(by_position.items())))
    print(f"k = {args.k} step ms: {1e3 * statistics.median(s for k, s in steps if k > 0):.2f}")


if __name__ == "__main__":
    main()

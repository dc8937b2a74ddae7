"""Prefill planning, before against after, in one process on one engine: the target alone at B = 8 (k = 0) through
`generate_offline` with a pool of B and of 2 x B, `plan_prefill` and `PrefillCost` taken from this checkout ("new")
and from an older `scheduler/policy.py` ("old", e.g. `git show 4092fd1^:scheduler/policy.py > /tmp/old_policy.py`),
rounds in alternating order after one untimed round; per run tokens/s, prefill forward seconds and steps, and the
padded tokens (rows x width) the prefill forwards ran. Outputs must be identical across versions and pools.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/prefill_ab.py --pair ~/.cache/exspec/demo --old /tmp/old_policy.py

Run on the SmolLM2 demo pair, 16 SpecBench chat prompts, 64 tokens (docs/BENCHMARKS.md section 2, session 19).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import exspec.scheduler.core as core
from exspec.data import all_questions, encode_prompts, evenly_spaced
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.scheduler import SchedulerConfig, generate_offline


def _old_planner(path: Path):
    spec = importlib.util.spec_from_file_location("old_policy", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_policy"] = old  # dataclasses look their module up
    spec.loader.exec_module(old)

    def plan(remaining, budget, overhead):
        out = old.plan_prefill(remaining, budget, overhead)
        return (tuple(range(out[0])), out[1]) if isinstance(out[0], int) else out  # (n, width): the FIFO prefix

    return plan, old.PrefillCost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a directory holding target/")
    ap.add_argument("--old", type=Path, required=True, help="an older scheduler/policy.py")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    b = args.batch_size
    pools = (b, 2 * b)
    versions = {"old": _old_planner(args.old), "new": (core.plan_prefill, core.PrefillCost)}
    engine = SpecEngine(EngineConfig(model=args.pair / "target", draft_model=None, max_num_seqs=max(pools),
                                     max_model_len=2048, max_num_speculative_tokens=0))
    prompts = [p for p in encode_prompts(engine.tokenizer, all_questions("specbench"), True) if len(p) <= 1024]
    prompts = evenly_spaced(prompts, args.num_prompts)
    params = [SamplingParams(max_tokens=args.max_tokens)] * len(prompts)
    stats = collections.Counter()
    prefill = engine.prefill

    def counted(batch):
        t0 = time.perf_counter()
        out = prefill(batch)
        stats["s"] += time.perf_counter() - t0
        stats["steps"] += 1
        stats["padded"] += len(batch.chunks) * max(c.end - c.start for c in batch.chunks)
        return out

    engine.prefill = counted
    runs, reference = collections.defaultdict(list), None
    points = [(v, pool) for v in versions for pool in pools]
    for r in range(args.rounds + 1):
        for v, pool in points if r % 2 else points[::-1]:
            core.plan_prefill, core.PrefillCost = versions[v]
            stats.clear()
            sched = SchedulerConfig(max_batch_size=b, pool_size=pool, max_waiting=10**9, num_speculative_tokens=0,
                                    speculation="fixed")
            results, s = generate_offline(engine, prompts, params, sched)
            ids = [x.token_ids for x in results]
            reference = reference or ids
            if ids != reference:
                raise SystemExit(f"{v} pool {pool}: outputs differ")
            if r == 0:
                continue
            row = dict(version=v, pool=pool, round=r, tokens_per_s=round(s.num_generated_tokens / s.wall_seconds, 2),
                       prefill_forward_s=round(stats["s"], 2), prefill_steps=stats["steps"], padded=stats["padded"],
                       real=sum(len(p) for p in prompts), decode_s=round(s.decode_seconds, 2))
            runs[(v, pool)].append(row)
            print(json.dumps(row), flush=True)
    for pool in pools:
        old, new = runs[("old", pool)], runs[("new", pool)]
        print(json.dumps(dict(
            pool=pool, tokens_per_s_old=statistics.median(x["tokens_per_s"] for x in old),
            tokens_per_s_new=statistics.median(x["tokens_per_s"] for x in new),
            new_over_old_per_round=[round(n["tokens_per_s"] / o["tokens_per_s"], 3) for o, n in zip(old, new)],
            prefill_forward_s_old=statistics.median(x["prefill_forward_s"] for x in old),
            prefill_forward_s_new=statistics.median(x["prefill_forward_s"] for x in new),
            padded_old=old[0]["padded"], padded_new=new[0]["padded"])))
    print("outputs identical across versions and pools")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

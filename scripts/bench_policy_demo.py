"""exspec's default speculation policy vs plain target decoding on the demo pair, through the offline API.

Methods, interleaved per repeat (A B A B ...), tokens/s medians reported:
- target-ar: the target alone (no draft loaded), SchedulerConfig(num_speculative_tokens=0)
- exspec:    the pair with SchedulerConfig() defaults (speculation="auto" on this branch)
- fixed-k:   the pair with speculation="fixed" (for reference)
Every exspec output is checked token-identical to target-ar's.

    .venv/bin/python scripts/bench_policy_demo.py --batch-sizes 1,8 --num-prompts 32 --max-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from exspec.data import encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.scheduler import SchedulerConfig, generate_offline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default=str(Path.home() / ".cache/exspec/demo"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="target-ar,exspec,fixed")
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    demo = Path(args.demo)
    pool = 32
    spec = SpecEngine(
        EngineConfig(
            model=demo / "target", draft_model=demo / "draft", max_num_seqs=pool, max_model_len=1024,
            max_num_speculative_tokens=args.k,
        )
    )
    ar = SpecEngine(EngineConfig(model=demo / "target", max_num_seqs=pool, max_model_len=1024))
    prompts = encode_prompts(spec.tokenizer, load_questions("specbench", args.num_prompts), True)
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=False)] * len(prompts)
    methods = args.methods.split(",")
    results: dict[tuple[int, str], list[float]] = {}
    extra: dict[tuple[int, str], list[dict]] = {}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        reference = None
        for rep in range(args.repeats):
            for m in methods:
                if m == "target-ar":
                    engine, cfg = ar, SchedulerConfig(max_batch_size=b, pool_size=4 * b, num_speculative_tokens=0)
                elif m == "exspec":
                    engine, cfg = spec, SchedulerConfig(max_batch_size=b, pool_size=4 * b, num_speculative_tokens=args.k)
                else:
                    engine, cfg = spec, SchedulerConfig(
                        max_batch_size=b, pool_size=4 * b, num_speculative_tokens=args.k, speculation="fixed"
                    )
                t0 = time.perf_counter()
                out, summary = generate_offline(engine, prompts, params, cfg)
                wall = time.perf_counter() - t0
                tokens = [r.token_ids for r in out]
                if m == "target-ar":
                    reference = reference or tokens
                assert reference is None or tokens == reference, f"{m} B={b}: outputs differ from target-ar"
                tps = sum(map(len, tokens)) / wall
                results.setdefault((b, m), []).append(tps)
                extra.setdefault((b, m), []).append(
                    {"tps": tps, "acceptance_length": summary.mean_acceptance_length, "steps": dict(summary.steps)}
                )
                print(f"B={b} rep={rep} {m:>9}: {tps:8.1f} tok/s  accept_len={summary.mean_acceptance_length:.2f}", flush=True)
    print(f"\n{'B':>2} {'method':>9} {'median tok/s':>13} {'/ target-ar':>12}")
    rows = []
    for (b, m), v in results.items():
        med = statistics.median(v)
        ref = statistics.median(results[(b, "target-ar")]) if (b, "target-ar") in results else float("nan")
        print(f"{b:>2} {m:>9} {med:>13.1f} {med / ref:>12.3f}")
        rows.append({"batch_size": b, "method": m, "tps": v, "median": med, "ratio": med / ref})
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "rows": rows, "runs": {f"{b}/{m}": e for (b, m), e in extra.items()}}, indent=1))


if __name__ == "__main__":
    main()

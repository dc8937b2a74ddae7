"""Where a B-row decode run's time goes, for comparing two versions of the code: `generate_offline` as `exspec bench`
runs `target-ar` (pool B, k = 0) or `exspec-fixed` (pool 4B, fixed k), per run: tokens/s, decode and prefill step
counts, rows, forward seconds; with --sdpa-calls, PyTorch SDPA's calls and seconds split by one query against more.
Only the public API, so the same script runs an older commit's package.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/decode_ab.py --demo DIR --method target-ar --batch-size 8 --repeats 5

To run another commit's code, put a folder on PYTHONPATH holding an `exspec/` whose `__init__.py` and subpackages
(engine, scheduler, ...) link to that checkout's folders, and run from a directory that has no `exspec/`: an
editable install resolves `exspec.<subpackage>` to its own checkout whenever the package found first lacks it.
Check with `python -c "import exspec.engine; print(exspec.engine.__file__)"`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", type=Path, required=True, help="a pair folder with target/ and draft/")
    ap.add_argument("--method", choices=("target-ar", "exspec-fixed"), default="target-ar")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="exspec-fixed's k")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs after one untimed")
    ap.add_argument("--sdpa-calls", action="store_true")
    args = ap.parse_args()

    from exspec.data import all_questions, encode_prompts, evenly_spaced
    from exspec.engine import EngineConfig, SamplingParams, SpecEngine
    from exspec.scheduler import SchedulerConfig, generate_offline, policies

    calls = collections.defaultdict(lambda: [0, 0.0])  # "one query" / "more": [calls, seconds]
    if args.sdpa_calls:
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def timed(q, *a, **kw):
            t0 = time.perf_counter()
            out = sdpa(q, *a, **kw)
            c = calls["one query" if q.shape[2] == 1 else "more"]
            c[0] += 1
            c[1] += time.perf_counter() - t0
            return out

        torch.nn.functional.scaled_dot_product_attention = timed
    torch.set_num_threads(1)
    b, k = args.batch_size, 0 if args.method == "target-ar" else args.k
    pool = b if args.method == "target-ar" else max(b, min(4 * b, args.num_prompts))
    engine = SpecEngine(EngineConfig(model=args.demo / "target", draft_model=None if k == 0 else args.demo / "draft",
                                     max_num_seqs=pool, max_model_len=2048, max_num_speculative_tokens=k))
    prompts = [p for p in encode_prompts(engine.tokenizer, all_questions("specbench"), True) if len(p) <= 1024]
    prompts = evenly_spaced(prompts, args.num_prompts)
    fields = dict(max_batch_size=b, pool_size=pool, max_waiting=10**9, num_speculative_tokens=k)
    if args.method == "exspec-fixed":
        fields["speculation"] = "fixed"
    sched = SchedulerConfig(**fields)
    policy = policies.create(sched.speculation, k)
    params = [SamplingParams(max_tokens=args.max_tokens)] * len(prompts)
    for r in range(args.repeats + 1):
        calls.clear()
        _, s = generate_offline(engine, prompts, params, sched, speculation=policy)
        if r == 0:
            continue
        decode_steps = s.steps["grouped"] + s.steps["mixed"]
        row = dict(repeat=r, tokens_per_s=round(s.num_generated_tokens / s.wall_seconds, 1), steps=s.steps,
                   rows=s.num_row_steps, forward_ms_per_decode_step=round(1000 * s.forward_seconds / decode_steps, 3),
                   decode_s=round(s.decode_seconds, 3), prefill_s=round(s.wall_seconds - s.decode_seconds, 3))
        if args.sdpa_calls:
            row["sdpa_us_per_call"] = {n: round(1e6 * sec / c, 1) for n, (c, sec) in calls.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

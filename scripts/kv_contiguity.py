"""How often the CPU attention backend `sdpa` reads a row's keys in place: the share of its row reads whose KV
blocks are one run of consecutive ids (a zero-copy view) against those it must gather, over a real offline run of
the toy demo pair (docs/BENCHMARKS.md, section 4). Rows of one length that `sdpa` gathers on purpose, to attend
them in one call, are counted apart ("batched"). Counts calls; times nothing.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/kv_contiguity.py --batch-size 8 --num-prompts 32
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import exspec.engine.backends.sdpa as sdpa
from exspec.data import encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.scheduler import SchedulerConfig, generate_offline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, default=Path.home() / ".cache/exspec/demo", help="a target/ and draft/ pair")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    counts: Counter[str] = Counter()
    forward = sdpa.RowSdpaBackend.forward

    def counting(self, query, k_cache, v_cache, plan, scale):
        for kv_len, first in plan.rows:
            kind = "batched" if plan.batch_ids is not None else "view" if first >= 0 else "gather"
            counts[kind] += 1
            counts[f"{kind} keys"] += kv_len
        return forward(self, query, k_cache, v_cache, plan, scale)

    sdpa.RowSdpaBackend.forward = counting
    b = args.batch_size
    engine = SpecEngine(EngineConfig(model=args.demo / "target", draft_model=args.demo / "draft", max_num_seqs=4 * b,
                                     max_model_len=2048, max_num_speculative_tokens=4, attention="sdpa"))
    prompts = [p for p in encode_prompts(engine.tokenizer, load_questions("specbench", args.num_prompts), True)
               if len(p) < 2048 - args.max_tokens - 8]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)
    generate_offline(engine, prompts, params, SchedulerConfig(max_batch_size=b, pool_size=4 * b, num_speculative_tokens=4))
    reads = counts["view"] + counts["gather"]
    keys = counts["view keys"] + counts["gather keys"]
    print(f"{len(prompts)} prompts, B = {b}: of the row reads one call per row, {counts['view']} of {reads} in place "
          f"({100 * counts['view'] / reads:.1f}%), {100 * counts['view keys'] / keys:.1f}% of their keys; "
          f"{counts['batched']} more row reads gathered into one call with rows of the same length")


if __name__ == "__main__":
    main()

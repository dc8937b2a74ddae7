"""Row padding (engine/packed_linear.py): what a decode step costs by k with and without the tuned padding.

Two measurements on one model pair, one thread, interleaved (each round alternates the order), medians:
1. a pass over the target's large linears (>= ONE_ROW_PACKED_MIN_ELEMENTS: the ones a forward streams from memory),
   for 1..8 rows, unpadded and padded to the rows `tune_row_padding` chose;
2. engine steps of k = 0..4 at each batch size, two engines (`--gemm unpadded` and the default `auto`), on the same
   random 40-token prompts, greedy.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python scripts/bench_row_padding.py ~/.cache/exspec/synthetic/350m-v1-seed0
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

from exspec.engine import EngineConfig, SpecEngine
from exspec.engine.packed_linear import ONE_ROW_PACKED_MIN_ELEMENTS, PackedLinear, row_padding
from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, PrefillChunk, StepBatch

ROUNDS, KS, BATCHES, PROMPT = 7, (0, 1, 2, 3, 4), (1, 2, 4), 40


def linear_pass(engine: SpecEngine) -> None:
    linears = [m for m in engine.pair.target.modules() if isinstance(m, PackedLinear)
               and m.weight.numel() >= ONE_ROW_PACKED_MIN_ELEMENTS]
    pad = linears[0].row_pad
    inputs = {(r, n): torch.randn(r, n) for r in range(1, 9) for n in {m.in_features for m in linears}}
    times: dict[tuple[int, bool], list[float]] = {}
    with torch.no_grad():
        for i in range(ROUNDS + 1):
            for rows in (range(1, 9) if i % 2 else range(8, 0, -1)):
                for padded in (False, True) if rows in pad else (False,):
                    for m in linears:
                        m.row_pad = pad if padded else {}
                    t0 = time.perf_counter()
                    for m in linears:
                        m(inputs[rows, m.in_features])
                    if i:
                        times.setdefault((rows, padded), []).append(1e3 * (time.perf_counter() - t0))
    for m in linears:
        m.row_pad = pad
    print(f"pass over the target's {len(linears)} large linears, ms (median of {ROUNDS}); padding {pad}")
    for (rows, padded), ts in sorted(times.items()):
        print(f"  {rows} rows{f' padded to {pad[rows]}' if padded else ''}: {statistics.median(ts):.1f}")


def main() -> None:
    torch.set_num_threads(1)
    pair = Path(sys.argv[1]).expanduser()
    engines = {gemm: SpecEngine(EngineConfig(model=pair / "target", draft_model=pair / "draft", max_num_seqs=8,
                                             max_model_len=2048, max_num_speculative_tokens=max(KS), gemm=gemm))
               for gemm in ("unpadded", "auto")}
    print("row padding (target, draft):", {g: (row_padding(e.pair.target), row_padding(e.pair.draft))
                                           for g, e in engines.items()})
    linear_pass(engines["auto"])
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 30000) for _ in range(PROMPT)] for _ in range(max(BATCHES))]
    for b in BATCHES:
        times: dict[tuple[str, int], list[float]] = {}
        ids = tuple(range(b))
        for e in engines.values():
            for s in ids:
                e.add(s, prompts[s], SamplingParams(max_tokens=1000, temperature=0.0))
            e.prefill(PrefillBatch(tuple(PrefillChunk(s, 0, PROMPT) for s in ids), draft=True))
        for i in range(ROUNDS + 1):
            for gemm, e in (engines.items() if i % 2 else list(engines.items())[::-1]):
                for k in KS:
                    t0 = time.perf_counter()
                    e.step(StepBatch(ids, k))
                    if i:
                        times.setdefault((gemm, k), []).append(1e3 * (time.perf_counter() - t0))
        for e in engines.values():
            for s in ids:
                e.free(s)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        print(f"B = {b}: step ms by k (median of {ROUNDS}), unpadded / padded")
        for k in KS:
            print(f"  k = {k}: {med['unpadded', k]:.1f} / {med['auto', k]:.1f} = {med['unpadded', k] / med['auto', k]:.2f}x")


if __name__ == "__main__":
    main()

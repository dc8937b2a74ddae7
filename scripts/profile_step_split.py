"""Where a decode step's time goes: target forwards, draft forwards, everything else (scheduler, engine
bookkeeping, sampling/acceptance, metadata). Offline API, the demo pair, B=8, fixed k.

Forward time is measured by wrapping `ModelRunner.extend` (the model's forward, mask and pool plan included);
step time is wall time around `SchedulerCore.step` (decode steps only). With --cprofile, the top functions by
own time outside the forwards are listed too.

    .venv/bin/python scripts/profile_step_split.py --batch-size 8 --k 4 [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from exspec.data import encode_prompts, load_questions
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.runner import ModelRunner
from exspec.scheduler import SchedulerConfig
from exspec.scheduler.core import SchedulerCore
from exspec.scheduler.request import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default=str(Path.home() / ".cache/exspec/demo"))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculation", default="fixed")
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    demo = Path(args.demo)
    engine = SpecEngine(
        EngineConfig(model=demo / "target", draft_model=demo / "draft", max_num_seqs=4 * args.batch_size,
                     max_model_len=1024, max_num_speculative_tokens=args.k)
    )
    forward_s = {"target": 0.0, "draft": 0.0}
    names = {id(engine.target): "target", id(engine.draft): "draft"}
    original = ModelRunner.extend

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            forward_s[names[id(self)]] += time.perf_counter() - t0

    ModelRunner.extend = timed
    prompts = encode_prompts(engine.tokenizer, load_questions("specbench", args.num_prompts), True)
    cfg = SchedulerConfig(max_batch_size=args.batch_size, pool_size=4 * args.batch_size, num_speculative_tokens=args.k,
                          speculation=args.speculation)
    core = SchedulerCore(engine, cfg)
    for i, p in enumerate(prompts):
        core.add(Request(str(i), list(p), SamplingParams(max_tokens=args.max_tokens), order=i))
    prof = cProfile.Profile() if args.cprofile else None
    decode = {"steps": 0, "wall": 0.0, "target": 0.0, "draft": 0.0}
    prefill = {"steps": 0, "wall": 0.0, "target": 0.0, "draft": 0.0}
    while core.has_work():
        before = dict(forward_s)
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        _, stats = core.step()
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        if stats:  # one StepStats per engine call (several only while a failing row is isolated)
            part = prefill if stats[0].kind == "prefill" else decode
            part["steps"] += 1
            part["wall"] += wall
            part["target"] += forward_s["target"] - before["target"]
            part["draft"] += forward_s["draft"] - before["draft"]
    other = decode["wall"] - decode["target"] - decode["draft"]
    n = decode["steps"]
    print(f"B={args.batch_size} k={args.k} speculation={args.speculation}: {n} decode steps, "
          f"{1000 * decode['wall'] / n:.2f} ms/step")
    for part in ("target", "draft"):
        print(f"  {part} forwards: {1000 * decode[part] / n:7.2f} ms/step  {100 * decode[part] / decode['wall']:5.1f}%")
    print(f"  everything else: {1000 * other / n:7.2f} ms/step  {100 * other / decode['wall']:5.1f}%")
    total = decode["wall"] + prefill["wall"]
    print(f"  prefill steps: {prefill['steps']}, {100 * prefill['wall'] / total:.1f}% of all step time; of it the "
          f"draft's prefill forwards {100 * prefill['draft'] / total:.1f}%, the target's {100 * prefill['target'] / total:.1f}%")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumtime").print_stats("scheduler|engine/engine|engine/sampling|tokenizers|stopping|request", 30)


if __name__ == "__main__":
    main()

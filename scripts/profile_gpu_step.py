"""Where a decode step's time goes on a GPU, and how many host syncs it makes: the synthetic pair through the
offline API at fixed k, one warm-up run, then one run under the PyTorch profiler. Per configuration it prints
the wall time per decode step, the draft / verify split the engine measures (CUDA events), the host-sync calls
per step (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, copies, aten::item: over the whole
run, divided by the decode steps, and inside decode steps only), where each sync inside a decode step comes from
(`sync_sources`: of the Python frames around it, the innermost in exspec's code and the innermost of all), and from
the exported trace the whole run's waits per engine step, decode and prefill (`waits_per_engine_step`: stream,
device and event syncs, aten::item, device-to-host copies) with the frames each wait comes from (`wait_sources`),
and the top operators by self CPU time; it writes a Chrome trace per configuration into --out.

    python scripts/profile_gpu_step.py --synthetic 1b --configs 1:0,1:2,8:2 [--compile] --out DIR
    python scripts/profile_gpu_step.py --synthetic 8b --configs 1:0,1:3 --modes eager,compiled --no-profile --out DIR

Run on an H100 on 2026-11-24 and 2026-11-27 (docs/BENCHMARKS.md section 0); on the CPU it runs at tiny shapes
(--synthetic tiny --device cpu).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from exspec.bench.synthetic import DEFAULT_CACHE, SHAPES, ensure_synthetic_pair
from exspec.engine import EngineConfig, SamplingParams, SpecEngine
from exspec.engine.loader import load_model_pair
from exspec.scheduler import SchedulerConfig, generate_offline

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
               "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaMemcpy")


DECODE_RANGE = "exspec.decode_step"


CHECKOUT = str(Path(__file__).resolve().parents[1])
FRAME = re.compile(r"^(.+)\((\d+)\): (.+)$")  # a Python frame event of a profile taken with_stack=True


def _source(frames: list[str]) -> str:
    """A sync's origin from the Python frames around it (innermost first): the innermost frame in exspec's code
    (this checkout or an installed `exspec`), and the innermost frame outside it when that is deeper."""
    ours = [f for f in frames if f.startswith(CHECKOUT) or "exspec/" in f]
    if not ours:
        return frames[0] if frames else "(no Python frame)"
    own = ours[0].replace(CHECKOUT + "/", "")
    return own if frames[0] == ours[0] else f"{own} <- {frames[0]}"


def _decode_syncs(prof) -> tuple[dict[str, int], dict[str, int]]:
    """SYNC_EVENTS that start inside a decode step's range (prefill steps excluded): counts by name, and by
    name and source (`_source` of the Python frame events that hold it: a profile taken with_stack=True records
    each Python call as an event; operators and CUDA runtime calls carry no stack of their own)."""
    import bisect

    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == DECODE_RANGE)
    starts = [r[0] for r in ranges]
    frames = sorted((e for e in events if FRAME.match(e.name)), key=lambda e: e.time_range.start)
    frame_starts = [e.time_range.start for e in frames]
    counts: dict[str, int] = {}
    sources: dict[str, int] = {}
    for e in events:
        if e.name not in SYNC_EVENTS:
            continue
        t = e.time_range.start
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > ranges[i][1]:
            continue
        counts[e.name] = counts.get(e.name, 0) + 1
        held, j = [], bisect.bisect_right(frame_starts, t) - 1
        while j >= 0 and frame_starts[j] >= ranges[i][0]:  # the frames that hold t, innermost (latest) first
            if frames[j].time_range.end >= t:
                held.append(frames[j].name)
            j -= 1
        key = f"{e.name}: {_source(held)}"
        sources[key] = sources.get(key, 0) + 1
    return counts, sources


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item")


PACKAGES = {p.parent.name for p in Path(CHECKOUT).glob("*/__init__.py")}  # engine, scheduler, server, ...


def _ours(frame: str) -> bool:
    """A Python frame event's name ("path(line): function") in exspec's code: this checkout (the path relative to
    the working directory when run from the checkout, as scripts/gpu_check.sh does) or an installed `exspec`."""
    m = FRAME.match(frame)
    path = m.group(1) if m else frame
    return path.split("/")[0] in PACKAGES or path.startswith(CHECKOUT) or "/exspec/" in path


def _trace_waits(trace: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The host's waits over the whole profiled run, read from its exported Chrome trace: WAITS by name, device-to-host
    copies ("Memcpy DtoH", on the GPU's side), and each CPU-side wait by the innermost two frames of exspec's code
    around it (python_function events of its thread). The profiler's own event list held no Python frame around CUDA
    runtime calls on an H100 (2026-11-27); the trace does."""
    import bisect
    from collections import defaultdict

    events = json.loads(trace.read_text())["traceEvents"]
    frames: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            frames[e.get("tid")].append(e)
    for held in frames.values():
        held.sort(key=lambda f: f["ts"])
    starts = {tid: [f["ts"] for f in held] for tid, held in frames.items()}
    counts: dict[str, int] = {}
    sources: dict[str, int] = {}
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        if cat == "gpu_memcpy" and "DtoH" in name:
            counts["Memcpy DtoH"] = counts.get("Memcpy DtoH", 0) + 1
            continue
        if name not in WAITS or cat == "python_function":
            continue
        counts[name] = counts.get(name, 0) + 1
        thread = frames.get(e.get("tid"), [])
        end = bisect.bisect_right(starts[e.get("tid")], e["ts"]) if thread else 0
        held = [f["name"] for f in thread[:end] if f["ts"] + f["dur"] >= e["ts"] and _ours(f["name"])]  # outermost first
        key = f"{name}: {' > '.join(held[-2:]) or '(no Python frame)'}"
        sources[key] = sources.get(key, 0) + 1
    return counts, dict(sorted(sources.items(), key=lambda kv: -kv[1]))


def _configs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c]


def _run(engine, prompts, max_tokens, batch, k):
    config = SchedulerConfig(max_batch_size=batch, pool_size=batch, num_speculative_tokens=k, speculation="fixed")
    steps = {"n": 0, "draft_s": 0.0, "verify_s": 0.0}
    inner = engine.step

    def counted(b):
        with torch.profiler.record_function(DECODE_RANGE):  # a range the profiled run finds its decode steps by
            out = inner(b)  # decode steps only (a prefill goes through engine.prefill)
        steps["n"] += 1
        steps["draft_s"] += out.draft_s
        steps["verify_s"] += out.verify_s
        return out

    engine.step = counted
    try:
        start = time.perf_counter()
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
        _, summary = generate_offline(engine, prompts, params, config)
        wall = time.perf_counter() - start
    finally:
        del engine.step
    return summary, steps, wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", choices=sorted(SHAPES), default="1b")
    p.add_argument("--synthetic-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--configs", type=_configs, default=[(1, 0), (1, 2), (8, 2)], help="B:k,B:k,...")
    p.add_argument("--attention", default="auto")
    p.add_argument("--compile", action="store_true", help="the same as --modes compiled")
    p.add_argument("--modes", default=None, help="eager,compiled: each config in each (default: eager)")
    p.add_argument("--no-profile", action="store_true", help="time only (no profiled run)")
    p.add_argument("--random-prompts", action="store_true", help="random token prompts (default: SpecBench questions)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per config: the median is reported")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("profile-gpu-step"))
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    target_dir, draft_dir, _ = ensure_synthetic_pair(args.synthetic, args.synthetic_cache, device=args.device)
    batches = [b for b, _ in args.configs]
    fields = dict(model=target_dir, draft_model=draft_dir, device=args.device, dtype=dtype, max_num_seqs=max(batches),
                  max_model_len=args.prompt_len + args.max_tokens + 16, attention=args.attention)
    modes = (args.modes or ("compiled" if args.compile else "eager")).split(",")
    pair = load_model_pair(EngineConfig(**fields))
    rng = random.Random(0)
    if not args.random_prompts:
        from exspec.data import encode_prompts, load_questions

        texts = encode_prompts(pair.tokenizer, load_questions("specbench", max(batches)), chat_template=False)
        pool = [t[: args.prompt_len] for t in texts]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode, (batch, k) in [(m, c) for m in modes for c in args.configs]:
        engine = SpecEngine(EngineConfig(**{**fields, "compile": mode == "compiled"}), pair=pair)
        if args.random_prompts:
            prompts = [[rng.randrange(4, pair.vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
        else:
            prompts = pool[:batch]
        start = time.perf_counter()
        _run(engine, prompts, args.max_tokens, batch, k)  # warm-up (compiles, captures, Triton JIT)
        warmup_s = time.perf_counter() - start
        timed = sorted((_run(engine, prompts, args.max_tokens, batch, k) for _ in range(args.repeats)),
                       key=lambda r: r[0].decode_seconds)
        row = {"mode": mode, "B": batch, "k": k, "warmup_s": round(warmup_s, 1),
               **_timings(*timed[len(timed) // 2])}  # the median run by decode time
        events = None
        if not args.no_profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device.startswith("cuda"):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities, with_stack=True) as prof:
                _, psteps, _ = _run(engine, prompts, args.max_tokens, batch, k)
            suffix = "-compiled" if mode == "compiled" else ""
            trace = args.out / f"trace-B{batch}-k{k}{suffix}.json"
            prof.export_chrome_trace(str(trace))
            events = prof.key_averages()
            per_step = max(psteps["n"], 1)
            whole = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
            row["syncs_per_engine_step"] = {key: round(n / per_step, 2) for key, n in sorted(whole.items())}
            inside, sources = _decode_syncs(prof)
            row["syncs_inside_decode_steps"] = {key: round(n / per_step, 2) for key, n in sorted(inside.items())}
            row["sync_sources"] = dict(sorted(sources.items(), key=lambda kv: -kv[1]))  # counts over the run
            # the whole run's waits per engine step (decode and prefill steps: each makes one by design)
            steps = max(row["decode_steps"] + row["prefill_steps"], 1)
            waits, wait_sources = _trace_waits(trace)
            row["engine_steps"] = steps
            row["waits_per_engine_step"] = {key: round(n / steps, 2) for key, n in sorted(waits.items())}
            row["wait_sources"] = wait_sources  # counts over the run
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "profile.json").write_text(json.dumps(rows, indent=1) + "\n")
        if events is not None:
            print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
    return 0


def _timings(summary, steps: dict, wall: float) -> dict:
    """A run's figures: per decode step (wall, forwards, the engine's draft and verify parts), tokens per row-step,
    decode and whole-run tokens/s."""
    n = max(summary.steps["grouped"] + summary.steps["mixed"], 1)
    decode_s = summary.decode_seconds
    return {
        "decode_steps": n,
        "prefill_steps": summary.steps["prefill"],  # each makes one host sync too
        "decode_ms_per_step": round(1e3 * decode_s / n, 3),
        "forward_ms_per_step": round(1e3 * summary.forward_seconds / n, 3),
        **{f"{part}_ms_per_step": round(1e3 * steps[f"{part}_s"] / max(steps["n"], 1), 3)
           for part in ("draft", "verify")},
        "acceptance": round(summary.mean_acceptance_length, 3),
        "decode_tok_s": round(summary.num_decode_tokens / decode_s, 1) if decode_s else None,
        "wall_tok_s": round(summary.num_generated_tokens / wall, 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())

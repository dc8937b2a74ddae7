"""`exspec serve` with a step trace, and its summary: what each scheduler step did, in the server, under a real load.

    python scripts/serve_step_trace.py TRACE.jsonl serve --model ... [serve flags]      # serve, tracing
    python scripts/serve_step_trace.py --summary TRACE.jsonl [...]                      # per burst, per (B, k)

One JSON line per engine call of `SchedulerCore.step` (the server's calibration is not traced): [start (perf_counter
s), wall s, worker-thread CPU s, kind, batch size, k, rows that drafted, draft tokens proposed, tokens kept, prompt
tokens, draft s, verify s, running, prefilling, waiting (after the step)]. Wall against CPU shows whether the event
loop's thread (HTTP, SSE) takes the step's core; draft + verify against wall, what the scheduler adds. The summary
cuts the trace into bursts where the server idled over a second, and prints each burst's decode and prefill engine
seconds per token and its decode steps per (batch size, k): their median wall time and tokens per second of wall.
Used for docs/BENCHMARKS.md section 7 (session 39, with scripts/loadtest_paired.sh's STEP_TRACE=1).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

FIELDS = ("start", "wall_s", "cpu_s", "kind", "batch_size", "k", "drafting_rows", "proposed", "tokens",
          "prompt_tokens", "draft_s", "verify_s", "running", "prefilling", "waiting")


def trace_steps(path: str) -> None:
    """Wrap SchedulerCore.step so each engine call it makes appends a line to `path` (the step loop's thread)."""
    from exspec.scheduler import core
    from exspec.scheduler.request import RequestState

    step, out = core.SchedulerCore.step, open(path, "w", buffering=1)

    def traced(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        deltas, stats = step(self)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        running = sum(r.state is RequestState.RUNNING for r in self.pool)
        prefilling = sum(r.state is RequestState.PREFILLING for r in self.pool)
        for s in stats:
            out.write(json.dumps([round(t0, 5), round(wall, 5), round(cpu, 5), s.kind, s.batch_size,
                                  s.num_draft_tokens, s.num_drafts, s.num_proposed_tokens, s.num_tokens,
                                  s.num_prompt_tokens, round(s.draft_s, 5), round(s.verify_s, 5), running,
                                  prefilling, len(self.waiting)]) + "\n")
        return deltas, stats

    core.SchedulerCore.step = traced


def bursts(path: str, gap_s: float = 1.0) -> list[list[dict]]:
    """The trace's steps, cut where the server idled longer than `gap_s`."""
    parts, cur, end = [], [], None
    with open(path) as f:
        for line in f:
            s = dict(zip(FIELDS, json.loads(line)))
            if end is not None and s["start"] - end > gap_s and cur:
                parts.append(cur)
                cur = []
            cur.append(s)
            end = s["start"] + s["wall_s"]
    return parts + [cur] if cur else parts


def summary(steps: list[dict]) -> str:
    dec = [s for s in steps if s["kind"] != "prefill"]
    pre = [s for s in steps if s["kind"] == "prefill"]
    def engine(xs: list[dict]) -> float:
        return sum(s["draft_s"] + s["verify_s"] for s in xs)

    tokens, ptokens = sum(s["tokens"] for s in dec), sum(s["prompt_tokens"] for s in pre)
    lines = [f"  {len(steps)} steps over {steps[-1]['start'] + steps[-1]['wall_s'] - steps[0]['start']:.1f} s "
             f"(worker CPU {sum(s['cpu_s'] for s in steps):.1f} s of {sum(s['wall_s'] for s in steps):.1f} s in steps); "
             f"decode {engine(dec):.1f} s engine for {tokens} tokens ({1e3 * engine(dec) / max(tokens, 1):.2f} ms a token), "
             f"prefill {engine(pre):.1f} s for {ptokens} ({1e3 * engine(pre) / max(ptokens, 1):.2f} ms a token); "
             f"rows running at a decode step {statistics.fmean(s['running'] for s in dec) if dec else 0:.1f}"]
    by = defaultdict(list)
    for s in dec:
        by[(s["batch_size"], s["k"])].append(s)
    for (b, k), xs in sorted(by.items()):
        wall = sum(s["wall_s"] for s in xs)
        lines.append(f"    B={b} k={k}: {len(xs):4d} steps, median {1e3 * statistics.median(s['wall_s'] for s in xs):6.1f} ms, "
                     f"{sum(s['tokens'] for s in xs) / len(xs):5.2f} tokens a step, {sum(s['tokens'] for s in xs) / wall:6.1f} "
                     f"tokens/s, {statistics.fmean(s['drafting_rows'] for s in xs):.1f} rows drafting")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        for path in argv[1:]:
            for i, steps in enumerate(bursts(path), start=1):
                print(f"{path} burst {i}:\n{summary(steps)}")
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    trace_steps(argv[0])
    from exspec.cli.main import main as exspec_main
    return exspec_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

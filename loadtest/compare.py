"""Compare two servers' load-test results, interleaved rounds: `python -m exspec.loadtest.compare DIR A B`.

DIR holds the JSON files `python -m exspec.loadtest --output` wrote, named `{server}-{rate}-{round}.json`
(scripts/loadtest_ab.sh writes them so). For each request rate it prints, per metric, the median over the
rounds of each server, and the ratio A / B of each round (the rounds interleave the servers, so a round's
ratio shares its machine load) with their median.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

METRICS = (
    "output_throughput",
    "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "p50_tpot_ms",
    "mean_itl_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms",
)
NAME = re.compile(r"^(?P<server>.+)-(?P<rate>[^-]+)-(?P<round>\d+)\.json$")


def load(directory: Path) -> dict[tuple[str, str], dict[int, dict]]:
    """(server, rate) -> round -> the result's metrics."""
    runs: dict[tuple[str, str], dict[int, dict]] = {}
    for path in sorted(directory.glob("*.json")):
        m = NAME.match(path.name)
        if m:
            runs.setdefault((m["server"], m["rate"]), {})[int(m["round"])] = json.loads(path.read_text())
    return runs


def compare(runs: dict[tuple[str, str], dict[int, dict]], a: str, b: str) -> list[dict]:
    """One row per (rate, metric) both servers have: the medians and the per-round ratios A / B (rounds that
    only one server has are left out of the ratios)."""
    rows = []
    for rate in sorted({r for s, r in runs if s == a} & {r for s, r in runs if s == b}):
        ra, rb = runs[(a, rate)], runs[(b, rate)]
        for metric in METRICS:
            if not all(metric in x for x in (*ra.values(), *rb.values())):
                continue
            rounds = sorted(set(ra) & set(rb))
            ratios = [ra[i][metric] / rb[i][metric] if rb[i][metric] else float("nan") for i in rounds]
            rows.append({
                "rate": rate, "metric": metric,
                "a": statistics.median(x[metric] for x in ra.values()),
                "b": statistics.median(x[metric] for x in rb.values()),
                "ratios": ratios, "ratio": statistics.median(ratios) if ratios else float("nan"),
            })
    return rows


def format_rows(rows: list[dict], a: str, b: str) -> str:
    lines = [f"{'rate':>5} {'metric':<18} {a + ' (median)':>16} {b + ' (median)':>16} {a + '/' + b:>8}  per round"]
    for r in rows:
        per_round = " ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(f"{r['rate']:>5} {r['metric']:<18} {r['a']:>16.1f} {r['b']:>16.1f} {r['ratio']:>8.2f}  {per_round}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exspec.loadtest.compare", description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("a", help="the first server's name in the file names (e.g. default)")
    p.add_argument("b", help="the second server's name (e.g. k0)")
    args = p.parse_args(argv)
    rows = compare(load(args.directory), args.a, args.b)
    if not rows:
        print(f"no results of both {args.a!r} and {args.b!r} in {args.directory}", file=sys.stderr)
        return 1
    print(format_rows(rows, args.a, args.b))
    return 0


if __name__ == "__main__":
    sys.exit(main())

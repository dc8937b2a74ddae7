"""Load test metrics, named as vLLM's `bench serve` names them, and the printed table.

Definitions (as vLLM's):
- TTFT: sending the request to the first chunk with output.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1), over requests with > 1 output token.
- ITL: time between successive chunks with output, over all requests. A speculative step may put several
  tokens in one chunk, so ITL can exceed TPOT: TPOT is per token, ITL per chunk.
- E2EL: sending the request to the end of its stream.
Throughputs divide by `duration`: the first request's send to the last request's end.
"""

from __future__ import annotations

import math
import statistics

from exspec.loadtest.client import RequestResult

PERCENTILES = (50, 90, 99)  # p50 equals the median; written under both names, as vLLM does with 50 asked


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(results: list[RequestResult], duration: float) -> dict:
    """The metrics of a finished load test, keyed as vLLM's `bench serve` JSON."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [x for r in ok for x in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
    }
    return metrics


def format_table(m: dict, title: str = "Serving Benchmark Result") -> str:
    """A plain-text table in the layout of vLLM's `bench serve`."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40}{value:<10{fmt}}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("max_concurrency") is not None:
        row("Maximum request concurrency:", m["max_concurrency"])
    row("Request rate configured (RPS):", m.get("request_rate", "inf"))
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{label:-^{width}}")
        row(f"Mean {key.upper()} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {key.upper()} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in PERCENTILES:
            row(f"P{p} {key.upper()} (ms):", m[f"p{p}_{key}_ms"], ".2f")
    eq = m.get("equivalence")
    if eq:
        lines.append(f"{'Output equivalence (greedy)':-^{width}}")
        row("Checked requests:", eq["checked"])
        if eq.get("not_checked"):
            row("Not checked (failed):", eq["not_checked"])
        row("Identical to the reference:", eq["matched"])
        row("Mismatches (near-tie / real / unclassified):",
            f"{eq['near_ties']} / {eq['real']} / {eq.get('unclassified', 0)}")
    errors = [e for e in m.get("errors", []) if e]
    if errors:
        lines.append(f"{'Errors':-^{width}}")
        for text, count in sorted(_count(errors).items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{count:>4} x {text[:width + 20]}")
    lines.append("=" * width)
    return "\n".join(lines)


def _count(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out

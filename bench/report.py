"""Write `exspec bench` results: `results.json` (a list of rows), `results.md` (tables) and, when matplotlib is
installed (`pip install 'exspec[bench]'`), `throughput.png`."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

RATIOS = (  # (numerator, denominator) of the ratio table, per batch size
    ("exspec", "target-ar"),
    ("exspec", "hf-generate"),
    ("exspec-fixed", "target-ar"),
    ("exspec", "exspec-fixed"),  # the default policy against a fixed k
    ("exspec-fixed", "exspec-mixed"),  # what grouping alone gains at a fixed k
    ("exspec", "hf-assisted"),  # B = 1 only: hf-assisted runs at batch 1
    ("exspec-fixed", "hf-assisted"),
)
NO_PLOT = "exspec bench: matplotlib is not installed, so no throughput.png: pip install 'exspec[bench]' gives the plot"


def write_results(rows: list[dict], out_dir: Path, meta: dict) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib) throughput.png into out_dir (created if
    missing); return their paths by kind ("png" only when the plot was written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md"}
    _write_atomic(paths["json"], json.dumps(rows, indent=2) + "\n")
    _write_atomic(paths["md"], markdown(rows, meta))
    detail = ", ".join(f"{k} {meta[k]}" for k in ("device", "dtype", "k", "max_tokens") if k in meta)
    png = out_dir / "throughput.png"
    if plot(rows, png, title=meta.get("title", "exspec bench") + (f" ({detail})" if detail else "")):
        paths["png"] = png
    else:
        print(NO_PLOT, file=sys.stderr)
    return paths


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, text)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(value, spec: str = ".2f", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# {meta.get('title', 'exspec bench')}", ""]
    for key, value in meta.items():
        if key != "title":
            lines.append(f"- {key}: {value}")
    lines += [
        "",
        "| method | B | tokens/s | mean acceptance length | grouped steps | equivalent | near-ties | real divergences "
        "| generated tokens | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {_fmt(r['mean_acceptance_length'])} "
            f"| {_fmt(r['grouped_fraction'], '.0%')} | {r['equivalence_rate']:.0%} | {r['near_ties']} "
            f"| {r['real_divergences']} | {r['generated_tokens']} | {r['decode_seconds']:.2f} |"
        )
    by = {(r["method"], r["batch_size"]): r for r in rows}
    sizes = sorted({r["batch_size"] for r in rows})
    ratios = [(a, b) for a, b in RATIOS if any((a, s) in by and (b, s) in by for s in sizes)]
    if ratios:
        lines += ["", "Throughput ratios (tokens/s over tokens/s; > 1: exspec is faster): the median of the ratios within "
                  "one repeat, where both methods ran together (one repeat: the ratio of the medians); in brackets the "
                  "lowest and highest of those ratios:", ""]
        lines.append("| B | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
        lines.append("| ---: |" + " ---: |" * len(ratios))
        for s in sizes:
            cells = [_ratio_cell(by.get((a, s)), by.get((b, s))) for a, b in ratios]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += fixed_ks(rows) + policy_lines(rows)
    lines += efficiency(rows)
    return "\n".join(lines) + "\n"


def fixed_ks(rows: list[dict]) -> list[str]:
    """With --fixed-ks: per batch size, the best fixed k and the default policy (`exspec`) against it."""
    by = {(r["method"], r["batch_size"]): r for r in rows}
    ks = sorted({int(r["method"][len("exspec-fixed-k"):]) for r in rows if r["method"].startswith("exspec-fixed-k")})
    if not ks:
        return []
    lines = ["", "The default policy against each fixed k (tokens/s over tokens/s, the median of the ratios within one "
             "repeat; in brackets their range; the best fixed k: the highest median tokens/s):", "",
             "| B | best fixed k | exspec / best fixed | " + " | ".join(f"exspec / k = {k}" for k in ks) + " |",
             "| ---: | ---: | ---: |" + " ---: |" * len(ks)]
    for b in sorted({r["batch_size"] for r in rows}):
        fixed = {k: by[(f"exspec-fixed-k{k}", b)] for k in ks if (f"exspec-fixed-k{k}", b) in by}
        auto = by.get(("exspec", b))
        if not fixed or not auto:
            continue
        best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
        cells = [_ratio_cell(auto, fixed.get(k)) for k in ks]
        lines.append(f"| {b} | {best} | {_ratio_cell(auto, fixed[best])} | " + " | ".join(cells) + " |")
    return lines


def paired_ratios(a: dict, b: dict) -> list[float]:
    """Per repeat, a's tokens/s over b's: the methods run in turn within a repeat (bench/runner.py), so a slow spell
    of the machine weighs on both sides of a pair more than on the medians. [] unless both rows hold the same number
    (two or more) of positive timings."""
    sa, sb = a.get("seconds_per_repeat") or [], b.get("seconds_per_repeat") or []
    if len(sa) < 2 or len(sa) != len(sb) or min(sa + sb) <= 0:
        return []
    return [(a["generated_tokens"] / x) / (b["generated_tokens"] / y) for x, y in zip(sa, sb)]


def paired_ratio(a: dict, b: dict) -> float:
    """a's tokens/s over b's: the median of the per-repeat ratios (`paired_ratios`: each repeat's methods ran together,
    so a drift of the machine between repeats cancels in each ratio, where a ratio of medians may take its two medians
    from different repeats); with fewer than two repeats that pair up, the ratio of the medians."""
    pairs = paired_ratios(a, b)
    return statistics.median(pairs) if pairs else a["tokens_per_s"] / b["tokens_per_s"]


def _ratio_cell(a: dict | None, b: dict | None) -> str:
    """'1.05x (0.98-1.10)': `paired_ratio` of a over b, and the range of the per-repeat ratios."""
    if a is None or b is None or not b["tokens_per_s"]:
        return "–"
    cell = f"{paired_ratio(a, b):.2f}x"
    pairs = paired_ratios(a, b)
    return f"{cell} ({min(pairs):.2f}-{max(pairs):.2f})" if pairs else cell


def policy_lines(rows: list[dict]) -> list[str]:
    """What the default policy did, per batch size: steps per k (all runs, warm-up included) and the share of
    decode seconds it spent exploring."""
    lines = []
    for r in rows:
        for bucket, s in (r.get("policy") or {}).items():
            steps = ", ".join(f"k = {k}: {n}" for k, n in s["steps_by_k"].items())
            o = s.get("draft_prefill_ms_per_token")
            explore = f"{s['explore_steps']} ({s.get('recheck_steps', 0)})"
            lines.append(f"| {r['batch_size']} | {bucket} | {steps} | {explore} "
                         f"| {s['explore_fraction']:.1%} | {s['best_k']} | {'–' if o is None else f'{o:.2f}'} |")
    if not lines:
        return []
    return ["", "The default policy's steps (warm-up and timed runs together; o: its estimate of the draft's prefill "
            "seconds per generated token, charged to every k > 0):", "",
            "| B | bucket | steps per k | exploring steps (of which re-checks) | exploring share of decode seconds "
            "| k* now | o (ms) |",
            "| ---: | ---: | --- | ---: | ---: | ---: | ---: |", *lines]


def efficiency(rows: list[dict]) -> list[str]:
    """Measured speedup against the ideal one, per speculative method and batch size: ideal = tokens per step /
    (forward time per speculative step / forward time per target-ar step), both measured in the same run (so a
    step's draft, verify and acceptance cost, at this batch size); measured = decode tokens/s over target-ar's
    (decode steps only: the tokens they emit over their wall time), so both sides leave prefill out. A ratio
    near 1 means the engine loses nothing outside its forwards; below 1, scheduling and host overhead cost more per
    token than without speculation; above 1, they cost less (a step's host overhead is shared by a + 1 tokens)."""
    ar = {r["batch_size"]: r for r in rows
          if r["method"] == "target-ar" and r.get("forward_ms_per_step") and r.get("decode_tokens_per_s")}
    cells = []
    for r in rows:
        base = ar.get(r["batch_size"])
        if (r["method"] == "target-ar" or base is None or not r.get("forward_ms_per_step")
                or not r["mean_acceptance_length"] or not r.get("decode_tokens_per_s")):
            continue
        ideal = r["mean_acceptance_length"] / (r["forward_ms_per_step"] / base["forward_ms_per_step"])
        measured = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        cells.append(
            f"| {r['batch_size']} | {r['method']} | {r['mean_acceptance_length']:.2f} | {r['forward_ms_per_step']:.2f} "
            f"| {base['forward_ms_per_step']:.2f} | {ideal:.2f}x | {measured:.2f}x | {measured / ideal:.2f} |"
        )
    if not cells:
        return []
    return [
        "",
        "Speculation against its ideal (ideal = tokens per step / (forward ms per step / target-ar's forward ms per "
        "step), both measured in this run; measured = decode tokens/s over target-ar's: decode steps only on both "
        "sides, their tokens over their wall time):",
        "",
        "| B | method | tokens per step | forward ms / step | target-ar forward ms / step | ideal | measured | "
        "measured / ideal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *cells,
    ]


def plot(rows: list[dict], path: Path, title: str = "exspec bench") -> bool:
    """Tokens/s against B per method, as a PNG; False (nothing written) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in methods:
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if r["method"] == m)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", linestyle="-" if len(xs) > 1 else "none", label=m)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(s) for s in sizes])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True

"""Write `exspec bench` results: `results.json` (a list of rows), `results.md` (tables) and `throughput.png`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RATIOS = (  # (numerator, denominator) of the ratio table, per batch size
    ("exspec", "target-ar"),
    ("exspec", "hf-generate"),
    ("exspec", "exspec-mixed"),
    ("exspec", "hf-assisted"),  # B = 1 only: hf-assisted runs at batch 1
)


def write_results(rows: list[dict], out_dir: Path, meta: dict) -> dict[str, Path]:
    """Write the three files into out_dir (created if missing); return their paths by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md", "png": out_dir / "throughput.png"}
    _write_atomic(paths["json"], json.dumps(rows, indent=2) + "\n")
    _write_atomic(paths["md"], markdown(rows, meta))
    detail = ", ".join(f"{k} {meta[k]}" for k in ("device", "dtype", "k", "max_tokens") if k in meta)
    plot(rows, paths["png"], title=meta.get("title", "exspec bench") + (f" ({detail})" if detail else ""))
    return paths


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
    by = {(r["method"], r["batch_size"]): r["tokens_per_s"] for r in rows}
    sizes = sorted({r["batch_size"] for r in rows})
    ratios = [(a, b) for a, b in RATIOS if any((a, s) in by and (b, s) in by for s in sizes)]
    if ratios:
        lines += ["", "Throughput ratios (tokens/s over tokens/s; > 1: exspec is faster):", ""]
        lines.append("| B | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
        lines.append("| ---: |" + " ---: |" * len(ratios))
        for s in sizes:
            cells = []
            for a, b in ratios:
                num, den = by.get((a, s)), by.get((b, s))
                cells.append(f"{num / den:.2f}x" if num is not None and den else "–")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str = "exspec bench") -> None:
    import matplotlib

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

"""One `exspec bench` command run on two commits of this repository, interleaved in one sitting: round after round,
one bench per side, the order swapped every round (old new, new old, ...), then a table of tokens/s per round, the
ratio new / old per round and the median / median. With --control the new side runs twice a round (`new` and `new-2`,
the order rotated): the ratio new-2 / new of two identical runs is the sitting's own noise, stated beside the result.

    python scripts/commit_ab.py --old 4add254 --new HEAD --rounds 5 --core 1 --out /tmp/ab -- \\
        --model DIR/target --draft-model DIR/draft --methods target-ar,exspec --batch-sizes 1,8 --chat-template \\
        --max-prompt-len 1024 --max-model-len 2048 --repeats 5
    python scripts/commit_ab.py --summarize /tmp/ab

Each side runs its own commit's package: a detached worktree of the commit under OUT/src-<side>, and beside it a
folder OUT/shim-<side>/exspec whose entries link to that worktree's exspec/ files and top-level packages (engine,
scheduler, ...), first on PYTHONPATH. An editable install of this checkout would otherwise answer `exspec.<sub>` for
any subpackage an older commit's exspec/ lacks; the script checks where `exspec.engine` comes from before it starts.
Benches run from OUT (no exspec/ there), one thread (OMP_NUM_THREADS=1), pinned with taskset when --core is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_side(out: Path, side: str, rev: str) -> Path:
    """A worktree of `rev` and its shim; returns the shim folder (for PYTHONPATH)."""
    src, shim = out / f"src-{side}", out / f"shim-{side}"
    if not src.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), rev], check=True,
                       stdout=subprocess.DEVNULL)
    pkg = shim / "exspec"
    pkg.mkdir(parents=True, exist_ok=True)
    links = [p for p in (src / "exspec").iterdir() if p.name != "__pycache__"]
    links += [p for p in src.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p.name != "exspec"]
    for p in links:
        link = pkg / p.name
        if not link.is_symlink():
            link.symlink_to(p)
    return shim


def side_env(shim: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(shim), "OMP_NUM_THREADS": "1"}


def check_side(out: Path, shim: Path) -> None:
    where = subprocess.run([sys.executable, "-c", "import exspec.engine; print(exspec.engine.__file__)"], cwd=out,
                           env=side_env(shim), check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).is_relative_to(shim):
        sys.exit(f"exspec.engine came from {where}, not from {shim}")
    print(f"{shim.name}: exspec.engine from {where}", flush=True)


def run(args: argparse.Namespace) -> None:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    revs = {"old": args.old, "new": args.new}
    shims = {side: make_side(out, side, rev) for side, rev in revs.items()}
    for shim in shims.values():
        check_side(out, shim)
    sides = ["old", "new"] + (["new-2"] if args.control else [])
    shims["new-2"] = shims["new"]
    (out / "sitting.json").write_text(json.dumps({"revs": revs, "sides": sides, "bench_args": args.bench_args,
                                                  "core": args.core, "rounds": args.rounds}, indent=1))
    taskset = ["taskset", "-c", str(args.core)] if args.core is not None else []
    for r in range(1, args.rounds + 1):
        turn = (r - 1) % len(sides)
        order = sides[turn:] + sides[:turn] if args.control else (sides if r % 2 else sides[::-1])
        for side in order:
            dest = out / f"r{r}-{side}"
            load = os.getloadavg()[0]
            print(f"round {r} {side}: start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {load:.2f}",
                  flush=True)
            with open(f"{dest}.log", "w") as log:
                rc = subprocess.run([*taskset, sys.executable, "-m", "exspec", "bench", *args.bench_args,
                                     "--output", str(dest)], cwd=out, env=side_env(shims[side]), stdout=log,
                                    stderr=subprocess.STDOUT).returncode
            if rc:
                sys.exit(f"round {r} {side}: exspec bench exited {rc}; see {dest}.log")
    summarize(out)


def load_points(path: Path) -> dict[tuple[str, int], float]:
    """(method, B) -> tokens/s from one bench's results.json (a list of rows, at 4add254 as today)."""
    rows = json.loads(path.read_text())
    return {(row["method"], int(row["batch_size"])): float(row["tokens_per_s"]) for row in rows}


def summarize(out: Path) -> None:
    meta = json.loads((out / "sitting.json").read_text())
    sides = meta["sides"]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(1, meta["rounds"] + 1):
        if not all((out / f"r{r}-{side}" / "results.json").is_file() for side in sides):
            break
        for side in sides:
            runs[side].append(load_points(out / f"r{r}-{side}" / "results.json"))
    n = len(runs["old"])
    if not n:
        sys.exit("no complete round yet")
    print(f"\nold {meta['revs']['old']}, new {meta['revs']['new']}; {n} complete rounds\n")
    head = "| method, B | old tokens/s | new tokens/s | new / old per round | median / median |"
    cols = " --- | --- | --- | --- | ---: |"
    if "new-2" in sides:
        head += " new-2 / new per round (A/A) | median / median |"
        cols += " --- | ---: |"
    print(head + "\n|" + cols)
    fmt = lambda xs: ", ".join(f"{x:.1f}" if x < 100 else f"{x:.0f}" for x in xs)  # noqa: E731
    ratios = lambda a, b: ", ".join(f"{x / y:.2f}" for x, y in zip(a, b))  # noqa: E731
    for key in sorted(runs["old"][0], key=lambda k: (k[0], k[1])):
        old = [p[key] for p in runs["old"]]
        new = [p[key] for p in runs["new"]]
        line = (f"| {key[0]}, {key[1]} | {fmt(old)} | {fmt(new)} | {ratios(new, old)} | "
                f"**{statistics.median(new) / statistics.median(old):.2f}** |")
        if "new-2" in sides:
            new2 = [p[key] for p in runs["new-2"]]
            line += f" {ratios(new2, new)} | {statistics.median(new2) / statistics.median(new):.2f} |"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the commit to compare against")
    ap.add_argument("--new", default="HEAD", help="the commit under test (default HEAD)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--core", type=int, help="pin every bench to this core (taskset)")
    ap.add_argument("--control", action="store_true", help="run the new side twice a round (A/A noise)")
    ap.add_argument("--out", type=Path, help="the sitting's folder: worktrees, shims, every bench's output")
    ap.add_argument("--summarize", type=Path, metavar="OUT", help="only print the table of a sitting's folder")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: exspec bench's arguments, no --output")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if not args.old or not args.out:
        ap.error("--old and --out are needed to run a sitting")
    if args.bench_args[:1] == ["--"]:
        args.bench_args = args.bench_args[1:]
    if "--output" in args.bench_args:
        ap.error("--output is the script's (OUT/r<round>-<side>)")
    run(args)


if __name__ == "__main__":
    main()

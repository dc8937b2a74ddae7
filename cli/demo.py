"""`exspec demo-models`: build the built-in demo target/draft pair offline (or report the cached one);
`--show` only says where the pair and its tokenizer are and whether they are built; `--target-only` prepares only the
target, which is all the SmolLM2 demo serves with by default (n-gram lookup)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from exspec.cli.flags import add_settings_arguments, settings_from_args
from exspec.demo.recipe import SCALES

SETTINGS = ("demo",)  # the shared settings demo-models takes: --demo / EXSPEC_DEMO, as serve, generate and bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=None,
        help="directory for target/ and draft/ (default: $EXSPEC_CACHE or ~/.cache/exspec/demo; its tiny/ for --demo tiny)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete pair is cached")
    parser.add_argument(
        "--target-only", action="store_true",
        help="prepare only what the demo serves by default: for SmolLM2 its target (converted from GGUF, seconds; the "
             "demo speculates by n-gram lookup), not its trained draft (minutes; used with --speculative-method draft)",
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed (default: 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--show", action="store_true",
        help="print where the target, draft and tokenizer are and whether they are built; build nothing",
    )
    add_settings_arguments(parser, SETTINGS)
    parser.add_argument(
        "--tiny", action="store_const", const="tiny", dest="demo",
        help="--demo tiny: the toy pair (both models trained here from nothing, ~3 minutes) instead of SmolLM2 and "
             "its draft",
    )
    # Tests build a tiny pair in seconds with --scale test (any recipe, over --demo).
    parser.add_argument("--scale", default=None, choices=SCALES, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from exspec.demo import DemoBuildError, build_demo_pair, cached_pair, default_demo_dir, locate_pair

    settings = settings_from_args(args, SETTINGS)  # flags, then EXSPEC_* variables, then defaults
    args.scale = args.scale or settings.demo
    if args.seed < 0:
        raise DemoBuildError(f"--seed must be >= 0, got {args.seed}")
    out = args.out if args.out is not None else default_demo_dir(args.scale)
    if args.show:
        if args.force:
            raise DemoBuildError("--show builds nothing: it cannot be combined with --force")
        where = locate_pair(out, seed=args.seed, scale=args.scale)
        print(f"target:    {where.target}")
        print(f"draft:     {where.draft}")
        print(f"tokenizer: {where.tokenizer}")
        print(f"built:     {'yes' if where.built else 'no'}")
        if where.note:
            print(f"exspec demo-models: {where.note}", file=sys.stderr)
        return 0
    if args.target_only:
        if args.force:
            raise DemoBuildError("--target-only reuses what is cached: it cannot be combined with --force")
        from exspec.demo.build import demo_target

        print(f"target: {demo_target(progress=not args.quiet, seed=args.seed, scale=args.scale, out_dir=out)}")
        return 0
    reused = not args.force and cached_pair(out, seed=args.seed, scale=args.scale) is not None
    t0 = time.perf_counter()
    target, draft = build_demo_pair(out, seed=args.seed, force=args.force, progress=not args.quiet, scale=args.scale)
    if not args.quiet:
        what = "cached demo pair" if reused else f"built the demo pair in {time.perf_counter() - t0:.0f} s"
        print(f"exspec demo-models: {what}", file=sys.stderr)
    print(f"target: {target}")
    print(f"draft:  {draft}")
    return 0

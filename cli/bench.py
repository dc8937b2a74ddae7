"""`exspec bench`: offline benchmarks on one model pair (`exspec.bench` does the work; this module only
parses flags, and its imports stay light until `run`).

- `--mode throughput` (default): tokens/s of exspec against plain decoding and Hugging Face on SpecBench
  prompts; writes DIR/results.json, DIR/results.md and, with matplotlib, DIR/throughput.png.
- `--mode forward`: the time of one target forward per (batch size, kv_len, q_len), consecutive against
  scattered KV slots; writes DIR/results.json and DIR/results.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from exspec.bench.config import (
    DEFAULT_KV_LENS, DEFAULT_REPEATS, INTERLEAVE, METHODS, SYNTHETIC_CACHE, SYNTHETIC_NAMES, BenchConfig,
)
from exspec.cli.flags import ENGINE_FIELDS, add_settings_arguments, resolve_models, settings_from_args
from exspec.scheduler.types import POOL_FACTOR

# The shared settings bench takes: the same flags, EXSPEC_* variables, defaults and checks as serve and generate
# (cli/settings.py: Settings, resolved into the EngineConfig by resolve()), less the scheduler's batch and pool (the
# bench sweeps --batch-sizes, with W = --pool-factor x B or serve's default W) and its policy (the `exspec` method runs
# the scheduler's default, exspec-fixed and exspec-mixed a fixed k); plus serve's `calibrate` (the `exspec` method
# calibrates as serve does).
BENCH_FIELDS = (*(f for f in ENGINE_FIELDS if f not in ("max_batch_size", "pool_size", "speculation")), "calibrate")



def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _k_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())  # k's range: checked by BenchConfig
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _methods(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in values if v not in METHODS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"methods must be a comma-separated subset of {','.join(METHODS)}, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, BENCH_FIELDS)
    p.add_argument("--mode", choices=["throughput", "forward"], default="throughput",
                   help="throughput: tokens/s per method (default); forward: one target forward, consecutive "
                        "against scattered KV slots")
    p.add_argument("--synthetic", choices=SYNTHETIC_NAMES, default=None,
                   help="benchmark a random Llama-shaped pair built in seconds (no training, no download): "
                        "tiny (tests), 350m (CPU), 1b, 8b (GPU); instead of --model")
    p.add_argument("--synthetic-cache", type=Path, default=SYNTHETIC_CACHE,
                   help="where synthetic pairs are cached (default: %(default)s)")
    p.add_argument("--output", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    # BenchConfig's own fields, one flag each with the field's name (exspec.bench.config.OPTIONS); no default
    # here: an absent flag leaves BenchConfig's, written once there.
    p.add_argument("--methods", type=_methods, default=None, help=f"comma-separated (default: {','.join(METHODS)})")
    p.add_argument("--batch-sizes", type=_int_list, default=None,
                   help=f"default: {','.join(map(str, BenchConfig.batch_sizes))}")
    p.add_argument("--kv-lens", type=_int_list, default=DEFAULT_KV_LENS,
                   help=f"forward mode: keys per row, comma-separated (default: {','.join(map(str, DEFAULT_KV_LENS))})")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"SpecBench questions, evenly spaced (default: {BenchConfig.num_prompts})")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="leave out questions longer than this many tokens (default: no limit)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per prompt (default: {BenchConfig.max_tokens})")
    p.add_argument("--fixed-ks", type=_k_list, default=None,
                   help="run exspec-fixed once per k in this comma-separated list (rows exspec-fixed-kK), e.g. "
                        "0,1,2,4,6 to find the best fixed k in the same run (default: only at --num-speculative-tokens)")
    p.add_argument("--pool-factor", type=int, default=None,
                   help=f"exspec pool W = factor x B, capped at the prompt count (default: serve's, {POOL_FACTOR} x B, "
                        "1 at B = 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed runs per point; the median is reported (default: {DEFAULT_REPEATS['throughput']}; "
                        f"forward mode: {DEFAULT_REPEATS['forward']})")
    p.add_argument("--interleave", choices=INTERLEAVE, default=None,
                   help="how each repeat's methods take turns: steps (every run at once, one engine step or Hugging "
                        "Face generate call at a time, the run least far along first, each timed by its own pieces) "
                        "or runs (each method's run whole, in turn) "
                        f"(default: {BenchConfig.interleave})")
    p.add_argument("--chat-template", dest="chat_template", action="store_const", const=True, default=None,
                   help="prompts as a user turn through the chat template")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const=False, default=None,
                   help="skip the untimed warm-up run of each point")
    p.add_argument("--write-reference", type=Path, default=None,
                   help="also write the target-alone (target-ar, B=1) outputs as a reference JSONL for "
                        "`python -m exspec.loadtest --reference FILE`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from exspec.bench.command import run_command
    from exspec.cli.settings import resolve

    settings = settings_from_args(args, BENCH_FIELDS)  # flags, then EXSPEC_* variables, then defaults
    if args.synthetic is not None and settings.speculative_method is None:  # the demo pair's default is not its own
        settings = settings.model_copy(update={"speculative_method": "draft"})
    return run_command(args, settings, lambda: resolve_models(settings)[:2],
                       lambda target, draft: resolve(settings, target, draft).engine)

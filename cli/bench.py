"""`exspec bench`: offline throughput of exspec against plain decoding and Hugging Face on SpecBench prompts.

Writes DIR/results.json, DIR/results.md and DIR/throughput.png. The benchmark itself is `loadtest.bench`;
this module only parses flags (its imports stay light until `run`).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from dataclasses import replace
from pathlib import Path

from exspec.cli.flags import add_settings_arguments, resolve_models, settings_from_args
from exspec.config import resolve_device

# The shared settings bench takes (the same defaults as serve and generate, from exspec.config.Settings).
BENCH_FIELDS = ("model", "draft_model", "device", "dtype", "max_model_len")

METHODS = ("target-ar", "hf-generate", "hf-assisted", "exspec-mixed", "exspec")  # == loadtest.bench.METHODS


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _methods(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in values if v not in METHODS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"methods must be a comma-separated subset of {','.join(METHODS)}, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, BENCH_FIELDS)
    p.add_argument("--output", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--methods", type=_methods, default=METHODS, help=f"comma-separated (default: {','.join(METHODS)})")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 2, 4, 8, 16, 32), help="default: 1,2,4,8,16,32")
    p.add_argument("--num-prompts", type=int, default=32, help="SpecBench questions, evenly spaced (default: 32)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="leave out questions longer than this many tokens (default: no limit)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default: 128)")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="k (default: 5)")
    p.add_argument("--pool-factor", type=int, default=4, help="exspec pool W = factor x B, capped at the prompt count (default: 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is reported (default: 3)")
    p.add_argument("--chat-template", action="store_true", help="prompts as a user turn through the chat template")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each point")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from exspec.bench.runner import NEAR_TIE_EPS, TIMING, BenchConfig, BenchError, run_bench
    from exspec.bench.report import write_results

    if args.output.exists() and not args.output.is_dir():
        raise BenchError(f"--output {str(args.output)!r} exists and is not a directory")
    # Validate every option before the demo pair may be built (minutes): placeholders stand for its paths.
    settings = settings_from_args(args, BENCH_FIELDS)
    device, dtype = resolve_device(settings.device, settings.dtype)
    config = BenchConfig(
        model=settings.model or Path("<demo target>"),
        draft_model=settings.draft_model if settings.model is not None else Path("<demo draft>"),
        device=device,
        dtype=dtype,
        methods=args.methods,
        batch_sizes=args.batch_sizes,
        num_prompts=args.num_prompts,
        max_prompt_len=args.max_prompt_len,
        max_tokens=args.max_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        pool_factor=args.pool_factor,
        repeats=args.repeats,
        chat_template=args.chat_template,
        max_model_len=settings.max_model_len or 2048,
        warmup=not args.no_warmup,
    )
    target, draft, _ = resolve_models(settings)
    config = replace(config, model=target, draft_model=draft)
    import torch

    rows = [r.to_dict() for r in run_bench(config, progress=not args.no_progress)]
    meta = {
        "title": "exspec bench",
        "command": "exspec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "exspec bench",
        "target": str(target),
        "draft": str(draft),
        "device": device,
        "dtype": dtype,
        "prompts": f"{config.num_prompts} SpecBench turns[0]" + (" (chat template)" if config.chat_template else "")
                   + (f", at most {config.max_prompt_len} tokens" if config.max_prompt_len else ""),
        "max_tokens": config.max_tokens,
        "k": config.num_speculative_tokens,
        "repeats": config.repeats,
        "tokens/s": TIMING,
        "near-tie": f"reference top-2 logit gap < {NEAR_TIE_EPS[config.dtype]} at the first differing position",
        "torch threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
    }
    paths = write_results(rows, args.output, meta)
    print(paths["md"].read_text(), end="")
    print(f"exspec bench: wrote {paths['json']}, {paths['md']}, {paths['png']}", file=sys.stderr)
    return 0

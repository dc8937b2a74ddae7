"""`exspec generate`: offline batch generation from a JSONL file, through the EXSPEC scheduler."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from exspec.errors import ExspecError


class InputError(ExspecError):
    """The input file or an argument is malformed."""


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by generate and bench."""
    p.add_argument("--model", type=Path, help="target model directory (default: the built-in demo pair)")
    p.add_argument("--draft-model", type=Path, help="draft model directory (default: the demo draft with the demo target; none otherwise)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens per sequence (default: 2048)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", type=Path, required=True, help='JSONL: {"prompt": "text"} or {"prompt_token_ids": [...]} per line')
    p.add_argument("--output", type=Path, required=True, help="JSONL results, in input order")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--seed", type=int, default=None, help="base seed; prompt i uses seed + i")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k; 0 decodes without speculation (default: 4)")
    p.add_argument("--speculation", choices=["fixed", "adaptive"], default="fixed")
    p.add_argument("--max-batch-size", type=int, default=8, help="B: sequences per step (default: 8)")
    p.add_argument("--pool-size", type=int, default=None, help="W: live sequences in the pool (default: 4 x B)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(path: Path) -> list[str | list[int]]:
    """Parse and check every line before any model is loaded: text prompts or token-id lists."""
    if not path.exists():
        raise InputError(f"input file {str(path)!r} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_token_ids" in obj):
                raise InputError(f'{path}:{lineno}: expected an object with exactly one of "prompt" or "prompt_token_ids"')
            if "prompt" in obj:
                if not isinstance(obj["prompt"], str):
                    raise InputError(f'{path}:{lineno}: "prompt" must be a string')
                prompts.append(obj["prompt"])
            else:
                ids = obj["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InputError(f'{path}:{lineno}: "prompt_token_ids" must be a list of integers')
                prompts.append(ids)
    if not prompts:
        raise InputError(f"input file {str(path)!r} holds no prompts")
    return prompts


def resolve_models(args) -> tuple[Path, Path | None]:
    if args.model is not None:
        return args.model, args.draft_model
    from exspec.demo import ensure_demo_pair

    target, draft = ensure_demo_pair(progress=True)
    return target, (args.draft_model or draft)


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    """Write all rows or nothing: a temp file in the same directory, renamed over the target."""
    path = path.resolve()
    if not path.parent.is_dir():
        raise InputError(f"output directory {str(path.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(args) -> int:
    from exspec.engine import EngineConfig, SamplingParams, SpecEngine
    from exspec.scheduler import SchedulerConfig, generate_offline

    top_k = 0 if args.top_k == -1 else args.top_k
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=top_k)
    if args.num_speculative_tokens < 0:
        raise InputError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    if args.max_batch_size < 1:
        raise InputError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if not args.output.resolve().parent.is_dir():
        raise InputError(f"output directory {str(args.output.resolve().parent)!r} does not exist")
    raw_prompts = read_prompts(args.input)
    pool = args.pool_size or 4 * args.max_batch_size
    k = args.num_speculative_tokens
    target, draft = resolve_models(args)
    if k == 0:
        draft = None
    cfg = EngineConfig(
        model=target,
        draft_model=draft,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=pool,
        max_model_len=args.max_model_len,
        max_num_speculative_tokens=max(k, 0),
    )
    sched = SchedulerConfig(
        max_batch_size=args.max_batch_size,
        pool_size=pool,
        max_waiting=10**9,
        num_speculative_tokens=k,
        speculation=args.speculation,
    )
    engine = SpecEngine(cfg)
    prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in raw_prompts]
    for i, p in enumerate(prompts):
        try:
            engine.check_prompt(p)
        except ExspecError as e:
            raise InputError(f"prompt {i} (line {i + 1} of {args.input}): {e}") from e
    params = [
        SamplingParams(**{**base.__dict__, "seed": None if args.seed is None else args.seed + i})
        for i in range(len(prompts))
    ]
    results, summary = generate_offline(engine, prompts, params, sched, progress=not args.no_progress)
    rows = [
        {"index": r.index, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
        for r in results
    ]
    write_jsonl_atomic(args.output, rows)
    print(
        f"exspec generate: {len(results)} prompts, {summary.num_generated_tokens} tokens in "
        f"{summary.wall_seconds:.2f} s: {summary.tokens_per_second:.1f} tokens/s; "
        f"mean acceptance length {summary.mean_acceptance_length:.2f}; "
        f"acceptance rate {summary.acceptance_rate:.1%}; "
        f"grouped steps {summary.grouped_fraction:.1%} (k={k}, B={args.max_batch_size}, W={pool})",
        file=sys.stderr,
    )
    return 0

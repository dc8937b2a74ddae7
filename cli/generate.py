"""`exspec generate`: offline batch generation from a JSONL file, through the EXSPEC scheduler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from exspec.cli.flags import (
    ENGINE_FIELDS,
    add_settings_arguments,
    resolve_models,
    settings_from_args,
)

from exspec.cli.settings import resolve
from exspec.data.atomic import write_lines_atomic
from exspec.errors import ExspecError, InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", type=Path, required=True, help='JSONL: {"prompt": "text"} or {"prompt_token_ids": [...]} per line')
    p.add_argument("--output", type=Path, required=True, help="JSONL results, in input order")
    add_settings_arguments(p, ENGINE_FIELDS)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    p.add_argument("--seed", type=int, default=None, help="base seed; prompt i uses seed + i")
    p.add_argument("--chat-template", action="store_true",
                   help="text prompts as one user turn through the tokenizer's chat template (as /v1/chat/completions)")
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


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    """Write all rows or nothing: a temp file in the same directory, renamed over the target."""
    if not path.resolve().parent.is_dir():
        raise InputError(f"output directory {str(path.resolve().parent)!r} does not exist")
    write_lines_atomic(path, (json.dumps(row, ensure_ascii=False) for row in rows))


def encode(tokenizer, prompt: str | list[int], chat_template: bool) -> list[int]:
    """A text prompt's token ids (as /v1/completions encodes it, or as one chat user turn); ids pass through."""
    if not isinstance(prompt, str):
        return prompt
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("--chat-template asked for, but the tokenizer has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def run(args) -> int:
    from exspec.engine import SamplingParams, SpecEngine
    from exspec.scheduler import generate_offline

    settings = settings_from_args(args, ENGINE_FIELDS)
    top_k = 0 if args.top_k == -1 else args.top_k
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=top_k)
    if not args.output.resolve().parent.is_dir():
        raise InputError(f"output directory {str(args.output.resolve().parent)!r} does not exist")
    raw_prompts = read_prompts(args.input)
    target, draft, _ = resolve_models(settings)
    cfg = resolve(settings, target, draft, max_waiting=10**9)
    engine = SpecEngine(cfg.engine)
    prompts = [encode(engine.tokenizer, p, args.chat_template) for p in raw_prompts]
    for i, p in enumerate(prompts):
        try:
            engine.check_prompt(p)
        except ExspecError as e:
            raise InputError(f"prompt {i} (line {i + 1} of {args.input}): {e}") from e
    params = [
        SamplingParams(**{**base.__dict__, "seed": None if args.seed is None else args.seed + i})
        for i in range(len(prompts))
    ]
    results, summary = generate_offline(engine, prompts, params, cfg.scheduler, progress=not args.no_progress)
    rows = [
        {"index": r.index, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
        for r in results
    ]
    write_jsonl_atomic(args.output, rows)
    sc = cfg.scheduler
    print(
        f"exspec generate: {len(results)} prompts, {summary.num_generated_tokens} tokens in "
        f"{summary.wall_seconds:.2f} s: {summary.tokens_per_second:.1f} tokens/s; "
        f"mean acceptance length {summary.mean_acceptance_length:.2f}; "
        f"acceptance rate {summary.acceptance_rate:.1%}; "
        f"grouped steps {summary.grouped_fraction:.1%} (k={cfg.engine.max_num_speculative_tokens if cfg.engine.speculates else 0} "
        f"{sc.speculation}, B={sc.max_batch_size}, W={sc.pool_size}, max_model_len={cfg.engine.max_model_len})",
        file=sys.stderr,
    )
    return 0

"""What `exspec bench` does once its flags are parsed: pick the model pair (given, the demo pair or a
synthetic one), run the throughput or the forward benchmark, write the results.

The engine's settings (device, dtype, k, attention backend, GEMM mode, compile, KV memory, max_model_len) come
resolved from the command line's one settings path, as for serve and generate: `resolve_engine(target, draft)`
gives the EngineConfig for a pair (the models' position limit checked there); this module adds the bench's own
options (methods, batch sizes, prompts ...)."""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from exspec.bench.config import DEFAULT_REPEATS, OPTIONS, BenchConfig
from exspec.bench.equivalence import NEAR_TIE_EPS, NEAR_TIE_ULPS
from exspec.bench.runner import TIMING, Bench, BenchError
from exspec.engine.config import EngineConfig


# (target, draft) -> the pair's EngineConfig, resolved from the command's settings (exspec.cli: flags, EXSPEC_*
# variables, defaults; the models' position limit)
ResolveEngine = Callable[[Path, "Path | None"], EngineConfig]


def run_command(args: argparse.Namespace, settings, resolve_models: Callable[[], tuple[Path, Path | None]],
                resolve_engine: ResolveEngine) -> int:
    """`exspec bench`. `args`: the bench's own options; `settings`: the command line's resolved settings (read:
    model, draft_model, device, dtype); resolve_models() -> (target, draft) gives the pair when --synthetic does
    not (the CLI passes the given or the demo pair); resolve_engine(target, draft) -> EngineConfig."""
    if args.output.exists() and not args.output.is_dir():
        raise BenchError(f"--output {str(args.output)!r} exists and is not a directory")
    if args.synthetic is not None and settings.model is not None:
        raise BenchError("pass one of --model and --synthetic, not both")
    # Every engine setting checked before a pair may be built (minutes): placeholders stand for its paths.
    pair = (settings.model, settings.draft_model) if settings.model is not None else (Path("<target>"), Path("<draft>"))
    template = resolve_engine(*pair)
    if args.mode == "forward":
        return _forward(args, template, resolve_models, resolve_engine)
    return _throughput(args, template, resolve_models, resolve_engine, calibrate=settings.calibrate,
                       max_prefill_tokens=settings.max_prefill_tokens)


def _pair(args, device: str, resolve_models) -> tuple[Path, Path | None, dict]:
    if args.synthetic is None:
        target, draft = resolve_models()
        return target, draft, {}
    from exspec.bench.synthetic import SyntheticError, ensure_synthetic_pair

    try:
        target, draft, info = ensure_synthetic_pair(args.synthetic, args.synthetic_cache, device=device,
                                                    log=lambda m: print(m, file=sys.stderr))
    except SyntheticError as e:
        raise BenchError(str(e)) from e
    return target, draft, {
        "synthetic": f"{args.synthetic} (random Llama shape, later layers scaled by {info['shape']['scale']}; "
                     f"draft = its first {info['shape']['draft_layers']} layer(s) + norm + head)",
        "synthetic draft agreement": f"{info['agreement']:.3f} ({info['agreement_measured_on']})",
        "parameters": f"target {info['parameters']['target'] / 1e6:.1f}M, draft {info['parameters']['draft'] / 1e6:.1f}M",
    }


def _meta(args, title: str, device: str, dtype: str) -> dict:
    import torch

    return {
        "title": title,
        "command": "exspec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "exspec bench",
        "device": device,
        "dtype": dtype,
        "torch threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}, "
                   f"torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else ""),
        "load average at start": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _engine_meta(engine) -> str:
    """The resolved engine settings every engine method shares (each point sets its own pool, k and length)."""
    mem = "device default" if engine.kv_cache_memory is None else engine.kv_cache_memory
    return (f"attention {engine.attention}, gemm {engine.gemm}, compile {'on' if engine.compile else 'off'}, "
            f"kv_cache_memory {mem}, max_model_len {engine.max_model_len}")


def _row_padding(pair) -> str:
    """What `tune_row_padding` chose for each model of the pair (engine/packed_linear.py), and the pass times per row
    count it chose from, relative to the fastest."""
    from exspec.engine.packed_linear import row_padding, row_padding_times

    models = {"target": pair.target, **({"draft": pair.draft} if pair.draft is not None else {})}
    parts = []
    for role, model in models.items():
        times = row_padding_times(model)
        measured = f" (pass time / fastest: {' '.join(f'{r}:{t:.2f}' for r, t in times.items())})" if times else ""
        parts.append(f"{role} {row_padding(model) or 'none'}{measured}")
    return ", ".join(parts)


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages (`cat /proc/loadavg`), or "?" where there is none."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _throughput(args, template: EngineConfig, resolve_models, resolve_engine: ResolveEngine,
                calibrate: bool, max_prefill_tokens: int) -> int:
    from exspec.bench.report import write_results
    from exspec.data.reference import write_reference

    # Validate every option before a pair may be built (minutes): the template holds placeholder paths. The
    # flags are BenchConfig's fields by name; an absent one (None) leaves BenchConfig's default.
    options = {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}
    config = BenchConfig(engine=template, calibrate=calibrate, max_prefill_tokens=max_prefill_tokens, **options)
    if args.write_reference is not None and not args.write_reference.resolve().parent.is_dir():
        raise BenchError(f"--write-reference: directory {str(args.write_reference.resolve().parent)!r} does not exist")
    target, draft, extra = _pair(args, template.device, resolve_models)
    config = replace(config, engine=resolve_engine(target, draft))  # the models' position limit checked here
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.no_progress else None
    bench = Bench(config, progress=not args.no_progress, log=log)
    meta = _meta(args, "exspec bench", config.device, config.dtype)  # load average as the timed runs start
    rows = [r.to_dict() for r in bench.run()]
    from exspec.scheduler import SchedulerConfig

    meta["load average at end"] = _loadavg()
    meta.update({
        "target": str(target),
        "draft": config.engine.drafter if config.engine.speculative_method == "ngram" else str(draft),
        **extra,
        "prompts": f"{config.num_prompts} SpecBench turns[0]" + (" (chat template)" if config.chat_template else "")
                   + (f", at most {config.max_prompt_len} tokens" if config.max_prompt_len else ""),
        "max_tokens": config.max_tokens,
        "k": config.num_speculative_tokens,
        "engine": _engine_meta(config.engine),
        "gemm row padding (rows: padded rows, tuned at load)": _row_padding(bench.pair),
        "exspec policy": f"SchedulerConfig() default speculation={SchedulerConfig().speculation!r}, k up to "
                         f"{config.num_speculative_tokens}"
                         + ("; calibrated before its warm-up as `exspec serve` calibrates" if config.calibrate
                            else "; not calibrated (--no-calibrate)")
                         + "; exspec-fixed and exspec-mixed: fixed k",
        "max_prefill_tokens": config.max_prefill_tokens,
        "repeats": config.repeats,
        "interleave": {
            "steps": "every method's run at once, one piece at a time (an engine step, a Hugging Face generate call), "
                     "the next piece always the run's least far along in its tokens: the runs end together",
            "runs": "each method's run whole, in turn; in reverse order every other repeat",
        }[config.interleave],
        "tokens/s": TIMING,
        "near-tie": (f"reference top-2 logit gap < {NEAR_TIE_EPS[config.dtype]}, or <= {NEAR_TIE_ULPS} units in the last "
                     f"place of the top-1 logit in {config.dtype}, at the first differing position"),
    })
    paths = write_results(rows, args.output, meta)
    print(paths["md"].read_text(), end="")
    print(f"exspec bench: wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    if args.write_reference is not None:
        write_reference(args.write_reference, bench.reference_rows())
        print(f"exspec bench: wrote the target-alone reference {args.write_reference}", file=sys.stderr)
    return 0


def _forward(args, template: EngineConfig, resolve_models, resolve_engine: ResolveEngine) -> int:
    import json

    from exspec.bench.forward import forward_markdown, forward_points, time_forwards
    from exspec.bench.report import write_text_atomic
    from exspec.engine import load_model_pair

    if not args.kv_lens or any(v < 1 for v in args.kv_lens):
        raise BenchError(f"--kv-lens must be a comma-separated list of integers >= 1, got {args.kv_lens!r}")
    repeats = args.repeats if args.repeats is not None else DEFAULT_REPEATS["forward"]
    warmup = 0 if args.warmup is False else 1
    batch_sizes = args.batch_sizes or BenchConfig.batch_sizes
    if repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {repeats}")
    target, _, extra = _pair(args, template.device, resolve_models)
    engine = resolve_engine(target, None)
    k = engine.max_num_speculative_tokens
    pair = load_model_pair(engine)
    points = forward_points(tuple(sorted(set(batch_sizes))), tuple(args.kv_lens), k)
    meta = _meta(args, "exspec bench --mode forward", engine.device, engine.dtype)  # load average as the forwards start
    attention = engine.attention
    rows = time_forwards(pair.target, pair.vocab_size, points, repeats=repeats, warmup=warmup,
                         progress=not args.no_progress, attention=attention)
    meta["load average at end"] = _loadavg()
    meta.update({
        "target": str(target),
        **extra,
        "forward": "ModelRunner.extend(tokens [B, q_len], starts=[kv_len] * B, slots) of the target, logits for "
                   "every query; q_len 1 and k + 1; KV blocks consecutive (each row's block ids in a run) or "
                   "scattered (the rows' blocks interleaved); layouts interleaved, median of "
                   f"{repeats} after {warmup} warm-up",
        "attention backend": attention,
        "k": k,
    })
    args.output.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output / "results.json", json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = forward_markdown(rows, meta)
    write_text_atomic(args.output / "results.md", md)
    print(md, end="")
    print(f"exspec bench: wrote {args.output / 'results.json'}, {args.output / 'results.md'}", file=sys.stderr)
    return 0

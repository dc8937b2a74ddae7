"""The flags every command shares, one per `exspec.cli.settings.Settings` field: `--x-y` for field `x_y`, which
the variable `EXSPEC_X_Y` also sets (a flag wins). No defaults here: `Settings` holds them, once."""

from __future__ import annotations

import argparse

from exspec.cli.settings import DTYPES, SPECULATION_MODES, Settings, attention_backends, load_settings
from exspec.engine.config import ATTENTION_DEFAULT, KV_MEMORY_DEFAULT, MAX_SPECULATIVE_TOKENS
from exspec.scheduler.core import PREFILL_BOUND_SCALE, STREAM_GAP_SCALE
from exspec.scheduler.types import POOL_FACTOR, SchedulerConfig


def _default(field: str):
    return Settings.model_fields[field].default


# settings field -> (metavar, help)
FLAGS = {
    "model": ("PATH", "target model: a Hugging Face directory, or a .gguf file (or a directory holding one), "
                      "converted once and cached; default: the built-in demo pair"),
    "draft_model": ("PATH", "draft model (a directory or a .gguf, as --model); with --model and no draft, decoding "
                            "is plain (no speculation)"),
    "served_model_name": ("NAME", "model name clients pass; default: the target directory's name (a .gguf's stem) "
                                  "('exspec-demo' for the demo pair)"),
    "demo": ("PAIR", "smollm2 | tiny: the built-in pair used without --model (default smollm2: SmolLM2-135M-Instruct "
                     "with a draft distilled from it; tiny: the toy pair trained here in minutes)"),
    "device": ("DEVICE", "auto | cpu | cuda | cuda:N (default auto: cuda when available)"),
    "dtype": ("DTYPE", f"one of {', '.join(DTYPES)} (default auto: bfloat16 on CUDA, float32 on CPU)"),
    "max_model_len": ("L", "prompt + generated tokens per sequence (default: the smaller position limit of the "
                           "target and the draft, from their config.json)"),
    "num_speculative_tokens": ("K", f"draft tokens per step, 0 to {MAX_SPECULATIVE_TOKENS} (the largest k under an "
                                    f"adaptive policy; default {_default('num_speculative_tokens')}); 0 decodes "
                                    "without speculation"),
    "attention_backend": ("NAME", f"auto | {' | '.join(attention_backends())}: how attention reads each row's KV "
                                  f"blocks (default auto: {' else '.join(ATTENTION_DEFAULT['cuda'])} on CUDA, "
                                  f"{' else '.join(ATTENTION_DEFAULT['cpu'])} on CPU (native builds a C kernel with the "
                                  "machine's compiler on first use), reference where those cannot run; "
                                  "docs/ARCHITECTURE.md)"),
    "kv_cache_memory": ("MEM", "memory for the paged KV cache: a fraction of what is free once the weights are "
                               "loaded (e.g. 0.5) or a size (e.g. 4GiB); it sets how many tokens all live sequences "
                               f"hold together (default {KV_MEMORY_DEFAULT['cuda']} on CUDA, "
                               f"{KV_MEMORY_DEFAULT['cpu']} of available RAM on CPU)"),
    "gemm": ("MODE", "auto | packed | unpadded | default: oneDNN-prepacked linears for CPU forwards; packed also pads "
                     "few-row forwards to the row count measured fastest at load (default auto: packed for float32 "
                     "on CPU)"),
    "compile": (None, "--compile: the draft's forwards and the verify run compiled at static shapes "
                      "(torch.compile fullgraph; CUDA graphs on CUDA: 2x to 7.6x faster decode steps on an H100, "
                      "30-70 s to compile each batch bucket and width at first use); default --no-compile"),
    "compile_mode": ("MODE", "inductor | cudagraph: how --compile does it (default inductor: torch.compile, CUDA "
                             "graphs through it on CUDA; cudagraph: CUDA only, the forwards recorded into CUDA graphs "
                             "with no compiler, 0.1-0.2 s to capture on an H100)"),
    "speculative_method": ("METHOD", "draft | ngram: where draft tokens come from (default draft: the draft model; "
                                     "ngram for the SmolLM2 demo pair: each sequence's own tokens, prompt and output, "
                                     "looked up for its last --prompt-lookup-max down to --prompt-lookup-min tokens "
                                     "and the tokens that followed copied, no draft model: vLLM's ngram method; the "
                                     "demo pair's draft is then not loaded)"),
    "prompt_lookup_max": ("N", f"ngram: the longest suffix looked up (default {_default('prompt_lookup_max')})"),
    "prompt_lookup_min": ("N", f"ngram: the shortest suffix looked up (default {_default('prompt_lookup_min')})"),
    "calibrate": (None, "--calibrate: before serving (bench: before the exspec method's warm-up), seconds of steps "
                        "(35 s for the demo pair on a slow 2-core CPU) at each batch size and k measure what the "
                        "speculation policy would otherwise explore under live traffic (default); --no-calibrate: it "
                        "starts unmeasured"),
    "speculation": ("MODE", f"{' | '.join(SPECULATION_MODES)}: how k is chosen per step "
                            f"(default {Settings.model_fields['speculation'].default})"),
    "max_batch_size": ("B", f"sequences per speculative step (default {_default('max_batch_size')})"),
    "pool_size": ("W", f"live sequences at most (sequence slots), W >= B (default {POOL_FACTOR} x B, 1 at B = 1); "
                       "the KV blocks free bound them too"),
    "max_waiting": ("N", f"requests queued beyond the pool before the server answers 429 "
                         f"(default {_default('max_waiting')})"),
    "max_prefill_tokens": ("N", "tokens (rows x width, padding included) of one prefill step at most; longer "
                                "prompts are prefilled in chunks, and while sequences decode a chunk is also cut to "
                                f"about {SchedulerConfig.max_prefill_chunk_s} s per token a running sequence got in its "
                                f"last step, up to {PREFILL_BOUND_SCALE:g}x, and so that it and a decode step stay "
                                f"within {STREAM_GAP_SCALE:g}x unless 1x or prefill's half of the time needs more "
                                f"(default "
                                f"{_default('max_prefill_tokens')}; vLLM's max_num_batched_tokens plays this part)"),
    "host": ("HOST", "address to listen on (default 127.0.0.1)"),
    "port": ("PORT", "port to listen on (default 8000)"),
    "api_key": ("KEY", "require 'Authorization: Bearer KEY' on /v1/* (default: no key)"),
    "shutdown_timeout": ("SECONDS", "on SIGTERM, how long running requests get to finish before they are aborted "
                                    "(default 30)"),
    "log_level": ("LEVEL", "critical | error | warning | info | debug (default info)"),
    "max_body_bytes": ("BYTES", "request bodies above this are answered 413 (default 2097152, 2 MiB)"),
    "body_read_timeout": ("SECONDS", "time a client gets to send a whole request body, else 408 (default 30)"),
    "keep_alive_timeout": ("SECONDS", "an idle connection, or one not finishing its headers, is closed (default 5)"),
    "max_n": ("N", "choices per request, n and best_of (default 16)"),
    "max_prompts": ("N", "prompts in one /v1/completions request (default 64)"),
    "max_prompt_chars": ("N", "characters per prompt, and per chat request over all messages (default 1000000)"),
    "max_messages": ("N", "messages per chat request (default 1024)"),
    "max_stop": ("N", "stop strings per request (default 16)"),
    "max_stop_chars": ("N", "characters per stop string (default 1024)"),
    "max_stop_token_ids": ("N", "stop_token_ids per request (default 256)"),
    "max_logit_bias": ("N", "logit_bias entries per request (default 300)"),
}
# The fields of the model pair, the engine and the scheduler: serve, generate and bench take these.
ENGINE_FIELDS = (
    "model", "draft_model", "demo", "device", "dtype", "max_model_len", "num_speculative_tokens", "speculation",
    "max_batch_size", "pool_size", "attention_backend", "kv_cache_memory", "gemm",
    "compile", "compile_mode", "max_prefill_tokens", "speculative_method", "prompt_lookup_max", "prompt_lookup_min",
)


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, fields=tuple(FLAGS)) -> None:
    for field in fields:
        metavar, help_text = FLAGS[field]
        env = "EXSPEC_" + field.upper()
        if metavar is None:  # a boolean: --x-y / --no-x-y
            parser.add_argument(flag(field), dest=field, default=None, action=argparse.BooleanOptionalAction,
                                help=f"{help_text} [env {env}]")
            continue
        # No default: an absent flag leaves the field to its environment variable, then to Settings' default.
        parser.add_argument(flag(field), dest=field, default=None, metavar=metavar, help=f"{help_text} [env {env}]")


def settings_from_args(args: argparse.Namespace, fields=tuple(FLAGS)) -> Settings:
    """Raises exspec.errors.ConfigError naming each bad flag / variable."""
    return load_settings({f: getattr(args, f) for f in fields if getattr(args, f, None) is not None})


def resolve_models(settings: Settings):
    """(target, draft, served name): the given pair, or the built-in demo pair (built on first use); where no draft
    is used (n-gram lookup, the SmolLM2 demo's default, or k = 0), the demo's target alone (`demo_target`)."""
    if settings.model is not None:
        from exspec.engine.gguf import model_name, resolve_model_path

        name = settings.served_model_name or model_name(settings.model.resolve())
        # a .gguf file (or a directory holding one) becomes its converted, cached Hugging Face directory
        draft = resolve_model_path(settings.draft_model) if settings.draft_model is not None else None
        return resolve_model_path(settings.model), draft, name
    from exspec.demo import demo_target, ensure_demo_pair

    name = settings.served_model_name or "exspec-demo"
    if settings.resolved_speculative_method == "ngram" or settings.num_speculative_tokens == 0:
        return demo_target(progress=True, scale=settings.demo), None, name  # no draft to build or load
    target, draft = ensure_demo_pair(progress=True, scale=settings.demo)
    return target, draft, name

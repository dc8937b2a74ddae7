"""The built-in demo model pair: a small Llama-shaped target and a much smaller draft, built offline.

No model hub is needed. `build_demo_pair` trains, from nothing but the installed packages:
1. a byte-level BPE tokenizer (`tokenizers`) with a chat template and `<|end|>` as EOS;
2. a target (Llama, 4 layers, hidden 256) on chat-formatted text: the SpecBench questions with their
   reference answers (Apache-2.0), docstrings of the Python standard library and the Python language
   reference topics shipped in `pydoc_data` (both PSF License 2.0);
3. a draft (Llama, 1 layer, hidden 128) distilled from the target: while the target trains, the draft
   learns the target's (detached) next-token distribution on the same batches; then the target continues
   held-in prompts and the draft is distilled on those continuations, so it agrees with the target
   often, but not always.

The pair is deterministic given a seed (fixed thread count, seeded RNGs, a corpus read in sorted
order) on one software stack; the standard library text differs between Python versions.
Writes are atomic: both models are built in a temporary directory inside `out_dir`, moved into place,
and a marker file `demo-pair.json` is written last; a directory without the marker is never reused.

Also `python -m exspec.demo.build --measure`: draft/target agreement, the engine's acceptance length and
each model's forward latency (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from exspec.data import read_rows
from exspec.errors import ExspecError

FORMAT_VERSION = 2  # bump when the recipe changes: older caches are rebuilt, never reused
MARKER = "demo-pair.json"  # written last into out_dir: its presence means the pair is complete
MODEL_MARKER = "exspec_demo.json"  # inside target/ and draft/: marks directories this module may replace

SPECIALS = ["<unk>", "<s>", "<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
UNK_ID, BOS_ID, PAD_ID, EOS_ID = 0, 1, 2, 3  # ids of the first four specials
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class DemoBuildError(ExspecError):
    """The demo pair cannot be built or written (unwritable directory, foreign files in the way)."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # hidden size
    layers: int  # decoder layers
    intermediate: int  # SwiGLU width
    heads: int  # attention heads (head_dim = hidden // heads)
    kv_heads: int  # key/value heads (grouped-query attention)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that decides the pair's weights, besides the seed and the corpus."""

    vocab_size: int  # BPE vocabulary, specials included
    target: ModelShape
    draft: ModelShape
    seq_len: int  # training window in tokens
    batch_size: int  # windows per step
    steps: int  # optimizer steps (target and draft step together)
    lr: float  # peak AdamW learning rate of both models; linear warm-up, cosine decay to lr / 10
    warmup: int  # warm-up steps
    corpus_chars: int  # the corpus is cut to about this many characters
    distill_prompts: int  # prompts the target continues for the draft's second phase
    distill_new_tokens: int  # tokens the target generates per prompt (greedy for half, sampled for half)
    distill_steps: int  # draft-only steps on those continuations
    threads: int  # torch intra-op threads at most while building (1 when the cores are busy; see _threads)


RECIPES = {
    "full": DemoRecipe(
        vocab_size=2048,
        target=ModelShape(hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2),
        draft=ModelShape(hidden=128, layers=1, intermediate=384, heads=2, kv_heads=1),
        seq_len=128,
        batch_size=8,
        steps=480,
        lr=3e-3,
        warmup=30,
        corpus_chars=1_200_000,
        distill_prompts=192,
        distill_new_tokens=64,
        distill_steps=400,
        threads=2,
    ),
    # Seconds, for tests: same code path, tiny models.
    "test": DemoRecipe(
        vocab_size=384,
        target=ModelShape(hidden=32, layers=2, intermediate=64, heads=2, kv_heads=1),
        draft=ModelShape(hidden=16, layers=1, intermediate=32, heads=1, kv_heads=1),
        seq_len=64,
        batch_size=4,
        steps=8,
        lr=3e-3,
        warmup=2,
        corpus_chars=40_000,
        distill_prompts=4,
        distill_new_tokens=8,
        distill_steps=3,
        threads=1,
    ),
}


# ---------------------------------------------------------------------------------------------- paths


def default_demo_dir() -> Path:
    """Where the demo pair is cached: `$EXSPEC_CACHE` if set, else `~/.cache/exspec/demo`."""
    env = os.environ.get("EXSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exspec" / "demo"


def cached_pair(out_dir: Path, *, seed: int = 0, scale: str = "full") -> tuple[Path, Path] | None:
    """The complete pair in out_dir built with this seed, scale and format version, else None."""
    out_dir = Path(out_dir)
    try:
        info = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    want = {"format_version": FORMAT_VERSION, "seed": seed, "scale": scale}
    if any(info.get(k) != v for k, v in want.items()):
        return None
    target, draft = out_dir / "target", out_dir / "draft"
    for d in (target, draft):
        if not ((d / "config.json").is_file() and (d / "tokenizer.json").is_file() and (d / MODEL_MARKER).is_file()):
            return None
    return target, draft


def ensure_demo_pair(progress: bool = True, *, seed: int = 0, scale: str = "full") -> tuple[Path, Path]:
    """The demo pair in `default_demo_dir()`: reused if a complete one is cached, else built (minutes)."""
    return build_demo_pair(default_demo_dir(), seed=seed, force=False, progress=progress, scale=scale)


def build_demo_pair(
    out_dir: Path, *, seed: int = 0, force: bool = False, progress: bool = True, scale: str = "full"
) -> tuple[Path, Path]:
    """Build the pair into out_dir/target and out_dir/draft; return both paths.

    A complete pair already there (same seed, scale and format) is reused unless `force`. Two processes
    building into the same directory serialize on a lock file; the second then reuses the first's pair.
    """
    if scale not in RECIPES:
        raise DemoBuildError(f"scale must be one of {sorted(RECIPES)}, got {scale!r}")
    if not isinstance(seed, int) or seed < 0:
        raise DemoBuildError(f"seed must be an integer >= 0, got {seed!r}")
    out_dir = Path(out_dir).expanduser().absolute()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoBuildError(f"cannot create the output directory {str(out_dir)!r}: {e.strerror or e}") from e
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DemoBuildError(f"the output directory {str(out_dir)!r} is not writable")
    with _locked(out_dir):
        if not force:
            found = cached_pair(out_dir, seed=seed, scale=scale)
            if found is not None:
                return found
        for name in ("target", "draft"):
            existing = out_dir / name
            if existing.exists() and not (existing / MODEL_MARKER).is_file():
                raise DemoBuildError(
                    f"{str(existing)!r} exists and was not written by exspec demo-models: "
                    "move it away or choose another --out"
                )
        with tempfile.TemporaryDirectory(prefix=".build-", dir=out_dir) as tmp:
            info = _build_into(Path(tmp), RECIPES[scale], seed=seed, scale=scale, progress=progress)
            (out_dir / MARKER).unlink(missing_ok=True)  # from here until the end the pair is incomplete
            for name in ("target", "draft"):
                dst = out_dir / name
                if dst.exists():
                    shutil.rmtree(dst)
                os.replace(Path(tmp) / name, dst)
            _write_atomic(out_dir / MARKER, json.dumps(info, indent=2) + "\n")
    return out_dir / "target", out_dir / "draft"


@contextlib.contextmanager
def _locked(out_dir: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    try:
        fd = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DemoBuildError(f"cannot write to {str(out_dir)!r}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- corpus


def _clip(text: str, limit: int) -> str:
    """At most `limit` characters, cut at a paragraph (else sentence) boundary when there is one."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 3:
        cut = text.rfind(". ", 0, limit) + 1
    if cut < limit // 3:
        cut = limit
    return text[:cut].strip()


def _flatten(ref) -> str:
    if isinstance(ref, str):
        return ref
    if isinstance(ref, (list, tuple)):
        return ", ".join(_flatten(r) for r in ref)
    return str(ref)


def _clean_reference(text: str) -> str:
    text = re.sub(r"<<[^>]*>>", "", text)  # GSM8K calculator annotations
    return re.sub(r"^#### ", "The answer is ", text, flags=re.M).strip()


def spec_bench_conversations() -> list[list[dict]]:
    """SpecBench questions (Apache-2.0) with their reference answers, turn by turn.

    MT-Bench's 80 questions are SpecBench's ids 81-160, so they are not read twice.
    """
    convs = []
    for row in read_rows("specbench"):
        refs = row.get("reference") or []
        if isinstance(refs, list) and row.get("category") == "rag":
            refs = [refs]  # one list of acceptable answers for the one turn
        messages = []
        for turn, ref in zip(row["turns"], refs):
            answer = _clean_reference(_flatten(ref))
            if not answer:
                break
            messages += [{"role": "user", "content": turn.strip()}, {"role": "assistant", "content": answer}]
        if messages:
            convs.append(messages)
    return convs


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv", "pydoc_data",
            "site-packages", "dist-packages", "__phello__", "encodings"}
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    skipped = lambda p: p.parent != root and (p.parent.name in skip or p.parent.name.startswith(("test", "config-")))  # noqa: E731
    return [p for p in files if not skipped(p)]


def stdlib_docstring_conversations(rng: random.Random, limit_chars: int) -> list[list[dict]]:
    """Docstrings of the installed Python standard library (PSF License 2.0), read with `ast` (nothing is
    imported), as questions about a module, class or function and the docstring as the answer."""
    convs, total = [], 0
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        if total >= limit_chars:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        rel = path.relative_to(root).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        items = [(tree, module, "module")]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                items.append((node, f"{module}.{node.name}", kind))
                if kind == "class":
                    items += [
                        (m, f"{module}.{node.name}.{m.name}", "method")
                        for m in node.body
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_")
                    ]
        for node, name, kind in items:
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 60:
                continue
            if kind == "module":
                q = rng.choice([f"What is the Python {name} module for?", f"Explain the {name} module."])
            elif kind == "class":
                q = rng.choice([f"Describe the class {name}.", f"What is {name} in Python?"])
            else:
                q = rng.choice([f"What does {name}() do?", f"Explain {name}.", f"How do I use {name}?"])
            answer = _clip(doc, 700)
            convs.append([{"role": "user", "content": q}, {"role": "assistant", "content": answer}])
            total += len(q) + len(answer)
    return convs


def pydoc_topic_conversations(limit_chars: int) -> list[list[dict]]:
    """The Python language reference topics shipped as `pydoc_data.topics` (PSF License 2.0): a question
    about a topic, then "Go on." turns, each answered with the next few paragraphs."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    convs, total = [], 0
    for key in sorted(topics):
        if total >= limit_chars:
            break
        paragraphs = [p.strip() for p in topics[key].split("\n\n") if p.strip()]
        chunks, cur = [], ""
        for p in paragraphs:
            if cur and len(cur) + len(p) > 800:
                chunks.append(cur)
                cur = ""
            cur = f"{cur}\n\n{p}" if cur else p
        if cur:
            chunks.append(cur)
        messages = []
        for i, chunk in enumerate(chunks[:4]):
            q = f"Explain {key.replace('-', ' ')} in Python." if i == 0 else "Go on."
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": _clip(chunk, 1200)}]
            total += len(q) + len(messages[-1]["content"])
        convs.append(messages)
    return convs


def build_corpus(seed: int, limit_chars: int) -> list[str]:
    """Chat-formatted training texts (one per conversation), shuffled with `seed`, about limit_chars long."""
    rng = random.Random(seed)
    spec = spec_bench_conversations()
    spec_chars = sum(len(m["content"]) for c in spec for m in c)
    if spec_chars > limit_chars // 2:  # small scales: a deterministic subset
        spec = random.Random(seed + 1).sample(spec, max(1, len(spec) * limit_chars // (2 * spec_chars)))
        spec_chars = sum(len(m["content"]) for c in spec for m in c)
    rest = max(limit_chars - spec_chars, 0)
    topics = pydoc_topic_conversations(rest * 2 // 5)
    docs = stdlib_docstring_conversations(rng, rest - sum(len(m["content"]) for c in topics for m in c))
    convs = spec + topics + docs
    rng.shuffle(convs)
    return [render_chat(c) for c in convs]


def render_chat(messages: list[dict]) -> str:
    """The chat template, in Python (for the training text; the tokenizer carries it as Jinja)."""
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)


# ---------------------------------------------------------------------------------------------- build


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the chat specials, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    ids = fast.convert_tokens_to_ids(SPECIALS[:4])
    if ids != [UNK_ID, BOS_ID, PAD_ID, EOS_ID]:
        raise DemoBuildError(f"unexpected special token ids {ids}")
    return fast


def _llama(shape: ModelShape, vocab_size: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _lr_at(step: int, r: DemoRecipe) -> float:
    import math

    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def train_pair(tokens, r: DemoRecipe, seed: int, progress: bool):
    """Train the target on next-token prediction and, on the same batches, distil the draft from the
    target's detached distribution (KL(target || draft)). tokens: [N] long. Returns (target, draft, log)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    target = _llama(r.target, r.vocab_size)
    draft = _llama(r.draft, r.vocab_size)
    opts = [
        torch.optim.AdamW(m.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1) for m in (target, draft)
    ]
    gen = torch.Generator().manual_seed(seed)
    span = r.seq_len + 1
    if tokens.numel() <= span:
        raise DemoBuildError(f"the corpus has {tokens.numel()} tokens: too few for windows of {span}")
    windows = torch.arange(span)  # [T + 1]
    log = []
    bar = tqdm(range(r.steps), desc="training demo pair", unit="step", disable=not progress, file=sys.stderr)
    for step in bar:
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, r)
        starts = torch.randint(0, tokens.numel() - span, (r.batch_size,), generator=gen)  # [B]
        batch = tokens[starts[:, None] + windows]  # [B, T + 1]
        inp, labels = batch[:, :-1], batch[:, 1:]  # [B, T] each
        t_logits = target(input_ids=inp).logits  # [B, T, V]
        t_loss = F.cross_entropy(t_logits.flatten(0, 1), labels.flatten())
        d_logits = draft(input_ids=inp).logits  # [B, T, V]
        teacher = F.log_softmax(t_logits.detach().flatten(0, 1), dim=-1)  # [B * T, V]
        d_loss = F.kl_div(F.log_softmax(d_logits.flatten(0, 1), dim=-1), teacher, log_target=True, reduction="batchmean")
        (t_loss + d_loss).backward()
        for m, opt in zip((target, draft), opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        log.append((round(t_loss.item(), 4), round(d_loss.item(), 4)))
        bar.set_postfix(target_loss=f"{log[-1][0]:.3f}", draft_kl=f"{log[-1][1]:.3f}")
    bar.close()
    return target.eval(), draft.eval(), log


def distill_prompt_texts(seed: int, n: int) -> list[str]:
    """`n` short chat prompts for the draft's second phase: corpus questions, never the SpecBench
    questions that `measure_agreement` and `measure_acceptance` use by default (every 10th)."""
    held_out = {i * 480 // 48 for i in range(48)}
    rows = read_rows("specbench")
    questions = [r["turns"][0] for i, r in enumerate(rows) if i not in held_out and len(r["turns"][0]) <= 600]
    rng = random.Random(seed + 2)
    docs = [c[0]["content"] for c in stdlib_docstring_conversations(rng, 200_000)]
    topics = [c[0]["content"] for c in pydoc_topic_conversations(100_000)]
    pool = rng.sample(questions, min(len(questions), n // 2))
    pool += rng.sample(docs + topics, min(len(docs) + len(topics), n - len(pool)))
    return [render_chat([{"role": "user", "content": q}]) + "<|assistant|>" for q in pool]


def distill_draft_on_continuations(target, draft, tokenizer, r: DemoRecipe, seed: int, progress: bool) -> float:
    """Phase 2: the target continues held-in prompts (greedy for even prompts, sampled at temperature 1
    for odd ones); the draft is trained on those sequences to match the target's distribution at every
    position. This is where the draft learns to follow the target's own generations, which is what
    speculative decoding asks of it. Returns the last KL."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    texts = distill_prompt_texts(seed, r.distill_prompts)
    seqs: list[int] = []
    with torch.inference_mode():
        for i in range(0, len(texts), 16):
            for sample in (False, True):
                group = texts[i + int(sample) : i + 16 : 2]
                if not group:
                    continue
                enc = tokenizer(group, return_tensors="pt", padding=True, padding_side="left")
                out = target.generate(
                    **enc, max_new_tokens=r.distill_new_tokens, do_sample=sample, temperature=1.0, top_k=0,
                    top_p=1.0, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                )  # [b, P + n]
                for row in out.tolist():
                    seqs += [t for t in row if t != PAD_ID]
    tokens = torch.tensor(seqs, dtype=torch.long)  # [N]
    span = min(r.seq_len + 1, tokens.numel() - 1)
    windows = torch.arange(span)
    opt = torch.optim.AdamW(draft.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 3)
    draft.train()
    kl = float("nan")
    bar = tqdm(range(r.distill_steps), desc="distilling draft", unit="step", disable=not progress, file=sys.stderr)
    for step in bar:
        for g in opt.param_groups:  # linear decay from lr to lr / 10
            g["lr"] = r.lr * (1 - 0.9 * step / max(1, r.distill_steps - 1))
        starts = torch.randint(0, tokens.numel() - span, (r.batch_size,), generator=gen)  # [B]
        inp = tokens[starts[:, None] + windows][:, :-1]  # [B, T]
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=inp).logits.flatten(0, 1), dim=-1)  # [B * T, V]
        student = F.log_softmax(draft(input_ids=inp).logits.flatten(0, 1), dim=-1)  # [B * T, V]
        loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        kl = round(loss.item(), 4)
        bar.set_postfix(draft_kl=f"{kl:.3f}")
    bar.close()
    return kl


def _build_threads(limit: int) -> int:
    """Intra-op threads for training: up to `limit`, but 1 when other processes already keep the cores busy.

    On a shared machine, threads that wait for each other on oversubscribed cores cost several times more
    CPU than one thread alone. The weights do not depend on this choice: CPU matmuls here split work over
    output blocks, not over the reduced dimension (tests/test_demo_models.py checks 1 vs 2 threads).
    """
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] > cores / 2
    except OSError:
        busy = False
    return 1 if busy else max(1, min(limit, cores))


def _build_into(tmp: Path, r: DemoRecipe, *, seed: int, scale: str, progress: bool) -> dict:
    """Train everything and save tmp/target and tmp/draft. Returns the build record for the marker."""
    import torch
    from transformers import GenerationConfig

    t0, cpu0 = time.perf_counter(), time.process_time()
    say = (lambda msg: print(f"[demo-models] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    threads = torch.get_num_threads()
    build_threads = _build_threads(r.threads)
    torch.set_num_threads(build_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            say("reading the corpus")
            texts = build_corpus(seed, r.corpus_chars)
            say(f"{len(texts)} conversations, {sum(map(len, texts))} characters; training the tokenizer")
            tokenizer = train_tokenizer(texts, r.vocab_size)
            enc = tokenizer.backend_tokenizer.encode_batch(texts)
            tokens = torch.tensor([t for e in enc for t in e.ids], dtype=torch.long)  # [N]
            say(f"{tokens.numel()} tokens; training target and draft for {r.steps} steps")
            target, draft, log = train_pair(tokens, r, seed, progress)
            say(f"target continues {r.distill_prompts} prompts; distilling the draft for {r.distill_steps} steps")
            distill_kl = distill_draft_on_continuations(target, draft, tokenizer, r, seed, progress)
            draft.eval()
    finally:
        torch.set_num_threads(threads)
    seconds = round(time.perf_counter() - t0, 1)
    info = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "scale": scale,
        "recipe": asdict(r),
        "corpus_tokens": tokens.numel(),
        "corpus_conversations": len(texts),
        "final_target_loss": log[-1][0],
        "final_draft_kl": log[-1][1],
        "final_draft_kl_on_continuations": distill_kl,
        "build_seconds": seconds,
        "build_cpu_seconds": round(time.process_time() - cpu0, 1),
        "build_threads": build_threads,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    for name, model in (("target", target), ("draft", draft)):
        d = tmp / name
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
        )
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        params = sum(p.numel() for p in model.parameters())
        (d / MODEL_MARKER).write_text(json.dumps({**info, "role": name, "parameters": params}, indent=2) + "\n")
        info[f"{name}_parameters"] = params
    say(f"built in {seconds} s")
    return info


# ---------------------------------------------------------------------------------------------- measure


def spec_bench_prompts(num_prompts: int) -> list[tuple[str, str]]:
    """(category, turns[0]) of `num_prompts` SpecBench questions evenly spaced over the file."""
    rows = read_rows("specbench")
    num_prompts = max(1, min(num_prompts, len(rows)))
    return [(rows[i * len(rows) // num_prompts]["category"], rows[i * len(rows) // num_prompts]["turns"][0])
            for i in range(num_prompts)]


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def measure_agreement(target_dir: Path, draft_dir: Path, num_prompts: int = 48, max_tokens: int = 64) -> dict:
    """How often the draft's greedy top-1 equals the target's along the target's own greedy continuations.

    For each prompt (SpecBench `turns[0]` in the chat template), the target generates greedily up to
    max_tokens (stopping at EOS); the draft then reads prompt + continuation in one forward, and every
    continuation position counts once (agree: the draft's argmax there is the token the target chose).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    agree = total = ended = 0
    continuations = []
    with torch.inference_mode():
        for _, text in spec_bench_prompts(num_prompts):
            ids = torch.tensor([_chat_ids(tok, text)])  # [1, P]
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID,
            )  # [1, P + n]
            cont = out[0, ids.shape[1]:]  # [n]
            ended += int(cont.numel() > 0 and cont[-1].item() == EOS_ID)
            d_logits = draft(input_ids=out).logits[0, ids.shape[1] - 1 : -1]  # [n, V]
            agree += (d_logits.argmax(-1) == cont).sum().item()
            total += cont.numel()
            continuations.append(cont.tolist())
    return {
        "agreement": agree / max(total, 1),
        "positions": total,
        "prompts": len(continuations),
        "ended_with_eos": ended,
        "continuations": continuations,
    }


def measure_acceptance(target_dir: Path, draft_dir: Path, num_prompts: int = 48, max_tokens: int = 64,
                       k: int = 4, batch_size: int = 8) -> dict:
    """The engine's greedy mean acceptance length at k: mean over steps and sequences of (accepted + 1)."""
    from transformers import AutoTokenizer

    from exspec.engine import EngineConfig, SamplingParams, SpecEngine
    from exspec.scheduler import SchedulerConfig, generate_offline

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [_chat_ids(tok, text) for _, text in spec_bench_prompts(num_prompts)]
    cfg = EngineConfig(
        model=Path(target_dir), draft_model=Path(draft_dir), max_num_seqs=batch_size,
        max_model_len=max(map(len, prompts)) + max_tokens + 1, max_num_speculative_tokens=k,
    )
    engine = SpecEngine(cfg)
    t0 = time.perf_counter()
    sched = SchedulerConfig(max_batch_size=batch_size, pool_size=batch_size, num_speculative_tokens=k, speculation="fixed")
    results, summary = generate_offline(engine, prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts), sched)
    emitted, steps = summary.num_decode_tokens, summary.num_row_steps
    outputs = [r.token_ids for r in results]
    return {
        "mean_acceptance_length": emitted / max(steps, 1),
        "sequence_steps": steps,
        "k": k,
        "seconds": time.perf_counter() - t0,
        "outputs": outputs,
    }


def measure_forward_latency(model_dirs, batch_sizes=(1, 8), context: int = 32, repeats: int = 60) -> list[dict]:
    """Median seconds of one decode forward (1 new token per row over `context` cached tokens) of each
    model, per batch size. The models take turns call by call, so load from other processes hits both."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in model_dirs]
    results: list[dict] = [{} for _ in models]
    with torch.inference_mode():
        for b in batch_sizes:
            ids = torch.randint(10, models[0].config.vocab_size, (b, context), generator=torch.Generator().manual_seed(0))
            caches = [DynamicCache(config=m.config) for m in models]
            for m, c in zip(models, caches):
                m(input_ids=ids, past_key_values=c, use_cache=True)
            nxt = ids[:, -1:]  # [b, 1]
            times: list[list[float]] = [[] for _ in models]
            for _ in range(repeats + 5):
                for m, c, ts in zip(models, caches, times):
                    t = time.perf_counter()
                    m(input_ids=nxt, past_key_values=c, use_cache=True)
                    ts.append(time.perf_counter() - t)
                    c.crop(-1)  # drop it again: always one new token over the same context
            for res, ts in zip(results, times):
                ts = sorted(ts[5:])
                res[b] = ts[len(ts) // 2]
    return results


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exspec.demo.build", description="Build and measure the demo pair.")
    p.add_argument("--dir", type=Path, default=None, help="pair directory (default: the demo cache)")
    p.add_argument("--scale", default="full", choices=sorted(RECIPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--measure", action="store_true", help="agreement, acceptance length and forward latency")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--show", type=int, default=3, help="print this many decoded continuations")
    a = p.parse_args(argv)
    out = a.dir if a.dir is not None else default_demo_dir()
    t0 = time.perf_counter()
    target, draft = build_demo_pair(out, seed=a.seed, force=a.force, scale=a.scale)
    print(f"target: {target}\ndraft:  {draft}\n(build or reuse: {time.perf_counter() - t0:.1f} s)")
    if not a.measure:
        return 0
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    for name, d in (("target", target), ("draft", draft)):
        info = json.loads((d / MODEL_MARKER).read_text())
        print(f"{name}: {info['parameters']:,} parameters")
    lat_t, lat_d = measure_forward_latency([target, draft])
    for b in lat_t:
        print(f"decode forward, batch {b}, 32-token context: target {lat_t[b] * 1e3:.2f} ms, "
              f"draft {lat_d[b] * 1e3:.2f} ms, ratio {lat_t[b] / lat_d[b]:.1f}x")
    ag = measure_agreement(target, draft, a.num_prompts, a.max_tokens)
    print(f"agreement (draft top-1 == target greedy): {ag['agreement']:.1%} over {ag['positions']} positions, "
          f"{ag['prompts']} prompts; {ag['ended_with_eos']} continuations ended with EOS")
    acc = measure_acceptance(target, draft, a.num_prompts, a.max_tokens, k=a.k)
    print(f"engine, greedy, k={acc['k']}: mean acceptance length {acc['mean_acceptance_length']:.2f} "
          f"over {acc['sequence_steps']} sequence-steps ({acc['seconds']:.1f} s)")
    same = sum(o == c for o, c in zip(acc["outputs"], ag["continuations"]))
    print(f"engine output identical to target greedy (HF generate): {same}/{len(acc['outputs'])}")
    tok = AutoTokenizer.from_pretrained(target)
    for (cat, text), cont in list(zip(spec_bench_prompts(a.num_prompts), ag["continuations"]))[: a.show]:
        print(f"--- [{cat}] {text[:80]!r}\n{tok.decode(cont)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())

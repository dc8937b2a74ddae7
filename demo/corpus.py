"""The demo pair's training text, read offline: SpecBench questions with their reference answers
(Apache-2.0), docstrings of the installed Python standard library and the language reference topics in
`pydoc_data` (both PSF License 2.0); rendered in the chat format the tokenizer's template writes."""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

from exspec.data import read_rows

MEASURE_PROMPTS = 48  # SpecBench questions measure.py uses by default; never used as distillation prompts


def render_chat(messages: list[dict]) -> str:
    """The chat template, in Python (for the training text; the tokenizer carries it as Jinja)."""
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)


def spec_bench_prompts(num_prompts: int) -> list[tuple[str, str]]:
    """(category, turns[0]) of `num_prompts` SpecBench questions evenly spaced over the file."""
    rows = read_rows("specbench")
    num_prompts = max(1, min(num_prompts, len(rows)))
    picked = (rows[i * len(rows) // num_prompts] for i in range(num_prompts))
    return [(row["category"], row["turns"][0]) for row in picked]


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


def distill_prompt_texts(seed: int, n: int) -> list[str]:
    """`n` short chat prompts, ready for the target to continue, for the draft's second phase: corpus
    questions, never the SpecBench questions that measure.py uses by default."""
    rows = read_rows("specbench")
    held_out = {i * len(rows) // MEASURE_PROMPTS for i in range(MEASURE_PROMPTS)}
    questions = [r["turns"][0] for i, r in enumerate(rows) if i not in held_out and len(r["turns"][0]) <= 600]
    rng = random.Random(seed + 2)
    docs = [c[0]["content"] for c in stdlib_docstring_conversations(rng, 200_000)]
    topics = [c[0]["content"] for c in pydoc_topic_conversations(100_000)]
    pool = rng.sample(questions, min(len(questions), n // 2))
    pool += rng.sample(docs + topics, min(len(docs) + len(topics), n - len(pool)))
    return [render_chat([{"role": "user", "content": q}]) + "<|assistant|>" for q in pool]


def imitation_prompts(seed: int, n_train: int, n_heldout: int) -> tuple[list[str], list[str]]:
    """(training, held-out) user turns for the real pair's draft. Held-out: the first `n_heldout` of the
    SpecBench questions measure.py uses (MEASURE_PROMPTS, evenly spaced); training: the other SpecBench first
    turns (at most 600 characters) in a seeded order, then stdlib docs questions if more are asked for."""
    rows = read_rows("specbench")
    held = sorted({i * len(rows) // MEASURE_PROMPTS for i in range(MEASURE_PROMPTS)})
    heldout = [rows[i]["turns"][0] for i in held][:n_heldout]
    rng = random.Random(seed + 2)
    questions = [r["turns"][0] for i, r in enumerate(rows) if i not in set(held) and len(r["turns"][0]) <= 600]
    rng.shuffle(questions)
    if len(questions) < n_train:
        questions += [c[0]["content"] for c in stdlib_docstring_conversations(rng, 200_000)]
    return questions[:n_train], heldout

"""Issue 10: one import package, `exspec`, whose layers point one way, and whose wheel ships nothing else."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder -> the exspec subpackages it must never import (cli -> server -> scheduler -> engine; bench ->
# scheduler -> engine; loadtest speaks only HTTP)
FORBIDDEN = {
    "engine": {"scheduler", "server", "loadtest", "bench", "cli", "demo"},
    "scheduler": {"server", "loadtest", "bench", "cli", "demo"},
    "server": {"loadtest", "bench", "cli", "demo"},
    "loadtest": {"engine", "scheduler", "server", "bench", "cli", "demo"},
    "bench": {"server", "loadtest", "cli"},
    "demo": {"server", "loadtest", "cli", "bench"},
    "data": {"engine", "scheduler", "server", "loadtest", "bench", "cli", "demo"},
}
THIRD_PARTY_FORBIDDEN = {"loadtest": {"torch"}, "data": {"torch", "transformers"}}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_folder_imports_upward(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "exspec" and len(parts) > 1 and parts[1] in FORBIDDEN[folder]:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
            if parts[0] in THIRD_PARTY_FORBIDDEN.get(folder, ()):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
            if parts[0] in {"engine", "scheduler", "server", "loadtest", "bench", "cli", "demo"}:
                bad.append(f"{path.relative_to(ROOT)}: {name} (import exspec.{parts[0]}, not a top-level name)")
    assert not bad, "\n".join(bad)


def test_the_wheel_has_one_top_level_name(tmp_path):
    """`pip wheel --no-deps .` builds a wheel whose only importable top-level name is `exspec`, with the
    question sets and the CPU kernel's C source (built on first use: engine/kernels/native.py) as package data."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("exspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"exspec"}
    for sub in ("engine", "scheduler", "server", "loadtest", "cli", "bench", "demo", "data"):
        assert f"exspec/{sub}/__init__.py" in names
    assert "exspec/data/spec_bench_questions.jsonl" in names and "exspec/data/mt_bench_questions.jsonl" in names
    assert "exspec/engine/kernels/paged_attention_cpu.c" in names
    assert not [n for n in names if n.startswith("exspec/") and "/tests/" in n]


def test_every_command_s_flags_import_no_torch():
    """`exspec <command> --help` builds its parser without torch or transformers (seconds to import): the settings
    resolver (cli/settings.py) reads its defaults and limits from torch-free modules of the engine, the scheduler,
    the bench and the demo."""
    code = ("import sys\nfrom exspec.cli.main import COMMANDS, build_parser\n"
            "for c in COMMANDS: build_parser(c)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]"


# Each default and range written once (issue 24): patterns that wrote one of them again, and the one file (relative
# to the repository) allowed to hold each. Tests (fakes) are not scanned.
WRITTEN_ONCE = {
    r"MAX_SPECULATIVE_TOKENS = \d+|(<=|le=)\s*32\b|\[[01], 32\]": "engine/config.py",  # k's range
    r"num_speculative_tokens\b[^\n]*(=|default:?)\s*4\b": "scheduler/types.py",  # default k
    r"max_model_len[^\n]*\b2048\b|MAX_MODEL_LEN = \d+": "engine/config.py",  # max_model_len's fallback
    r'"max_sequence_length"': "engine/config.py",  # the position-limit keys
    r"max_model_len \+ [^\n]*\+ 1\b": "engine/config.py",  # a slot's token-buffer length
    r'"cuda": 0\.9': "engine/config.py",  # the KV memory default
    r"2\*\*63 - 1": "server/config.py",  # the largest integer a request field may hold
    r"= 2 \* 1024 \* 1024": "server/config.py",  # the server's limits (Settings reads ServerConfig's)
    r"POOL_FACTOR = \d+|\b4 \* (self\.)?max_batch_size|pool_factor: int = 4": "scheduler/types.py",  # W = 4 x B
}


@pytest.mark.parametrize("pattern", sorted(WRITTEN_ONCE))
def test_each_default_is_written_once(pattern):
    import re

    hits = []
    for folder in ("engine", "scheduler", "server", "loadtest", "cli", "bench", "demo", "data", "exspec"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            hits += [str(path.relative_to(ROOT)) for line in path.read_text().splitlines() if re.search(pattern, line)]
    assert hits == [WRITTEN_ONCE[pattern]], hits

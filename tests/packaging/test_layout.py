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
    question sets as package data."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("exspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"exspec"}
    for sub in ("engine", "scheduler", "server", "loadtest", "cli", "bench", "demo", "data"):
        assert f"exspec/{sub}/__init__.py" in names
    assert "exspec/data/spec_bench_questions.jsonl" in names and "exspec/data/mt_bench_questions.jsonl" in names
    assert not [n for n in names if n.startswith("exspec/") and "/tests/" in n]

"""scripts/commit_ab.py, the interleaved two-commit sitting of `exspec bench`: its table (per-round ratios, median /
median, the A/A control's column; an unfinished round left out) and its shim (a worktree's package, not this
checkout's, answers `import exspec.engine`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.packaging.test_gpu_check import ROOT, _script


def _sitting(out: Path, sides: list[str], rounds: dict[str, list[float]], declared: int) -> None:
    """A sitting folder as commit_ab.run leaves it: sitting.json and r<round>-<side>/results.json (target-ar, B = 8)."""
    (out / "sitting.json").write_text(json.dumps({"revs": {"old": "aaa", "new": "bbb"}, "sides": sides,
                                                  "rounds": declared}))
    for side, values in rounds.items():
        for r, tps in enumerate(values, start=1):
            (out / f"r{r}-{side}").mkdir()
            rows = [{"method": "target-ar", "batch_size": 8, "tokens_per_s": tps},
                    {"method": "exspec", "batch_size": 1, "tokens_per_s": 2 * tps}]
            (out / f"r{r}-{side}" / "results.json").write_text(json.dumps(rows))


def test_table_ratios_and_medians(tmp_path, capsys):
    ab = _script("commit_ab")
    # round 4 has only its old side: the table counts 3 rounds
    _sitting(tmp_path, ["old", "new"], {"old": [100.0, 200.0, 300.0, 50.0], "new": [110.0, 180.0, 330.0]}, declared=5)
    ab.summarize(tmp_path)
    out = capsys.readouterr().out
    assert "3 complete rounds" in out
    line = next(row for row in out.splitlines() if row.startswith("| target-ar, 8 |"))
    assert "| 100, 200, 300 | 110, 180, 330 | 1.10, 0.90, 1.10 | **0.90** |" in line  # 180 / 200
    assert next(row for row in out.splitlines() if row.startswith("| exspec, 1 |")).endswith("**0.90** |")


def test_table_with_the_control(tmp_path, capsys):
    ab = _script("commit_ab")
    _sitting(tmp_path, ["old", "new", "new-2"],
             {"old": [100.0, 100.0], "new": [100.0, 120.0], "new-2": [95.0, 120.0]}, declared=2)
    ab.summarize(tmp_path)
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("| target-ar, 8 |"))
    assert line.endswith("| **1.10** | 0.95, 1.00 | 0.98 |")  # new-2 / new per round, then 107.5 / 110


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs this repository's git")
def test_shim_imports_the_worktree(tmp_path):
    ab = _script("commit_ab")
    src = tmp_path / "src-new"
    try:
        shim = ab.make_side(tmp_path, "new", "HEAD")
        assert (shim / "exspec" / "engine").resolve() == (src / "engine").resolve()
        ab.check_side(tmp_path, shim)  # exits when exspec.engine comes from elsewhere
        again = ab.make_side(tmp_path, "new", "HEAD")  # a second call reuses the worktree and links
        assert again == shim
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)], capture_output=True)

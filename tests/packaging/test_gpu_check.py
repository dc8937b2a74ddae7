"""scripts/gpu_check.sh (issue 20 item 4) cannot run here (no GPU): what can be checked on the CPU is checked. The
script parses; --dry-run prints every stage the GPU issue needs, with flags the CLI accepts; without CUDA it refuses
cleanly; and its Python part, scripts/compile_check.py, runs at tiny shapes (compile on against off, identical in
fp32)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _compile_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compile_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return compile_check


def _plan(tmp_path: Path) -> dict[str, list[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "results")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "results").exists()  # a dry run writes nothing
    stages = {}
    for line in out.stdout.splitlines()[1:]:
        name, limit, *command = line.split(maxsplit=2)
        assert limit.endswith("s") and limit[:-1].isdigit(), line
        stages[name] = shlex.split(command[0])
    return stages


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_plans_every_stage_the_gpu_issue_needs(tmp_path):
    stages = _plan(tmp_path)
    assert set(stages) == {"kernel-tests", "gpu-tests", "bf16-equivalence", "compile-check", "kernel-bench-8b",
                           "kernel-bench-1b", "bench-1b", "bench-8b"}
    assert "tests/engine/test_engine_bf16.py" in stages["bf16-equivalence"]
    for shape in ("1b", "8b"):
        cmd = stages[f"bench-{shape}"]
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--synthetic"] == shape and flags["--batch-sizes"] == "1,2,4,8,16,32,64"
        assert flags["--fixed-ks"] == "2,4,6" and "target-ar" in flags["--methods"].split(",")
        assert flags["--output"] == str(tmp_path / "results" / f"bench-{shape}")  # everything into one folder


def test_planned_commands_parse(tmp_path):
    """The bench and compile-check command lines use flags their parsers accept (a renamed flag fails here, not on
    the GPU machine)."""
    from exspec.cli.main import build_parser

    stages = _plan(tmp_path)
    for shape in ("1b", "8b"):
        argv = stages[f"bench-{shape}"][3:]  # after PYTHON -m exspec
        build_parser("bench").parse_args(argv)
    cmd = stages["compile-check"]
    assert cmd[1] == "scripts/compile_check.py"
    args = _compile_check().parser().parse_args(cmd[2:])
    assert args.device == "cuda" and args.dtype == "bfloat16" and args.synthetic == "1b"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_refuses_without_cuda(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "r")], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)})
    assert out.returncode == 2 and "no CUDA device" in out.stderr


@pytest.mark.models
def test_compile_check_smoke_on_the_cpu(tmp_path):
    """scripts/compile_check.py at tiny shapes: compile on gives the outputs compile off gives (fp32), and the JSON
    and Markdown are written."""
    code = _compile_check().main(["--synthetic", "tiny", "--synthetic-cache", str(tmp_path / "syn"), "--device", "cpu",
                               "--batch-sizes", "2", "--max-tokens", "4", "--out", str(tmp_path / "cc")])
    assert code == 0
    (row,) = json.loads((tmp_path / "cc" / "compile_check.json").read_text())["rows"]
    assert row["batch"] == 2 and row["identical"] == row["prompts"] == 4 and not row["real_divergences"]
    assert row["static_forwards"] >= 2  # the draft's and the verify's forwards ran compiled
    assert "| 2 | 4 | 4 |" in (tmp_path / "cc" / "compile_check.md").read_text()

"""scripts/gpu_check.sh (issue 20 item 4; run on an H100 on 2026-11-24) cannot run here (no GPU): what can be checked
on the CPU is checked. The script parses; --dry-run prints every stage the GPU issue needs, with flags the CLI accepts;
without CUDA it refuses cleanly; and its Python parts run at tiny shapes: scripts/compile_check.py (compile on against
off, identical in fp32), scripts/synthetic_agreement.py and scripts/profile_gpu_step.py."""

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


def _script(name: str):
    import importlib

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _compile_check():
    return _script("compile_check")


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
    assert set(stages) == {"kernel-tests", "gpu-tests", "bf16-equivalence", "synthetic-agreement", "compile-check",
                           "compile-check-cudagraph", "profile-eager", "profile-compiled", "speed-8b",
                           "kernel-bench-8b", "kernel-bench-1b", "bench-1b", "bench-8b", "loadtest-1b"}
    assert "tests/engine/test_engine_bf16.py" in stages["bf16-equivalence"]
    assert "tests/engine/test_cuda_graphs.py" in stages["gpu-tests"]
    for shape in ("1b", "8b"):
        cmd = stages[f"bench-{shape}"]
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--synthetic"] == shape and flags["--batch-sizes"] == "1,8"
        assert flags["--fixed-ks"] == "3" and {"target-ar", "exspec"} <= set(flags["--methods"].split(","))
        assert flags["--output"] == str(tmp_path / "results" / f"bench-{shape}")  # everything into one folder
        assert "--compile" in cmd and flags["--compile-mode"] == "cudagraph"  # captured, as the GPU is meant to run


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
    assert args.compile_mode == "inductor"
    cmd = stages["compile-check-cudagraph"]
    args = _compile_check().parser().parse_args(cmd[2:])
    assert args.device == "cuda" and args.compile_mode == "cudagraph"


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


@pytest.mark.models
def test_synthetic_agreement_reproduces_the_built_pairs_agreement(tmp_path):
    """The scale sweep measures what ensure_synthetic_pair measures: at the shipped scale, the built pair's agreement;
    and a smaller scale (later layers closer to nothing) agrees more."""
    from exspec.bench.synthetic import SHAPES, ensure_synthetic_pair

    shipped = SHAPES["tiny"].scale
    _, _, info = ensure_synthetic_pair("tiny", tmp_path / "syn", log=lambda *_: None)
    assert _script("synthetic_agreement").main(["--shapes", "tiny", "--scales", f"{shipped / 10},{shipped}", "--device",
                                                "cpu", "--json", str(tmp_path / "a.json")]) == 0
    small, at_shipped = json.loads((tmp_path / "a.json").read_text())
    assert at_shipped["agreement"] == pytest.approx(info["agreement"], abs=1e-3)
    assert small["agreement"] > at_shipped["agreement"]


@pytest.mark.models
def test_profile_gpu_step_smoke_on_the_cpu(tmp_path, monkeypatch):
    """scripts/profile_gpu_step.py at tiny shapes: eager and compiled rows, speculation's acceptance above 1 and a
    draft time where k > 0; the profiled variant writes its trace and names where each sync of a decode step comes
    from (the CPU makes no CUDA sync: `aten::cat`, which the step's commit calls once, stands in for one)."""
    profile = _script("profile_gpu_step")
    monkeypatch.setattr(profile, "SYNC_EVENTS", (*profile.SYNC_EVENTS, "aten::cat"))
    monkeypatch.setattr(profile, "WAITS", (*profile.WAITS, "aten::cat"))
    common = ["--synthetic", "tiny", "--synthetic-cache", str(tmp_path / "syn"), "--device", "cpu", "--max-tokens", "6",
              "--prompt-len", "12"]
    assert profile.main(common + ["--configs", "1:0,2:2", "--modes", "eager,compiled", "--no-profile", "--repeats", "1",
                                  "--out", str(tmp_path / "t")]) == 0
    rows = json.loads((tmp_path / "t" / "profile.json").read_text())
    assert [(r["mode"], r["B"], r["k"]) for r in rows] == [("eager", 1, 0), ("eager", 2, 2), ("compiled", 1, 0),
                                                           ("compiled", 2, 2)]
    for r in rows:
        assert r["decode_steps"] > 0 and r["decode_tok_s"] > 0
        assert (r["acceptance"] > 1.0) == (r["k"] > 0) and (r["k"] == 0 or r["draft_ms_per_step"] > 0)
    assert profile.main(common + ["--configs", "2:2", "--repeats", "1", "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "trace-B2-k2.json").is_file()
    (row,) = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert {"syncs_per_engine_step", "syncs_inside_decode_steps", "sync_sources"} <= set(row)
    commits = sum(n for key, n in row["sync_sources"].items()
                  if key.startswith("aten::cat: ") and "engine/engine.py(" in (own := key.split(" <- ")[0])
                  and own.endswith(": _commit"))
    assert commits == row["decode_steps"]  # one torch.cat in each decode step's commit, found by its frame
    # the same from the exported trace, over the whole run (prefill steps too), per engine step
    assert row["engine_steps"] == row["decode_steps"] + row["prefill_steps"]
    assert row["waits_per_engine_step"]["aten::cat"] > 0
    from_trace = sum(n for key, n in row["wait_sources"].items()
                     if key.startswith("aten::cat: ") and "engine/engine.py(" in key and key.endswith(": _commit"))
    assert from_trace >= row["decode_steps"]


@pytest.mark.models
def test_gpu_loadtest_serves_both_sides_on_the_cpu(tmp_path):
    """scripts/gpu_loadtest.sh (the GPU check's loadtest-1b stage) on the tiny synthetic pair on the CPU: the pair
    built, a real server per side (the default policy, then k = 0), a burst of two requests each, the comparison."""
    from tests.support.server_fixtures import free_port

    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DEVICE": "cpu", "SERVE_FLAGS": "--no-calibrate",
           "RATES": "inf", "NUM_PROMPTS": "2", "MAX_TOKENS": "3", "PORT": str(free_port()),
           "GPU_CHECK_SYNTHETIC_CACHE": str(tmp_path / "syn"), "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_loadtest.sh"), str(tmp_path / "lt"), "tiny"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for side in ("default", "k0"):
        report = json.loads((tmp_path / "lt" / f"{side}-inf-1.json").read_text())
        assert report["completed"] == 2 and report["output_throughput"] > 0, report
    assert "default/k0" in out.stdout and "output_throughput" in out.stdout  # the comparison's table
    assert "--num-speculative-tokens 0" in out.stdout  # side B ran with speculation off

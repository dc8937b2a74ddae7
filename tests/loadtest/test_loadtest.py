"""`python -m loadtest` against a real exspec server (uvicorn over `build_app`, tiny random pair, loopback):
the report's structure and the consistency of its numbers, greedy equivalence with a reference file (from a
k = 0 server or from `exspec bench`), errors, and that the load test imports nothing of the engine.
No speed thresholds."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from exspec.loadtest.__main__ import main
from exspec.data.reference import ReferenceRow, compare_with_reference, is_near_tie, read_reference, write_reference
from exspec.errors import ReferenceError
from exspec.loadtest.report import percentile
from exspec.loadtest.runner import LoadTestError, arrival_offsets, check_loopback
from tests.support.server_fixtures import running_server
from tests.support.tiny_models import build_pair

API_KEY = "test-key"
VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput",
    *[f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p50", "p90", "p99")],
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("loadtest-models"), "llama")


@pytest.fixture(scope="module")
def srv(pair):
    target, draft = pair
    with running_server(target, draft, max_model_len=128, max_batch_size=4, pool_size=8,
                        num_speculative_tokens=3, api_key=API_KEY) as s:
        yield s


def _run(srv, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["--base-url", srv.v1, "--api-key", API_KEY, "--no-progress", "--output", str(out), *args])
    return rc, json.loads(out.read_text())


def _check_consistent(r: dict, n: int) -> None:
    for key in VLLM_KEYS:
        assert isinstance(r[key], (int, float)), key
    assert r["completed"] + r["failed"] == r["num_prompts"] == n
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert r["duration"] > 0
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], m
        assert r[f"p50_{m}_ms"] == pytest.approx(r[f"median_{m}_ms"]), m
    assert r["mean_ttft_ms"] <= r["mean_e2el_ms"]
    assert r["p99_e2el_ms"] <= r["duration"] * 1000.0 + 1.0


@pytest.fixture(scope="module")
def srv0(pair):
    """The target alone: a server at k = 0 with no draft."""
    with running_server(pair[0], None, max_model_len=128, max_batch_size=4, pool_size=8,
                        num_speculative_tokens=0, api_key=API_KEY) as s:
        yield s


def test_reference_from_a_k0_server_matches_a_speculative_server(srv0, srv, pair, tmp_path, capsys):
    """Record the target alone (a k = 0 server) with --write-reference, then replay its prompts against the
    k = 3 server with --reference: random token-id prompts, ignore_eos, Poisson arrivals; every greedy
    output equals the target's own."""
    ref = tmp_path / "ref.jsonl"
    rc, r0 = _run(srv0, tmp_path, "--dataset", "random", "--num-prompts", "6", "--random-input-len", "12",
                  "--random-output-len", "8", "--request-rate", "50", "--tokenizer", str(pair[0]),
                  "--write-reference", str(ref))
    assert rc == 0 and r0["completed"] == 6
    rows = read_reference(ref)
    assert len(rows) == 6
    assert all(len(x.prompt_token_ids) == 12 and len(x.output_token_ids) == 8 for x in rows)
    assert all(x.ignore_eos and x.max_tokens == 8 and x.top2_gaps is None for x in rows)
    capsys.readouterr()
    rc, r = _run(srv, tmp_path, "--reference", str(ref), "--request-rate", "50")
    assert rc == 0
    _check_consistent(r, 6)
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_lens"] == [8] * 6 and r["input_lens"] == [12] * 6
    assert r["usage_reported"] is True and r["prompts_as_token_ids"] is True
    eq = r["equivalence"]
    assert eq["checked"] == eq["matched"] == 6 and eq["real"] == eq["unclassified"] == 0 and eq["mismatches"] == []
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Identical to the reference:" in table


@pytest.fixture(scope="module")
def bench_reference(pair, tmp_path_factory):
    """A reference written by `exspec bench --write-reference` (target-ar at B = 1, with top-2 gaps)."""
    from exspec.cli.main import main as exspec_main

    out = tmp_path_factory.mktemp("bench-ref")
    rc = exspec_main(["bench", "--model", str(pair[0]), "--methods", "target-ar", "--batch-sizes", "1",
                      "--num-prompts", "3", "--max-tokens", "8", "--max-prompt-len", "64", "--repeats", "1",
                      "--no-warmup", "--no-progress", "--output", str(out), "--write-reference", str(out / "ref.jsonl")])
    assert rc == 0
    return read_reference(out / "ref.jsonl")


def test_a_bench_written_reference_matches_the_speculative_server(srv, bench_reference, tmp_path):
    rows = bench_reference
    assert len(rows) == 3
    for x in rows:
        assert 1 <= len(x.output_token_ids) <= 8 and x.max_tokens == 8 and not x.ignore_eos
        assert len(x.top2_gaps) == len(x.output_token_ids) and all(g >= 0 for g in x.top2_gaps)
        assert x.near_tie_eps == 1e-3 and "target-ar" in x.source
    rc, r = _run(srv, tmp_path, "--reference", _save(rows, tmp_path))
    assert rc == 0
    eq = r["equivalence"]
    assert eq["checked"] == eq["matched"] == 3, eq["mismatches"]


def _save(rows, tmp_path, name: str = "ref.jsonl") -> str:
    path = tmp_path / name
    write_reference(path, rows)
    return str(path)


def test_a_divergence_is_classified_by_the_reference_gap(srv, bench_reference, tmp_path):
    """Plant a wrong token in one reference row: the server's output then diverges there. With the row's
    eps above its gap the divergence is a near-tie (exit 0); with eps 0 it is real (exit 1)."""
    rows = list(bench_reference)
    x = rows[1]
    wrong = x.output_token_ids[:1] + [(x.output_token_ids[1] + 1) % 300] + x.output_token_ids[2:]
    for eps, kind, status in ((x.top2_gaps[1] + 1.0, "near-tie", 0), (0.0, "real", 1)):
        rows[1] = dataclasses.replace(x, output_token_ids=wrong, near_tie_eps=eps)
        rc, r = _run(srv, tmp_path, "--reference", _save(rows, tmp_path, f"ref-{kind}.jsonl"))
        assert rc == status
        eq = r["equivalence"]
        assert eq["matched"] == 2
        assert eq["mismatches"] == [{"position": 1, "gap": x.top2_gaps[1], "top1": x.top1_logits[1], "kind": kind,
                                     "request": 1}]


def test_reference_file_errors_are_reported(srv, pair, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2], "output_token_ids": "x", "max_tokens": 4}\n')
    assert main(["--base-url", srv.v1, "--api-key", API_KEY, "--no-progress", "--reference", str(bad)]) == 2
    assert "'output_token_ids' must be a list of integers" in capsys.readouterr().err
    assert main(["--base-url", srv.v1, "--no-progress", "--write-reference", str(tmp_path / "r.jsonl")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["--reference", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a wrong API key: every request fails, nothing is compared, and no reference is recorded from them
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_token_ids": [5, 6, 7], "output_token_ids": [8], "max_tokens": 2}\n')
    rc, r = _run(srv, tmp_path, "--reference", str(good), "--api-key", "wrong", "--model", srv.model_name)
    assert rc == 0 and r["failed"] == 1
    assert r["equivalence"]["checked"] == 0 and r["equivalence"]["not_checked"] == 1
    assert main(["--base-url", srv.v1, "--api-key", "wrong", "--model", srv.model_name, "--no-progress",
                 "--tokenizer", str(pair[0]), "--dataset", "random", "--num-prompts", "2", "--random-input-len", "4",
                 "--random-output-len", "2", "--write-reference", str(tmp_path / "r.jsonl")]) == 2
    assert "2 requests failed" in capsys.readouterr().err and not (tmp_path / "r.jsonl").exists()


def test_compare_with_reference_without_gaps_is_unclassified():
    rows = [ReferenceRow([5], [1, 2, 3], 3), ReferenceRow([6], [4, 5], 3, top2_gaps=[0.5, 0.01], near_tie_eps=0.1)]
    assert compare_with_reference([[1, 2, 3], [4, 6]], rows) == [
        {"index": 1, "position": 1, "gap": 0.01, "top1": None, "kind": "near-tie"}]
    assert compare_with_reference([[1, 9, 3], [4, 5, 7]], rows) == [
        {"index": 0, "position": 1, "gap": None, "top1": None, "kind": "unclassified"},
        {"index": 1, "position": 2, "gap": None, "top1": None, "kind": "real"}]


def test_a_reference_with_top1_logits_tells_bf16_near_ties_by_units_in_the_last_place(tmp_path):
    """bf16 logits in [8, 16) are 0.0625 apart: a gap of one or two such steps above the 0.05 eps is a near-tie when
    the row carries its top-1 logits and dtype (the bench's rule, is_near_tie), real without them; three steps are
    real either way. The fields survive a write and a read."""
    gaps, top1 = [0.0625, 0.125, 0.1875], [10.0, 9.5, 12.0]
    bare = ReferenceRow([5], [1, 2, 3], 3, top2_gaps=gaps, near_tie_eps=0.05)
    full = dataclasses.replace(bare, top1_logits=top1, dtype="bfloat16")
    write_reference(tmp_path / "r.jsonl", [full])
    assert read_reference(tmp_path / "r.jsonl") == [full]
    outputs = [[9, 2, 3], [1, 9, 3], [1, 2, 9]]  # a divergence at position 0, 1, 2
    kinds = lambda row: [d["kind"] for o in outputs for d in compare_with_reference([o], [row])]  # noqa: E731
    assert kinds(full) == ["near-tie", "near-tie", "real"]
    assert kinds(bare) == ["real", "real", "real"]
    assert [is_near_tie(g, t, "bfloat16") for g, t in zip(gaps, top1)] == [True, True, False]  # the bench agrees


@pytest.mark.parametrize(("field", "value", "said"), [
    ("top1_logits", [1.0], "'top1_logits' must be null or one number per output id"),
    ("top1_logits", [1.0, "x"], "'top1_logits' must be null or one number per output id"),
    ("dtype", "float8", "'dtype' must be null or one of"),
])
def test_a_reference_row_with_bad_top1_logits_or_dtype_is_refused(tmp_path, field, value, said):
    path = tmp_path / "r.jsonl"
    row = {"prompt_token_ids": [5], "output_token_ids": [1, 2], "max_tokens": 2, field: value}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ReferenceError, match=re.escape(said)):
        read_reference(path)


def test_the_load_test_imports_no_engine_torch_or_benchmark():
    """loadtest speaks HTTP only: importing its entry point loads no torch, transformers, engine, scheduler
    or offline benchmark (a tokenizer is imported lazily, only for --tokenizer)."""
    code = ("import sys, exspec.loadtest.__main__; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith(('exspec.engine', 'exspec.scheduler', 'exspec.bench', 'exspec.server'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in (Path(__file__).parents[2] / "loadtest").glob("*.py"):
        text = path.read_text()
        for banned in ("exspec.engine", "exspec.scheduler", "exspec.bench", "import torch", "exspec.server"):
            assert banned not in text, (path.name, banned)


def test_chat_text_prompts_under_a_concurrency_cap(srv, tmp_path):
    rc, r = _run(srv, tmp_path, "--endpoint", "chat", "--dataset", "random", "--num-prompts", "5",
                 "--random-input-len", "6", "--random-output-len", "6", "--max-concurrency", "2")
    assert rc == 0
    _check_consistent(r, 5)
    assert r["failed"] == 0 and r["max_concurrency"] == 2
    assert r["output_lens"] == [6] * 5
    assert all(n > 6 for n in r["input_lens"])  # the chat template's tokens, counted by the server's usage


def test_failures_are_counted_not_raised(srv, tmp_path):
    out = tmp_path / "result.json"
    rc = main(["--base-url", srv.v1, "--api-key", "wrong", "--model", srv.model_name, "--dataset", "random",
               "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "4", "--no-progress",
               "--output", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0
    assert r["completed"] == 0 and r["failed"] == 3 and r["total_output_tokens"] == 0
    assert all(e.startswith("HTTP 401") for e in r["errors"])


def test_only_loopback_servers_and_valid_options(capsys):
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:1/v1", "http://[::1]:8000/v1"):
        check_loopback(url)
    with pytest.raises(LoadTestError):
        check_loopback("http://example.com/v1")
    assert main(["--base-url", "http://192.0.2.1:8000/v1", "--model", "m", "--no-progress"]) == 2
    assert "this machine" in capsys.readouterr().err
    assert main(["--reference", "x.jsonl", "--temperature", "0.5", "--no-progress"]) == 2
    assert "--temperature 0" in capsys.readouterr().err


def test_arrivals_and_percentiles():
    assert arrival_offsets(4, float("inf"), 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)  # exponential gaps, mean 1 / rate
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 90) == 90


def test_the_flags_map_onto_load_config_with_its_defaults():
    """One mapping from the flags to LoadConfig (FLAG_FIELDS), whose defaults the parser takes (issue 24)."""
    from exspec.loadtest.__main__ import build_parser
    from exspec.loadtest.runner import FLAG_FIELDS, LoadConfig

    args = build_parser().parse_args([])
    assert {n: getattr(args, n) for n in FLAG_FIELDS} == {n: getattr(LoadConfig, n) for n in FLAG_FIELDS}
    args = build_parser().parse_args(["--timeout", "5", "--request-rate", "2", "--endpoint", "chat"])
    cfg = LoadConfig(model="m", **{n: getattr(args, n) for n in FLAG_FIELDS})
    assert (cfg.total_timeout, cfg.request_rate, cfg.endpoint, cfg.base_url) == (5.0, 2.0, "chat", LoadConfig.base_url)

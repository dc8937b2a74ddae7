"""`python -m loadtest` against a real exspec server (uvicorn over `build_app`, tiny random pair, loopback):
the report's structure and the consistency of its numbers, greedy equivalence with the target, errors.
No speed thresholds."""

from __future__ import annotations

import json
import statistics

import pytest

from exspec.loadtest.__main__ import main
from exspec.loadtest.report import percentile
from exspec.loadtest.runner import LoadTestError, arrival_offsets, check_loopback
from tests.support.server_fixtures import running_server
from tests.support.tiny_models import build_pair

API_KEY = "test-key"
VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput",
    *[f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")],
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
    assert r["mean_ttft_ms"] <= r["mean_e2el_ms"]
    assert r["p99_e2el_ms"] <= r["duration"] * 1000.0 + 1.0


def test_poisson_token_ids_with_equivalence_check(srv, pair, tmp_path, capsys):
    """Random token-id prompts, ignore_eos: every request yields exactly max_tokens tokens, and every
    greedy output equals the target's own (our engine at k = 0, batch 1)."""
    rc, r = _run(srv, tmp_path, "--dataset", "random", "--num-prompts", "6", "--random-input-len", "12",
                 "--random-output-len", "8", "--request-rate", "50", "--check-equivalence",
                 "--reference-model", str(pair[0]))
    assert rc == 0
    _check_consistent(r, 6)
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_lens"] == [8] * 6 and r["input_lens"] == [12] * 6
    assert r["usage_reported"] is True and r["prompts_as_token_ids"] is True
    eq = r["equivalence"]
    assert eq["checked"] == eq["matched"] == 6 and eq["real"] == 0 and eq["mismatches"] == []
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Identical to the reference:" in table


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
    assert main(["--check-equivalence", "--no-progress"]) == 2
    assert "--reference-model" in capsys.readouterr().err


def test_arrivals_and_percentiles():
    assert arrival_offsets(4, float("inf"), 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)  # exponential gaps, mean 1 / rate
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 90) == 90

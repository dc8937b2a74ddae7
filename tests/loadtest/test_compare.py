"""`python -m exspec.loadtest.compare`: medians over rounds and per-round ratios from result files."""

from __future__ import annotations

import json

import pytest

from exspec.loadtest.compare import compare, load, main


def _write(d, name, **metrics):
    (d / name).write_text(json.dumps(metrics))


def test_medians_and_round_ratios(tmp_path, capsys):
    for rnd, (a, b) in enumerate([(100.0, 200.0), (300.0, 200.0), (150.0, 100.0)], start=1):
        _write(tmp_path, f"default-inf-{rnd}.json", mean_ttft_ms=a, output_throughput=10.0)
        _write(tmp_path, f"k0-inf-{rnd}.json", mean_ttft_ms=b, output_throughput=10.0)
    _write(tmp_path, "default-4-1.json", mean_ttft_ms=1.0)  # no k0 at this rate: not compared
    (tmp_path / "notes.txt").write_text("ignored")
    rows = compare(load(tmp_path), "default", "k0")
    ttft = next(r for r in rows if r["metric"] == "mean_ttft_ms")
    assert (ttft["rate"], ttft["a"], ttft["b"]) == ("inf", 150.0, 200.0)
    assert ttft["ratios"] == pytest.approx([0.5, 1.5, 1.5]) and ttft["ratio"] == pytest.approx(1.5)
    assert {r["rate"] for r in rows} == {"inf"}
    assert main([str(tmp_path), "default", "k0"]) == 0
    assert "mean_ttft_ms" in capsys.readouterr().out
    assert main([str(tmp_path), "default", "other"]) == 1

"""`exspec bench` end to end on a tiny random pair (3 prompts, 8 tokens, B = 1, 2, every method): the
structure of results.json / results.md / throughput.png and the consistency of the numbers. No speed
thresholds: the tiny random pair on a shared CI machine says nothing about speed."""

from __future__ import annotations

import json

import pytest

from exspec.bench.equivalence import classify_divergences, first_divergence
from exspec.cli.main import main
from tests.support.tiny_models import build_pair

KEYS = {
    "method", "batch_size", "tokens_per_s", "mean_acceptance_length", "grouped_fraction", "equivalence_rate",
    "near_ties", "real_divergences", "num_prompts", "generated_tokens", "decode_seconds",
}
POINTS = {("target-ar", 1), ("hf-generate", 1), ("hf-assisted", 1), ("exspec-mixed", 1), ("exspec", 1),
          ("target-ar", 2), ("hf-generate", 2), ("exspec-mixed", 2), ("exspec", 2)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("bench-models"), "llama")


@pytest.fixture(scope="module")
def bench_dir(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    target, draft = pair
    rc = main([
        "bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "3", "--max-tokens", "8",
        "--batch-sizes", "1,2", "--num-speculative-tokens", "2", "--repeats", "1", "--max-prompt-len", "64",
        "--no-warmup", "--no-progress", "--output", str(out),
    ])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def rows(bench_dir):
    return json.loads((bench_dir / "results.json").read_text())


def test_results_json_has_one_row_per_point_with_every_key(rows):
    assert isinstance(rows, list)
    assert {(r["method"], r["batch_size"]) for r in rows} == POINTS
    assert len(rows) == len(POINTS)
    for r in rows:
        assert KEYS <= set(r), r["method"]


def test_numbers_are_consistent(rows):
    for r in rows:
        assert r["num_prompts"] == 3
        assert 3 <= r["generated_tokens"] <= 3 * 8
        assert r["decode_seconds"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["decode_seconds"])
        assert 0.0 <= r["equivalence_rate"] <= 1.0
        diverged = round((1.0 - r["equivalence_rate"]) * r["num_prompts"])
        assert r["near_ties"] + r["real_divergences"] == diverged == len(r["divergences"])
        if r["grouped_fraction"] is not None:
            assert 0.0 <= r["grouped_fraction"] <= 1.0
    by = {(r["method"], r["batch_size"]): r for r in rows}
    for b in (1, 2):
        assert by[("target-ar", b)]["mean_acceptance_length"] == 1.0
        assert by[("hf-generate", b)]["mean_acceptance_length"] == 1.0
        assert by[("hf-generate", b)]["grouped_fraction"] is None
        assert by[("exspec-mixed", b)]["grouped_fraction"] == 0.0
        for m in ("exspec", "exspec-mixed"):
            assert 1.0 <= by[(m, b)]["mean_acceptance_length"] <= 3.0  # k = 2: at most 3 tokens a step
            assert by[(m, b)]["num_speculative_tokens"] == 2
    assert by[("exspec", 2)]["pool_size"] == 3  # 4 x B, capped at the 3 prompts
    assert by[("target-ar", 2)]["pool_size"] == 2


def test_exspec_and_plain_decoding_reproduce_the_target_exactly(rows):
    """fp32 tiny pair: our engine's methods give the target's own greedy tokens on every prompt."""
    reference = next(r for r in rows if (r["method"], r["batch_size"]) == ("target-ar", 1))
    for r in rows:
        if r["method"] in ("target-ar", "exspec", "exspec-mixed"):
            assert r["equivalence_rate"] == 1.0, r
            assert r["real_divergences"] == 0
            assert r["generated_tokens"] == reference["generated_tokens"]


def test_markdown_table_ratios_and_plot(bench_dir, rows):
    md = (bench_dir / "results.md").read_text()
    assert "| method | B | tokens/s |" in md
    for header in ("exspec / target-ar", "exspec / hf-generate", "exspec / exspec-mixed", "exspec / hf-assisted"):
        assert header in md
    assert md.count("\n| exspec |") == 2
    by = {(r["method"], r["batch_size"]): r["tokens_per_s"] for r in rows}
    assert f"{by[('exspec', 2)] / by[('target-ar', 2)]:.2f}x" in md
    png = (bench_dir / "throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_bad_options_are_reported_before_loading_anything(tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path), "--num-prompts", "0", "--output", str(tmp_path)]) == 2
    assert "--num-prompts must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path), "--output", str(tmp_path)]) == 2
    assert "need a draft model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--methods", "exspec,vllm"])


def test_divergences_are_classified_by_the_reference_gap():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    gaps = {(0, 1): 1e-5, (1, 0): 2.0}
    found = classify_divergences(
        [[7, 8], [9], [4]], [[7, 9], [3], [4]], lambda i, prefix: gaps[(i, len(prefix))], eps=1e-3
    )
    assert found == [
        {"prompt": 0, "position": 1, "gap": 1e-5, "kind": "near-tie"},
        {"prompt": 1, "position": 0, "gap": 2.0, "kind": "real"},
    ]

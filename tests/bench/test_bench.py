"""`exspec bench` end to end on a tiny random pair (3 prompts, 8 tokens, B = 1, 2, every method): the
structure of results.json / results.md / throughput.png and the consistency of the numbers; the reference
file it writes; the plot left out without matplotlib; `--mode forward` and `--synthetic tiny`. No speed
thresholds: tiny random models on a shared CI machine say nothing about speed."""

from __future__ import annotations

import json
import sys

import pytest

from exspec.bench.equivalence import classify_divergences, first_divergence, is_near_tie, top2_gaps_along, top2_logits, ulp
from exspec.bench.report import NO_PLOT, markdown, paired_ratio, paired_ratios, write_results
from exspec.bench.runner import repeat_order
from exspec.cli.main import main
from exspec.data.reference import read_reference
from exspec.scheduler import SchedulerConfig
from tests.support.tiny_models import build_pair

KEYS = {
    "method", "batch_size", "tokens_per_s", "mean_acceptance_length", "grouped_fraction", "equivalence_rate",
    "near_ties", "real_divergences", "num_prompts", "generated_tokens", "decode_seconds",
}
POINTS = {("target-ar", 1), ("hf-generate", 1), ("hf-assisted", 1), ("exspec-mixed", 1), ("exspec-fixed", 1),
          ("exspec", 1), ("target-ar", 2), ("hf-generate", 2), ("exspec-mixed", 2), ("exspec-fixed", 2),
          ("exspec", 2)}
SPECULATIVE = ("exspec", "exspec-fixed", "exspec-mixed")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("bench-models"), "llama")


@pytest.fixture(scope="module")
def bench_dir(pair, tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("bench-out")
    target, draft = pair
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([
            "bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "3", "--max-tokens", "8",
            "--batch-sizes", "1,2", "--num-speculative-tokens", "2", "--repeats", "1", "--max-prompt-len", "64",
            "--no-warmup", "--no-progress", "--output", str(out), "--device", "cpu",
            "--write-reference", str(out / "ref.jsonl"),
        ])
    assert rc == 0
    (out / "stderr.txt").write_text(err.getvalue())
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


def test_no_progress_logs_each_timed_run_as_it_ends(bench_dir, rows):
    """--no-progress: one line per timed run on stderr, as it ends (what a run cut off by a time limit still shows)."""
    lines = [line for line in (bench_dir / "stderr.txt").read_text().splitlines() if line.startswith("[bench] ")]
    assert sorted(line.split(":")[0] for line in lines) == sorted(f"[bench] {r['method']} B={r['batch_size']}" for r in rows)
    for r in rows:
        (line,) = [x for x in lines if x.startswith(f"[bench] {r['method']} B={r['batch_size']}:")]
        assert f"{r['generated_tokens']} tokens in " in line


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
        for m in SPECULATIVE:
            assert 1.0 <= by[(m, b)]["mean_acceptance_length"] <= 3.0  # k = 2: at most 3 tokens a step
            assert by[(m, b)]["num_speculative_tokens"] == 2
        # `exspec` runs the scheduler's default policy; the fixed-k rows say so
        assert by[("exspec", b)]["speculation"] == SchedulerConfig().speculation
        assert by[("exspec-fixed", b)]["speculation"] == by[("exspec-mixed", b)]["speculation"] == "fixed"
        assert by[("hf-generate", b)]["speculation"] is None
    assert by[("exspec", 2)]["pool_size"] == 3  # 4 x B, capped at the 3 prompts
    assert by[("target-ar", 2)]["pool_size"] == 2
    assert by[("exspec", 1)]["pool_size"] == by[("exspec-fixed", 1)]["pool_size"] == 1  # serve's W at B = 1


def test_exspec_and_plain_decoding_reproduce_the_target_exactly(rows):
    """fp32 tiny pair: our engine's methods give the target's own greedy tokens on every prompt."""
    reference = next(r for r in rows if (r["method"], r["batch_size"]) == ("target-ar", 1))
    for r in rows:
        if r["method"] in ("target-ar", *SPECULATIVE):
            assert r["equivalence_rate"] == 1.0, r
            assert r["real_divergences"] == 0
            assert r["generated_tokens"] == reference["generated_tokens"]


def test_markdown_table_ratios_and_plot(bench_dir, rows):
    md = (bench_dir / "results.md").read_text()
    assert "| method | B | tokens/s |" in md
    for header in ("exspec / target-ar", "exspec / hf-generate", "exspec / exspec-fixed",
                   "exspec-fixed / exspec-mixed", "exspec / hf-assisted"):
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
    with pytest.raises(SystemExit):
        main(["bench", "--interleave", "tokens"])
    from exspec.bench.config import BenchConfig
    from exspec.engine import EngineConfig
    from exspec.errors import BenchError

    with pytest.raises(BenchError, match="--interleave must be one of steps, runs"):
        BenchConfig(engine=EngineConfig(model=tmp_path), methods=("target-ar",), interleave="tokens")


def test_divergences_are_classified_by_the_reference_gap():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    top2 = {(0, 1): (3.0, 3.0 - 2**-17), (1, 0): (5.0, 3.0)}  # gaps 2**-17 (exact in fp32) and 2.0
    found = classify_divergences(
        [[7, 8], [9], [4]], [[7, 9], [3], [4]], lambda i, prefix: top2[(i, len(prefix))], "float32"
    )
    assert found == [
        {"prompt": 0, "position": 1, "gap": 2**-17, "top1": 3.0, "kind": "near-tie"},
        {"prompt": 1, "position": 0, "gap": 2.0, "top1": 5.0, "kind": "real"},
    ]


def test_a_gap_of_a_bf16_step_is_a_near_tie_where_bf16_logits_are_that_coarse():
    """bf16 logits in [8, 16) are 0.0625 apart, in [2, 4) 0.015625: a gap of 0.0625 (above NEAR_TIE_EPS's 0.05) is one
    step at a top-1 of 10, a near-tie, and four steps at a top-1 of 3, real (the H100's 8b runs: every 0.05-real
    divergence, Hugging Face's own generate's included, sat at exactly 0.0625)."""
    assert ulp(10.0, "bfloat16") == 0.0625 and ulp(3.0, "bfloat16") == 2**-6 and ulp(-10.0, "bfloat16") == 0.0625
    assert ulp(0.0, "bfloat16") == 0.0 and ulp(1.0, "float32") == 2**-23
    assert is_near_tie(0.0625, 10.0, "bfloat16") and is_near_tie(0.125, 10.0, "bfloat16")
    assert not is_near_tie(0.1875, 10.0, "bfloat16") and not is_near_tie(0.0625, 3.0, "bfloat16")
    assert is_near_tie(0.04, 3.0, "bfloat16")  # below NEAR_TIE_EPS at any magnitude
    assert not is_near_tie(0.0625, 10.0, "float32") and not is_near_tie(2e-3, 100.0, "float32")  # fp32: eps only
    found = classify_divergences([[1], [2]], [[3], [4]], lambda i, prefix: [(10.0, 9.9375), (3.0, 2.9375)][i], "bfloat16")
    assert [f["kind"] for f in found] == ["near-tie", "real"]


def test_the_reference_file_holds_the_target_alone_with_its_gaps(bench_dir, rows, pair):
    """--write-reference: one row per prompt, the target-ar B = 1 outputs, and gap[j] equal to the top-2 gap
    of the target run on prompt + output[:j] (what the near-tie check needs)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = read_reference(bench_dir / "ref.jsonl")
    assert len(ref) == 3
    target_ar = next(r for r in rows if (r["method"], r["batch_size"]) == ("target-ar", 1))
    assert sum(len(x.output_token_ids) for x in ref) == target_ar["generated_tokens"]
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    for x in ref:
        assert x.max_tokens == 8 and x.near_tie_eps == 1e-3 and len(x.top2_gaps) == len(x.output_token_ids)
        assert x.dtype == "float32" and len(x.top1_logits) == len(x.output_token_ids)
        for j in (0, len(x.output_token_ids) - 1):
            first, second = top2_logits(model, x.prompt_token_ids + x.output_token_ids[:j], 320)
            assert x.top2_gaps[j] == pytest.approx(first - second, rel=1e-4, abs=1e-5)
            assert x.top1_logits[j] == pytest.approx(first, rel=1e-4, abs=1e-5)
        # the reference is the target's own greedy output
        with torch.inference_mode():
            out = model.generate(torch.tensor([x.prompt_token_ids]), do_sample=False, max_new_tokens=8,
                                 eos_token_id=2, pad_token_id=3)
        assert out[0, len(x.prompt_token_ids):].tolist()[: len(x.output_token_ids)] == x.output_token_ids
    assert top2_gaps_along(model, [5, 6], [], 320) == ([], [])


def test_without_matplotlib_the_plot_is_skipped_with_one_line(rows, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    paths = write_results(rows, tmp_path, {"title": "t"})
    assert set(paths) == {"json", "md"}
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    assert not (tmp_path / "throughput.png").exists()
    err = capsys.readouterr().err
    assert err.strip() == NO_PLOT and "pip install 'exspec[bench]'" in err


def test_forward_mode_times_every_point_in_both_layouts(tmp_path):
    out = tmp_path / "fwd"
    rc = main(["bench", "--mode", "forward", "--synthetic", "tiny", "--synthetic-cache", str(tmp_path / "cache"),
               "--batch-sizes", "1,3", "--kv-lens", "8,20", "--num-speculative-tokens", "2", "--repeats", "2",
               "--device", "cpu", "--no-progress", "--output", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    expected = {(b, kv, q, s) for b in (1, 3) for kv in (8, 20) for q in (1, 3) for s in ("consecutive", "scattered")}
    assert {(r["batch_size"], r["kv_len"], r["q_len"], r["slots"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r["forward_ms"] > 0 and len(r["forward_ms_repeats"]) == 2
        assert r["forward_ms_min"] == min(r["forward_ms_repeats"]) <= r["forward_ms"] <= max(r["forward_ms_repeats"])
    md = (out / "results.md").read_text()
    assert "| B | kv_len | q_len | consecutive ms | scattered ms | scattered / consecutive |" in md
    by = {(r["batch_size"], r["kv_len"], r["q_len"], r["slots"]): r for r in rows}
    c, s = by[(3, 20, 3, "consecutive")], by[(3, 20, 3, "scattered")]
    assert (f"| 3 | 20 | 3 | {c['forward_ms']:.2f} | {s['forward_ms']:.2f} | {s['forward_ms'] / c['forward_ms']:.2f}x "
            f"| {c['forward_ms_min']:.2f} | {s['forward_ms_min']:.2f} |") in md
    assert md.count("x |") == len(expected)  # two ratios per point


def test_synthetic_pair_is_built_cached_and_benchmarked(tmp_path):
    from exspec.bench.synthetic import ensure_synthetic_pair

    cache = tmp_path / "cache"
    out = tmp_path / "out"
    rc = main(["bench", "--synthetic", "tiny", "--synthetic-cache", str(cache), "--methods",
               "target-ar,exspec-fixed,hf-assisted", "--batch-sizes", "1", "--num-prompts", "2", "--max-tokens", "6",
               "--max-prompt-len", "48", "--repeats", "1", "--no-warmup", "--no-progress", "--device", "cpu",
               "--output", str(out)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"target-ar", "exspec-fixed", "hf-assisted"}
    assert rows["exspec-fixed"]["equivalence_rate"] == 1.0  # fp32: the target's own tokens
    target, draft, info = ensure_synthetic_pair("tiny", cache)  # cached: no rebuild
    assert (target / "config.json").exists() and (draft / "config.json").exists()
    assert 0.0 <= info["agreement"] <= 1.0 and info["parameters"]["draft"] < info["parameters"]["target"]
    md = (out / "results.md").read_text()
    assert "synthetic draft agreement" in md and f"{info['agreement']:.3f}" in md
    with pytest.raises(Exception, match="--synthetic must be one of"):
        ensure_synthetic_pair("huge", cache)


def test_efficiency_compares_measured_speedup_with_the_ideal():
    """ideal = tokens per step / (forward ms per step / target-ar's); measured = decode tokens/s over target-ar's
    (decode-only on both sides: whole-run tokens/s, prefill included, is not used); measured/ideal is 1 when nothing
    is lost outside the forwards."""
    from exspec.bench.report import efficiency

    rows = [
        {"method": "target-ar", "batch_size": 1, "tokens_per_s": 100.0, "mean_acceptance_length": 1.0,
         "forward_ms_per_step": 10.0, "decode_tokens_per_s": 110.0},
        {"method": "exspec-fixed", "batch_size": 1, "tokens_per_s": 150.0, "mean_acceptance_length": 3.0,
         "forward_ms_per_step": 20.0, "decode_tokens_per_s": 165.0},  # ideal 3 / 2 = 1.5x, measured 1.5x
        {"method": "exspec", "batch_size": 1, "tokens_per_s": 999.0, "mean_acceptance_length": 2.0,
         "forward_ms_per_step": 12.5, "decode_tokens_per_s": 132.0},  # ideal 1.6x, measured 1.2x
        {"method": "hf-assisted", "batch_size": 1, "tokens_per_s": 90.0, "mean_acceptance_length": 2.5,
         "forward_ms_per_step": None, "decode_tokens_per_s": None},  # not our engine: no row
    ]
    table = "\n".join(efficiency(rows))
    assert "| 1 | exspec-fixed | 3.00 | 20.00 | 10.00 | 1.50x | 1.50x | 1.00 |" in table
    assert "| 1 | exspec | 2.00 | 12.50 | 10.00 | 1.60x | 1.20x | 0.75 |" in table
    assert "hf-assisted" not in table
    assert efficiency(rows[1:]) == []  # no target-ar to compare with


def test_engine_rows_carry_their_forward_time(rows):
    for r in rows:
        if r["method"] in ("target-ar", *SPECULATIVE):
            assert r["forward_ms_per_step"] > 0
            assert r["decode_tokens_per_s"] > 0
        else:
            assert r["forward_ms_per_step"] is None
            assert r["decode_tokens_per_s"] is None


def test_fixed_ks_expand_exspec_fixed_into_one_method_per_k():
    from pathlib import Path

    from exspec.bench.runner import BenchConfig
    from exspec.engine import EngineConfig
    from exspec.errors import BenchError

    engine = EngineConfig(model=Path("t"), draft_model=Path("d"))
    cfg = BenchConfig(engine=engine, methods=("target-ar", "exspec-fixed", "exspec"), batch_sizes=(2, 1),
                      fixed_ks=(4, 0, 2, 2))
    assert cfg.points() == [
        ("target-ar", 1), ("exspec-fixed-k0", 1), ("exspec-fixed-k2", 1), ("exspec-fixed-k4", 1), ("exspec", 1),
        ("target-ar", 2), ("exspec-fixed-k0", 2), ("exspec-fixed-k2", 2), ("exspec-fixed-k4", 2), ("exspec", 2),
    ]
    with pytest.raises(BenchError, match="--fixed-ks"):
        BenchConfig(engine=engine, fixed_ks=(33,))


def _row(method: str, seconds: list[float], tokens: int = 100) -> dict:
    median = sorted(seconds)[len(seconds) // 2]
    return dict(method=method, batch_size=1, tokens_per_s=tokens / median, mean_acceptance_length=1.0,
                grouped_fraction=1.0, equivalence_rate=1.0, near_ties=0, real_divergences=0, num_prompts=1,
                generated_tokens=tokens, decode_seconds=median, seconds_per_repeat=seconds)


def test_ratios_show_the_range_of_their_per_repeat_pairs():
    """Each ratio cell is the median of the per-repeat ratios (the methods of a repeat ran together: a drift of the
    machine between repeats cancels in each, where a ratio of medians may take its medians from different repeats),
    with the lowest and highest of them. Model-free: rows as results.json holds them."""
    base = _row("target-ar", [10.0, 10.0, 12.0])
    fast = _row("exspec", [8.0, 10.0, 8.0])  # per repeat 1.25x, 1.00x, 1.50x; medians 10 / 8 = 1.25x
    assert paired_ratios(fast, base) == pytest.approx([1.25, 1.0, 1.5])
    k2, k4 = _row("exspec-fixed-k2", [9.0, 11.0, 9.0]), _row("exspec-fixed-k4", [10.0, 12.0, 12.0])
    md = markdown([base, fast, k2, k4], {})
    assert "| 1 | 1.25x (1.00-1.50) |" in md  # exspec / target-ar
    # against the best fixed k (k = 2: 9 s median), per repeat 1.125, 1.1, 1.125; against k = 4 1.25, 1.2, 1.5, whose
    # median 1.25 is not the ratio of the medians, 12 / 8 = 1.5 (k = 4's median from repeat 2 or 3, exspec's from 1 or 3)
    assert "| 1 | 2 | 1.12x (1.10-1.12) | 1.12x (1.10-1.12) | 1.25x (1.20-1.50) |" in md
    assert paired_ratio(fast, k4) == pytest.approx(1.25) and fast["tokens_per_s"] / k4["tokens_per_s"] == pytest.approx(1.5)
    # one repeat, or repeats that do not pair up: the ratio alone
    assert paired_ratios(_row("exspec", [8.0]), _row("target-ar", [10.0])) == []
    assert paired_ratios(fast, _row("target-ar", [10.0, 10.0])) == []
    assert "| 1 | 1.25x |" in markdown([_row("target-ar", [10.0]), _row("exspec", [8.0])], {})


def test_fixed_ks_rows_and_the_default_policy_against_the_best(pair, tmp_path):
    target, draft = pair
    rc = main([
        "bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "2", "--max-tokens", "6",
        "--batch-sizes", "1", "--methods", "target-ar,exspec-fixed,exspec", "--fixed-ks", "0,2",
        "--repeats", "1", "--max-prompt-len", "64", "--no-progress", "--output", str(tmp_path), "--device", "cpu",
    ])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(rows) == {"target-ar", "exspec-fixed-k0", "exspec-fixed-k2", "exspec"}
    assert rows["exspec-fixed-k0"]["num_speculative_tokens"] == 0 and rows["exspec-fixed-k0"]["mean_acceptance_length"] == 1.0
    assert rows["exspec-fixed-k2"]["num_speculative_tokens"] == 2 and rows["exspec-fixed-k2"]["speculation"] == "fixed"
    assert all(r["equivalence_rate"] == 1.0 for r in rows.values())
    steps = rows["exspec"]["policy"]["1"]["steps_by_k"]  # what the default policy ran, warm-up included
    assert sum(steps.values()) >= 1 and rows["exspec-fixed-k2"]["policy"] == {}
    md = (tmp_path / "results.md").read_text()
    fixed = {k: rows[f"exspec-fixed-k{k}"]["tokens_per_s"] for k in (0, 2)}
    best = max(fixed, key=fixed.get)
    assert f"| 1 | {best} | {rows['exspec']['tokens_per_s'] / fixed[best]:.2f}x |" in md
    assert "The default policy's steps" in md


def test_repeats_run_the_methods_forward_then_backward(pair, tmp_path, capsys):
    """Each timed repeat runs every method once, in the given order in even repeats and reversed in odd ones, so that a
    slow spell late in a repeat does not fall on the same (last) method every time; over two repeats each method's
    mean position is the same. Read from the real run's log lines, which come as each run ends."""
    methods = ["target-ar", "exspec-fixed-k0", "exspec"]
    assert repeat_order(methods, 0) == methods and repeat_order(methods, 1) == methods[::-1]
    assert repeat_order(methods, 2) == methods and methods == ["target-ar", "exspec-fixed-k0", "exspec"]
    positions = {m: sum(repeat_order(methods, r).index(m) for r in (4, 5)) for m in methods}
    assert set(positions.values()) == {len(methods) - 1}
    target, draft = pair
    rc = main([
        "bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "1", "--max-tokens", "2",
        "--batch-sizes", "1", "--methods", "target-ar,exspec-fixed,exspec", "--fixed-ks", "0", "--repeats", "3",
        "--max-prompt-len", "64", "--no-warmup", "--no-progress", "--output", str(tmp_path), "--device", "cpu",
        "--interleave", "runs",
    ])
    assert rc == 0
    ran = [line.split(" ")[1] for line in capsys.readouterr().err.splitlines() if line.startswith("[bench] ")]
    assert ran == methods + methods[::-1] + methods
    assert "each method's run whole, in turn" in (tmp_path / "results.md").read_text()


def test_methods_advance_together_and_each_run_is_timed_by_its_own_steps(pair, monkeypatch):
    """The default interleave: within a repeat every method's run is under way at once, and the next piece (a
    scheduler step of an engine method, a `generate` call of a Hugging Face one) is always the one of the run least
    far along in its tokens (ties in `repeat_order`): the runs advance together, whatever tokens a step of each
    yields. A run's seconds are the sum of its own steps' wall times (on a counting clock: exact, whatever the
    machine's speed), and the outputs are the target's, as with whole runs."""
    from types import SimpleNamespace

    import exspec.bench.runner as runner
    import exspec.scheduler.offline as offline
    from exspec.engine import EngineConfig

    target, draft = pair
    engine = EngineConfig(model=target, draft_model=draft, max_num_speculative_tokens=2, device="cpu")
    config = runner.BenchConfig(engine=engine, methods=("target-ar", "hf-generate", "exspec-fixed"), fixed_ks=(0, 2),
                                batch_sizes=(1,), num_prompts=2, max_tokens=6, max_prompt_len=64, repeats=2,
                                warmup=False)
    assert config.interleave == "steps"
    tokens = config.num_prompts * config.max_tokens
    events, live, behind = [], [], []
    start, step, hf = runner._EngineMethod.start, runner.OfflineRun.step, runner.Bench._hf_generate

    def progress(run):
        return run.summary.num_generated_tokens / tokens

    def tagged_start(self, prompts):
        run = start(self, prompts)
        run.name = self.name.split(" ")[0]
        live.append(run)
        return run

    def recorded_step(self):
        others = [progress(r) for r in live if r is not self and not r.done]
        behind.append(all(progress(self) <= p for p in others))  # the least far along steps
        events.append(self.name)
        finished = step(self)
        if self.done:
            live.remove(self)
        return finished

    def recorded_hf(self, prompts, b):
        calls = hf(self, prompts, b)

        def recorded(i, call):
            def run():
                # a call covers 1 / len(calls) of its run: it runs once every engine run is past its middle
                behind.append(all(progress(r) >= (i + 0.5) / len(calls) for r in live if not r.done))
                events.append("hf-generate")
                return call()
            return run
        return [recorded(i, call) for i, call in enumerate(calls)]

    ticks = iter(range(10**9))
    monkeypatch.setattr(offline, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))  # OfflineRun's clock
    monkeypatch.setattr(runner._EngineMethod, "start", tagged_start)
    monkeypatch.setattr(runner.OfflineRun, "step", recorded_step)
    monkeypatch.setattr(runner.Bench, "_hf_generate", recorded_hf)
    bench = runner.Bench(config, progress=False)
    rows = {r.method: r for r in bench.run()}
    engine_methods = ["target-ar", "exspec-fixed-k0", "exspec-fixed-k2"]
    assert all(behind) and len(behind) == len(events)
    # the first pieces of each repeat: every engine run at 0 tokens, in repeat_order (reversed in repeat 1)
    assert events[:3] == engine_methods
    second = next(i for i in range(3, len(events)) if events[i:i + 3] == engine_methods[::-1])
    assert "hf-generate" in events[3:second] and events[second:].count("hf-generate") == 2  # 2 calls a repeat
    for m in [*engine_methods, "hf-generate"]:
        row = rows[m]
        assert row.equivalence_rate == 1.0 and len(row.seconds_per_repeat) == 2
    # each engine run's seconds are its own steps' alone: on a clock that every step of every run advances by 2 (one
    # unit from the step's start to its end, one for its bookkeeping), a run's seconds are 2 x its own steps
    for m in engine_methods:
        assert rows[m].seconds_per_repeat == [2.0 * events[:second].count(m), 2.0 * events[second:].count(m)], m


@pytest.mark.parametrize("flag", ["--calibrate", "--no-calibrate"])
def test_exspec_calibrates_its_policy_once_as_serve_does(pair, tmp_path, monkeypatch, flag):
    """The `exspec` method measures the server's default: its policy runs the calibration `exspec serve` runs
    before serving, once, before the warm-up (`--no-calibrate`: none); the fixed-k methods have nothing to calibrate."""
    import exspec.bench.runner as runner

    calls = []

    class Recording(runner.SchedulerCore):
        def calibrate(self, prompts):
            calls.append((self.config.max_batch_size, type(self.speculation).__name__, len(prompts)))
            return super().calibrate(prompts)

    monkeypatch.setattr(runner, "SchedulerCore", Recording)
    target, draft = pair
    rc = main(["bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "2", "--max-tokens", "4",
               "--batch-sizes", "1,2", "--methods", "exspec-fixed,exspec", "--repeats", "2", "--max-prompt-len", "64",
               "--no-progress", "--output", str(tmp_path), "--device", "cpu", flag])
    assert rc == 0
    assert calls == ([(1, "AutoPolicy", 1), (2, "AutoPolicy", 2)] if flag == "--calibrate" else [])
    assert ("calibrated before its warm-up" in (tmp_path / "results.md").read_text()) == (flag == "--calibrate")


def test_exspec_num_speculative_tokens_sets_k_of_a_real_run(pair, tmp_path, monkeypatch):
    """`EXSPEC_NUM_SPECULATIVE_TOKENS=2 exspec bench` runs its draft methods at k = 2 (issue 24)."""
    monkeypatch.setenv("EXSPEC_NUM_SPECULATIVE_TOKENS", "2")
    target, draft = pair
    rc = main(["bench", "--model", str(target), "--draft-model", str(draft), "--num-prompts", "2", "--max-tokens", "4",
               "--batch-sizes", "1", "--methods", "target-ar,exspec-fixed,hf-assisted", "--repeats", "1",
               "--max-prompt-len", "64", "--no-warmup", "--no-progress", "--output", str(tmp_path), "--device", "cpu"])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert rows["exspec-fixed"]["num_speculative_tokens"] == rows["hf-assisted"]["num_speculative_tokens"] == 2
    assert rows["target-ar"]["num_speculative_tokens"] == 0
    assert "compile off" in (tmp_path / "results.md").read_text()


def test_the_resolved_engine_config_reaches_every_engine_method(pair, monkeypatch):
    """--compile (and every other engine setting) reaches the SpecEngine of target-ar, exspec-mixed, exspec-fixed
    and exspec; each point sets only its pool, k, length and the mixed path."""
    from dataclasses import replace

    import exspec.bench.runner as runner
    from exspec.engine import EngineConfig

    target, draft = pair
    engine = EngineConfig(model=target, draft_model=draft, max_num_speculative_tokens=3, compile=True, gemm="default",
                          kv_cache_memory=2**24, attention="reference")
    bench = runner.Bench(runner.BenchConfig(engine=engine, num_prompts=2, max_tokens=4, max_prompt_len=64),
                         progress=False)
    built = []
    monkeypatch.setattr(runner, "SpecEngine", lambda config, pair: built.append(config))
    for method, b in (("target-ar", 1), ("exspec-mixed", 3), ("exspec-fixed", 2), ("exspec", 2)):
        bench._engine_runner(method, b)
        k = 0 if method == "target-ar" else 3
        assert built.pop() == replace(engine, draft_model=None if k == 0 else draft, max_num_speculative_tokens=k,
                                      max_num_seqs=bench._pool_size(method, b), max_model_len=bench.max_model_len,
                                      force_mixed=method == "exspec-mixed")
    # the scheduler of every engine method takes the prefill step's token bound (--max-prefill-tokens)
    bench.config = replace(bench.config, max_prefill_tokens=48)
    assert {bench._scheduler_config(m, 2).max_prefill_tokens for m in ("target-ar", "exspec-fixed", "exspec")} == {48}


def test_forward_layouts_are_what_they_say_whatever_the_allocator_does():
    """--mode forward compares rows whose blocks are one run against rows whose blocks interleave: the layouts
    are set block by block (BlockManager.assign), so a smarter allocator cannot make "scattered" contiguous."""
    import torch

    from exspec.bench.forward import block_layouts, slot_layout

    blocks = block_layouts(3, 40, 16, torch.device("cpu"))  # 3 blocks per row
    for slot in slot_layout("consecutive", 3):
        assert blocks.first_contiguous_block(slot, 40) > 0
    scattered = [blocks.blocks(slot) for slot in slot_layout("scattered", 3)]
    assert scattered == [[10, 13, 16], [11, 14, 17], [12, 15, 18]]
    for slot in slot_layout("scattered", 3):
        assert blocks.first_contiguous_block(slot, 40) == -1
    assert blocks.num_free_blocks == 0
    assert blocks.block_table[3].tolist()[:3] == [10, 13, 16]

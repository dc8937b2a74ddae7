"""measure.py on the test-scale pair: the engine runs through the public offline API (`generate_offline`)
and reproduces the target's own greedy output; a build prints no stray warnings."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from exspec.demo import build_demo_pair, measure


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_demo_pair(tmp_path_factory.mktemp("demo") / "pair", seed=0, progress=False, scale="test")


def test_acceptance_goes_through_generate_offline(pair, monkeypatch):
    import exspec.scheduler as scheduler

    calls = []
    real = scheduler.generate_offline

    def spy(engine, prompts, params, config, progress=False):
        calls.append((len(prompts), config))
        return real(engine, prompts, params, config, progress)

    monkeypatch.setattr(scheduler, "generate_offline", spy)
    out = measure.measure_acceptance(*pair, num_prompts=5, max_tokens=8, k=3, batch_size=2)
    assert len(calls) == 1
    n, config = calls[0]
    assert n == 5 and (config.max_batch_size, config.num_speculative_tokens, config.speculation) == (2, 3, "fixed")
    assert 1.0 <= out["mean_acceptance_length"] <= 4.0 and 0.0 <= out["acceptance_rate"] <= 1.0
    assert out["sequence_steps"] > 0 and len(out["outputs"]) == 5
    assert all(1 <= len(o) <= 8 for o in out["outputs"])
    ag = measure.measure_agreement(*pair, num_prompts=5, max_tokens=8)
    assert out["outputs"] == ag["continuations"]  # the engine reproduces HF greedy generate, prompt by prompt
    assert 0.0 <= ag["lookup_agreement"] <= ag["lookup_proposed"] <= 1.0
    # n-gram lookup in place of the draft: the same outputs
    lookup = measure.measure_acceptance(pair[0], None, num_prompts=5, max_tokens=8, k=3, batch_size=2)
    assert lookup["outputs"] == ag["continuations"] and 1.0 <= lookup["mean_acceptance_length"] <= 4.0


def test_forward_latency_is_measured_per_model_and_batch(pair):
    lat_t, lat_d = measure.measure_forward_latency(pair, batch_sizes=(1, 2), context=8, repeats=3)
    assert set(lat_t) == set(lat_d) == {1, 2}
    assert all(v > 0 for v in (*lat_t.values(), *lat_d.values()))


def test_measure_command_prints_all_three(pair, capsys):
    d = pair[0].parent
    assert measure.main(["--dir", str(d), "--scale", "test", "--num-prompts", "2", "--max-tokens", "4", "--show", "1"]) == 0
    printed = capsys.readouterr().out
    for text in ("decode forward, batch 1", "agreement (draft top-1 == target greedy)", "mean acceptance length",
                 "agreement of the n-gram lookup instead", "engine (draft) output identical to target greedy (HF "
                 "generate): 2/2", "engine (ngram) output identical to target greedy (HF generate): 2/2"):
        assert text in printed


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def test_a_build_warns_about_nothing(tmp_path, capfd):
    """No log warning from transformers (its own handler may write to a stream pytest swapped out, so a
    handler of ours listens on its logger), no Python warning, nothing on stderr but our lines and bars."""
    records = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_demo_pair(tmp_path / "pair", seed=0, progress=True, scale="test")
    finally:
        hf_logger.removeHandler(records)
    assert records.messages == []
    assert [str(w.message) for w in caught] == []
    err = capfd.readouterr().err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    # Only our own messages and tqdm bars (`desc: 100%|...`).
    assert [line for line in lines if not line.startswith("[demo-models]") and "|" not in line] == []
    assert "Writing model shards" not in err

"""scripts/serve_step_trace.py (the server's step trace, docs/BENCHMARKS.md section 7): the wrapped scheduler writes
one line per engine call with what the step did, and the summary cuts the trace into bursts at the server's idle gaps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from exspec.engine.params import SamplingParams
from exspec.scheduler import SchedulerConfig, SchedulerCore
from exspec.scheduler import core as scheduler_core
from exspec.scheduler.request import Request
from tests.support.fake_engine import FakeEngine

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve_step_trace.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_step_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trace_records_each_step_and_the_summary_cuts_bursts(tmp_path, monkeypatch):
    st = _script()
    monkeypatch.setattr(scheduler_core.SchedulerCore, "step", scheduler_core.SchedulerCore.step)  # restored after
    path = tmp_path / "trace.jsonl"
    st.trace_steps(str(path))
    eng = FakeEngine(accept=lambda seq, k: 1)  # every row keeps its first draft
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=2, pool_size=2, num_speculative_tokens=2,
                                              speculation="fixed"))
    for i in range(2):
        core.add(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=7, ignore_eos=True), order=i))
    calls = 0
    while core.has_work():
        calls += len(core.step()[1])
    steps = [dict(zip(st.FIELDS, json.loads(line))) for line in path.read_text().splitlines()]
    assert len(steps) == calls and {s["kind"] for s in steps} >= {"prefill", "grouped"}
    decode = [s for s in steps if s["kind"] != "prefill"]
    assert sum(s["tokens"] for s in decode) + 2 == 14  # the first tokens come with the prefill
    assert all(s["k"] == 2 and s["batch_size"] == 2 and s["drafting_rows"] == 2 for s in decode[:-1])
    assert sum(s["prompt_tokens"] for s in steps) == 6 and steps[-1]["running"] == 0
    # two bursts: the same steps again, starting 5 s after the first ended
    shift = steps[-1]["start"] + steps[-1]["wall_s"] - steps[0]["start"] + 5.0
    rows = [list(s.values()) for s in steps]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [[r[0] + shift, *r[1:]] for r in rows]))
    parts = st.bursts(str(path))
    assert [len(p) for p in parts] == [len(steps), len(steps)]
    text = st.summary(parts[0])
    assert f"engine for {sum(s['tokens'] for s in decode)} tokens" in text and "B=2 k=2:" in text

"""The one-file claim for speculation policies (docs/ARCHITECTURE.md, "Adding a speculation policy"): a policy
defined in this test module, registered by name, is accepted by SchedulerConfig, built by the scheduler from the
registry and runs; the built-in policies are one file each, listed without importing them."""

from __future__ import annotations

import pytest
from tests.support.fake_engine import FakeEngine

from exspec.engine.params import SamplingParams
from exspec.errors import ExspecError
from exspec.registry import listed
from exspec.scheduler import SchedulerConfig, SchedulerCore, policies
from exspec.scheduler.policies import SpeculationPolicy, register
from exspec.scheduler.request import Request


class ShrinkPolicy(SpeculationPolicy):  # as it would stand in scheduler/policies/shrink.py
    """k_max for a lone sequence, one draft fewer each time the batch doubles"""

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        return max(0, self.k_max - (batch_size - 1).bit_length())


@pytest.fixture
def shrink():
    register("shrink")(ShrinkPolicy)  # the line the policy's file holds as its decorator
    yield "shrink"
    policies.POLICIES.unregister("shrink")


def test_the_builtin_policies_are_one_file_each():
    assert policies.names()[0] == SchedulerConfig().speculation  # the default registers first
    assert listed("exspec.scheduler.policies") == tuple(sorted(policies.names()))  # the CLI's list
    for name in policies.names():
        assert type(policies.create(name, 4)).__module__ == f"exspec.scheduler.policies.{name}"
    with pytest.raises(ValueError, match="speculation policy must be one of auto, fixed, adaptive, got 'psychic'"):
        policies.create("psychic", 4)
    with pytest.raises(ExspecError, match="speculation must be one of auto, fixed, adaptive"):
        SchedulerConfig(speculation="psychic")
    with pytest.raises(ValueError, match="speculation policy 'fixed' is registered twice"):
        register("fixed")(ShrinkPolicy)
    with pytest.raises(TypeError, match="must live in scheduler/policies/shrink.py"):
        register("shrink")(type("Elsewhere", (SpeculationPolicy,), {"__module__": "exspec.scheduler.core"}))
    assert "shrink" not in policies.names()


def test_a_registered_policy_runs_in_the_scheduler(shrink):
    eng = FakeEngine(accept=lambda seq, k: k)
    core = SchedulerCore(eng, SchedulerConfig(max_batch_size=4, pool_size=4, num_speculative_tokens=4,
                                              speculation=shrink))
    assert isinstance(core.speculation, ShrinkPolicy) and core.speculation.k_max == 4
    for i in range(4):
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=7) if i == 0 else SamplingParams(max_tokens=12)
        core.add(Request(str(i), [1, 2, 3], params, order=i))
    while core.has_work():
        core.step()
    assert eng.batches and all(b.num_draft_tokens == 4 - (len(b.seq_ids) - 1).bit_length() for b in eng.batches)
    assert {b.num_draft_tokens for b in eng.batches} >= {2}  # B = 4 ran with k = 2, not k_max
    # k_varies (inherited): the seeded sampled request runs without drafts, so its seed reproduces exactly
    assert [p.use_speculation for _, _, p in eng.added] == [False, True, True, True]
    policies.POLICIES.unregister("shrink")
    with pytest.raises(ExspecError, match="speculation must be one of"):
        SchedulerConfig(speculation="shrink")

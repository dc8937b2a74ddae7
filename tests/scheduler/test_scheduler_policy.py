"""The scheduling policy without any model: batch choice, the aging bound, the speculation policy."""

import math
import random

import pytest

from exspec.scheduler.policy import Candidate, SpeculationPolicy, age_threshold_for, choose_batch


def cands(*specs):
    """specs: (length, waited) per candidate; key = order = index."""
    return [Candidate(i, length, waited, i) for i, (length, waited) in enumerate(specs)]


def test_largest_same_length_group_wins():
    c = cands((10, 0), (12, 0), (12, 0), (12, 0), (15, 0), (15, 0))
    choice = choose_batch(c, batch_size=8, group_threshold=2, age_threshold=100)
    assert choice.grouped and set(choice.keys) == {1, 2, 3}


def test_group_capped_at_batch_size_longest_waiting_first():
    c = cands(*[(7, w) for w in (0, 3, 1, 5, 2)])
    choice = choose_batch(c, batch_size=3, group_threshold=2, age_threshold=100)
    assert choice.grouped and choice.keys == (3, 1, 4)


def test_tie_between_groups_goes_to_longest_waiting():
    c = cands((5, 0), (5, 0), (9, 4), (9, 0))
    choice = choose_batch(c, batch_size=4, group_threshold=2, age_threshold=100)
    assert set(choice.keys) == {2, 3}


def test_small_group_falls_back_to_mixed_oldest_first():
    c = cands((1, 0), (2, 3), (3, 1), (4, 2), (4, 0))
    choice = choose_batch(c, batch_size=3, group_threshold=3, age_threshold=100)
    assert not choice.grouped and choice.keys == (1, 3, 2)


def test_aging_forces_a_fair_step():
    c = cands((5, 0), (5, 0), (5, 0), (9, 6))
    choice = choose_batch(c, batch_size=2, group_threshold=2, age_threshold=6)
    assert 3 in choice.keys and not choice.grouped


def test_force_mixed_never_groups():
    c = cands((5, 0), (5, 0), (5, 0))
    choice = choose_batch(c, batch_size=8, group_threshold=2, age_threshold=100, force_mixed=True)
    assert not choice.grouped and len(choice.keys) == 3


def test_infeasible_wait_bound_is_rejected():
    with pytest.raises(ValueError, match="ceil"):
        age_threshold_for(max_wait_steps=3, pool_size=32, batch_size=8)
    assert age_threshold_for(8, 32, 8) == 5


@pytest.mark.parametrize("pool,batch,max_wait", [(32, 8, 8), (16, 4, 5), (9, 2, 6), (8, 8, 1)])
def test_aging_bound_holds_under_adversarial_lengths(pool, batch, max_wait):
    """Simulate many steps: random advances (1..6 tokens), random finishes and arrivals; the longest
    consecutive wait of any sequence never exceeds max_wait_steps."""
    rng = random.Random(pool * 100 + batch)
    threshold = age_threshold_for(max_wait, pool, batch)
    order = 0
    live = {}
    worst = 0
    for step in range(3000):
        while len(live) < pool:  # keep the pool full: the hardest case
            live[order] = [rng.choice([10, 11, 12, 40]), 0]
            order += 1
        cs = [Candidate(k, v[0], v[1], k) for k, v in live.items()]
        choice = choose_batch(cs, batch, group_threshold=2, age_threshold=threshold)
        assert 1 <= len(choice.keys) <= batch
        if choice.grouped:
            assert len({live[k][0] for k in choice.keys}) == 1
        for k, v in live.items():
            if k in choice.keys:
                v[0] += rng.randint(1, 6)
                v[1] = 0
            else:
                v[1] += 1
                worst = max(worst, v[1])
        for k in list(choice.keys):
            if rng.random() < 0.1:
                del live[k]
    assert worst <= max_wait
    assert worst >= threshold  # the bound is exercised, not vacuous


def test_fixed_speculation_policy():
    p = SpeculationPolicy("fixed", 5)
    assert {p.choose(b) for b in (1, 8, 32)} == {5}


def _drive(policy, rate_of, batch, steps=400):
    chosen = []
    for _ in range(steps):
        k = policy.choose(batch)
        tokens, secs = rate_of(batch, k)
        policy.observe(batch, k, tokens, secs)
        chosen.append(k)
    return chosen


def test_adaptive_turns_speculation_off_when_it_loses():
    # Large batches: drafting costs more than it saves -> k = 0 is fastest.
    def rate(batch, k):
        return batch * (1 + 0.3 * k), 0.01 * (1 + 0.5 * k)

    chosen = _drive(SpeculationPolicy("adaptive", 4), rate, batch=32)
    tail = chosen[-100:]
    assert tail.count(0) >= 90


def test_adaptive_speculates_when_it_wins():
    def rate(batch, k):
        return batch * (1 + 0.8 * k), 0.01 * (1 + 0.1 * k)

    chosen = _drive(SpeculationPolicy("adaptive", 4), rate, batch=2)
    assert chosen[-100:].count(4) >= 90


def test_adaptive_keeps_separate_estimates_per_batch_size():
    def rate(batch, k):
        gain = 0.8 if batch <= 2 else 0.05
        return batch * (1 + gain * k), 0.01 * (1 + 0.3 * k)

    p = SpeculationPolicy("adaptive", 4)
    small = _drive(p, rate, batch=2)
    large = _drive(p, rate, batch=32)
    assert small[-50:].count(4) >= 45 and large[-50:].count(0) >= 45
    assert math.isfinite(sum(p.rates().values()))

"""The scheduling policy without any model: batch choice, the aging bound, the speculation policy."""

import math
import random

import pytest

from exspec.scheduler.policy import Candidate, GoodputPolicy, SpeculationPolicy, age_threshold_for, choose_batch


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


# ---------------------------------------------------------------------------------------------------- auto
# Synthetic cost models: a step over B rows with k drafts emits B * E(k) tokens, E(k) = (1 - a^(k+1)) / (1 - a)
# for acceptance a, in t(k) = t1 * (1 + draft * k + verify(k)) seconds, with seeded multiplicative noise.


def _cost_model(accept: float, draft: float, verify, noise: float = 0.05, seed: int = 0):
    rng = random.Random(seed)

    def expected(batch, k):
        tokens = batch * (1 - accept ** (k + 1)) / (1 - accept)
        return tokens, 0.01 * (1 + draft * k + verify(k))

    def sample(batch, k):
        tokens, secs = expected(batch, k)
        return tokens, secs * math.exp(rng.gauss(0.0, noise))

    return expected, sample


def _best_rate(expected, batch, k_max):
    rates = {k: expected(batch, k)[0] / expected(batch, k)[1] for k in range(k_max + 1)}
    return max(rates, key=rates.get), rates


def _run_auto(policy, sample, batch, steps):
    """Drive the policy; returns the chosen ks and the goodput (tokens / seconds) over all steps."""
    chosen, tokens, secs = [], 0.0, 0.0
    for _ in range(steps):
        k = policy.choose(batch)
        n, s = sample(batch, k)
        policy.observe(batch, k, n, s)
        chosen.append(k)
        tokens, secs = tokens + n, secs + s
    return chosen, tokens / secs


LOSES = dict(accept=0.5, draft=0.35, verify=lambda k: 0.3 * k)  # CPU at B=8: verify rows cost compute
PAYS = dict(accept=0.8, draft=0.05, verify=lambda k: 0.04 * k)  # a cheap, strong draft, memory-bound verify
JUMP = dict(accept=0.85, draft=0.04, verify=lambda k: 0.5 * (k > 0) + 0.02 * k)  # k=1 loses, larger k wins


def test_auto_stays_within_3_percent_of_no_speculation_where_it_loses():
    expected, sample = _cost_model(**LOSES)
    best, rates = _best_rate(expected, 8, 4)
    assert best == 0 and max(rates[k] for k in (1, 2, 3, 4)) < 0.95 * rates[0]  # the premise: every k > 0 loses
    for seed in range(5):
        _, sample = _cost_model(**LOSES, seed=seed)
        chosen, goodput = _run_auto(SpeculationPolicy("auto", 4), sample, 8, 300)
        assert goodput >= 0.97 * rates[0], f"seed {seed}: regret above 3%"
        assert chosen[50:].count(0) >= 0.95 * 250  # converged to k = 0 within 50 steps


@pytest.mark.parametrize("model", [PAYS, JUMP], ids=["pays", "k1-loses-larger-wins"])
def test_auto_converges_to_the_best_k_where_speculation_pays(model):
    expected, _ = _cost_model(**model)
    k_max = 8
    best, rates = _best_rate(expected, 1, k_max)
    candidates = SpeculationPolicy("auto", k_max).candidates
    best_candidate = max(candidates, key=rates.get)
    assert best_candidate > 0 and rates[best_candidate] > 1.3 * rates[0]  # the premise: speculation pays
    for seed in range(5):
        _, sample = _cost_model(**model, seed=seed)
        chosen, goodput = _run_auto(SpeculationPolicy("auto", k_max), sample, 1, 400)
        near_best = {k for k in candidates if rates[k] >= 0.97 * rates[best_candidate]}
        tail = chosen[50:]
        assert sum(k in near_best for k in tail) >= 0.9 * len(tail), f"seed {seed}: not converged within 50 steps"
        assert goodput >= 0.95 * rates[best_candidate]


def test_auto_follows_a_load_change_both_ways():
    pays_expected, pays = _cost_model(**PAYS, seed=1)
    loses_expected, loses = _cost_model(**LOSES, seed=2)
    policy = SpeculationPolicy("auto", 4)
    before, _ = _run_auto(policy, pays, 4, 200)
    assert before[-50:].count(0) == 0  # speculating
    after, goodput = _run_auto(policy, loses, 4, 300)  # speculation stops paying: back to k = 0 quickly
    assert after[20:].count(0) >= 0.95 * 280
    rate0 = loses_expected(4, 0)[0] / loses_expected(4, 0)[1]
    assert goodput >= 0.92 * rate0  # includes the ~20 steps that detect the change (stale estimates age out)
    again, _ = _run_auto(policy, pays, 4, 1500)  # and it pays again: found by the budgeted re-measurement
    assert again[-100:].count(0) <= 5


def test_auto_keeps_separate_estimates_per_batch_size_and_respects_k_max():
    _, pays = _cost_model(**PAYS)
    _, loses = _cost_model(**LOSES)
    policy = SpeculationPolicy("auto", 2)
    small, _ = _run_auto(policy, pays, 1, 150)
    large, _ = _run_auto(policy, loses, 16, 150)
    small2, _ = _run_auto(policy, pays, 1, 50)
    assert max(small + large) <= 2
    assert small2.count(2) >= 45 and large[-100:].count(0) >= 95
    assert SpeculationPolicy("auto", 0).choose(8) == 0


def test_auto_is_the_default_speculation_mode():
    from exspec.scheduler.types import SchedulerConfig

    assert SchedulerConfig().speculation == "auto"


def test_plan_prefill_bounds_padding_and_cuts_prompts_only_where_it_pays():
    from exspec.scheduler.policy import plan_prefill

    assert plan_prefill([], 512) == (0, 0)
    assert plan_prefill([964], 512) == (1, 512)  # chunked, alone
    assert plan_prefill([10] * 100, 512) == (51, 10)  # 51 whole prompts, no padding, none cut
    assert plan_prefill([964, 20, 20], 512) == (1, 512)  # the long one first, nothing padded beside it
    assert plan_prefill([20, 964, 20], 512) == (2, 256)  # cut: 276 real tokens against 20 whole
    assert plan_prefill([100] * 5 + [600], 512) == (5, 100)  # 500 whole against 510 cut: nothing cut
    assert plan_prefill([1] * 600, 512) == (128, 1)  # at most MAX_PREFILL_ROWS rows per step
    for remaining in ([3, 1, 4, 1, 5, 9, 2, 6], [700, 600, 15, 15], [1] * 600, [513], [15, 964, 17, 611, 20]):
        for budget in (1, 7, 64, 512):
            n, w = plan_prefill(remaining, budget)
            assert 1 <= n <= len(remaining) and 1 <= w
            assert n * min(w, max(remaining[:n])) <= budget  # padded cost within the budget
            real = sum(min(x, w) for x in remaining[:n])
            rows = min(len(remaining), budget, 128)
            best = max(sum(min(x, budget // m) for x in remaining[:m]) for m in range(1, rows + 1))
            assert 2 * real >= best  # at least half of what the best FIFO prefix could prefill


def test_drafting_says_whether_prompts_need_the_draft():
    assert SpeculationPolicy("fixed", 4).drafting() and not SpeculationPolicy("fixed", 0).drafting()
    assert SpeculationPolicy("adaptive", 4).drafting()
    loses = SpeculationPolicy("auto", 4)
    assert loses.drafting()  # nothing measured yet: prefill the draft
    _run_auto(loses, _cost_model(**LOSES)[1], 8, 300)
    assert not loses.drafting()  # k = 0 measured best: prompts may skip the draft
    _run_auto(loses, _cost_model(**PAYS)[1], 1, 20)
    assert loses.drafting()  # a new batch size, still warming up
    pays = SpeculationPolicy("auto", 4)
    _run_auto(pays, _cost_model(**PAYS)[1], 8, 300)
    assert pays.drafting()


def test_auto_weighs_k_without_the_one_off_catch_up():
    """A step that catches the draft up reports that time apart; k's goodput leaves it out (it is paid once
    per token whatever k follows), so a large catch-up does not make a paying k look like a loss."""
    expected, sample = _cost_model(**PAYS)
    policy = GoodputPolicy(4)
    for step in range(200):
        k = policy.choose(1)
        n, s = sample(1, k)
        catchup = 20 * s if k > 0 and step % 5 == 0 else 0.0  # a big one-off catch-up every fifth step
        policy.observe(1, k, n, s + catchup, catchup)
    best, _ = _best_rate(expected, 1, 4)
    assert policy.best(1) == best > 0

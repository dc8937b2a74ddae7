"""`auto`, the default speculation policy: k from a model of what it measures, not from racing every k.

Two models, fitted from what each decode step reports, give the expected goodput of every k; the step runs
the argmax. Nothing here reads a clock or draws a random number: the same observations give the same
choices (the timing that feeds it still differs between runs; see `AutoPolicy`).

Acceptance (shared by every batch size: it is a property of the pair and the prompts, not of the load).
For draft position i = 1..k_max, the decayed counts of rows that reached position i (their i - 1 first
drafts accepted) and of those whose i-th draft was accepted give the conditional acceptance a_i, shrunk
toward the pooled rate over all positions (`prior_strength` pseudo-rows), itself shrunk toward 1/2. A row
drafting k tokens then emits E(k) = 1 + sum_{i<=k} a_1 * ... * a_i tokens (accepted drafts + the target's
own token). Positions are counted apart because acceptance is not geometric: the first draft after a
verified token is accepted more often than the fourth. Counts decay by `accept_decay` per drafting step
and by `idle_decay` per step without drafts, so the estimate follows a change and grows uncertain while
it goes unmeasured.

Step cost, per batch-size bucket (`size_bucket`: each batch size up to EXACT_SIZES, powers of two beyond), per k:
the median of the last `window` steady step times (the step's wall time less the one-off draft catch-up, which is
paid once per token whatever k follows; k = 0 steps measure the target alone; the first `settle_steps` k = 0 steps
after drafting steps are not recorded:
right after drafting a k = 0 step costs more than plain decoding does in a row, on the toy pair twice, settling
over some ten steps; with n-gram lookup, no draft model, nothing settles: every step is recorded). Over k > 0 a line
a + b * k is fitted through those medians, weighted by their sample counts (k draft forwards and k more query columns
in the verify; the jump from k = 0, a draft forward's fixed cost and the verify's second column, is in a). A measured
k's cost is its median pulled toward the line (`fit_weight` pseudo-samples), so neighbouring k share their evidence;
a k not measured is the line's value. With one k > 0 measured the slope is half the one from k = 0 (uncertain);
with only k = 0 measured, c(0) * (1 + `prior_slope` * k). A calibrated bucket (`calibration`) takes its relative
costs c(k) / c(0) from the calibration, where each k ran in a block on the same prompts: live, the ks are measured at
different times on different contexts, and comparing them reads the contexts' growth as a change of k's cost. Its
live steps give the level c(0), and its relative costs move only by paired evidence: a k > 0 and a k = 0 measured
within `pair_steps` steps of each other (an exploration's or a re-check's burst beside the steps it left; their
median less its standard error, `_pair_scale`). A calibration is a few steps of each k: a slow spell during them skews
it, so the calibration runs in two rounds, and a calibrated bucket re-checks the other side of the draft boundary
(`_recheck`: k = 0 while drafting, its best k > 0 while not, if the models put it within `recheck_window` of k*) in a
burst of `min_samples` steps after `recheck_steps` steps (4x that for k = 0 in a bucket calibrated to draft: its first
live steps are k = 0 beside drafting ones), the interval doubling up to `recheck_max` while the decision holds and back
to `recheck_steps` when it crosses (the 350m pair at B = 1, a one-block calibration on a loaded VM: k = 0 in all 992
live steps, no exploration, where fixed k = 2 was 1.23x faster). What re-checks cost (catch-up of the draft, and their
other seconds times the loss the models put on them) is kept within `recheck_budget` (1%) of the bucket's seconds: a
k > 0 while prompts skip the draft first catches every row's context up (the toy pair at B = 8: 2 to 15 steps' time).

Draft prefill. Drafting has a cost outside the decode steps: every prompt is prefilled into the draft too
(or caught up later, the same work). Per generated token it is the draft's prefill seconds per prompt token
(measured on prefill steps that fed the draft, `observe_prefill`) times prompt tokens per generated token (of
finished requests, `observe_finished`, decayed by `request_decay` each): o seconds per token, 0 until both
are measured. Long prompts with short answers make it large: where a step that drafts gains a few percent
over k = 0 (a large batch on the CPU), o can turn that gain into a loss (docs/BENCHMARKS.md section 2).

Goodput per row: G(k) = T / (c(k) + o * n * T) for k > 0, T = 1 + f * (E(k) - 1), G(0) = 1 / c(0); f the
fraction of rows that draft when k > 0 (rows that opted out emit one token whatever k is), n the bucket's
mean rows per step, and every c(k > 0) lifted by one factor so the cheapest is c(0) (a drafting step does all a k = 0
step does and more: a lower measurement is noise, or GEMMs not monotone in rows; one factor keeps the relative costs
of the k > 0, which the choice among them needs). o leaves the choice among k > 0 as it is (a cost per token, the
same for every k > 0): it decides between drafting and not. The step runs k* = argmax G, and k = 0 unless some k beats
it by `draft_margin` (5%: near-ties go to plain decoding, which skips the draft's prefill too, `drafting()`, and
pays no catch-up; on the 350m pair at B = 8 fixed k = 1 was 1-3.5% slower than k = 0 in five runs while the
calibrated model put it 2% or more above); between two k > 0 the one running stays unless the other beats it by
`margin` (2%). Where the scheduler says how many of the
step's rows will draft (`choose(batch_size, drafting_rows)`: with n-gram lookup only rows whose tokens match propose
anything, and which do is known before the step), the step's k is the argmax of G with that fraction for f (`_for_rows`):
k = 0 when no row will draft (an exploration or re-check under way then waits for a step that can measure it), and
the choice follows the step's share of matching rows rather than their mean (in
model-free worlds of independent matches, 0.98-1.08x the goodput of the mean's choice at B = 2 to 8, within 4% of the
best k for each step's matches, tests/scheduler). The plan is computed again every
`replan_every` steps of a bucket and after any step that measured another k (a plan costs ~0.1 ms of Python,
a choice from the last one ~0.01 ms).

Exploration, only where the models are uncertain: an optimistic goodput G+(k) (acceptance at its upper
bound, `z` standard errors; cost at its lower bound: sampling spread over sqrt(n), wider for predicted and
stale costs) names a k whose measurement could change the decision (G+(k) > (1 + margin) * G(k*), and
G+(k) > (1 + draft_margin) * G(0) while k* = 0: what it takes to be chosen; in a calibrated
bucket only a k above k* > 0, whose acceptance at the positions k* leaves undrafted is uncertain, at its cost: a
calibrated bucket whose k* is 0 explores nothing, its re-checks of its best k > 0 (below) measure the same acceptance
within their own budget, charged by the loss the models put on them, where an exploration's every second counts
against `budget`; on the toy pair at B = 8, where k = 0 is right, explorations and re-checks took 2.8-3.0% of bucket
8's decode seconds). It is
measured in a burst of `min_samples` steps (old samples dropped if stale) when the bucket's exploring
seconds, catch-up included, are within `budget` of its decode seconds plus `free_steps` steps of k = 0 (at
once for a bucket with nothing to go on; one that starts from another bucket that drafted earns them at one per 4
of its steps, so a bucket that lives a few steps, as a closed batch drains, does not probe; a calibrated one has
none: the calibration measured what they would). While prompts skip the draft (`drafting()` False: the buckets
that want drafts run a small share of the rows), a bucket whose k* > 0 runs k = 0 for its first `streak_steps`
steps in a row: its rows were not fed to the draft, and catching whole contexts up for the few steps of a closed
batch's drain costs more than the drafts gain (a bucket that goes on running drafts, and the catch-up pays).
A server measures most of this before traffic (`calibration`): live exploration is then for what changes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from exspec.scheduler.policies import SpeculationPolicy, bucket, register


CALIBRATION_DRIFT = 0.03  # added to a calibrated relative cost's uncertainty: live contexts are not the calibration's
CALIBRATION_KS = (0, 1, 2, 3, 4)  # the k measured before serving (`calibration`); the cost line covers the others
# batch sizes up to this are buckets of their own, larger ones share their power of two: a step's cost is not smooth in
# its rows (B x (k + 1) in the verify). On the 350m pair at B = 3 a k = 2 step cost 1.32x a k = 1 step, at B = 4 1.13x
# (docs/BENCHMARKS.md section 2, session 31): one bucket for 3 and 4 rows ran k = 2 at both
EXACT_SIZES = 8


def size_bucket(batch_size: int) -> int:
    """`auto`'s batch-size bucket: the batch size itself up to EXACT_SIZES, else the next power of two."""
    return batch_size if batch_size <= EXACT_SIZES else bucket(batch_size)


def candidates_for(k_max: int) -> list[int]:
    """The k a policy chooses among: every k up to 8, powers of two beyond, and k_max."""
    return sorted({k for k in range(min(k_max, 8) + 1)} | {k for k in (16, 32) if k < k_max} | {k_max})


@dataclass
class _Bucket:
    size: int  # the bucket's batch size (a power of two)
    steps: int = 0  # steps chosen in this bucket
    costs: dict[int, deque] = field(default_factory=dict)  # k -> last steady step seconds
    last: dict[int, int] = field(default_factory=dict)  # k -> step of its last sample
    best: int = 0  # k* of the last step that did not explore
    planned: tuple | None = None  # the last _plan (recomputed every `replan_every` steps and after news)
    planned_at: int = 0  # the step it was computed at
    by_rows: dict[tuple[int, int], int] = field(default_factory=dict)  # of the last plan: (rows, drafting rows) -> k
    burst: tuple[int, int] = (0, 0)  # (k, steps left) of the exploration under way
    exploring: bool = False  # the step chosen last explores
    explore_s: float = 0.0  # seconds of exploring steps (catch-up included)
    total_s: float = 0.0  # seconds of every step
    explore_steps: int = 0
    share: float = 0.0  # decayed share of recent rows (drafting()): steps weighted by their rows
    by_k: dict[int, int] = field(default_factory=dict)  # k -> steps observed
    # k > 0 -> (c(k) / c(0), relative uncertainty) measured by the calibration (`calibrated`): a live k = 0 cost
    # times these predicts the k > 0 costs until they are measured live
    ratios: dict[int, tuple[float, float]] = field(default_factory=dict)
    rows: float = 0.0  # mean rows per step (decayed)
    # calibrated: live relative costs over the calibration's, (c(k) / c(0) measured) / (c(k) / c(0) calibrated), each
    # from a k > 0 and k = 0 measured within `pair_steps` steps of each other (`_pair`)
    paired: deque = field(default_factory=deque)  # the last `window` (AutoPolicy._bucket)
    streak: int = 0  # steps chosen in a row in this bucket, up to the last
    regime: bool | None = None  # whether the bucket's last observed step drafted (None: none observed)
    settling: int = 0  # k = 0 steps after drafting still to observe before their costs are recorded
    # calibrated: the next re-check of the other side of the draft boundary (`_recheck`) is due at step `recheck_at`;
    # the interval doubles after each, back to `recheck_steps` when the decision crosses the boundary
    recheck_at: int = 0
    recheck_every: int = 0
    rechecking: bool = False  # the burst under way is a re-check
    recheck_steps: int = 0  # steps of re-check bursts (counted in explore_steps too)
    recheck_loss: float = 0.0  # of the re-check under way: 1 - G(its k) / G(k*) as modelled when it started
    recheck_s: float = 0.0  # what re-checks cost: their catch-up, and their other seconds times their recheck_loss
    recheck_catchup: float = 0.0  # catch-up seconds of the last re-check (its next is expected to pay as much)


@register("auto")
class AutoPolicy(SpeculationPolicy):
    """See the module docstring. k follows measured time, so it may differ between runs (`k_varies`): greedy
    outputs do not depend on k (token-identical to the target), but a seeded sampled output reproduces exactly
    only under the same k schedule, so the scheduler decodes seeded sampled requests without drafts."""

    def __init__(
        self,
        k_max: int,
        *,
        window: int = 16,
        min_samples: int = 3,
        accept_decay: float = 1 / 128,
        idle_decay: float = 1 / 4096,
        prior_strength: float = 4.0,
        prior_slope: float = 0.15,
        margin: float = 0.02,
        draft_margin: float = 0.05,
        z: float = 1.0,
        budget: float = 0.03,
        free_steps: int = 12,
        stale_steps: int = 400,
        share_decay: float = 1 / 256,
        fit_weight: float = 8.0,
        replan_every: int = 8,
        draft_share: float = 0.1,
        request_decay: float = 1 / 64,
        prefill_decay: float = 1 / 16,
        streak_steps: int = 8,
        settle_steps: int = 8,
        pair_steps: int = 16,
        recheck_steps: int = 128,
        recheck_max: int = 4096,
        recheck_window: float = 0.5,
        recheck_budget: float = 0.01,
    ) -> None:
        super().__init__(k_max)
        self.candidates = candidates_for(k_max)
        self.window, self.min_samples = window, min_samples
        self.accept_decay, self.idle_decay, self.prior_strength = accept_decay, idle_decay, prior_strength
        self.prior_slope, self.margin, self.z = prior_slope, margin, z
        self.draft_margin = draft_margin
        self.budget, self.free_steps, self.stale_steps = budget, free_steps, stale_steps
        self.share_decay, self.draft_share, self.fit_weight = share_decay, draft_share, fit_weight
        self.replan_every = replan_every
        self.request_decay, self.prefill_decay = request_decay, prefill_decay
        self._tried = [0.0] * (k_max + 1)  # [k_max + 1]: index i = rows that reached draft position i (0 unused)
        self._accepted = [0.0] * (k_max + 1)  # of those, rows whose i-th draft was accepted
        self._rows = 0.0  # rows of drafting steps (decayed)
        self._drafting_rows = 0.0  # of those, rows that proposed drafts
        self._buckets: dict[int, _Bucket] = {}
        self._last: _Bucket | None = None  # the bucket of the last step chosen
        self.streak_steps, self.settle_steps, self.pair_steps = streak_steps, settle_steps, pair_steps
        self.recheck_steps, self.recheck_max, self.recheck_window = recheck_steps, recheck_max, recheck_window
        self.recheck_budget = recheck_budget
        self._prompt_tokens = 0.0  # of finished requests (decayed per request)
        self._output_tokens = 0.0  # of finished requests (decayed per request)
        self._requests = 0.0  # finished requests (decayed per request)
        self._draft_prefill_s = 0.0  # draft seconds of prefill steps that fed the draft (decayed per step)
        self._draft_prefill_tokens = 0.0  # prompt tokens of those steps (decayed per step)

    # ------------------------------------------------------------------ acceptance

    def acceptance(self) -> list[float]:
        """[k_max]: the conditional acceptance a_i of draft positions 1..k_max."""
        prior = (sum(self._accepted) + 1.0) / (sum(self._tried) + 2.0)  # pooled over positions, shrunk to 1/2
        m, rates = self.prior_strength, []
        for i in range(1, self.k_max + 1):
            prior = (self._accepted[i] + m * prior) / (self._tried[i] + m)  # shrunk toward the position before
            rates.append(prior)
        return rates

    def _acceptance_bounds(self) -> tuple[list[float], list[float]]:
        rates = self.acceptance()
        upper = [
            min(1.0, a + self.z * math.sqrt(a * (1 - a) / (self._tried[i + 1] + self.prior_strength)))
            for i, a in enumerate(rates)
        ]
        return rates, upper

    @staticmethod
    def _expected(rates: list[float], k: int) -> float:
        """Tokens a row emits with k drafts: 1 + sum over i <= k of the chance to accept the first i."""
        total, p = 1.0, 1.0
        for a in rates[:k]:
            p *= a
            total += p
        return total

    def draft_overhead(self) -> float:
        """o: seconds of draft prefill per generated token (0 until measured)."""
        if self._output_tokens <= 0 or self._draft_prefill_tokens <= 0:
            return 0.0
        return self._draft_prefill_s / self._draft_prefill_tokens * self._prompt_tokens / self._output_tokens

    def _draft_fraction(self) -> float:
        return 1.0 if self._rows <= 0 else self._drafting_rows / self._rows

    # ------------------------------------------------------------------ cost

    def _costs(self, st: _Bucket) -> dict[int, tuple[float, float]]:
        """k -> (predicted steady seconds of a step with k drafts, relative uncertainty) for every candidate;
        empty before k = 0 is measured in this bucket."""
        med, unc = {}, {}
        for c in self.candidates:
            s = st.costs.get(c)
            if s:
                m = statistics.median(s)
                spread = statistics.median(abs(x - m) for x in s) / m if len(s) > 2 else 0.3
                stale = max(0, st.steps - st.last[c] - self.stale_steps) / self.stale_steps
                med[c], unc[c] = m, max(0.05, 1.5 * spread) / math.sqrt(len(s)) + 0.1 * stale
        if 0 not in med:
            return {}
        drafted = [c for c in sorted(med) if c > 0]
        out = {0: (med[0], unc[0])}
        if st.ratios:  # calibrated: the relative costs c(k) / c(0) are the calibration's, live steps give the level
            # only. Live, the ks are measured at different times, on different contexts (a bucket's first k = 0
            # steps on short ones, its drafting steps on longer ones): compared, the growth of the contexts reads as
            # a change of k's cost (a model-free world whose steps all grow dearer as a batch decodes: k switched
            # every 8 steps and k = 0 ran in 19-25 of 200 steps, tests/scheduler). The calibration measures every k
            # on the same prompts.
            # What live steps do say about relative costs comes from a k > 0 and k = 0 measured close together (an
            # exploration's or a re-check's burst beside the steps it left): `paired`, their median less its standard
            # error (`_pair_scale`).
            scale = self._pair_scale(st.paired)
            ratio = {0: 1.0, **{k: r * scale for k, (r, _) in st.ratios.items()}}
            w = {c: len(st.costs[c]) for c in med}
            level = sum(w[c] * med[c] / ratio[c] for c in med) / sum(w.values())  # c(0) now, from every k measured
            out[0] = (level, unc[0])
            for k in self.candidates[1:]:
                out[k] = (level * ratio[k], st.ratios[k][1] + CALIBRATION_DRIFT)
            return out
        if not drafted:
            near = self._nearest_drafted(st)
            if near is None:  # no bucket has drafted yet: a prior slope, uncertain
                for k in self.candidates[1:]:
                    out[k] = (med[0] * (1 + self.prior_slope * k), 0.3)
                return out
            # the relative cost c(k) / c(0) of the nearest bucket that drafted (a drafting step does what a
            # k = 0 step does and more, at about the same proportion nearby), less certain with the distance
            other, distance = near
            theirs = self._costs(other)
            for k in self.candidates[1:]:
                ratio = theirs[k][0] / theirs[0][0]
                out[k] = (med[0] * ratio, theirs[k][1] + 0.05 * distance)
            return out
        # k > 0: a line a + b * k through the measured medians, weighted by their sample counts (the draft
        # forwards and the verify's extra query columns grow with k; the jump from k = 0 is in a)
        w = {c: len(st.costs[c]) for c in drafted}
        if len(drafted) >= 2:
            sw = sum(w.values())
            mk = sum(w[c] * c for c in drafted) / sw
            mc = sum(w[c] * med[c] for c in drafted) / sw
            slope = sum(w[c] * (c - mk) * (med[c] - mc) for c in drafted) / sum(w[c] * (c - mk) ** 2 for c in drafted)
            slope = max(0.0, slope)
            base = mc - slope * mk
        else:  # one k > 0 measured: half the slope from k = 0 (the first draft pays a jump), uncertain
            (c1,) = drafted
            slope = 0.5 * max(0.0, med[c1] - med[0]) / c1
            base = med[c1] - slope * c1
        lo, hi = drafted[0], drafted[-1]
        for k in self.candidates[1:]:
            fit = base + slope * k
            if k in med:  # the measurement, shrunk toward the line by its sample count
                n = w[k]
                out[k] = ((n * med[k] + self.fit_weight * fit) / (n + self.fit_weight), unc[k])
            else:
                outside = max(0, lo - k, k - hi)
                inside = 0 if outside else min(abs(k - c) for c in drafted)
                u = (0.15 if len(drafted) < 2 else 0.05) + 0.02 * inside + 0.03 * outside
                out[k] = (fit, u)
        return out

    @staticmethod
    def _pair_scale(paired: deque) -> float:
        """Live relative costs over the calibration's, from the pairs: their median (a single step caught by a slow
        spell is one pair) less its standard error toward 1 (soft thresholding: noise about a near-tie does not move
        the calibration, a skewed calibration is undone by the first pairs that show it: three at least)."""
        if len(paired) < 3:
            return 1.0
        med = statistics.median(paired)
        se = 1.25 * 1.4826 * statistics.median(abs(x - med) for x in paired) / math.sqrt(len(paired))
        return 1.0 + math.copysign(max(0.0, abs(med - 1.0) - se), med - 1.0)

    def _nearest_drafted(self, st: _Bucket) -> tuple[_Bucket, float] | None:
        """(the bucket nearest to `st` in log2 batch size whose costs include k = 0 and some k > 0, that
        distance); None if there is none."""
        found = [
            (abs(math.log2(o / st.size)), o)
            for o, x in self._buckets.items()
            if x is not st and x.costs.get(0) and any(c > 0 and x.costs[c] for c in x.costs)
        ]
        if not found:
            return None
        distance, o = min(found)
        return self._buckets[o], distance

    # ------------------------------------------------------------------ decisions

    def _bucket(self, b: int) -> _Bucket:
        st = self._buckets.get(b)
        if st is None:
            st = self._buckets[b] = _Bucket(b, paired=deque(maxlen=4 * self.window))
        return st

    def plan(self, batch_size: int) -> tuple[int, int | None, dict[int, float]]:
        """(k*, the k worth exploring or None, goodput per row for each k) of a batch size, from the models
        as they stand; k* is 0 until k = 0 is measured in its bucket."""
        return self._plan(self._bucket(size_bucket(batch_size)))[:3]

    def _plan(self, st: _Bucket) -> tuple[int, int | None, dict[int, float], dict[int, tuple[float, float]]]:
        costs = self._costs(st)
        if not costs:
            return st.best, None, {}, costs
        goodput, optimistic = self._goodputs(st, costs, self._draft_fraction())
        best = self._best(st, goodput)
        # to be chosen a k > 0 must beat k = 0 by the draft margin, and another k > 0 by the margin: exploring one
        # whose optimistic goodput cannot clear that bar cannot change the decision
        bar = (1 + (self.draft_margin if best == 0 else self.margin)) * goodput[best]
        # calibrated: only a k above k* > 0 drafts positions k* leaves unmeasured; with k* = 0 the re-checks
        # (`_recheck`, within `recheck_budget`) are the only probes
        worth = [k for k in self.candidates if k != best and optimistic[k] > bar and (not st.ratios or 0 < best < k)]
        explore = max(worth, key=lambda k: (optimistic[k], -k)) if worth else None
        return best, explore, goodput, costs

    def _best(self, st: _Bucket, goodput: dict[int, float]) -> int:
        """k* = argmax G, k = 0 unless some k beats it by the draft margin, the k > 0 held unless beaten by the margin."""
        best = max(self.candidates, key=lambda k: (goodput[k], -k))
        if goodput[best] < (1 + self.draft_margin) * goodput[0]:
            best = 0
        held = st.best
        if held in goodput and best != 0 and held != 0 and goodput[best] < (1 + self.margin) * goodput[held]:
            best = held  # hysteresis among k > 0: a near-tie does not switch
        return best

    def _goodputs(self, st: _Bucket, costs: dict[int, tuple[float, float]],
                  f: float) -> tuple[dict[int, float], dict[int, float]]:
        """(G(k), G+(k)) per candidate k, a fraction `f` of the rows drafting."""
        rates, upper = self._acceptance_bounds()
        per_token = self.draft_overhead() * max(1.0, st.rows)  # o * n: draft prefill seconds per token of a row
        # A drafting step does all a k = 0 step does, and more: no k > 0 may look cheaper than k = 0. One factor
        # lifts every k > 0 so the cheapest is c(0), which keeps their relative costs: measured below c(0) a k > 0 is
        # noise, or a machine whose GEMMs are not monotone in rows (AVX-512 oneDNN, the 350m pair at B = 2: a k = 1
        # step 112-116 ms, k = 0 125-133 ms). Clipping each at c(0) made every k at or under it look alike, so the next
        # k up won against a cheaper k = 2 (docs/BENCHMARKS.md section 2, run 11: k = 3 at B = 2, 0.93x of k = 2).
        c0 = costs[0][0]
        lift = max(1.0, c0 / min(c for k, (c, _) in costs.items() if k > 0)) if len(costs) > 1 else 1.0
        goodput, optimistic = {}, {}
        for k, (c, u) in costs.items():
            # calibrated: live steps do not measure relative costs (`_costs`), an exploration learns acceptance only
            low = c if st.ratios else c * max(0.5, 1 - u)
            t, t_up = 1 + f * (self._expected(rates, k) - 1), 1 + f * (self._expected(upper, k) - 1)
            if k > 0:  # lifted (above); and its tokens need the draft prefilled
                c, low = c * lift, max(low * lift, c0)
                c, low = c + per_token * t, low + per_token * t_up
            goodput[k], optimistic[k] = t / c, t_up / low
        return goodput, optimistic

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        if self.k_max == 0:
            return 0
        b = size_bucket(batch_size)
        st = self._bucket(b)
        st.steps += 1
        st.streak = st.streak + 1 if self._last is st else 1
        self._last = st
        for other in self._buckets.values():
            other.share *= 1 - self.share_decay
        st.share += self.share_decay * batch_size
        if drafting_rows == 0:  # no row has anything to propose: the step runs k = 0 whatever is chosen (the engine's
            st.exploring = False  # rule), so an exploration or re-check under way waits for a step that can measure it
            return 0
        k, left = st.burst
        if left > 0:
            st.burst = (k, left - 1)
            st.exploring = True
            return k
        st.rechecking = False
        if len(st.costs.get(0, ())) < self.min_samples:  # plain decoding first: the safe incumbent
            st.exploring = False
            return 0
        if st.planned is None or st.steps - st.planned_at >= self.replan_every:
            st.planned, st.planned_at = self._plan(st), st.steps
            st.by_rows.clear()
        best, explore, goodput, costs = st.planned
        if explore is not None and self._burst(st, explore, costs, recheck=False):
            return explore
        if self._recheck_due(st):  # due, and no exploration runs in its place
            other = self._recheck(st, best, goodput)
            # what it will cost: at least the catch-up the last one paid (its modelled loss is the calibration's
            # word, which the re-check is there to question: charged as it runs, not up front)
            affordable = other is not None and (
                st.recheck_s + self._catchup_expected(st, other) <= self.recheck_budget * st.total_s)
            if affordable:
                self._burst(st, other, costs, recheck=True)
                st.recheck_loss = max(0.0, 1.0 - goodput[other] / goodput[best])
                return other
        st.exploring = False
        if st.ratios and (best > 0) != (st.best > 0):  # the decision crossed the boundary: re-check it soon
            st.recheck_every = self.recheck_steps
            st.recheck_at = min(st.recheck_at, st.steps + self.recheck_steps)
        st.best = best
        k = self._for_rows(st, best, batch_size, drafting_rows, costs)
        if k > 0 and st.streak < self.streak_steps and not self.drafting():
            # prompts skip the draft (the buckets that want drafts run under `draft_share` of the rows): this
            # bucket's rows were not fed to it, and a bucket that has run only a few steps in a row (a closed
            # batch draining) would pay the catch-up of whole contexts for a few steps of drafts
            return 0
        return k

    def _for_rows(self, st: _Bucket, best: int, batch_size: int, drafting_rows: int | None,
                  costs: dict[int, tuple[float, float]]) -> int:
        """This step's k where the scheduler says how many of its rows will draft: k* of the goodputs with that
        fraction f of rows drafting, in place of the measured mean (`_draft_fraction`). With n-gram lookup a row drafts
        only where its tokens match (65-73% of the SmolLM2 demo's positions): a step whose rows match nothing runs k = 0,
        and one where all of them match may draft where the mean would not (and the reverse)."""
        if drafting_rows is None or not costs or drafting_rows >= batch_size and self._draft_fraction() >= 1.0:
            return best
        if drafting_rows <= 0:
            return 0
        key = (batch_size, drafting_rows)
        k = st.by_rows.get(key)
        if k is None:
            k = st.by_rows[key] = self._best(st, self._goodputs(st, costs, drafting_rows / batch_size)[0])
        return k

    def _burst(self, st: _Bucket, explore: int, costs: dict[int, tuple[float, float]], recheck: bool) -> bool:
        """Start a burst of `explore` if its bound allows: an exploration's is the budget; a re-check's were checked by
        the caller (its interval and `recheck_budget`: it is due because a skewed calibration may be what makes the
        other side look dear, so its cost as the models put it cannot be the bar). Returns whether it started (its
        first step is this one)."""
        samples = st.costs.get(explore)
        stale = bool(samples) and st.steps - st.last[explore] > self.stale_steps
        n = 0 if stale or not samples else len(samples)
        # a re-check takes min_samples fresh pairs beside the steps it leaves
        burst = self.min_samples if recheck else self.min_samples - n if n < self.min_samples else 1
        if explore == 0 and st.regime:
            burst += self._settle_steps  # its first steps settle (unrecorded)
        if not recheck:
            # the free steps at once only for a bucket with nothing to go on; one that starts from the relative costs
            # of a bucket that drafted earns them as it runs (one per 4 of its steps: a closed batch's drain runs
            # each smaller bucket a few steps, where a probe cannot pay for itself); a calibrated one has none
            if st.ratios:  # calibrated: every k it would probe for free was measured before serving
                free = 0.0
            elif self._nearest_drafted(st) is not None:
                free = min(self.free_steps, st.steps / 4)
            else:
                free = self.free_steps
            allowed = self.budget * st.total_s + free * costs[0][0]
            if st.explore_s + burst * costs[explore][0] > allowed:
                return False
        if stale:
            samples.clear()  # a fresh measurement: the old one is from another time
        st.burst = (explore, burst - 1)
        st.exploring, st.rechecking = True, recheck
        if recheck:
            st.recheck_every = min(self.recheck_max, 2 * st.recheck_every)
            st.recheck_at = st.steps + st.recheck_every
        return True

    def _catchup_expected(self, st: _Bucket, k: int) -> float:
        """Seconds a re-check of k is expected to spend catching the draft up: what the bucket's last one paid, and
        while prompts skip the draft at least its rows' contexts (prompt and half an answer, of finished requests) at
        the draft's prefill seconds per token."""
        if k == 0:
            return 0.0
        estimate = 0.0
        if not self.drafting() and self._requests > 0 and self._draft_prefill_tokens > 0:
            context = (self._prompt_tokens + 0.5 * self._output_tokens) / self._requests
            estimate = st.rows * context * self._draft_prefill_s / self._draft_prefill_tokens
        return max(st.recheck_catchup, estimate)

    def _recheck_due(self, st: _Bucket) -> bool:
        """A calibrated bucket's re-check is due after its interval; the caller then holds it to `recheck_budget`: a
        k > 0 while prompts skip the draft catches whole contexts up (on the toy pair at B = 8, 2 to 15 steps' time a
        burst), so the budget, not the interval, then spaces them."""
        return bool(st.ratios) and self.recheck_steps > 0 and st.steps >= st.recheck_at

    def _recheck(self, st: _Bucket, best: int, goodput: dict[int, float]) -> int | None:
        """A calibrated bucket's re-check: the other side of the draft boundary from k* (k = 0 while drafting, the best
        k > 0 while not), if the models put it within `recheck_window` of k*; None if not. A calibrated bucket's
        relative costs are the calibration's, moved only by pairs (`_pair`), and its exploration measures acceptance
        only: a calibration skewed by a slow spell would otherwise hold the wrong side for good."""
        if not goodput:
            return None
        other = 0 if best > 0 else max(self.candidates[1:], key=lambda k: (goodput[k], -k))
        return other if goodput[other] >= (1 - self.recheck_window) * goodput[best] else None

    def prefill_k(self, batch_size: int) -> int:
        """The k its bucket runs when not exploring (no step is counted, nothing is explored in a prefill)."""
        st = self._buckets.get(size_bucket(batch_size))
        return st.best if st is not None and self.k_max > 0 else 0

    @property
    def _settle_steps(self) -> int:
        """The k = 0 steps after drafting left unrecorded: `settle_steps` after a draft model's steps; none after n-gram
        lookup's, which run no second model (on the demo target at B = 8, k = 0 steps 1-8 after 12 steps of k = 4 cost
        0.986x steps 9-20: docs/BENCHMARKS.md section 7)."""
        return self.settle_steps if self.draft_model else 0

    def calibration(self, max_batch_size: int) -> list[tuple[int, int]]:
        """2 x `min_samples` recorded steps of each k in CALIBRATION_KS (up to k_max) at each bucket up to
        max_batch_size, in two rounds of `min_samples` steps of each k: the ks > 0 interleaved step by step (1, 2, 3, 4,
        1, 2, ...; the second round in the reverse order), then k = 0 after `settle_steps` more (k = 0 right after
        drafting steps costs more than plain decoding does: on the toy pair twice, settling over some ten steps; none
        with n-gram lookup, `_settle_steps`;
        interleaved step by step with drafting steps, it made drafting look half as dear as it is; between two k > 0
        no settling is assumed, both run the draft). Two rounds, not one block per k: a slow spell on the machine (a neighbour's burst)
        then skews every k's samples, not one k's relative cost (on the 350m pair at B = 1 a one-block calibration put
        drafting below k = 0 where fixed k = 2 was 1.23x faster); the ks > 0 step by step, not in blocks of
        `min_samples`: a spell of a few steps, and the contexts' growth, then fall on all of them alike (the 350m pair,
        6 calibrations each way: the spread of c(k + 1) / c(k) over the calibrations 1.7-8.0%, mean 4.2%, in blocks,
        1.0-5.8%, mean 2.6%, step by step; docs/BENCHMARKS.md section 2, session 28). Every bucket the server will run
        starts with its k = 0 cost and its relative cost of drafting measured (twice the samples an exploration takes:
        a cost within a few percent of k = 0's is then told apart without exploring), and acceptance with some
        evidence, so live traffic is not where a draft that loses is found out."""
        if self.k_max == 0:
            return []
        powers = (1 << i for i in range(max(1, max_batch_size).bit_length() + 1))
        sizes = sorted({min(b, max_batch_size) for b in (*range(1, EXACT_SIZES + 1), *powers)})
        ks = [k for k in self.candidates if k in CALIBRATION_KS or k == min(self.k_max, max(CALIBRATION_KS))][1:]
        n, plain = self.min_samples, [0] * (self.min_samples + self._settle_steps)
        rounds = [k for order in (ks, ks[::-1]) for k in [*(k for _ in range(n) for k in order), *plain]]
        return [(b, k) for b in sizes for k in rounds]

    def calibrated(self) -> None:
        """The calibration's steps are in: keep each bucket's relative costs c(k) / c(0) and its k*, forget its
        absolute costs (measured on other contexts, without the rest of a live step), keep the acceptance."""
        for st in self._buckets.values():
            costs = self._costs(st)
            if not costs:
                continue
            st.best = self._plan(st)[0]
            st.ratios = {k: (c / costs[0][0], u) for k, (c, u) in costs.items() if k > 0}
            st.costs, st.last, st.planned, st.burst = {}, {}, None, (0, 0)
            st.explore_s = st.total_s = 0.0
            st.by_k, st.explore_steps, st.recheck_steps = {}, 0, 0  # the summary reports live steps
            st.recheck_s = st.recheck_catchup = 0.0
            # a bucket that drafts measures k = 0 live at its start (its first steps, paired with the drafting steps
            # after them): its first re-check of k = 0 (a burst of settling steps and min_samples) comes 4x later
            st.recheck_every = st.recheck_at = self.recheck_steps * (4 if st.best > 0 else 1)

    def drafting(self) -> bool:
        """Whether prompts should be fed to the draft as they are prefilled: False once the batch-size buckets
        that want drafts (k* > 0, or not yet measured) ran less than `draft_share` of recent rows (steps weighted
        by their rows, so by the tokens they generate: a batch draining to a row or two at the end of an offline
        run does not make every prompt pay the draft's prefill). A row prefilled without the draft that later
        drafts is caught up then (the same work, deferred)."""
        if self.k_max == 0:
            return False
        if not self._buckets:
            return True
        wanting, wants_any = 0.0, False
        for b, st in self._buckets.items():
            unmeasured = len(st.costs.get(0, ())) < self.min_samples and not st.ratios
            if st.burst[1] > 0 or unmeasured or st.best > 0:
                wanting += st.share
                wants_any = True
        total = sum(st.share for st in self._buckets.values())
        if total <= 0:  # no step run yet (calibrated only): whether any bucket wants drafts
            return wants_any
        return wanting > self.draft_share * total

    def observe(
        self,
        batch_size: int,
        k: int,
        num_tokens: int,
        seconds: float,
        catchup_s: float = 0.0,
        accepted: tuple[int, ...] = (),
        drafting_rows: int | None = None,
    ) -> None:
        """A decode step's result: `seconds` of wall time, of which `catchup_s` fed the draft tokens it skipped;
        `accepted[i]`: rows whose (i + 1)-th draft was accepted; `drafting_rows`: rows that proposed drafts
        (all of them when None)."""
        if seconds <= 0 or self.k_max == 0:
            return
        st = self._bucket(size_bucket(batch_size))
        st.total_s += seconds
        if st.exploring:
            st.explore_s += seconds
            st.explore_steps += 1
            st.recheck_steps += st.rechecking
            if st.rechecking:
                catchup = min(catchup_s, seconds)
                st.recheck_s += catchup + (seconds - catchup) * st.recheck_loss
                if k > 0 and st.burst[1] == self.min_samples - 1:  # a k > 0 re-check's first step pays the catch-up
                    st.recheck_catchup = catchup
            st.exploring = False
        st.by_k[k] = st.by_k.get(k, 0) + 1
        st.rows = batch_size if st.rows == 0 else st.rows + 0.1 * (batch_size - st.rows)
        if k != st.best:
            st.planned = None  # a measurement of another k: plan again at once
        steady = seconds - min(catchup_s, 0.9 * seconds)
        # k = 0 right after drafting steps costs more than plain decoding does (on the toy pair twice, settling
        # over some ten steps): the first `settle_steps` of them are not recorded (drafting steps always are)
        if k > 0:
            st.settling = 0
        else:
            st.settling = self._settle_steps if st.regime else max(0, st.settling - 1)
        st.regime = k > 0
        if k > 0 or st.settling == 0:
            if st.ratios:
                self._pair(st, k, steady)
            st.costs.setdefault(k, deque(maxlen=self.window)).append(steady)
            st.last[k] = st.steps
        if k == 0:
            self._decay((1 - self.idle_decay) ** batch_size)
            return
        rows = batch_size if drafting_rows is None else drafting_rows
        self._decay((1 - self.accept_decay) ** rows)
        self._rows += batch_size
        self._drafting_rows += rows
        reached = float(rows)
        for i, n in enumerate(accepted[: self.k_max], start=1):
            self._tried[i] += reached
            self._accepted[i] += n
            reached = float(n)

    def _pair(self, st: _Bucket, k: int, seconds: float) -> None:
        """A calibrated bucket's step of k (recorded): if the other side (k = 0 for a k > 0, the last k > 0 for a k = 0)
        was measured within `pair_steps` steps, their relative cost over the calibration's joins `st.paired`."""
        other = 0 if k > 0 else max((c for c in st.last if c > 0), key=lambda c: st.last[c], default=None)
        if other is None or st.steps - st.last[other] > self.pair_steps or not st.costs.get(other):
            return
        recent = statistics.median(list(st.costs[other])[-self.min_samples:])
        drafted, plain, c = (seconds, recent, k) if k > 0 else (recent, seconds, other)
        st.paired.append(drafted / plain / st.ratios[c][0])

    def observe_proposals(self, proposed: int, accepted: int) -> None:
        """A step without drafts whose rows' n-gram lookup proposed a first token (free: no forward): `accepted` of the
        `proposed` were the target's token, the event a first draft's acceptance is (greedy; sampled, its probability).
        Counted at position 1 as a drafting step's rows are: while k = 0 holds, acceptance is still measured, and the
        later positions follow it through the shrinkage toward the position before (`acceptance`)."""
        if proposed <= 0 or self.k_max == 0:
            return
        self._decay((1 - self.accept_decay) ** proposed)
        self._tried[1] += proposed
        self._accepted[1] += accepted

    def observe_prefill(self, num_tokens: int, draft_seconds: float) -> None:
        if draft_seconds <= 0 or num_tokens <= 0:
            return  # the draft was not fed: nothing learnt about its prefill speed
        keep = 1 - self.prefill_decay
        self._draft_prefill_s = keep * self._draft_prefill_s + draft_seconds
        self._draft_prefill_tokens = keep * self._draft_prefill_tokens + num_tokens

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        if output_tokens <= 0:
            return
        keep = 1 - self.request_decay
        self._prompt_tokens = keep * self._prompt_tokens + prompt_tokens
        self._output_tokens = keep * self._output_tokens + output_tokens
        self._requests = keep * self._requests + 1.0

    def _decay(self, keep: float) -> None:
        self._tried = [x * keep for x in self._tried]
        self._accepted = [x * keep for x in self._accepted]
        self._rows *= keep
        self._drafting_rows *= keep

    def rates(self) -> dict[tuple[int, int], float]:
        """(bucket, k) -> modelled tokens per row-second"""
        return {(b, k): g for b in self.summary() for k, g in self.plan(b)[2].items()}

    def summary(self) -> dict:
        """Per bucket: steps per k, the share of decode seconds spent exploring, k* now, and o (milliseconds)."""
        return {
            b: {
                "steps_by_k": dict(sorted(st.by_k.items())),
                "explore_fraction": st.explore_s / st.total_s if st.total_s else 0.0,
                "explore_steps": st.explore_steps,
                "recheck_steps": st.recheck_steps,  # of those, re-checks of a calibrated bucket (`_recheck`)
                "recheck_cost_fraction": st.recheck_s / st.total_s if st.total_s else 0.0,  # modelled, see _Bucket
                "best_k": self.plan(b)[0],
                "draft_prefill_ms_per_token": 1e3 * self.draft_overhead(),  # o, the same for every bucket
            }
            for b, st in sorted(self._buckets.items())
        }

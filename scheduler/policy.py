"""Pure scheduling policy, no model and no clock: which sequences run next (how many drafts they get: the
speculation policies, scheduler/policies/).

Batch choice (`choose_batch`), per decode step, over the live pool of W sequences:
1. Aging. If the longest-waiting sequence has waited `age_threshold` steps or more, the step is a *fair*
   step: the B sequences that waited longest run (a same-length group if they happen to share a length,
   else a mixed batch).
2. Otherwise the largest same-length group runs (at most B of it, longest-waiting first); ties go to the
   group holding the longest-waiting sequence.
3. If that group is smaller than `group_threshold`, a mixed batch of the B longest-waiting sequences runs.

Bound (tested): no sequence waits more than age_threshold + ceil(W / B) - 1 consecutive decode steps.
Proof sketch: once a sequence e has waited age_threshold steps every step is fair. In a fair step the B
sequences ahead of e in (waited desc, arrival) order run and drop behind it; nothing overtakes e, since
others' waits grow no faster than e's and newcomers start at 0. At most W - 1 are ahead of e, so e runs
within ceil(W / B) - 1 further steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field



@dataclass(frozen=True)
class Candidate:
    key: int  # the scheduler's handle for the sequence
    length: int  # current sequence length (tokens, pending one included)
    waited: int  # consecutive decode steps since it last ran
    order: int  # arrival order (smaller is older): the tie-break


@dataclass(frozen=True)
class BatchChoice:
    keys: tuple[int, ...]  # sequences to run, at most B
    grouped: bool  # every chosen sequence has the same length


def age_threshold_for(max_wait_steps: int, pool_size: int, batch_size: int) -> int:
    """The aging threshold that makes `max_wait_steps` the proven bound; raises if that is infeasible."""
    rounds = math.ceil(pool_size / batch_size)
    threshold = max_wait_steps - rounds + 1
    if threshold < 1:
        raise ValueError(
            f"max_wait_steps={max_wait_steps} cannot be guaranteed with pool_size={pool_size} and "
            f"max_batch_size={batch_size}: it must be >= ceil(pool_size / max_batch_size) = {rounds}"
        )
    return threshold


def choose_batch(
    cands: list[Candidate], batch_size: int, group_threshold: int, age_threshold: int
) -> BatchChoice:
    if not cands:
        return BatchChoice((), False)
    by_wait = sorted(cands, key=lambda c: (-c.waited, c.order))
    oldest = by_wait[:batch_size]
    if by_wait[0].waited >= age_threshold:
        return BatchChoice(tuple(c.key for c in oldest), _same_length(oldest))
    groups: dict[int, list[Candidate]] = defaultdict(list)
    for c in by_wait:  # each group stays in (waited desc, arrival) order
        groups[c.length].append(c)
    rank = {c.key: i for i, c in enumerate(by_wait)}
    best = max(groups.values(), key=lambda g: (min(len(g), batch_size), -rank[g[0].key]))
    if min(len(best), batch_size) >= min(group_threshold, len(cands)):
        chosen = best[:batch_size]
        return BatchChoice(tuple(c.key for c in chosen), True)
    return BatchChoice(tuple(c.key for c in oldest), _same_length(oldest))


def _same_length(cands: list[Candidate]) -> bool:
    return all(c.length == cands[0].length for c in cands)


MAX_PREFILL_ROWS = 128  # rows one prefill step considers (bounds plan_prefill's work: O(rows^2))
DEFAULT_STEP_OVERHEAD_TOKENS = 16.0  # a prefill forward's fixed cost in tokens' worth, until measured (PrefillCost)


def plan_prefill(remaining: list[int], budget: int,
                 overhead_tokens: float = DEFAULT_STEP_OVERHEAD_TOKENS) -> tuple[tuple[int, ...], int]:
    """The next prefill step over sequences waiting to prefill (FIFO order, `remaining` prompt tokens each):
    returns (rows, width): the rows (indices into `remaining`, ascending, the first always among them: nothing is
    starved) that each get a chunk of min(remaining, width) tokens.

    A prefill forward is rectangular, [rows, longest chunk], so it costs what rows * width tokens cost, real or
    padding, plus a fixed cost per forward (`overhead_tokens`, in tokens' worth: PrefillCost measures it); the step
    keeps rows * width <= budget. Rows join in FIFO order, each while that costs no more than its chunk would cost in
    a step of its own (its tokens plus the overhead); a row that would cost more (too much padding beside the others,
    or too long for them) is passed over, not a stop: a later row may fit. So where a forward's fixed cost dominates
    (a GPU: a few hundred tokens cost about one) prompts share a step, padded or not; where tokens dominate (this CPU:
    SmolLM2's prefill ~7 ms a token, padding included, its fixed cost 0 to 30 tokens' worth) rows of unequal lengths
    are not padded to each other, and a short prompt behind a long one still joins the rows of its own length (16
    SpecBench prompts in a pool of 16: 14% of the prefill's tokens were padding when the first misfit ended the step,
    docs/BENCHMARKS.md section 2). A cut step (every chunk at most `cap`, for the caps budget // n of the FIFO
    prefixes that do not fit whole) is worth its real tokens per token of cost, real / (rows * width + overhead),
    and is taken only if it is worth more than the uncut step and prefills over twice its real tokens: a cut leaves
    a remainder for a later step (a hundred 10-token prompts: 51 whole, not 64 cut to 8). Measured at B = 1 in a
    pool of 4 on the 350m pair: four prompts of 18 to 269 tokens cut to 4 x 128 for 191 real tokens made the run's
    prefill 25% slower than one prompt at a time.
    """
    if not remaining or budget < 1:
        return (), 0
    overhead = max(0.0, overhead_tokens)
    rows = remaining[: min(budget, MAX_PREFILL_ROWS)]

    def walk(cap: int) -> tuple[list[int], int, int]:  # (rows, width, real tokens) with every chunk cut to cap
        chosen, width, real = [], 0, 0
        for i, r in enumerate(rows):
            chunk = min(r, cap)
            grown = max(width, chunk)
            n = len(chosen)
            if (n + 1) * grown > budget or (n and (n + 1) * grown - n * width > chunk + overhead):
                if n == 0:  # the head does not fit whole: no uncut step
                    return [], 0, 0
                continue
            chosen.append(i)
            width, real = grown, real + chunk
        return chosen, width, real

    whole, whole_width, total = walk(budget + 1)  # a prompt longer than the budget never joins whole
    whole_worth = total / (len(whole) * whole_width + overhead) if whole else -1.0
    best = (-1.0, 0, [], 0)  # (real / cost, real tokens, rows, width) of the best cut step
    longest, caps = 0, set()
    for n, r in enumerate(rows, start=1):
        longest = max(longest, r)
        if n * longest > budget:
            caps.add(budget // n)
    for cap in sorted(caps, reverse=True):
        chosen, width, real = walk(cap)
        if chosen:
            best = max(best, (real / (len(chosen) * width + overhead), real, chosen, width), key=lambda c: c[:2])
    if not whole or (best[0] > whole_worth and best[1] > 2 * total):
        return tuple(best[2]), best[3]
    return tuple(whole), whole_width


# A line through steps of nearly one size is noise: a prefill step's seconds also grow with its rows' widths
# (attention), so two steps of 512 and 416 padded tokens on the SmolLM2 pair (this CPU, 3.6 and 3.0 s) put the fixed
# cost at 49 tokens' worth, where steps of 18 to 512 tokens put it at 0 to 28.
MIN_SIZE_SPREAD = 0.5


@dataclass
class PrefillCost:
    """A prefill step's seconds as a line in its padded tokens (rows x width): fixed + per_token * tokens, by
    least squares over the steps seen, each older step's weight decayed by `decay`. `overhead_tokens()`:
    fixed / per_token, what one more forward costs in tokens' worth (plan_prefill's trade of padding against
    steps); DEFAULT_STEP_OVERHEAD_TOKENS until the measured sizes spread (MIN_SIZE_SPREAD)."""

    decay: float = 1 / 32
    _sums: list = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        keep = 1 - self.decay
        x, y = float(tokens), seconds
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until the steps' sizes spread enough to tell the two apart
        (their weighted standard deviation at least MIN_SIZE_SPREAD of their mean)."""
        w, sx, sy, sxx, sxy = self._sums
        spread = w * sxx - sx * sx  # w^2 * variance of the sizes
        if w <= 0 or spread <= 1e-9 * max(1.0, w * sxx) or spread < (MIN_SIZE_SPREAD * sx) ** 2:
            return None
        slope = (w * sxy - sx * sy) / spread
        if slope <= 0:
            return None
        return (sy - slope * sx) / w, slope

    def overhead_tokens(self, cap: int) -> float:
        line = self.line()
        if line is None:
            return DEFAULT_STEP_OVERHEAD_TOKENS
        return min(float(cap), max(0.0, line[0] / line[1]))

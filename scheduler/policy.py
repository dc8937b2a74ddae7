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
                 overhead_tokens: float = DEFAULT_STEP_OVERHEAD_TOKENS) -> tuple[int, int]:
    """The next prefill step over sequences waiting to prefill (FIFO order, `remaining` prompt tokens each):
    returns (n, width): the first n of them each get a chunk of min(remaining, width) tokens.

    A prefill forward is rectangular, [n, longest chunk], so it costs what n * width tokens cost, real or padding,
    plus a fixed cost per forward (`overhead_tokens`, in tokens' worth: PrefillCost measures it); the step keeps
    n * width <= budget. Uncut, the prefix grows by the next prompt while that costs no more than the prompt would
    cost in a step of its own (its tokens plus the overhead): where a forward's fixed cost dominates (a GPU: a
    few hundred tokens cost about one) prompts share a step, padded or not; where tokens dominate (this CPU: the
    350m synthetic target's forward is ~14 tokens' worth) prompts of unequal lengths are not padded to each other.
    A cut step (every chunk at most budget // n) is worth its real tokens per token of cost, real / (n * width +
    overhead), and is taken only if it is worth more than the uncut step and prefills over twice its real tokens:
    a cut leaves a remainder for a later step (a hundred 10-token prompts: 51 whole, not 64 cut to 8). Measured
    at B = 1 in a pool of 4 on the 350m pair: four prompts of 18 to 269 tokens cut to 4 x 128 for 191 real tokens
    made the run's prefill 25% slower than one prompt at a time.
    """
    if not remaining or budget < 1:
        return 0, 0
    overhead = max(0.0, overhead_tokens)
    rows = remaining[: min(budget, MAX_PREFILL_ROWS)]
    n_whole = whole_width = total = 0  # the uncut prefix: rows, its longest prompt, its real tokens
    for r in rows:
        grown = max(whole_width, r)
        if (n_whole + 1) * grown > budget or (n_whole and (n_whole + 1) * grown - n_whole * whole_width > r + overhead):
            break
        n_whole, whole_width, total = n_whole + 1, grown, total + r
    whole_worth = total / (n_whole * whole_width + overhead) if n_whole else -1.0
    cut = (-1.0, 0, 0, 0)  # (real / cost, real tokens, n, width) of the best cut step
    longest = 0
    for n, r in enumerate(rows, start=1):
        longest = max(longest, r)
        if n * longest > budget:
            width = budget // n
            real = sum(min(x, width) for x in rows[:n])
            cut = max(cut, (real / (n * width + overhead), real, n, width))
    if n_whole == 0 or (cut[0] > whole_worth and cut[1] > 2 * total):
        return cut[2], cut[3]
    return n_whole, whole_width


@dataclass
class PrefillCost:
    """A prefill step's seconds as a line in its padded tokens (rows x width): fixed + per_token * tokens, by
    least squares over the steps seen, each older step's weight decayed by `decay`. `overhead_tokens()`:
    fixed / per_token, what one more forward costs in tokens' worth (plan_prefill's trade of padding against
    steps); DEFAULT_STEP_OVERHEAD_TOKENS until two sizes are measured."""

    decay: float = 1 / 32
    _sums: list = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        keep = 1 - self.decay
        x, y = float(tokens), seconds
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until the steps span two sizes."""
        w, sx, sy, sxx, sxy = self._sums
        spread = w * sxx - sx * sx
        if w <= 0 or spread <= 1e-9 * max(1.0, w * sxx):
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

"""Pure scheduling policy, no model and no clock: which sequences run next, and with how many drafts.

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
from dataclasses import dataclass


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
    cands: list[Candidate], batch_size: int, group_threshold: int, age_threshold: int, force_mixed: bool = False
) -> BatchChoice:
    if not cands:
        return BatchChoice((), False)
    by_wait = sorted(cands, key=lambda c: (-c.waited, c.order))
    oldest = by_wait[:batch_size]
    if force_mixed or by_wait[0].waited >= age_threshold:
        return BatchChoice(tuple(c.key for c in oldest), _same_length(oldest) and not force_mixed)
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


class SpeculationPolicy:
    """How many draft tokens a step uses.

    fixed: always k (0 turns speculation off).
    adaptive: per batch-size bucket (powers of two), keep an exponential moving average of emitted tokens
    per second for each candidate k in {0, 1, 2, 4, ..., k_max}; try each candidate a few times, then use
    the best, re-trying the others now and then (every `explore_every` steps) since costs drift. Down to
    k = 0 when the batch is large enough that speculation loses.
    """

    def __init__(self, mode: str, k_max: int, warmup: int = 2, explore_every: int = 50, ema: float = 0.3) -> None:
        self.mode = mode
        self.k_max = k_max
        self.candidates = sorted({0, k_max} | {k for k in (1, 2, 4, 8, 16, 32) if k < k_max})
        self.warmup = warmup
        self.explore_every = explore_every
        self.ema = ema
        self._rate: dict[tuple[int, int], float] = {}  # (bucket, k) -> tokens/s
        self._count: dict[tuple[int, int], int] = defaultdict(int)
        self._steps: dict[int, int] = defaultdict(int)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, (batch_size - 1).bit_length())

    def choose(self, batch_size: int) -> int:
        if self.mode == "fixed" or self.k_max == 0:
            return self.k_max
        b = self.bucket(batch_size)
        self._steps[b] += 1
        for k in self.candidates:  # warm-up: measure every candidate
            if self._count[(b, k)] < self.warmup:
                return k
        if self._steps[b] % self.explore_every == 0:  # periodic re-measurement, round robin
            return self.candidates[(self._steps[b] // self.explore_every) % len(self.candidates)]
        return max(self.candidates, key=lambda k: self._rate[(b, k)])

    def observe(self, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        if self.mode == "fixed" or seconds <= 0:
            return
        key = (self.bucket(batch_size), k)
        rate = num_tokens / seconds
        self._count[key] += 1
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else (1 - self.ema) * old + self.ema * rate

    def rates(self) -> dict[tuple[int, int], float]:
        return dict(self._rate)

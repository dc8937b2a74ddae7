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


def plan_prefill(remaining: list[int], budget: int) -> tuple[int, int]:
    """The next prefill step over sequences waiting to prefill (FIFO order, `remaining` prompt tokens each):
    returns (n, width): the first n of them each get a chunk of min(remaining, width) tokens.

    A prefill forward is rectangular, [n, longest chunk], so it costs what n * width tokens cost, real or
    padding: the step keeps n * width <= budget. Among the FIFO prefixes it takes the one that prefills the
    most real tokens without cutting any prompt, unless cutting (every chunk at most budget // n) prefills
    more than twice as many: short prompts share a step unsplit, and a long one is chunked instead of
    padding everything beside it to its length (measured on the demo pair: 32 chat prompts of 15 to 964
    tokens in a pool of 32 padded to 2.0x their tokens when steps were bounded by real tokens only).
    """
    if not remaining or budget < 1:
        return 0, 0
    whole = (0, 0, 0)  # (real tokens, n, width): the best prefix prefilled to the end of every prompt
    cut = (0, 0, 0)  # the best prefix with chunks of at most budget // n
    longest = total = 0
    for n, r in enumerate(remaining[: min(budget, MAX_PREFILL_ROWS)], start=1):
        longest, total = max(longest, r), total + r
        if n * longest <= budget and total > whole[0]:
            whole = (total, n, longest)
        width = min(longest, budget // n)
        real = sum(min(x, width) for x in remaining[:n])
        if real > cut[0]:
            cut = (real, n, width)
        if cut[0] == budget:
            break  # a full step: no longer prefix prefills more
    best = whole if 2 * whole[0] >= cut[0] else cut
    return best[1], best[2]

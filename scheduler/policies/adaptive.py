"""`adaptive`: the older racing policy. Per batch-size bucket (powers of two), an exponential moving average of
emitted tokens per second for each candidate k in {0, 1, 2, 4, ..., k_max}; each candidate is tried a few
times, then the best runs, the others re-tried now and then (every `explore_every` steps) since costs drift.
Down to k = 0 when the batch is large enough that speculation loses."""

from __future__ import annotations

from collections import defaultdict

from exspec.scheduler.policies import SpeculationPolicy, bucket, register


@register("adaptive")
class AdaptivePolicy(SpeculationPolicy):
    """k of the best measured tokens/s per batch-size bucket (EMA)"""

    def __init__(self, k_max: int, warmup: int = 2, explore_every: int = 50, ema: float = 0.3) -> None:
        super().__init__(k_max)
        self.candidates = sorted({0, k_max} | {k for k in (1, 2, 4, 8, 16, 32) if k < k_max})
        self.warmup = warmup
        self.explore_every = explore_every
        self.ema = ema
        self._rate: dict[tuple[int, int], float] = {}  # (bucket, k) -> tokens/s
        self._count: dict[tuple[int, int], int] = defaultdict(int)
        self._steps: dict[int, int] = defaultdict(int)

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        if self.k_max == 0:
            return 0
        b = bucket(batch_size)
        self._steps[b] += 1
        for k in self.candidates:  # warm-up: measure every candidate
            if self._count[(b, k)] < self.warmup:
                return k
        if self._steps[b] % self.explore_every == 0:  # periodic re-measurement, round robin
            return self.candidates[(self._steps[b] // self.explore_every) % len(self.candidates)]
        return max(self.candidates, key=lambda k: self._rate[(b, k)])

    def observe(self, batch_size, k, num_tokens, seconds, catchup_s=0.0, accepted=(), drafting_rows=None) -> None:
        if seconds <= 0:
            return
        seconds -= min(catchup_s, 0.9 * seconds)
        key = (bucket(batch_size), k)
        rate = num_tokens / seconds
        self._count[key] += 1
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else (1 - self.ema) * old + self.ema * rate

    def rates(self) -> dict[tuple[int, int], float]:
        """(bucket, k) -> measured tokens/s"""
        return dict(self._rate)

"""`fixed`: every step drafts k_max tokens (0 turns speculation off). k never varies, so a seeded sampled
request speculates and still reproduces exactly."""

from __future__ import annotations

from exspec.scheduler.policies import SpeculationPolicy, register


@register("fixed")
class FixedPolicy(SpeculationPolicy):
    """k = k_max every step"""

    k_varies = False

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        return self.k_max

    def prefill_k(self, batch_size: int) -> int:
        return self.k_max

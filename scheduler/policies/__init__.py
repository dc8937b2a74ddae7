"""Speculation policies: how many draft tokens each decode step uses. One interface, one file each, registered
by name (`exspec.registry`).

A policy is pure: no model, no clock. The scheduler asks it `choose(batch_size, drafting_rows)` before each decode step,
`drafting()` before each prefill step, and tells it each decode step's result through `observe(...)` (and, with
n-gram lookup, what a step without drafts would have accepted at its first position: `observe_proposals(...)`), each
prefill step's through `observe_prefill(...)` and each finished request's lengths through
`observe_finished(...)`. A policy whose k follows measured time (`k_varies`) makes the scheduler decode seeded
sampled requests without drafts, so that a seed reproduces exactly (which random numbers a sampled row uses
depends on k).

To add a policy: a file here named as the policy, with a `SpeculationPolicy` subclass decorated
`@register("name")`, imported at the bottom of this file (docs/ARCHITECTURE.md has a worked example).
`--speculation` and `SchedulerConfig.speculation` accept `names()`; `create(name, k_max, draft_model=...)` builds one.
"""

from __future__ import annotations

from typing import ClassVar

from exspec.registry import Registry


def bucket(batch_size: int) -> int:
    """The batch-size bucket: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, (batch_size - 1).bit_length())


class SpeculationPolicy:
    """k per decode step, from what earlier steps measured. Subclasses set `k_varies` and override `choose`
    (and `observe`, `drafting`, `summary` where they measure)."""

    name: ClassVar[str]
    k_varies: ClassVar[bool] = True  # k may change with measured time: seeded sampled requests run without drafts
    # whether drafts come from a draft model (False: n-gram lookup, no second model's weights between two steps); set by
    # `create`
    draft_model: bool = True

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max  # the largest k (0: no draft model, or speculation off)

    def choose(self, batch_size: int, drafting_rows: int | None = None) -> int:
        """k for a decode step of `batch_size` rows, 0 <= k <= k_max; `drafting_rows`: how many of them will propose
        drafts if k > 0 (the engine's `SeqOutput.drafts_next`: with n-gram lookup, those whose tokens match; None:
        all)."""
        raise NotImplementedError

    def prefill_k(self, batch_size: int) -> int:
        """k for a prefill step whose chunks complete their prompts and feed the draft: the prefill's target
        forward then verifies k drafts with the prompts (the engine's fused prefill). `batch_size`: the decode
        batch the rows join. 0 (this default): the prefill samples one token a row."""
        return 0

    def drafting(self) -> bool:
        """Whether steps are expected to draft: False only when the policy has measured that the batch sizes
        it runs gain nothing from drafts, so prompts can be prefilled without the draft (a step that drafts
        catches it up)."""
        return self.k_max > 0

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
        """A decode step's result: `num_tokens` emitted in `seconds` of wall time, of which `catchup_s` fed the
        draft tokens it skipped (paid once per token, not a cost of k); `accepted[i]`: rows whose (i + 1)-th
        draft was accepted; `drafting_rows`: rows that proposed drafts (None: all)."""

    def observe_proposals(self, proposed: int, accepted: int) -> None:
        """A decode step without drafts where `proposed` rows had a first draft token for free (n-gram lookup), and
        `accepted` of them proposed the token the target then chose: evidence of the first position's acceptance."""

    def observe_prefill(self, num_tokens: int, draft_seconds: float) -> None:
        """A prefill step fed `num_tokens` prompt tokens; `draft_seconds` of its time went to the draft's forward
        (0 when the prompts were prefilled without the draft: `drafting()` said no)."""

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request that generated `output_tokens` for a prompt of `prompt_tokens` has ended (its draft prefill
        is then paid for that many tokens)."""

    def calibration(self, max_batch_size: int) -> list[tuple[int, int]]:
        """(batch size, k) of the steps to run before serving, in order, each reported to `observe` as a decode
        step is (`SchedulerCore.calibrate`): what the policy would otherwise explore under live traffic. None by
        default."""
        return []

    def calibrated(self) -> None:
        """The calibration's steps have all been observed (`SchedulerCore.calibrate` calls this once after them)."""

    def rates(self) -> dict[tuple[int, int], float]:
        """(bucket, k) -> what the policy expects of k at that batch size (tokens per second or per row-second)."""
        return {}

    def summary(self) -> dict:
        """What the policy did, per batch-size bucket, for reports (`exspec bench`); {} if it keeps nothing."""
        return {}


POLICIES: Registry[type[SpeculationPolicy]] = Registry("speculation policy", __name__)
register = POLICIES.register


def names() -> tuple[str, ...]:
    """Every registered policy, in registration order."""
    return POLICIES.names()


def create(name: str, k_max: int, draft_model: bool = True) -> SpeculationPolicy:
    """The policy `name` for draft budgets up to `k_max`, its drafts from a draft model or not (`draft_model`).
    Raises ValueError naming the choices."""
    policy = POLICIES.get(name)(k_max)
    policy.draft_model = draft_model
    return policy


from exspec.scheduler.policies import auto, fixed, adaptive  # noqa: E402,F401,I001  (registers them, the default first)

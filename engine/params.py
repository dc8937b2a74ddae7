"""Sampling parameters of one sequence, validated once at the edge of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from exspec.errors import InvalidRequestError

PENALTY_MAX = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
REPETITION_PENALTY_MAX = 10.0  # repetition_penalty in (0, this]
LOGIT_BIAS_MAX = 100.0  # |bias| at most, as OpenAI's logit_bias
MAX_LOGPROBS = 20  # alternatives a token's logprobs list at most (vLLM's default max_logprobs; OpenAI's top_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: drawn by the engine at admission
    stop_token_ids: tuple[int, ...] = ()  # end the sequence, like EOS (kept in the output)
    ignore_eos: bool = False  # do not stop at the model's EOS ids
    min_tokens: int = 0  # EOS and stop ids are suppressed until this many tokens are generated
    use_speculation: bool = True  # False: this sequence never accepts draft tokens
    stop: tuple[str, ...] = field(default=())  # stop strings: applied by the scheduler on text
    # None: no logprobs; n >= 0: each emitted token's log-probability under the target (its raw logits: before
    # temperature, top-k / top-p and min_tokens, as vLLM's default "raw_logprobs") and the n most likely tokens'
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (its prefill's logits)
    # (token id, bias) pairs added to the target's and the draft's logits before min_tokens, temperature and the
    # filters (OpenAI's logit_bias); each id once
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties on the target's and the draft's logits (after logit_bias), counted over the output so far and, at a
    # verify position, the drafts before it (what the target alone would have generated there), as vLLM's:
    presence_penalty: float = 0.0  # subtracted from a token's logit once the output holds it (OpenAI)
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token (OpenAI)
    repetition_penalty: float = 1.0  # a token in the prompt or the output: logit / r if positive, else x r (HF)
    recomputed: int = 0  # of the prompt's tokens, the last `recomputed` are output generated before a preemption

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, value: object) -> None:
            raise InvalidRequestError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: off)", self.top_k)
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "an integer in [0, 2**63)", self.seed)
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (type(n) is int and 0 <= n <= MAX_LOGPROBS):
                bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]", n)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_MAX <= getattr(self, name) <= PENALTY_MAX:
                bad(name, f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]", getattr(self, name))
        if not 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX:
            bad("repetition_penalty", f"in (0, {REPETITION_PENALTY_MAX:g}] (1: off)", self.repetition_penalty)
        if type(self.recomputed) is not int or self.recomputed < 0:
            bad("recomputed", "an integer >= 0", self.recomputed)
        ids = [t for t, _ in self.logit_bias]
        if any(type(t) is not int or t < 0 for t in ids) or len(set(ids)) != len(ids):
            bad("logit_bias", "distinct non-negative token ids", ids[:5])
        if not all(-LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX for _, v in self.logit_bias):  # NaN fails too
            values = [v for _, v in self.logit_bias][:5]
            bad("logit_bias", f"values in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]", values)
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "non-negative integers", self.stop_token_ids)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

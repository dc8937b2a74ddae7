"""What `exspec bench` runs: its methods and `BenchConfig`, each default written once here (the command line reads
them for its flags' defaults and help). Torch-free at import, like the engine's config it holds."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from exspec.bench.equivalence import NEAR_TIE_EPS
from exspec.engine.config import EngineConfig, check_num_speculative_tokens
from exspec.errors import BenchError
from exspec.scheduler.types import SchedulerConfig

METHODS = ("target-ar", "hf-generate", "hf-assisted", "exspec-mixed", "exspec-fixed", "exspec")
ENGINE_METHODS = ("target-ar", "exspec-mixed", "exspec-fixed", "exspec")  # through our engine and scheduler
DRAFT_METHODS = ("hf-assisted", "exspec-mixed", "exspec-fixed", "exspec")  # need a draft model
INTERLEAVE = ("steps", "runs")  # --interleave: how a repeat's methods take turns (bench/runner.py)
DEFAULT_REPEATS = {"throughput": 3, "forward": 7}  # timed runs per point (--repeats), by --mode
DEFAULT_KV_LENS = (256, 2048)  # --mode forward: keys per row (--kv-lens)
SYNTHETIC_NAMES = ("tiny", "350m", "1b", "8b")  # exspec.bench.synthetic.SHAPES, in this order (torch-free here)
SYNTHETIC_CACHE = Path.home() / ".cache" / "exspec" / "synthetic"  # --synthetic-cache


@dataclass(frozen=True)
class BenchConfig:
    # The pair, device, dtype, attention backend, GEMM mode, compile, KV memory, the cap on prompt + max_tokens
    # (max_model_len) and k (max_num_speculative_tokens): resolved once, as for serve and generate, by the command
    # line's settings (flags and EXSPEC_* variables). Each engine method runs a copy sized for its point.
    engine: EngineConfig
    methods: tuple[str, ...] = METHODS
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    num_prompts: int = 32  # SpecBench questions, evenly spaced over those that fit max_prompt_len
    max_prompt_len: int | None = None  # questions longer than this many tokens are left out; None: no limit
    max_tokens: int = 128  # new tokens per prompt (fewer when EOS comes first)
    # exspec's pool W = pool_factor * B, capped at max(B, num_prompts); None: serve's default (default_pool_size)
    pool_factor: int | None = None
    repeats: int = DEFAULT_REPEATS["throughput"]  # timed runs per (method, B); the median is reported
    chat_template: bool = False  # prompts through the tokenizer's chat template
    # how the methods of a repeat take turns: "steps", every run at once, one engine step or Hugging Face generate call
    # at a time, the run least far along first (each timed by its own pieces); "runs", every method's run whole, in
    # turn (bench/runner.py)
    interleave: str = INTERLEAVE[0]
    # one untimed run of the timed workload per (method, B) before the timed ones: the engine's first-run costs, and
    # the `exspec` policy enters its first timed run having seen the workload it is timed on (after a short warm-up,
    # 8 tokens for prompts of hundreds, its draft-prefill cost per token came out 4x the timed runs' and it ran k = 0
    # through half of the first one: docs/BENCHMARKS.md section 2)
    warmup: bool = True
    fixed_ks: tuple[int, ...] = ()  # exspec-fixed at each of these k (rows exspec-fixed-kK); (): at k only
    # `exspec`: its policy's calibration steps before the warm-up, as `exspec serve` runs them before serving (the
    # serve setting `calibrate`, resolved with the engine's settings: --calibrate / --no-calibrate)
    calibrate: bool = True
    # tokens of one prefill step at most, for our engine's methods (the serve setting `max_prefill_tokens`)
    max_prefill_tokens: int = SchedulerConfig.max_prefill_tokens

    @property
    def model(self) -> Path:
        return self.engine.model

    @property
    def draft_model(self) -> Path | None:  # needed by DRAFT_METHODS
        return self.engine.draft_model

    @property
    def device(self) -> str:  # resolved: "cpu", "cuda" or "cuda:N"
        return self.engine.device

    @property
    def dtype(self) -> str:  # resolved: a key of NEAR_TIE_EPS
        return self.engine.dtype

    @property
    def num_speculative_tokens(self) -> int:  # k of DRAFT_METHODS (the largest k for `exspec`)
        return self.engine.max_num_speculative_tokens

    @property
    def max_model_len(self) -> int:  # cap on prompt + max_tokens
        return self.engine.max_model_len

    def __post_init__(self) -> None:
        def bad(name: str, rule: str, value: object) -> None:
            raise BenchError(f"{name} must be {rule}, got {value!r}")

        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            bad("--methods", f"a non-empty comma-separated subset of {','.join(METHODS)}", ",".join(self.methods))
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            bad("--batch-sizes", "a comma-separated list of integers >= 1", self.batch_sizes)
        if self.num_prompts < 1:
            bad("--num-prompts", ">= 1", self.num_prompts)
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            bad("--max-prompt-len", ">= 1", self.max_prompt_len)
        if self.max_tokens < 1:
            bad("--max-tokens", ">= 1", self.max_tokens)
        if self.pool_factor is not None and self.pool_factor < 1:
            bad("--pool-factor", ">= 1", self.pool_factor)
        if self.max_prefill_tokens < 1:
            bad("--max-prefill-tokens", ">= 1", self.max_prefill_tokens)
        if self.repeats < 1:
            bad("--repeats", ">= 1", self.repeats)
        if self.interleave not in INTERLEAVE:
            bad("--interleave", f"one of {', '.join(INTERLEAVE)}", self.interleave)
        if self.dtype not in NEAR_TIE_EPS:
            bad("--dtype", f"one of {sorted(NEAR_TIE_EPS)}", self.dtype)
        if bad_k := next(filter(None, (check_num_speculative_tokens(k, "--fixed-ks") for k in self.fixed_ks)), None):
            raise BenchError(bad_k)
        needs_draft = [m for m in self.methods if m in DRAFT_METHODS]
        if needs_draft and self.num_speculative_tokens == 0:  # its upper bound: EngineConfig's
            bad("--num-speculative-tokens", f">= 1 for methods {', '.join(needs_draft)}", self.num_speculative_tokens)
        if needs_draft and not self.engine.speculates:
            raise BenchError(f"methods {', '.join(needs_draft)} need a draft model (--draft-model) or "
                             "--speculative-method ngram")

    def points(self) -> list[tuple[str, int]]:
        """(method, batch size) pairs to time, in report order; hf-assisted runs at B = 1 only; with fixed_ks,
        exspec-fixed becomes one method per k, named exspec-fixed-kK."""
        named = [
            (m, b)
            for b in sorted(set(self.batch_sizes))
            for m in METHODS
            if m in self.methods and (m != "hf-assisted" or b == 1)
        ] + ([("hf-assisted", 1)] if "hf-assisted" in self.methods and 1 not in self.batch_sizes else [])
        ks = sorted(set(self.fixed_ks))
        return [
            point
            for m, b in named
            for point in ([(f"exspec-fixed-k{k}", b) for k in ks] if ks and m == "exspec-fixed" else [(m, b)])
        ]


# The fields `exspec bench`'s own flags set, one flag each (`--x-y` sets `x_y`; an absent flag leaves the default
# above): the command line maps its options onto BenchConfig with this list, not field by field.
# `calibrate` and `max_prefill_tokens` are shared settings (serve's flags), not the bench's own.
OPTIONS = tuple(f.name for f in fields(BenchConfig) if f.name not in ("engine", "calibrate", "max_prefill_tokens"))

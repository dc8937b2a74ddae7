"""`exspec bench`: offline throughput of exspec against plain decoding and Hugging Face, on one model pair.

Every method decodes the same prompts greedily to the same `max_tokens`, and is timed the same way:

    tokens/s = generated tokens / wall time of the whole offline run

"wall time of the whole offline run" starts when the first prompt is handed over and ends when the last
token is on the host: prefill, scheduling, padding and every decode step are inside it; model loading,
engine construction (KV pool allocation) and the warm-up run are not. The median over `repeats` timed
runs is reported (methods interleaved within each repeat, in reverse order every other repeat: `repeat_order`,
so noise from other jobs spreads evenly). With `interleave="steps"` (the default) the methods run their repeat
together, one piece at a time (a scheduler step of an engine method, `OfflineRun`; a `generate` call of a Hugging
Face one), the run least far along in its tokens first (`Bench._repeat`), and each run's time is the sum of its own
pieces' wall times: a slow spell of the machine then falls on every method in proportion to its work, where a whole
run lasts tens of seconds and a spell may cover it whole (at B = 1 `target-ar` and `exspec-fixed-k0`, the same
computation, measured 0.92x-1.04x of each other with whole runs interleaved: docs/BENCHMARKS.md section 2).
`interleave="runs"`: every method's run whole, in turn.

Methods (`METHODS`):
- `target-ar`: the target alone through our engine and scheduler, k = 0, pool W = B.
- `hf-generate`: `model.generate()` of the target on static left-padded batches of B prompts.
- `hf-assisted`: Hugging Face assisted generation (`assistant_model=draft`; with `--speculative-method ngram` its
  prompt lookup, `prompt_lookup_num_tokens=k`), k fixed, batch 1 only.
- `exspec-mixed`: exspec at a fixed k with every step through the mixed-length path (the engine's
  `force_mixed=True`).
- `exspec-fixed`: exspec at a fixed k with EXSPEC grouping, pool W = pool_factor * B (serve's W by default).
- `exspec`: exspec exactly as served by default: `SchedulerConfig`'s default speculation policy (not passed
  here, so the row follows the default wherever it goes), k as the largest k, pool W as exspec-fixed.
  As in a server, whose one scheduler keeps its policy across requests, each (method, B) keeps one policy
  across its warm-up and timed runs: what the policy learned in one run carries into the next; and as
  `exspec serve` does before serving, the policy runs its calibration steps first (untimed, as the warm-up;
  `--no-calibrate` to measure a server started without them).

Output equivalence is measured against `target-ar` at B = 1, per prompt: identical generated token ids, or
a divergence, classified as a near-tie when the reference's top-2 logit gap at the first differing position
(the target run on prompt + reference prefix, in the benchmark's dtype) is below `NEAR_TIE_EPS[dtype]` or within two
units in the last place of the top-1 logit in that dtype (equivalence.is_near_tie).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from exspec.bench.equivalence import (
    NEAR_TIE_EPS,
    classify_divergences,
    top2_gaps_along,
    top2_logits,
)
from exspec.data import (
    DatasetError,
    all_questions,
    calibration_prompts,
    encode_prompts,
    evenly_spaced,
    load_questions,
)
from exspec.data.reference import ReferenceRow
from exspec.bench.config import (  # noqa: F401 (METHODS, DRAFT_METHODS re-exported)
    DRAFT_METHODS,
    ENGINE_METHODS,
    METHODS,
    BenchConfig,
)
from exspec.engine import (
    ModelPair,
    SamplingParams,
    SpecEngine,
    load_model_pair,
)
from exspec.scheduler import OfflineRun, SchedulerConfig, SchedulerCore, SpeculationPolicy, policies
from exspec.scheduler.types import default_pool_size

from exspec.errors import BenchError

REFERENCE = ("target-ar", 1)  # (method, batch size) every method's outputs are compared with
TIMING = (
    "generated tokens / wall time of the whole offline run (first prompt handed over to last token on the "
    "host: prefill, scheduling, padding and decode included; model loading and warm-up excluded; with the methods "
    "interleaved step by step, the sum of the run's own steps' or generate calls' wall times), median of the repeats"
)


@dataclass
class RunResult:
    """One run of a method at one batch size over every prompt."""

    outputs: list[list[int]]  # generated token ids per prompt (EOS kept, as the engine keeps it)
    seconds: float  # wall time, as defined in TIMING
    mean_acceptance_length: float | None  # tokens emitted per sequence per decode step (1.0 without drafts)
    grouped_fraction: float | None  # grouped / (grouped + mixed) decode steps; None outside our engine
    forward_s_per_step: float | None = None  # our engine: seconds per decode step in the forwards (+ acceptance)
    decode_tokens_per_s: float | None = None  # our engine: tokens emitted by decode steps / their wall time

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


@dataclass
class BenchRow:
    method: str
    batch_size: int
    tokens_per_s: float  # generated_tokens / decode_seconds
    mean_acceptance_length: float | None
    grouped_fraction: float | None
    forward_ms_per_step: float | None  # our engine: ms per decode step in draft + target forwards (+ acceptance)
    decode_tokens_per_s: float | None  # our engine: decode steps only (their tokens / their wall time), median
    equivalence_rate: float  # prompts whose token ids equal target-ar's at B = 1, over num_prompts
    near_ties: int  # divergences at a near-tie (reference top-2 logit gap < eps)
    real_divergences: int  # the other divergences
    num_prompts: int
    generated_tokens: int
    decode_seconds: float  # median wall time of the timed runs (TIMING)
    seconds_per_repeat: list[float] = field(default_factory=list)
    pool_size: int | None = None  # W for our engine's methods
    num_speculative_tokens: int = 0  # k used (0: no drafts; the largest k for an adaptive policy)
    speculation: str | None = None  # the scheduler's speculation policy for our engine's methods
    divergences: list[dict] = field(default_factory=list)  # {prompt, position, gap, kind} per divergence
    policy: dict = field(default_factory=dict)  # `exspec` (auto): per bucket, steps per k and exploration share

    def to_dict(self) -> dict:
        return asdict(self)


def _fixed_k(method: str) -> int | None:
    """K of a method named exspec-fixed-kK (BenchConfig.fixed_ks), else None."""
    prefix = "exspec-fixed-k"
    return int(method[len(prefix):]) if method.startswith(prefix) else None


def repeat_order(methods: list[str], repeat: int) -> list[str]:
    """The order the methods run in timed repeat `repeat` (from 0): as given in even repeats, reversed in odd ones.
    A slow spell of the machine that starts or ends during a repeat then does not fall on the same methods each
    time (in one fixed order `exspec` ran last in every repeat: docs/BENCHMARKS.md section 2, session 22). Over two
    consecutive repeats every method's mean position is the same."""
    return list(methods) if repeat % 2 == 0 else list(reversed(methods))


def _base(method: str) -> str:
    """The method a point runs: exspec-fixed-kK is exspec-fixed at k = K."""
    return "exspec-fixed" if _fixed_k(method) is not None else method


class Bench:
    """Loads the pair once, builds each method's runner lazily, times them, compares outputs."""

    def __init__(self, config: BenchConfig, progress: bool = True, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.progress = progress
        self.log = log  # given: one line per timed run as it ends (what a run cut off by a time limit still shows)
        self.pair: ModelPair = load_model_pair(config.engine)
        self.device = torch.device(config.device)
        tok = self.pair.tokenizer
        self.prompts = self._select_prompts(tok)
        longest = max(len(p) for p in self.prompts)
        self.max_model_len = longest + config.max_tokens + 1
        if self.max_model_len > config.max_model_len:
            raise BenchError(
                f"the longest prompt ({longest} tokens) + --max-tokens ({config.max_tokens}) exceeds "
                f"--max-model-len ({config.max_model_len}): lower --max-tokens or raise --max-model-len"
            )
        self.pad_id = self._pad_id()
        self._top2_cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._policies: dict[tuple[str, int], SpeculationPolicy] = {}  # (method, B) -> the policy it kept
        self.reference: list[list[int]] | None = None  # target-ar B = 1 outputs, once run() is done

    def _select_prompts(self, tok) -> list[list[int]]:
        """`num_prompts` SpecBench questions (`turns[0]`) evenly spaced over those within max_prompt_len."""
        cfg = self.config
        try:
            if cfg.max_prompt_len is None:
                return encode_prompts(tok, load_questions("specbench", cfg.num_prompts), cfg.chat_template)
            prompts = encode_prompts(tok, all_questions("specbench"), cfg.chat_template)
        except DatasetError as e:
            raise BenchError(str(e)) from e
        prompts = [p for p in prompts if len(p) <= cfg.max_prompt_len]
        if len(prompts) < cfg.num_prompts:
            raise BenchError(
                f"only {len(prompts)} SpecBench questions fit --max-prompt-len {cfg.max_prompt_len}; "
                f"--num-prompts is {cfg.num_prompts}"
            )
        return evenly_spaced(prompts, cfg.num_prompts)

    # ------------------------------------------------------------------ orchestration

    def run(self) -> list[BenchRow]:
        cfg = self.config
        points = cfg.points()
        bar = None
        if self.progress:
            from tqdm import tqdm

            total = len(points) * (cfg.repeats + int(cfg.warmup)) + 1
            bar = tqdm(total=total, unit="run", desc="bench", dynamic_ncols=True)
        runs: dict[tuple[str, int], list[RunResult]] = {}
        runners: dict[tuple[str, int], Callable[..., RunResult]] = {}
        for b in sorted({b for _, b in points}):
            at_b = [m for m, bb in points if bb == b]
            for m in at_b:
                runners[(m, b)] = self._runner(m, b)
                if cfg.warmup:
                    self._set(bar, f"warm-up {m} B={b}")
                    runners[(m, b)](self.prompts)  # the timed workload, untimed (see `warmup` in BenchConfig)
                    _tick(bar)
            for r in range(cfg.repeats):
                for m, run in self._repeat(b, at_b, r, runners, bar):
                    runs.setdefault((m, b), []).append(run)
                    if self.log is not None:
                        acc = run.mean_acceptance_length
                        self.log(f"[bench] {m} B={b}: {run.generated_tokens} tokens in {run.seconds:.2f} s, "
                                 f"{run.generated_tokens / run.seconds:.1f} tok/s"
                                 + ("" if acc is None else f", acceptance {acc:.2f}"))
                    _tick(bar)
            runners.clear()  # free this batch size's KV pools before the next one's
        self._set(bar, "reference and near-tie check")
        if REFERENCE in runs:
            reference = runs[REFERENCE][0].outputs
        else:
            reference = self._runner(*REFERENCE)(self.prompts).outputs
        self.reference = reference
        rows = [self._row(m, b, runs[(m, b)], reference) for m, b in points]
        _tick(bar)
        if bar is not None:
            bar.close()
        return rows

    def _repeat(self, b: int, methods: list[str], repeat: int, runners: dict, bar):
        """Timed repeat `repeat` of `methods` at batch size b: yields (method, RunResult) as each run ends, the methods
        in `repeat_order`. `interleave="runs"`: each method's run whole, in turn. "steps": every method's run at once,
        one piece at a time, each run timed by its own pieces: a scheduler step of an engine method, a `generate` call
        of a Hugging Face one (a prompt of hf-assisted, a static batch of hf-generate). The next piece is always the
        one of the run least far along (`_progress`; ties in `repeat_order`), so the runs advance through their
        tokens together and end together, whatever their speeds: a slow spell of the machine, whenever it comes,
        falls on every method in proportion to its own work."""
        order = repeat_order(methods, repeat)
        if self.config.interleave == "runs":
            for m in order:
                self._set(bar, f"{m} B={b}")
                yield m, runners[(m, b)](self.prompts)
            return
        self._set(bar, f"{len(order)} methods step by step, B={b}")
        runs = {m: runners[(m, b)].start(self.prompts) for m in order}
        tokens = len(self.prompts) * self.config.max_tokens
        active = list(order)
        while active:
            m = min(active, key=lambda m: _progress(runs[m], tokens))  # the first of the least far along
            runs[m].step()
            if runs[m].done:
                active.remove(m)
                yield m, runners[(m, b)].finish(runs[m])

    @staticmethod
    def _set(bar, text: str) -> None:
        if bar is not None:
            bar.set_postfix_str(text, refresh=True)

    def _row(self, method: str, b: int, runs: list[RunResult], reference: list[list[int]]) -> BenchRow:
        seconds = [r.seconds for r in runs]
        median_s = statistics.median(seconds)
        first = runs[0]
        divergences = self._divergences(first.outputs, reference)
        near = sum(1 for d in divergences if d["kind"] == "near-tie")
        n = len(self.prompts)
        return BenchRow(
            method=method,
            batch_size=b,
            tokens_per_s=first.generated_tokens / median_s if median_s > 0 else 0.0,
            mean_acceptance_length=first.mean_acceptance_length,
            grouped_fraction=first.grouped_fraction,
            forward_ms_per_step=(
                statistics.median(r.forward_s_per_step for r in runs) * 1e3 if first.forward_s_per_step else None
            ),
            decode_tokens_per_s=(
                statistics.median(r.decode_tokens_per_s for r in runs) if first.decode_tokens_per_s else None
            ),
            equivalence_rate=(n - len(divergences)) / n,
            near_ties=near,
            real_divergences=len(divergences) - near,
            num_prompts=n,
            generated_tokens=first.generated_tokens,
            decode_seconds=median_s,
            seconds_per_repeat=seconds,
            pool_size=self._pool_size(method, b) if _base(method) in ENGINE_METHODS else None,
            num_speculative_tokens=0 if method in ("target-ar", "hf-generate") else self._k(method),
            speculation=self._scheduler_config(method, b).speculation if _base(method) in ENGINE_METHODS else None,
            policy=self._policies[(method, b)].summary() if (method, b) in self._policies else {},
            divergences=divergences,
        )

    # ------------------------------------------------------------------ methods

    def _runner(self, method: str, b: int):
        """A callable running every given prompt with `method` at batch size b; built once per point."""
        if _base(method) in ENGINE_METHODS:
            return self._engine_runner(method, b)
        if method == "hf-generate":
            return _HFMethod(lambda prompts: self._hf_generate(prompts, b), self._sync)
        return _HFMethod(self._hf_assisted, self._sync)

    def _pool_size(self, method: str, b: int) -> int:
        if method == "target-ar":
            return b
        return max(b, min(default_pool_size(b, self.config.pool_factor), len(self.prompts)))

    def _k(self, method: str) -> int:
        """k of an engine method: 0 for target-ar, K for exspec-fixed-kK, else --num-speculative-tokens."""
        if method == "target-ar":
            return 0
        fixed = _fixed_k(method)
        return self.config.num_speculative_tokens if fixed is None else fixed

    def _scheduler_config(self, method: str, b: int) -> SchedulerConfig:
        """`exspec` passes no `speculation`: it measures the scheduler's default policy, whatever it is."""
        k = self._k(method)
        fields = dict(max_batch_size=b, pool_size=self._pool_size(method, b), max_waiting=10**9,
                      num_speculative_tokens=k, max_prefill_tokens=self.config.max_prefill_tokens)
        if _base(method) in ("exspec-fixed", "exspec-mixed"):
            fields.update(speculation="fixed")  # exspec-mixed's force_mixed is an engine setting
        return SchedulerConfig(**fields)

    def _engine_runner(self, method: str, b: int):
        cfg = self.config
        k = self._k(method)
        pool = self._pool_size(method, b)
        pair = replace(self.pair, draft=None) if k == 0 else self.pair
        engine = SpecEngine(
            replace(  # the resolved engine (attention, gemm, compile, KV memory ...) sized for this point
                cfg.engine,
                draft_model=None if k == 0 else cfg.draft_model,
                max_num_seqs=pool,
                max_model_len=self.max_model_len,
                max_num_speculative_tokens=k,
                force_mixed=method == "exspec-mixed",
            ),
            pair=pair,
        )
        sched = self._scheduler_config(method, b)
        # One policy per (method, B), kept across the warm-up and the timed runs as a server's scheduler keeps
        # it across requests: each run then measures the policy's steady state, not its first steps again.
        policy = policies.create(sched.speculation, k, cfg.draft_model is not None)  # n-gram lookup: no draft model
        self._policies[(method, b)] = policy
        calibrate = method == "exspec" and cfg.calibrate
        return _EngineMethod(f"{method} B={b}", engine, sched, policy, cfg.max_tokens,
                             self.pair.tokenizer if calibrate else None, self.max_model_len)

    def _pad_id(self) -> int:
        tok = self.pair.tokenizer
        for cand in (tok.pad_token_id, tok.eos_token_id, *self.pair.eos_token_ids):
            if isinstance(cand, int):
                return cand
        return 0

    def _generation_config(self, max_tokens: int):
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(self.pair.eos_token_ids) or None,
            pad_token_id=self.pad_id,
        )

    def _cut(self, row: list[int]) -> list[int]:
        """Generated ids up to and including the first EOS (the engine keeps EOS in its output)."""
        eos = set(self.pair.eos_token_ids)
        for i, t in enumerate(row):
            if t in eos:
                return row[: i + 1]
        return row

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _hf_generate(self, prompts: list[list[int]], b: int) -> list[Callable[[], tuple[list[list[int]], int]]]:
        """Static batches of b prompts, left-padded with the tokenizer's pad id (padding_side="left"): one call each,
        returning (outputs, target forward calls); acceptance length 1."""
        gen_cfg = self._generation_config(self.config.max_tokens)
        model = self.pair.target

        @torch.inference_mode()
        def call(batch: list[list[int]]) -> tuple[list[list[int]], int]:
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch], device=self.device)  # [b, P]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)  # [b, P]
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)  # [b, P + n]
            return [self._cut(row) for row in out[:, width:].tolist()], 0

        return [lambda batch=prompts[i : i + b]: call(batch) for i in range(0, len(prompts), b)]

    def _hf_assisted(self, prompts: list[list[int]]) -> list[Callable[[], tuple[list[list[int]], int]]]:
        """Assisted generation at batch 1 with exactly k draft tokens per step (constant schedule, no
        confidence-based early stop), one call per prompt returning (outputs, target forward calls). Acceptance
        length: generated tokens / target forward calls."""
        k = self.config.num_speculative_tokens
        gen_cfg = self._generation_config(self.config.max_tokens)
        target, draft = self.pair.target, self.pair.draft
        if draft is None:  # --speculative-method ngram: Hugging Face's prompt lookup, k tokens, the same longest n-gram
            gen_cfg = _copy(gen_cfg)
            gen_cfg.prompt_lookup_num_tokens = k
            gen_cfg.max_matching_ngram_size = self.config.engine.prompt_lookup_max
            assisting = None
        else:
            assisting = _copy(draft.generation_config)
            assisting.num_assistant_tokens = k
            assisting.num_assistant_tokens_schedule = "constant"
            assisting.assistant_confidence_threshold = 0.0  # 0: never stop drafting early

        @torch.inference_mode()
        def call(p: list[int]) -> tuple[list[list[int]], int]:
            # set and undone around each call (microseconds): the engine methods stepped between calls share the models
            if draft is not None:
                saved, draft.generation_config = draft.generation_config, assisting
            calls = [0]
            hook = target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            try:
                ids = torch.tensor([p], device=self.device)  # [1, P]
                out = target.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=gen_cfg,
                    **({"assistant_model": draft} if draft is not None else {}),
                )  # [1, P + n]
                return [self._cut(out[0, len(p) :].tolist())], calls[0]
            finally:
                hook.remove()
                if draft is not None:
                    draft.generation_config = saved

        return [lambda p=p: call(p) for p in prompts]

    # ------------------------------------------------------------------ equivalence

    def _divergences(self, outputs: list[list[int]], reference: list[list[int]]) -> list[dict]:
        return classify_divergences(outputs, reference, self._top2, self.config.dtype)

    def reference_rows(self) -> list[ReferenceRow]:
        """The target-alone outputs of `run()` in the reference-file format of the load test, with the
        target's top-2 logit gap and top-1 logit before every generated token (one forward per prompt) and the
        run's dtype, so that the load test tells near-ties by the bench's own rule (`is_near_tie`)."""
        if self.reference is None:
            raise BenchError("reference_rows() needs run() first")
        cfg = self.config
        eps = NEAR_TIE_EPS[cfg.dtype]
        source = f"exspec bench target-ar B=1 (our engine, k = 0), {Path(cfg.model).name}, {cfg.device} {cfg.dtype}"
        rows = []
        for prompt, out in zip(self.prompts, self.reference):
            gaps, top1 = top2_gaps_along(self.pair.target, prompt, out, self.pair.vocab_size)
            rows.append(ReferenceRow(prompt, out, cfg.max_tokens, False, gaps, eps, source, top1, cfg.dtype))
        return rows

    def _top2(self, i: int, prefix: list[int]) -> tuple[float, float]:
        """The reference's top-1 and top-2 logits after prompt i + prefix, cached (methods often diverge alike)."""
        key = (i, len(prefix))
        if key not in self._top2_cache:
            self._top2_cache[key] = top2_logits(self.pair.target, self.prompts[i] + prefix, self.pair.vocab_size)
        return self._top2_cache[key]


class _Method:
    """A method of one point: `start(prompts)` hands them over and returns the run, which its caller steps
    (`run.step()`, `run.done`) to the end, then `finish(run)` gives its `RunResult`; calling it does all three."""

    def start(self, prompts: list[list[int]]):
        raise NotImplementedError

    def finish(self, run) -> RunResult:
        raise NotImplementedError

    def __call__(self, prompts: list[list[int]]) -> RunResult:
        run = self.start(prompts)
        while not run.done:
            run.step()
        return self.finish(run)


class _EngineMethod(_Method):
    """A method through our engine at one batch size, its runs `OfflineRun`s. Given a tokenizer, the policy runs its
    calibration steps before the first run, untimed, as `exspec serve` does before serving."""

    def __init__(self, name: str, engine: SpecEngine, sched: SchedulerConfig, policy: SpeculationPolicy,
                 max_tokens: int, calibrate_with=None, max_model_len: int = 0) -> None:
        self.name, self.engine, self.sched, self.policy = name, engine, sched, policy
        self.max_tokens, self.calibrate_with, self.max_model_len = max_tokens, calibrate_with, max_model_len

    def start(self, prompts: list[list[int]]) -> OfflineRun:
        if self.calibrate_with is not None:  # once, before the first run
            prompts_for_calibration = calibration_prompts(self.calibrate_with, self.sched.max_batch_size,
                                                          self.max_model_len)
            SchedulerCore(self.engine, self.sched, self.policy).calibrate(prompts_for_calibration)
            self.calibrate_with = None
        params = [SamplingParams(max_tokens=self.max_tokens)] * len(prompts)
        return OfflineRun(self.engine, prompts, params, self.sched, speculation=self.policy)

    def finish(self, run: OfflineRun) -> RunResult:
        results, summary = run.results(), run.summary
        failed = [r for r in results if r.error]
        if failed:
            raise BenchError(f"{self.name}: prompt {failed[0].index} failed: {failed[0].error}")
        return RunResult(
            outputs=[r.token_ids for r in results],
            seconds=summary.wall_seconds,
            mean_acceptance_length=summary.mean_acceptance_length,
            grouped_fraction=summary.grouped_fraction,
            forward_s_per_step=summary.forward_seconds_per_step,
            decode_tokens_per_s=(summary.num_decode_tokens / summary.decode_seconds
                                 if summary.decode_seconds > 0 else None),
        )


def _progress(run, tokens: int) -> float:
    """How far along a run of the step interleave is, in [0, 1]: an engine method's share of `tokens` (its prompts
    times max_tokens) generated; a Hugging Face method's calls done, plus half of its next one (the call runs once the
    others are past its middle)."""
    if isinstance(run, OfflineRun):
        return run.summary.num_generated_tokens / tokens
    return (run.calls_done + 0.5) / len(run.calls)


class _Calls:
    """A Hugging Face method's run as the `generate` calls its caller makes one at a time (`step`), each timed alone
    (the device synchronised around it): `exspec bench`'s step interleaving spreads them over the engine methods'
    steps. Each call returns (outputs, target forward calls)."""

    def __init__(self, calls: list, sync: Callable[[], None]) -> None:
        self.calls, self.sync = calls, sync
        self.calls_done, self.outputs, self.forwards, self.seconds = 0, [], 0, 0.0

    @property
    def done(self) -> bool:
        return self.calls_done == len(self.calls)

    def step(self) -> None:
        self.sync()
        start = time.perf_counter()
        outputs, forwards = self.calls[self.calls_done]()
        self.sync()
        self.seconds += time.perf_counter() - start
        self.outputs.extend(outputs)
        self.forwards += forwards
        self.calls_done += 1


class _HFMethod(_Method):
    """A Hugging Face method, its runs `_Calls`: `calls(prompts)` gives its `generate` calls. Acceptance length:
    generated tokens / target forwards counted by the calls (1 where none are)."""

    def __init__(self, calls: Callable[[list[list[int]]], list], sync: Callable[[], None] = lambda: None) -> None:
        self.calls, self.sync = calls, sync

    def start(self, prompts: list[list[int]]) -> _Calls:
        return _Calls(self.calls(prompts), self.sync)

    def finish(self, run: _Calls) -> RunResult:
        tokens = sum(len(o) for o in run.outputs)
        acceptance = tokens / run.forwards if run.forwards else 1.0
        return RunResult(run.outputs, run.seconds, acceptance, None)


def _copy(gen_config):
    import copy

    return copy.deepcopy(gen_config)


def _tick(bar) -> None:
    if bar is not None:
        bar.update(1)


def run_bench(config: BenchConfig, progress: bool = True) -> list[BenchRow]:
    return Bench(config, progress=progress).run()

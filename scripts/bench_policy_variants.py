"""Where exspec's default loses to target-ar on the demo pair: the same prompts (bench's selection: 32 chat
SpecBench prompts <= 1024 tokens, 64 tokens each) through variants that add one difference at a time, interleaved
per repeat, every output checked identical (docs/BENCHMARKS-HISTORY.md, "Issue 13, session 3").

  ar-pool1x        target alone, pool B (= exspec bench's target-ar)
  ar-pool4x        target alone, pool 4B (exspec's sliding pool)
  draft-k0-pool4x  with the draft loaded, speculation fixed at k = 0
  auto-pool4x      the default policy (= exspec bench's exspec, but a fresh policy per run)
  auto-pool1x      the default policy, pool B
  fixed4-pool4x    k = 4 fixed

Then it counts the prefill tokens computed (padding included) against the real ones for the two target-alone pools.

Run: .venv/bin/python scripts/bench_policy_variants.py B REPEATS THREADS"""
import sys, statistics, time, torch
from dataclasses import replace
from pathlib import Path
from exspec.bench.runner import Bench, BenchConfig
from exspec.engine import SpecEngine, EngineConfig
from exspec.engine.params import SamplingParams
from exspec.scheduler import SchedulerConfig, generate_offline
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
demo = Path.home() / ".cache/exspec/demo"
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
cfg = BenchConfig(engine=EngineConfig(model=demo / "target", draft_model=demo / "draft",
                                      max_num_speculative_tokens=SchedulerConfig().num_speculative_tokens), methods=("target-ar", "exspec"), batch_sizes=(B,),
                  num_prompts=32, max_prompt_len=1024, max_tokens=64, chat_template=True)
bench = Bench(cfg, progress=False)
prompts = bench.prompts
def make(draft, pool, spec, k):
    pair = bench.pair if draft else replace(bench.pair, draft=None)
    eng = SpecEngine(EngineConfig(model=cfg.model, draft_model=cfg.draft_model if draft else None, device="cpu", dtype="float32",
                                  max_num_seqs=pool, max_model_len=bench.max_model_len, max_num_speculative_tokens=4 if draft else 0), pair=pair)
    sc = SchedulerConfig(max_batch_size=B, pool_size=pool, max_waiting=10**9, num_speculative_tokens=k, speculation=spec)
    def run(ps=prompts, mt=64):
        res, summ = generate_offline(eng, ps, [SamplingParams(max_tokens=mt)] * len(ps), sc)
        return summ.wall_seconds, [r.token_ids for r in res], summ
    return run
variants = {
    "ar-pool1x": make(False, B, "fixed", 0),
    "ar-pool4x": make(False, 4 * B, "fixed", 0),
    "draft-k0-pool4x": make(True, 4 * B, "fixed", 0),
    "auto-pool4x": make(True, 4 * B, "auto", 4),
    "auto-pool1x": make(True, B, "auto", 4),
    "fixed4-pool4x": make(True, 4 * B, "fixed", 4),
}
for v in variants.values(): v(prompts[:B], 8)
ref = None
res = {n: [] for n in variants}
det = {}
for r in range(reps):
    for n, v in variants.items():
        s, outs, summ = v()
        if ref is None: ref = outs
        assert outs == ref, n
        res[n].append(sum(len(o) for o in outs) / s)
        det.setdefault(n, []).append((s, summ.decode_seconds, s - summ.decode_seconds, dict(summ.steps), summ.mean_acceptance_length))
    print(r, {n: round(x[-1]) for n, x in res.items()}, open("/proc/loadavg").read().split()[:2], flush=True)
base = statistics.median(res["ar-pool1x"])
for n, x in res.items():
    print(f"{n:18s} median {statistics.median(x):7.1f} tok/s  ratio-to-ar {statistics.median(x)/base:.3f}  "
          f"ratio of per-repeat ratios {statistics.median([a/b for a, b in zip(x, res['ar-pool1x'])]):.3f}")

for n, d in det.items():
    print(n, "wall/decode/prefill s (median):", [round(statistics.median(x[i] for x in d), 3) for i in range(3)], d[-1][3], round(d[-1][4], 2))

# padding in prefill
from exspec.engine.engine import SpecEngine as _SE
acc = {}
orig = _SE.prefill
def wrapped(self, batch):
    w = [c.end - c.start for c in batch.chunks]
    a = acc.setdefault(id(self), [0, 0, 0])
    a[0] += sum(w); a[1] += len(w) * max(w); a[2] += 1
    return orig(self, batch)
_SE.prefill = wrapped
for n in ("ar-pool1x", "ar-pool4x"):
    acc.clear(); variants[n]()
    print(n, "real/padded prefill tokens, steps:", list(acc.values()))
print("prompt lengths", sorted(len(p) for p in prompts))

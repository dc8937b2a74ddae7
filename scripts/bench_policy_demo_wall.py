"""Experiment: bench_policy_demo.py with the auto policy fed whole-step wall time (choose to next choose,
prefill steps in between included) instead of core.py's draft_s + verify_s, by monkeypatching AutoPolicy."""
import time, runpy, sys, torch
torch.set_num_threads(1)
from exspec.scheduler.policies.auto import AutoPolicy
orig_choose, orig_observe = AutoPolicy.choose, AutoPolicy.observe
state = {}
def choose(self, b):
    prev = state.get(id(self))
    now = time.perf_counter()
    if prev is not None and prev[1] is not None:  # wall from the previous choose to this one: a whole step
        orig_observe(self, *prev[1], now - prev[0])
    state[id(self)] = (now, None)
    return orig_choose(self, b)
def observe(self, b, k, n, s, *rest):
    t, _ = state[id(self)]
    state[id(self)] = (t, (b, k, n))
AutoPolicy.choose, AutoPolicy.observe = choose, observe
sys.argv = ['x', '--batch-sizes', '1,8', '--repeats', '3', '--methods', 'target-ar,exspec,fixed']
runpy.run_path('scripts/bench_policy_demo.py', run_name='__main__')

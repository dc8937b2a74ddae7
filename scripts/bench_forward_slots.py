"""One target forward (`ModelRunner.extend`) at consecutive vs scattered slots, per attention backend.

A random Llama of a realistic shape (no download): B rows at the same length kv_len, feeding q_len tokens
each, at slots 0..B-1 ("consecutive") or 0, 2, 4, ... ("scattered"). Methods are interleaved per repeat
(A B A B ...), medians reported. Usage:

    .venv/bin/python scripts/bench_forward_slots.py --layers 8 --batch 8 --kv-lens 256,2048 --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from exspec.engine.attention import register
from exspec.engine.runner import ModelRunner


def build(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> torch.nn.Module:
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    cfg._attn_implementation = register()
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-lens", default="256,2048")
    ap.add_argument("--q-lens", default="1,5")
    ap.add_argument("--backends", default="gather,pool")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_lens = [int(x) for x in args.kv_lens.split(",")]
    q_lens = [int(x) for x in args.q_lens.split(",")]
    backends = args.backends.split(",")
    model = build(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab)
    b = args.batch
    pool_len = max(kv_lens) + max(q_lens) + 1
    runners = {name: ModelRunner(model, 2 * b, pool_len, args.vocab, attention=name) for name in backends}
    slot_sets = {"consecutive": list(range(b)), "scattered": list(range(0, 2 * b, 2))}
    times: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for runner in runners.values():  # allocate the pools, then fill them with random K/V
            runner.extend(torch.zeros(1, 1, dtype=torch.long), [0], [0])
            for pool in runner.cache.keys + runner.cache.values:
                pool.normal_()
        cases = list(itertools.product(kv_lens, q_lens, slot_sets, backends))
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            for kv_len, q_len, slots_name, name in cases:
                tokens = torch.randint(0, args.vocab, (b, q_len))
                t0 = time.perf_counter()
                runners[name].extend(tokens, [kv_len - q_len] * b, slot_sets[slots_name])
                dt = time.perf_counter() - t0
                if rep:
                    times.setdefault((kv_len, q_len, slots_name, name), []).append(dt * 1000)
    rows = []
    print(f"B={b} layers={args.layers} hidden={args.hidden} threads={torch.get_num_threads()}")
    print(f"{'kv_len':>6} {'q':>2} {'backend':>7} {'consec ms':>10} {'scatter ms':>11} {'ratio':>6}")
    for kv_len, q_len, name in itertools.product(kv_lens, q_lens, backends):
        c = statistics.median(times[(kv_len, q_len, "consecutive", name)])
        s = statistics.median(times[(kv_len, q_len, "scattered", name)])
        print(f"{kv_len:>6} {q_len:>2} {name:>7} {c:>10.1f} {s:>11.1f} {s / c:>6.2f}")
        rows.append({"kv_len": kv_len, "q_len": q_len, "backend": name, "consecutive_ms": c, "scattered_ms": s})
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

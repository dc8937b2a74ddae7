"""verify(k + 1) / forward(1): one row feeding k + 1 tokens vs one token, with MKL sgemm ("default") and with
oneDNN-prepacked linears ("packed"), interleaved, medians. A random Llama of a given shape, or a model dir.

    .venv/bin/python scripts/bench_verify_ratio.py --hidden 1024 --intermediate 4096 --layers 24 --threads 1
    .venv/bin/python scripts/bench_verify_ratio.py --model ~/.cache/exspec/demo/target --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from exspec.engine.attention import register
from exspec.engine.packed_linear import PackedLinear
from exspec.engine.random_model import causal_lm_config, random_causal_lm
from exspec.bench.forward import block_layouts
from exspec.engine.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--kv-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=register()).eval()
    else:
        cfg = causal_lm_config("llama", args.vocab, layers=args.layers, hidden=args.hidden, heads=args.heads,
                               positions=2048, intermediate=args.intermediate, kv_heads=args.kv_heads)
        base = random_causal_lm(cfg, attn_implementation=register()).eval()
    packed = copy.deepcopy(base)
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
    vocab = base.config.vocab_size
    params = sum(p.numel() for p in base.parameters()) / 1e6
    runners = {m: ModelRunner(model, block_layouts(args.batch, args.kv_len + args.k + 2, 16, torch.device("cpu")), vocab)
               for m, model in (("default", base), ("packed", packed))}
    b = args.batch
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for r in runners.values():
            r.extend(torch.zeros(b, args.kv_len, dtype=torch.long), [0] * b, list(range(b)))
        for rep in range(args.repeats + 2):
            for q in (1, args.k + 1):
                for m, r in runners.items():
                    tok = torch.randint(0, vocab, (b, q))
                    t0 = time.perf_counter()
                    r.extend(tok, [args.kv_len - 1] * b, list(range(b)))
                    if rep >= 2:
                        times.setdefault((m, q), []).append((time.perf_counter() - t0) * 1e3)
    print(f"{params:.0f}M params, B={b}, kv_len={args.kv_len}, threads={args.threads}: median ms")
    for m in runners:
        one, ver = statistics.median(times[(m, 1)]), statistics.median(times[(m, args.k + 1)])
        print(f"  {m:>8}: forward(1) {one:8.2f}  verify({args.k + 1}) {ver:8.2f}  ratio {ver / one:5.2f}")


if __name__ == "__main__":
    main()

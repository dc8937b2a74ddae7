"""One-row linears in real decoding: MKL sgemm (F.linear) against the oneDNN-prepacked weight, per torch thread
count (docs/BENCHMARKS-HISTORY.md, "One-row forwards"). Decodes with the target alone through Hugging Face's cache, every
linear a PackedLinear, one-row forwards routed either way, interleaved, median ms per token.

Run: .venv/bin/python scripts/bench_one_row_decode.py THREADS [MODEL_DIR]   (default: the 350m synthetic target)
"""
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from exspec.bench.synthetic import ensure_synthetic_pair
from exspec.engine import packed_linear as pl

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
target = Path(sys.argv[2]) if len(sys.argv) > 2 else ensure_synthetic_pair("350m")[0]
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
pl.prepack_linears(model)
packed_forward = pl.PackedLinear.forward


def sgemm_forward(self, x):  # one row through F.linear whatever the thread count
    if x.numel() // self.in_features <= 1:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return packed_forward(self, x)


def packed_always(self, x):
    rows = x.numel() // self.in_features
    flat, packed = x.reshape(rows, self.in_features), self._packed_weight(self.weight)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], self.out_features)


ROUTES = {"sgemm": sgemm_forward, "packed": packed_always}


def decode(n: int = 32, prompt_len: int = 64) -> float:
    ids = torch.randint(10, 1000, (1, prompt_len))
    with torch.inference_mode():
        cache = DynamicCache()
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(n):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t) / n * 1e3


for route in ROUTES.values():
    pl.PackedLinear.forward = route
    decode(8)
res = {name: [] for name in ROUTES}
for r in range(6):
    for name, route in ROUTES.items():
        pl.PackedLinear.forward = route
        res[name].append(decode())
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
m = {k: statistics.median(v) for k, v in res.items()}
print(f"threads {threads}: median ms/token sgemm {m['sgemm']:.1f}, packed {m['packed']:.1f}, packed/sgemm {m['packed'] / m['sgemm']:.2f}")

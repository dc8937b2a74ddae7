"""One-row linear: MKL sgemm (F.linear) against the oneDNN-prepacked weight, per weight shape (toy, SmolLM2, 350m
shapes), one thread, alternating, median of 7. Where the prepacked path starts to win sets
engine/packed_linear.py's ONE_ROW_PACKED_MIN_ELEMENTS.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_one_row_gemm.py
"""

import torch, time, statistics
torch.set_num_threads(1)
shapes = [(256,256),(256,768),(768,256),(256,2048),(576,192),(576,576),(576,1536),(1536,576),(1024,1024),(1024,2816),(2816,1024),(1024,4096),(4096,1024),(576,49152)]
def bench(fn, n):
    t0 = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t0) / n * 1e6
for i, o in shapes:
    w = torch.randn(o, i) * 0.02; b = None
    pk = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    x = torch.randn(1, i)
    n = max(20, int(2e8 / (i * o)))
    f1 = lambda: torch.nn.functional.linear(x, w)
    f2 = lambda: torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [], "")
    bench(f1, n); bench(f2, n)
    a, c = [], []
    for r in range(7):
        a.append(bench(f1, n)); c.append(bench(f2, n))
    a, c = statistics.median(a), statistics.median(c)
    print(f"in {i:5d} out {o:6d} ({i*o*4/2**20:6.2f} MiB): sgemm {a:8.1f} us  packed {c:8.1f} us  packed/sgemm {c/a:.2f}")

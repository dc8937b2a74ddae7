"""One-row linear: MKL sgemm (F.linear) against the oneDNN-prepacked weight (docs/BENCHMARKS.md, issue 13 caveat).

Run: .venv/bin/python scripts/bench_one_row_gemm.py (warm caches: a lower bound on the gap in real decoding)."""
import time, torch, statistics
from exspec.engine.packed_linear import PackedLinear
torch.manual_seed(0)
for (i, o) in [(1024, 4096), (4096, 1024)]:
    lin = torch.nn.Linear(i, o, bias=False)
    pk = PackedLinear(torch.nn.Linear(i, o, bias=False)); pk.weight = lin.weight
    x = torch.randn(1, 1, i)
    packed_w = pk._packed_weight()
    f_mkl = lambda: torch.nn.functional.linear(x, lin.weight)
    f_pk = lambda: torch.ops.mkldnn._linear_pointwise(x.reshape(1, i), packed_w, None, "none", [], "")
    res = {"mkl": [], "packed": []}
    with torch.inference_mode():
        for _ in range(5): f_mkl(); f_pk()
        for _ in range(15):
            for name, f in (("mkl", f_mkl), ("packed", f_pk)):
                t = time.perf_counter()
                for _ in range(50): f()
                res[name].append((time.perf_counter() - t) / 50 * 1e6)
    m, p = statistics.median(res["mkl"]), statistics.median(res["packed"])
    print(f"{i}x{o} one row: mkl {m:.0f} us, packed {p:.0f} us, packed/mkl {p/m:.2f}, threads {torch.get_num_threads()}")

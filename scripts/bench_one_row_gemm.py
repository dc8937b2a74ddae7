"""One-row linear: MKL sgemm (F.linear) against the oneDNN-prepacked weight, per weight shape (toy, SmolLM2, 350m
shapes), one thread, alternating, median of 7. Where the prepacked path starts to win sets
engine/packed_linear.py's ONE_ROW_PACKED_MIN_ELEMENTS.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_one_row_gemm.py
"""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(256, 256), (256, 768), (768, 256), (256, 2048), (576, 192), (576, 576), (576, 1536), (1536, 576),
          (1024, 1024), (1024, 2816), (2816, 1024), (1024, 4096), (4096, 1024), (576, 49152)]  # (in, out)


def bench(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    for n_in, n_out in SHAPES:
        w = torch.randn(n_out, n_in) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        x = torch.randn(1, n_in)
        n = max(20, int(2e8 / (n_in * n_out)))
        sgemm = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
        onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        bench(sgemm, n), bench(onednn, n)
        a, c = [], []
        for _ in range(7):
            a.append(bench(sgemm, n))
            c.append(bench(onednn, n))
        a, c = statistics.median(a), statistics.median(c)
        print(f"in {n_in:5d} out {n_out:6d} ({n_in * n_out * 4 / 2**20:6.2f} MiB): sgemm {a:8.1f} us  "
              f"packed {c:8.1f} us  packed/sgemm {c / a:.2f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()

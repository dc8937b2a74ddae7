"""Linear over few rows: F.linear (MKL sgemm) vs oneDNN-prepacked vs MKL-packed weights, interleaved, medians.

    .venv/bin/python scripts/bench_gemm_rows.py --shape 1536x6144 --threads 1 --rows 1,2,3,5,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1536x6144")  # in x out
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,5,8")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_in, n_out = (int(x) for x in args.shape.split("x"))
    w = torch.randn(n_out, n_in)
    rows = [int(r) for r in args.rows.split(",")]
    packed = torch.ops.mkldnn._reorder_linear_weight(w, max(rows))
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, max(rows))
    methods = {
        "mkl_sgemm": lambda x: torch.nn.functional.linear(x, w),
        "onednn_packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "mkl_packed": lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, max(rows)),
    }
    times = {(m, r): [] for m in methods for r in rows}
    with torch.inference_mode():
        for rep in range(args.repeats + 2):
            for r in rows:
                x = torch.randn(r, n_in)
                for m, f in methods.items():
                    t0 = time.perf_counter()
                    f(x)
                    if rep >= 2:
                        times[(m, r)].append((time.perf_counter() - t0) * 1000)
    print(f"shape {args.shape} threads {args.threads}: median ms")
    print("rows " + " ".join(f"{m:>14}" for m in methods))
    for r in rows:
        print(f"{r:>4} " + " ".join(f"{statistics.median(times[(m, r)]):>14.2f}" for m in methods))


if __name__ == "__main__":
    main()

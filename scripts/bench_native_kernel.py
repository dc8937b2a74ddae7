"""The CPU's attention choices for one forward's attention of B = 8 rows, attention alone, one thread: the `native`
backend's C kernel (engine/kernels/paged_attention_cpu.c) over rows whose blocks are consecutive ids and over rows whose
blocks interleave block by block (the worst case), against SDPA per row over a zero-copy view of consecutive blocks
(what `sdpa` does for rows of over 1024 keys, its best case) and SDPA over the scattered rows gathered into a kept
buffer (what it does when they interleave). Toy-target shapes (4 query heads, 2 kv heads, head_dim 64, blocks of 16),
kv_len 256 and 2048, 1 to 33 queries per row (decode, verifies, the short prefill chunks where the backend switches to
`sdpa`: MAX_KERNEL_QUERIES); median of 9 calls, ms. `--heads 9 --kv-heads 3` are SmolLM2-135M's shapes;
`--batch` and `--threads` set B and torch's (and the kernel's) threads.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python scripts/bench_native_kernel.py
    .venv/bin/python scripts/bench_native_kernel.py --heads 9 --kv-heads 3 --batch 1 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exspec.engine.kernels.native import paged_attention_cpu

SDPA = torch.nn.functional.scaled_dot_product_attention
D, BS = 64, 16
KV_LENS, Q_LENS = (256, 2048), (1, 5, 9, 17, 33)


def ms(fn, n: int = 9) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    B, H, KVH = a.batch, a.heads, a.kv_heads
    torch.set_num_threads(a.threads)
    print(f"B = {B}, {H} heads over {KVH} kv heads of {D}, {a.threads} thread(s)\n")
    print("| kv_len | Q | sdpa, view ms | sdpa, gathered ms | native, consecutive ms | native, scattered ms | "
          "native consecutive / sdpa view | native scattered / consecutive |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kv_len in KV_LENS:
        per_row = -(-kv_len // BS)
        blocks = 2 * B * per_row + 1
        keys, values = torch.randn(KVH, blocks, BS, D), torch.randn(KVH, blocks, BS, D)  # head-major, as KVPools
        k_pool, v_pool = keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)  # [blocks, block, kv_heads, D]
        consecutive = torch.tensor([[1 + b * per_row + i for i in range(per_row)] for b in range(B)], dtype=torch.int32)
        base = 1 + B * per_row
        scattered = torch.tensor([[base + i * B + b for i in range(per_row)] for b in range(B)], dtype=torch.int32)
        lens = torch.full((B,), kv_len, dtype=torch.int32)
        k_buf, v_buf = torch.empty(KVH, per_row, BS, D), torch.empty(KVH, per_row, BS, D)
        for q_len in Q_LENS:
            query = torch.randn(B, H, q_len, D)
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None] if q_len > 1 else None

            def view() -> None:
                for b in range(B):
                    s = int(consecutive[b, 0]) * BS
                    SDPA(query[b : b + 1], keys.view(KVH, -1, D)[None, :, s : s + kv_len],
                         values.view(KVH, -1, D)[None, :, s : s + kv_len], attn_mask=mask, enable_gqa=True)

            def gathered() -> None:
                for b in range(B):
                    torch.index_select(keys, 1, scattered[b], out=k_buf)
                    torch.index_select(values, 1, scattered[b], out=v_buf)
                    SDPA(query[b : b + 1], k_buf.view(1, KVH, -1, D), v_buf.view(1, KVH, -1, D), attn_mask=mask,
                         enable_gqa=True)

            def native(tables: torch.Tensor):
                return lambda: paged_attention_cpu(query, k_pool, v_pool, tables, lens, D**-0.5)

            v, g, c, s = ms(view), ms(gathered), ms(native(consecutive)), ms(native(scattered))
            print(f"| {kv_len} | {q_len} | {v:.2f} | {g:.2f} | {c:.2f} | {s:.2f} | {c / v:.2f}x | {s / c:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()

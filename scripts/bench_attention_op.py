"""One layer's attention at B rows over the slot pool, isolated: consecutive view (one SDPA), gathered
copy + one SDPA (the "gather" reference at scattered slots), per-row SDPA over pool views ("pool").
Interleaved, medians. `.venv/bin/python scripts/bench_attention_op.py --threads 1`"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-lens", default="256,2048")
    ap.add_argument("--q-lens", default="1,5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, h, hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
    kv_lens = [int(x) for x in args.kv_lens.split(",")]
    q_lens = [int(x) for x in args.q_lens.split(",")]
    pool_len = max(kv_lens) + 8
    k_pool = torch.randn(2 * b, hk, pool_len, d)
    v_pool = torch.randn(2 * b, hk, pool_len, d)
    consec = torch.arange(b)
    scattered = torch.arange(0, 2 * b, 2)

    def mask_for(q, kv):
        pos = torch.arange(kv - q, kv)[:, None]
        return (torch.arange(kv)[None, :] <= pos)[None, None]  # [1, 1, Q, kv]

    def view_one(q, kv):
        m = mask_for(q.shape[2], kv) if q.shape[2] > 1 else None
        return F.scaled_dot_product_attention(q, k_pool[:b, :, :kv], v_pool[:b, :, :kv], attn_mask=m, enable_gqa=True)

    def gather(q, kv):
        m = mask_for(q.shape[2], kv)
        k = k_pool[:, :, :kv].index_select(0, scattered)
        v = v_pool[:, :, :kv].index_select(0, scattered)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    def per_row(q, kv):
        m = mask_for(q.shape[2], kv) if q.shape[2] > 1 else None
        out = q.new_empty(b, q.shape[2], h, d)
        for r, s in enumerate(scattered.tolist()):
            o = F.scaled_dot_product_attention(
                q[r : r + 1], k_pool[s : s + 1, :, :kv], v_pool[s : s + 1, :, :kv], attn_mask=m, enable_gqa=True
            )
            out[r : r + 1] = o.transpose(1, 2)
        return out

    methods = {"consecutive_view": view_one, "scattered_gather": gather, "scattered_per_row": per_row}
    times = {}
    with torch.inference_mode():
        for rep in range(args.repeats + 3):
            for kv in kv_lens:
                for ql in q_lens:
                    q = torch.randn(b, h, ql, d)
                    for name, f in methods.items():
                        t0 = time.perf_counter()
                        f(q, kv)
                        if rep >= 3:
                            times.setdefault((kv, ql, name), []).append((time.perf_counter() - t0) * 1e3)
    print(f"B={b} heads={h}/{hk} head_dim={d} threads={args.threads}: median ms per layer")
    print(f"{'kv':>5} {'q':>2} " + " ".join(f"{m:>18}" for m in methods))
    for kv in kv_lens:
        for ql in q_lens:
            print(f"{kv:>5} {ql:>2} " + " ".join(f"{statistics.median(times[(kv, ql, m)]):>18.3f}" for m in methods))


if __name__ == "__main__":
    main()

"""What the CPU `sdpa` backend's choices cost, attention alone, one thread (engine/backends/sdpa.py): one row's keys
read as a zero-copy strided view, gathered into a fresh tensor, or gathered into a kept buffer; and 8 rows of one
length attended by 8 calls over views against one gather of all rows plus one call; and 8 rows of unequal lengths,
the same two ways, the batched call under a per-row mask (what sets BATCHED_MIN_FILL). Demo-target shapes (4 query
heads, 2 KV heads, head_dim 64, blocks of 16), median of 7.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_gather_sdpa.py
"""

from __future__ import annotations

import statistics
import time

import torch

F = torch.nn.functional.scaled_dot_product_attention
H, KVH, HD, BS = 4, 2, 64, 16


def bench(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def one_row() -> None:
    for L in (256, 2048):
        for Q in (1, 5):
            nb = L // BS
            blocks = torch.randn(nb, BS, KVH, HD)  # one row's blocks, contiguous
            q = torch.randn(1, H, Q, HD)
            mask = torch.ones(1, 1, Q, L, dtype=torch.bool) if Q > 1 else None
            view = blocks.view(L, KVH, HD).transpose(0, 1)[None]  # [1, kv_heads, L, head_dim]
            ids = torch.arange(nb)
            buf = torch.empty(nb, BS, KVH, HD)

            def fresh():
                k = torch.index_select(blocks, 0, ids).view(L, KVH, HD).transpose(0, 1)[None]
                v = torch.index_select(blocks, 0, ids).view(L, KVH, HD).transpose(0, 1)[None]
                return F(q, k, v, attn_mask=mask, enable_gqa=True)

            def kept():
                torch.index_select(blocks, 0, ids, out=buf)
                k = buf.view(L, KVH, HD).transpose(0, 1)[None]
                return F(q, k, k, attn_mask=mask, enable_gqa=True)

            a = bench(lambda: F(q, view, view, attn_mask=mask, enable_gqa=True))
            print(f"one row, {L} keys, Q = {Q}: view {a:.1f} us, K and V gathered fresh {bench(fresh):.1f} us, "
                  f"K gathered into a kept buffer {bench(kept):.1f} us")


def rows_against_batched(lens: list[int], Q: int) -> tuple[float, float]:
    """Microseconds of attention over rows holding `lens` keys (Q queries each): one SDPA call per row over a view
    of its blocks, against one gather of every row's blocks into a kept buffer and one call, masked per row where
    the lengths differ (one causal mask, or none for Q = 1, where they are all equal)."""
    B, L = len(lens), max(lens)
    nb = -(-L // BS)
    pool = torch.randn(B * nb + 1, BS, KVH, HD)
    flat = pool.view(-1, KVH, HD)
    q = torch.randn(B, H, Q, HD)
    if len(set(lens)) == 1:
        mask = torch.ones(1, 1, Q, L, dtype=torch.bool).tril(L - Q) if Q > 1 else None  # [1, 1, Q, L]
    else:
        pos = torch.tensor(lens)[:, None] - Q + torch.arange(Q)  # [B, Q]: each query's position
        mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Q, L]

    def rows():
        out = q.new_empty(B, Q, H, HD)
        for b in range(B):
            s = (1 + b * nb) * BS
            k = flat[s : s + lens[b]].transpose(0, 1)[None]
            m = None if Q == 1 else mask[b if mask.shape[0] > 1 else 0][None, :, :, : lens[b]]  # [1, 1, Q, lens[b]]
            out[b] = F(q[b : b + 1], k, k, attn_mask=m, enable_gqa=True)[0].transpose(0, 1)
        return out

    ids = torch.tensor([[1 + b * nb + i for i in range(nb)] for b in range(B)]).reshape(-1)
    buf = torch.empty(B * nb, BS, KVH, HD)

    def batched():
        torch.index_select(pool, 0, ids, out=buf)
        k = buf.view(B, nb * BS, KVH, HD)[:, :L].transpose(1, 2)
        return F(q, k, k, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    return bench(rows), bench(batched)


def eight_rows() -> None:
    for L in (128, 384, 1024):
        for Q in (1, 5):
            a, c = rows_against_batched([L] * 8, Q)
            print(f"8 rows, {L} keys, Q = {Q}: 8 calls over views {a:.1f} us, one gather + one call {c:.1f} us "
                  f"({c / a:.2f}x)")


def unequal_rows() -> None:
    B = 8
    for shortest, spread in ((128, 40), (300, 50), (300, 300), (800, 100)):
        for Q in (1, 5):
            lens = [shortest + spread * b // (B - 1) for b in range(B)]  # keys each row holds
            a, c = rows_against_batched(lens, Q)
            fill = sum(lens) / (B * max(lens))
            print(f"8 rows, {lens[0]} to {lens[-1]} keys (fill {fill:.2f}), Q = {Q}: 8 calls over views {a:.1f} us, "
                  f"one gather + one masked call {c:.1f} us ({c / a:.2f}x)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    with torch.inference_mode():
        one_row()
        eight_rows()
        unequal_rows()

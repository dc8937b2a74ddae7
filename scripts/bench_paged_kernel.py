"""Time the Triton paged-attention kernel (engine/kernels/paged_attention.py) on CUDA against two PyTorch baselines,
for one layer's attention at decode (Q = 1) and verify (Q = k + 1) shapes over B rows of kv keys each.

    python scripts/bench_paged_kernel.py                       # an 8B-shaped layer (32 heads, 8 kv heads, 128), bf16
    python scripts/bench_paged_kernel.py --heads 32 --kv-heads 8 --head-dim 64 --dtype float16 --json out.json

Columns (median of --repeats timed launches each, interleaved per shape, CUDA events):
- `triton`: `paged_attention` over scattered, shuffled blocks (as a long-running server holds them).
- `gather+sdpa`: what the `gather` backend does: copy each row's keys/values out of the blocks into a dense
  [B, kv_heads, kv, head_dim] tensor, then one `scaled_dot_product_attention` (GQA, bottom-right causal mask for Q > 1).
- `reference`: `paged_attention_reference` (dense fp32 gather and softmax), only where it fits (B x kv <= 65536).
- `GB/s`: K and V bytes the kernel must read (B x kv x kv_heads x head_dim x 2 x element size) over its time; an
  H100's HBM3 peaks near 3350 GB/s, so decode at large B x kv should approach it.
- `max|diff|`: the kernel against gather+sdpa, as a sanity check.

It needs a CUDA GPU and cannot run on a CPU-only machine (the interpreter times nothing useful): without CUDA it says
so and exits with status 2. Nothing here was measured when it was written (no GPU was at hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _scattered_tables(batch: int, blocks_per_row: int, gen: torch.Generator) -> torch.Tensor:
    """[B, blocks_per_row] int32: every row's blocks drawn from one shuffled pool of B x blocks_per_row blocks."""
    ids = torch.randperm(batch * blocks_per_row, generator=gen) + 1  # block 0 is the null block
    return ids.view(batch, blocks_per_row).to(torch.int32)


def _time_ms(fn, repeats: int) -> list[float]:
    """Per-launch times of fn, one CUDA event pair each."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench_shape(args, batch: int, kv_len: int, q_len: int) -> dict:
    from exspec.engine.kernels import paged_attention, paged_attention_reference

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(batch * 100003 + kv_len * 7 + q_len)
    blocks_per_row = -(-kv_len // args.block_size)
    tables = _scattered_tables(batch, blocks_per_row, gen).to(dev)  # [B, blocks_per_row]
    cache_shape = (batch * blocks_per_row + 1, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(cache_shape, device=dev, dtype=dtype)  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_cache = torch.randn(cache_shape, device=dev, dtype=dtype)
    query = torch.randn(batch, q_len, args.heads, args.head_dim, device=dev, dtype=dtype).transpose(1, 2)  # [B, H, Q, D]
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)  # [B]
    scale = args.head_dim**-0.5
    out = torch.empty(batch, q_len, args.heads, args.head_dim, device=dev, dtype=dtype)  # [B, Q, H, D]

    j = torch.arange(kv_len, device=dev)
    slots = (tables.long()[:, j // args.block_size] * args.block_size + j % args.block_size).view(-1)  # [B * kv]
    pos = torch.arange(kv_len - q_len, kv_len, device=dev)  # [Q]
    mask = (j[None, :] <= pos[:, None])[None, None] if q_len > 1 else None  # [1, 1, Q, kv]

    def triton_fn():
        return paged_attention(query, k_cache, v_cache, tables, seq_lens, scale, out=out)

    def gather_fn():
        flat_k = k_cache.view(-1, args.kv_heads, args.head_dim)
        flat_v = v_cache.view(-1, args.kv_heads, args.head_dim)
        keys = flat_k.index_select(0, slots).view(batch, kv_len, args.kv_heads, args.head_dim).transpose(1, 2)
        values = flat_v.index_select(0, slots).view(batch, kv_len, args.kv_heads, args.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)  # [B, Q, H, D]

    def reference_fn():
        return paged_attention_reference(query, k_cache, v_cache, tables, seq_lens, scale)

    fns = {"triton": triton_fn, "gather+sdpa": gather_fn}
    if batch * kv_len <= 65536:
        fns["reference"] = reference_fn
    for fn in fns.values():  # warm-up (and the kernel's compilation)
        fn()
    torch.cuda.synchronize()
    diff = (triton_fn().float() - gather_fn().float()).abs().max().item()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: each round times every method
        for name, fn in fns.items():
            samples[name] += _time_ms(fn, args.repeats)
    ms = {name: statistics.median(values) for name, values in samples.items()}
    kv_bytes = batch * kv_len * args.kv_heads * args.head_dim * 2 * k_cache.element_size()
    return dict(
        batch=batch,
        kv_len=kv_len,
        q_len=q_len,
        ms=ms,
        triton_gb_s=kv_bytes / (ms["triton"] * 1e-3) / 1e9,
        speedup_vs_gather=ms["gather+sdpa"] / ms["triton"],
        max_abs_diff=diff,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=_ints, default=_ints("1,2,4,8,16,32,64"))
    ap.add_argument("--kv-lens", type=_ints, default=_ints("256,1024,2048,4096,8192"))
    ap.add_argument("--q-lens", type=_ints, default=_ints("1,5"), help="1: a draft / decode step; k + 1: the verify")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20, help="timed launches per method per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_paged_kernel: needs a CUDA GPU (this machine has none); nothing measured.", file=sys.stderr)
        return 2
    from exspec.engine.kernels import available

    if not available():
        print("bench_paged_kernel: triton is not importable here; nothing measured.", file=sys.stderr)
        return 2

    import triton

    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; {args.dtype}, "
        f"heads {args.heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, block_size {args.block_size}\n"
    )
    print("| Q | B | kv | triton ms | gather+sdpa ms | reference ms | gather / triton | triton GB/s | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for q_len in args.q_lens:
        for kv_len in args.kv_lens:
            for batch in args.batch_sizes:
                r = bench_shape(args, batch, kv_len, q_len)
                rows.append(r)
                ref = f"{r['ms']['reference']:.3f}" if "reference" in r["ms"] else "-"
                print(
                    f"| {q_len} | {batch} | {kv_len} | {r['ms']['triton']:.3f} | {r['ms']['gather+sdpa']:.3f} | {ref} | "
                    f"{r['speedup_vs_gather']:.2f}x | {r['triton_gb_s']:.0f} | {r['max_abs_diff']:.1e} |",
                    flush=True,
                )
                torch.cuda.empty_cache()
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, **vars(args))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

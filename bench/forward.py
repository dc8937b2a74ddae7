"""`exspec bench --mode forward`: the time of one target forward through the engine's forward primitive.

For every (batch size B, kv_len, q_len in {1, k + 1}) it times `ModelRunner.extend(tokens [B, q_len],
starts=[kv_len] * B, slots)` with two KV block layouts of one paged pool:
- consecutive: each row's blocks are consecutive block ids, rows one after another (as for prompts admitted
  into a fresh pool: a strided view reads a row),
- scattered: the rows' blocks interleaved, block i of row b at id i * B + b + 1 (as after rows grew a block at
  a time side by side, or after admissions and departures: a row must be gathered). At B = 1 both are
  consecutive, so the two should match.

The keys at positions 0..kv_len-1 are whatever the pool holds (zeros): attention reads kv_len keys either
way, and the values do not change the time. Timing: layouts interleaved within each repeat (A B A B), the
device synchronised around each forward, the median of `repeats` forwards after `warmup` untimed ones.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from exspec.engine.kv_cache import BlockManager
from exspec.engine.runner import ModelRunner

LAYOUTS = ("consecutive", "scattered")


@dataclass(frozen=True)
class ForwardPoint:
    batch_size: int
    kv_len: int  # keys already in each row's slot before the forward
    q_len: int  # query tokens per row: 1 (plain decode, draft step) or k + 1 (verify)


def slot_layout(layout: str, batch_size: int) -> list[int]:
    """Slots (block table rows) of one batch among 2 * batch_size: "consecutive" rows 0..B-1, "scattered" B..2B-1."""
    first = 0 if layout == "consecutive" else batch_size
    return list(range(first, first + batch_size))


def block_layouts(batch_size: int, positions: int, block_size: int, device: torch.device) -> BlockManager:
    """A pool holding both layouts' rows, each row's blocks for `positions`: consecutive ids per row for the
    "consecutive" slots, ids interleaved across rows (one block per row in turn) for the "scattered" slots."""
    per_row = -(-positions // block_size)
    blocks = BlockManager(2 * batch_size * per_row, block_size, 2 * batch_size, per_row, device)
    for b, slot in enumerate(slot_layout("consecutive", batch_size)):  # row b: ids b * per_row + 1, + 2, ...
        blocks.assign(slot, [1 + b * per_row + i for i in range(per_row)])
    base = 1 + batch_size * per_row
    for b, slot in enumerate(slot_layout("scattered", batch_size)):  # block i of row b: base + i * B + b
        blocks.assign(slot, [base + i * batch_size + b for i in range(per_row)])
    return blocks


def forward_points(batch_sizes: tuple[int, ...], kv_lens: tuple[int, ...], k: int) -> list[ForwardPoint]:
    return [ForwardPoint(b, kv, q) for b in batch_sizes for kv in kv_lens for q in sorted({1, k + 1})]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(model: torch.nn.Module, vocab_size: int, points: list[ForwardPoint], repeats: int = 5,
                  warmup: int = 1, seed: int = 0, progress: bool = False, attention: str = "auto",
                  block_size: int = 16) -> list[dict]:
    """One row per (point, layout): {batch_size, kv_len, q_len, slots, forward_ms (the median),
    forward_ms_min, forward_ms_repeats}.
    One pool per batch size, sized for the longest kv_len + q_len, reused across that batch size's points."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    rows = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points) * (warmup + repeats), unit="repeat", desc="forward", dynamic_ncols=True)
    for b in sorted({p.batch_size for p in points}):
        at_b = [p for p in points if p.batch_size == b]
        max_len = max(p.kv_len + p.q_len for p in at_b)
        blocks = block_layouts(b, max_len, block_size, device)
        runner = ModelRunner(model, blocks, vocab_size=vocab_size, attention=attention)
        for p in at_b:
            tokens = torch.randint(0, vocab_size, (b, p.q_len), generator=gen).to(device)  # [B, Q] long
            starts = [p.kv_len] * b
            seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
            for i in range(warmup + repeats):
                for layout in LAYOUTS:
                    slots = slot_layout(layout, b)
                    _sync(device)
                    t0 = time.perf_counter()
                    runner.extend(tokens, starts, slots)
                    _sync(device)
                    if i >= warmup:
                        seconds[layout].append(time.perf_counter() - t0)
                if bar is not None:
                    bar.update(1)
            for layout in LAYOUTS:
                ms = [s * 1000.0 for s in seconds[layout]]
                rows.append({"batch_size": b, "kv_len": p.kv_len, "q_len": p.q_len, "slots": layout,
                             "forward_ms": statistics.median(ms), "forward_ms_min": min(ms), "forward_ms_repeats": ms})
        del runner, blocks  # free this batch size's pool before the next one's
    if bar is not None:
        bar.close()
    return rows


def forward_markdown(rows: list[dict], meta: dict) -> str:
    """One line per (B, kv_len, q_len): both layouts' median and the ratio scattered / consecutive, then the
    same for the fastest repeat (on a shared machine the minimum is the least disturbed estimate)."""
    lines = [f"# {meta.get('title', 'exspec bench --mode forward')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "title"]
    lines += ["", "| B | kv_len | q_len | consecutive ms | scattered ms | scattered / consecutive "
                  "| min consecutive ms | min scattered ms | ratio of minima |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {(r["batch_size"], r["kv_len"], r["q_len"], r["slots"]): r for r in rows}
    for key in dict.fromkeys((r["batch_size"], r["kv_len"], r["q_len"]) for r in rows):
        c, s = by[(*key, "consecutive")], by[(*key, "scattered")]
        cells = []
        for field in ("forward_ms", "forward_ms_min"):
            a, b = c.get(field, c["forward_ms"]), s.get(field, s["forward_ms"])
            cells += [f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}x" if a else "–"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

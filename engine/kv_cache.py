"""Paged per-sequence KV: fixed-size blocks, one block allocator for the target/draft pair, a device block table.

Each model owns, per layer, a key pool and a value pool of shape [num_blocks + 1, block_size, kv_heads,
head_dim] (a view of head-major storage [kv_heads, num_blocks + 1, block_size, head_dim]: `KVPools`). A sequence
owns block ids; its K/V for position p lives at
`block_table[slot, p // block_size] * block_size + p % block_size` of the pool seen as
[(num_blocks + 1) * block_size, kv_heads, head_dim], in both models' pools (the same ids). Block 0 is the
*null block*: never handed out; writes of padding columns past the blocks a row owns land there, and what
is read from it is always masked out.

A sequence gets the blocks for its prompt at admission and more at the start of each step (for the
positions the step may write); it returns them when freed. Its K/V never move: rolling back rejected
drafts is "do not advance the length". The block table is a device tensor [max_num_seqs, max_blocks_per_seq]
int32, one row per sequence metadata row ("slot"), updated in place for the new entries only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from exspec.errors import CapacityError, ModelLoadError

NULL_BLOCK = 0


class SlotAllocator:
    """O(1) bookkeeping of which sequence metadata rows ("slots": token buffer, sampling parameters, block
    table row) are in use."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out low indices first

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.num_slots} KV slots are in use; free a sequence or raise max_num_seqs")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class BlockManager:
    """Block ids 1..num_blocks for both models' pools, and the device block table.

    Placement keeps each sequence's blocks consecutive ids while the pool has room (CPU attention then reads
    them as one strided view instead of gathering them), without reserving any: the free blocks are kept as
    runs (maximal ranges of free ids). A sequence's first blocks go into the largest run, at its start when no
    sequence ends right before it, else at its middle, leaving the sequence on its left room to grow; growth
    takes the block right after the sequence's last one while it is free, else the end of the largest run (the
    sequence is no longer contiguous). Every free block stays usable by any sequence. The largest run comes
    from a max-heap with lazy entries: O(log n) amortized per allocation or freed run, no scan of the pool.
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = torch.zeros(num_slots, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._num_free = num_blocks
        self._run_end: dict[int, int] = {}  # first id of each free run -> its last id
        self._run_start: dict[int, int] = {}  # last id of each free run -> its first id
        # Max-heap of runs as (-length, last id). A run's entries claim at least its length (a run that shrinks
        # keeps its last id and entry; a new or merged run gets a new entry); entries of gone runs are dropped
        # when they reach the top.
        self._heap: list[tuple[int, int]] = []
        self._tails: set[int] = set()  # last block of each contiguous sequence that may still grow
        self._blocks: list[list[int]] = [[] for _ in range(num_slots)]  # host mirror of each table row
        self._contiguous = [True] * num_slots  # slot's blocks are consecutive ids
        if num_blocks > 0:
            self._add_run(1, num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def held(self, slot: int) -> int:
        return len(self._blocks[slot])

    def blocks_for(self, length: int) -> int:
        """Blocks that hold positions [0, length)."""
        return -(-length // self.block_size)

    def first_contiguous_block(self, slot: int, length: int) -> int:
        """The slot's first block id if its blocks are consecutive ids and hold positions [0, length) (one
        strided view then reads them), else -1."""
        blocks = self._blocks[slot]
        ok = self._contiguous[slot] and len(blocks) * self.block_size >= length > 0
        return blocks[0] if ok else -1

    def blocks(self, slot: int) -> list[int]:
        return self._blocks[slot]

    def free_runs(self) -> list[tuple[int, int]]:
        """The free blocks as sorted (first id, last id) runs (for tests and diagnostics: O(runs))."""
        return sorted(self._run_end.items())

    def grow(self, wants: list[tuple[int, int]]) -> None:
        """Give each (slot, blocks it must hold) its missing blocks, all or nothing: CapacityError before any
        change when the free blocks do not cover them all. One device write for the new table entries."""
        too_many = [n for _, n in wants if n > self.max_blocks_per_seq]
        if too_many:
            raise CapacityError(f"{too_many[0]} blocks asked for one sequence, at most {self.max_blocks_per_seq}")
        need = sum(max(0, n - len(self._blocks[s])) for s, n in wants)
        if need > self._num_free:
            raise CapacityError(f"{need} KV blocks needed, {self._num_free} of {self.num_blocks} free")
        rows, cols, ids = [], [], []
        for slot, n in wants:
            have = self._blocks[slot]
            if len(have) >= n:
                continue
            before = len(have)
            self._tails.discard(have[-1] if have else NULL_BLOCK)
            self._place(slot, have, n)
            if self._contiguous[slot] and n < self.max_blocks_per_seq:
                self._tails.add(have[-1])
            rows += [slot] * (n - before)
            cols += range(before, n)
            ids += have[before:]
        if ids:
            dev = self.block_table.device
            self.block_table[_to(rows, dev), _to(cols, dev)] = _to(ids, dev, torch.int32)

    def assign(self, slot: int, ids: list[int]) -> None:
        """Give an empty slot exactly these free block ids, in order: for benchmarks and tests that need a given
        layout (e.g. rows whose blocks interleave), not for serving (O(free runs) per id)."""
        if self._blocks[slot]:
            raise ValueError(f"slot {slot} already holds blocks")
        if len(ids) > self.max_blocks_per_seq or len(set(ids)) != len(ids):
            raise CapacityError(f"{len(ids)} blocks (distinct, at most {self.max_blocks_per_seq}) for one sequence")
        taken = [b for b in ids if not any(s <= b <= e for s, e in self._run_end.items())]
        if taken:  # all or nothing, as grow
            raise CapacityError(f"block {taken[0]} is not free")
        for b in ids:
            self._carve(*next((s, e) for s, e in self._run_end.items() if s <= b <= e), b, b)
        self._blocks[slot] = list(ids)
        self._contiguous[slot] = all(b == a + 1 for a, b in zip(ids, ids[1:]))
        if ids and self._contiguous[slot] and len(ids) < self.max_blocks_per_seq:
            self._tails.add(ids[-1])
        if ids:
            dev = self.block_table.device
            self.block_table[slot, : len(ids)] = _to(ids, dev, torch.int32)

    def free(self, slot: int) -> None:
        """Return the slot's blocks (merged into the free runs); its table row goes back to the null block."""
        blocks = self._blocks[slot]
        if blocks:
            # fill_, not `= NULL_BLOCK` (which wraps the number in a CPU tensor and reads it back: an aten::item)
            self.block_table[slot, : len(blocks)].fill_(NULL_BLOCK)
            self._tails.discard(blocks[-1])
            ordered = blocks if self._contiguous[slot] else sorted(blocks)
            first = prev = ordered[0]
            for b in ordered[1:]:
                if b != prev + 1:
                    self._release(first, prev)
                    first = b
                prev = b
            self._release(first, prev)
        self._num_free += len(blocks)
        self._blocks[slot] = []
        self._contiguous[slot] = True

    # ------------------------------------------------------------------ free runs

    def _place(self, slot: int, have: list[int], n: int) -> None:
        """Append ids to `have` until it holds n (the free blocks are known to cover them)."""
        if not have:
            start, end = self._largest()
            length = end - start + 1
            if length >= n:  # the sequence's first blocks, in one run
                at = start if start - 1 not in self._tails else start + (length - n + 1) // 2
                self._carve(start, end, at, at + n - 1)
                have.extend(range(at, at + n))
                return
        elif have[-1] + 1 in self._run_end:  # grow in place
            start = have[-1] + 1
            take = min(n - len(have), self._run_end[start] - start + 1)
            self._carve(start, self._run_end[start], start, start + take - 1)
            have.extend(range(start, start + take))
        if len(have) < n:
            self._contiguous[slot] = False
        while len(have) < n:  # the end of the largest run: the run's left neighbour keeps its room longest
            start, end = self._largest()
            take = min(n - len(have), end - start + 1)
            self._carve(start, end, end - take + 1, end)
            have.extend(range(end - take + 1, end + 1))

    def _largest(self) -> tuple[int, int]:
        """(first id, last id) of the largest free run (ties: the lowest ids); there must be one."""
        heap = self._heap
        while True:
            claim, end = heap[0]
            start = self._run_start.get(end)
            if start is None:
                heapq.heappop(heap)  # the run is gone
                continue
            length = end - start + 1
            if length == -claim:
                return start, end
            if length < -claim:
                heapq.heapreplace(heap, (-length, end))  # the run shrank from its left
            else:
                heapq.heappop(heap)  # a merged run's older entry: the merged run has its own

    def _carve(self, start: int, end: int, first: int, last: int) -> None:
        """Take [first, last] out of the free run [start, end]."""
        del self._run_end[start], self._run_start[end]
        if last < end:
            self._add_run(last + 1, end, push=False)  # same last id: the run's entry still claims enough
        if start < first:
            self._add_run(start, first - 1)
        self._num_free -= last - first + 1

    def _release(self, first: int, last: int) -> None:
        """Return [first, last] to the free runs, merged with the runs on either side (num_free is the caller's)."""
        start = self._run_start.pop(first - 1, None)
        if start is not None:
            del self._run_end[start]
            first = start
        end = self._run_end.pop(last + 1, None)
        if end is not None:
            del self._run_start[end]
            last = end
        self._add_run(first, last)

    def _add_run(self, first: int, last: int, push: bool = True) -> None:
        self._run_end[first] = last
        self._run_start[last] = first
        if push:
            heapq.heappush(self._heap, (first - last - 1, last))
            if len(self._heap) > 4 * len(self._run_end) + 64:  # drop dead entries: amortized O(1) per push
                self._heap = [(s - e - 1, e) for s, e in self._run_end.items()]
                heapq.heapify(self._heap)


def _to(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class ForwardMeta:
    """Where one forward writes and what its attention reads: built once per forward from device tensors,
    shared by every layer (and handed to the attention backend's plan)."""

    slot_mapping: torch.Tensor  # [B * Q] long: pool row (block * block_size + offset) each new K/V lands at
    block_tables: torch.Tensor  # [B, n_blocks] int32: physical block of each logical block [0, n_blocks) per row
    seq_lens: torch.Tensor  # [B] int32: keys each row holds once this forward's K/V are written (start + Q)
    mask: torch.Tensor | None  # [1 or B, 1, Q, kv_len] bool: query may see key (None: the backend needs none)
    kv_len: int  # max(seq_lens), host
    q_len: int
    starts: tuple[int, ...]  # [B] host: position of each row's first query
    first_blocks: tuple[int, ...]  # [B] host: each row's first block when its blocks are contiguous, else -1
    window: int | None  # sliding window, or None


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model's K/V, from its config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class KVPools:
    """One model's block pools, allocated up front and alive as long as the engine: per layer a key and a value
    pool [num_blocks + 1, block_size, kv_heads, head_dim]. Not a transformers `Cache`: the model runs without
    one, and exspec's attention entry point (engine/attention.py) writes each layer's K/V here through the
    forward's `ForwardMeta.slot_mapping`, which it receives with the forward's arguments (no state set on the
    pools between forwards)."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        layers, kv_heads, head_dim = kv_shape(config)
        # Stored head-major, [kv_heads, num_blocks + 1, block_size, head_dim], and seen as [num_blocks + 1,
        # block_size, kv_heads, head_dim] (a permuted view: every user indexes blocks and tokens the same way, and
        # the pool still flattens to [(num_blocks + 1) * block_size, kv_heads, head_dim] without a copy). So one
        # head's keys over a run of blocks are one contiguous stretch of memory: a decode row's SDPA over its
        # view streams them. Token-major storage interleaved the heads, and on the CPU (K/V read from memory, not
        # cache) one-query SDPA calls took 1.17x as long (46.7 us against 39.9; toy target, ~190 keys; BENCHMARKS.md
        # section 3). The Triton kernel reads any strides.
        store = (kv_heads, num_blocks + 1, block_size, head_dim)
        self.keys = [torch.zeros(store, dtype=dtype, device=device).permute(1, 2, 0, 3) for _ in range(layers)]
        self.values = [torch.zeros(store, dtype=dtype, device=device).permute(1, 2, 0, 3) for _ in range(layers)]
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        layers, kv_heads, head_dim = kv_shape(config)
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new K/V at their pool rows; return the layer's pools (no copy).

        key_states, value_states: [B, kv_heads, Q, head_dim]; slot_mapping: [B * Q] long.
        returns: (keys, values) [num_blocks + 1, block_size, kv_heads, head_dim]
        """
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        batch, kv_heads, q_len, head_dim = key_states.shape
        if kv_heads != k_pool.shape[2] or head_dim != k_pool.shape[3]:
            raise ModelLoadError(f"layer {layer_idx} K/V shape {tuple(key_states.shape)} does not match the config's "
                                 f"(kv_heads {k_pool.shape[2]}, head_dim {k_pool.shape[3]})")
        rows = k_pool.view(-1, kv_heads, head_dim)  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
        rows.index_copy_(0, slot_mapping, key_states.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(k_pool.dtype))
        v_pool.view(-1, kv_heads, head_dim).index_copy_(
            0, slot_mapping, value_states.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(v_pool.dtype)
        )
        return k_pool, v_pool


def gather_kv(pool: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
    """Each row's keys (or values) [0, kv_len) copied out of the blocks: [B, kv_heads, kv_len, head_dim].
    pool: [num_blocks + 1, block_size, kv_heads, head_dim]."""
    batch, n_blocks = meta.block_tables.shape
    _, block_size, kv_heads, head_dim = pool.shape
    rows = pool.index_select(0, meta.block_tables.reshape(-1))  # [B * n_blocks, block_size, kv_heads, head_dim]
    rows = rows.view(batch, n_blocks * block_size, kv_heads, head_dim)[:, : meta.kv_len]
    return rows.transpose(1, 2)  # [B, kv_heads, kv_len, head_dim]


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pools now: CUDA's free memory on the device, else the host's MemAvailable
    (physical pages times a quarter when /proc/meminfo cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import os  # pragma: no cover

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4  # pragma: no cover

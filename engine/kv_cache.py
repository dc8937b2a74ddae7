"""Per-sequence KV caches in preallocated, position-indexed slot pools.

Each model owns one pool per layer: keys and values of shape [num_slots, kv_heads, max_len, head_dim].
A sequence owns one slot (the same index in the target's and the draft's pool). Its K/V for token
position p is written at index p of its slot and never moves: rolling back rejected draft tokens is
"do not advance the length", admitting a sequence is taking a free slot index, freeing it is giving
the index back. Nothing is ever copied, padded or realigned between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from exspec.errors import CapacityError


class SlotAllocator:
    """O(1) bookkeeping of which slot indices are in use."""

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


@dataclass
class ForwardView:
    """Where one forward reads and writes in the pool. Set on the cache before each forward."""

    slots: torch.Tensor  # [B] long: slot of each batch row
    positions: torch.Tensor  # [B, Q] long: position of each query token (its K/V lands there)
    kv_len: int  # keys 0..kv_len-1 of each row are returned to attention ("gather" backend)
    slot_range: tuple[int, int] | None  # (first, last + 1) when slots are consecutive: a view, no gather
    read_pool: bool = False  # attention reads the pools in place (engine/attention_pool.py): return them whole
    write_index: tuple[int, torch.Tensor] | None = None  # (kv_heads, [B * kv_heads * Q]): built at the first layer


class _PoolLayer(CacheLayerMixin):
    """A layer marker so transformers' mask helpers see a full-attention layer."""

    is_sliding = False
    is_compileable = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - SlotKVCache.update is used
        raise NotImplementedError

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # pragma: no cover
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class SlotKVCache(Cache):
    """A transformers `Cache` over the slot pool. The pool tensors are allocated at the first forward
    (from the model's own K/V shapes, so any architecture works) and live as long as the engine."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int) -> None:
        super().__init__(layers=[_PoolLayer() for _ in range(num_layers)])
        self.num_slots = num_slots
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []  # per layer: [num_slots, kv_heads, max_len, head_dim]
        self.values: list[torch.Tensor] = []  # per layer: [num_slots, kv_heads, max_len, head_dim]
        self.view: ForwardView | None = None

    def _allocate(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, kv_heads, _, head_dim = key_states.shape
        v_dim = value_states.shape[-1]
        shape_k = (self.num_slots, kv_heads, self.max_len, head_dim)
        shape_v = (self.num_slots, kv_heads, self.max_len, v_dim)
        try:
            self.keys.append(torch.zeros(shape_k, dtype=key_states.dtype, device=key_states.device))
            self.values.append(torch.zeros(shape_v, dtype=value_states.dtype, device=value_states.device))
        except torch.OutOfMemoryError as e:  # pragma: no cover - depends on the device
            raise CapacityError(
                f"cannot allocate the KV pool for layer {layer_idx} ({shape_k} x2): lower max_num_seqs or max_model_len"
            ) from e

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write this forward's K/V at their positions; return what attention reads.

        key_states, value_states: [B, kv_heads, Q, head_dim]
        returns: with view.read_pool, the layer's pools themselves [num_slots, kv_heads, max_len, head_dim]
        (no copy); otherwise each row's keys/values [0, kv_len): [B, kv_heads, kv_len, head_dim], a view when
        the slots are consecutive, an `index_select` copy when not (the "gather" reference backend).
        """
        view = self.view
        if len(self.keys) <= layer_idx:
            self._allocate(layer_idx, key_states, value_states)
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        index = self._write_index(view, key_states.shape[1])  # [B * kv_heads * Q]
        k_pool.view(-1, k_pool.shape[-1]).index_copy_(0, index, key_states.reshape(-1, k_pool.shape[-1]).to(k_pool.dtype))
        v_pool.view(-1, v_pool.shape[-1]).index_copy_(0, index, value_states.reshape(-1, v_pool.shape[-1]).to(v_pool.dtype))
        if view.read_pool:
            return k_pool, v_pool
        if view.slot_range is not None:
            first, end = view.slot_range
            return k_pool[first:end, :, : view.kv_len], v_pool[first:end, :, : view.kv_len]
        return (
            k_pool[:, :, : view.kv_len].index_select(0, view.slots),
            v_pool[:, :, : view.kv_len].index_select(0, view.slots),
        )

    def _write_index(self, view: ForwardView, kv_heads: int) -> torch.Tensor:
        """Row of (slot, head, position) in the pool seen as [num_slots * kv_heads * max_len, head_dim], for
        every written K/V vector in (row, head, query) order; one `index_copy_` per layer then writes them all
        (15x cheaper than advanced-index assignment on the CPU). Built once per forward."""
        if view.write_index is None or view.write_index[0] != kv_heads:
            heads = torch.arange(kv_heads, device=view.slots.device)  # [H]
            index = (view.slots[:, None, None] * kv_heads + heads[None, :, None]) * self.max_len + view.positions[:, None, :]
            view.write_index = (kv_heads, index.reshape(-1))  # [B, H, Q] -> [B * H * Q]
        return view.write_index[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_compileable(self) -> bool:
        return False

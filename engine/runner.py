"""One model over its paged KV pools: a single forward primitive, `extend`, used for prefill, draft and verify."""

from __future__ import annotations

import torch

from exspec.engine import backends
from exspec.engine.attention import EAGER_NAME, AttentionCall, attach
from exspec.engine.attention import NAME as EXSPEC_ATTENTION
from exspec.engine.kv_cache import BlockManager, ForwardMeta, KVPools
from exspec.errors import ExspecError


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Per-step host metadata (slots, positions, counts) onto the device without waiting for it: on CUDA
    the copy goes from pinned memory with non_blocking, so it never syncs the host with queued kernels."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class ModelRunner:
    """Runs `extend` forwards of one causal LM: each row feeds Q tokens at positions start..start+Q-1.

    Two batch shapes, one code path:
    - grouped: every row has the same start. Positions are shared and the mask is one causal block
      [1, 1, Q, kv_len] broadcast over the batch: no padding, no per-row mask.
    - mixed: rows start at different positions. Each row gets its own positions and a [B, 1, Q, kv_len]
      mask (query at position p sees keys 0..p of its own sequence). Rows shorter than Q are right-padded;
      padding queries write K/V past the row's length (in a block it owns, where nothing reads before it is
      overwritten, or in the null block).
    The K/V live in `blocks`' block ids (shared with the other model of the pair) of this model's own pools.
    A forward hands the model one `AttentionCall` as a keyword (engine/attention.py: the edge to transformers);
    nothing is set on the pools or the model between forwards.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: BlockManager,
        vocab_size: int,
        attention: str = backends.AUTO,  # a name in engine/backends/ (names()); "auto": the device's default
    ) -> None:
        self.model = model
        attach(model)  # the model's attention layers call exspec's entry points (engine/attention.py)
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = vocab_size  # logits are cut to the vocabulary shared with the other model
        self.blocks = blocks
        self.pools = KVPools(self.config, blocks.num_blocks, blocks.block_size, self.dtype, self.device)
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.float_mask = self.config._attn_implementation == EAGER_NAME  # eager adds the mask to the scores
        self.sliding_window = _sliding_window(self.config)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # Positions the model can embed (learned position tables): a rectangular verify pads rows near the end
        # of their context with columns past it; those columns are clamped here for the model alone (their
        # outputs are never used), while the cache and the mask keep the true positions.
        self.max_position = _position_limit(self.config)
        self.backend = resolve_attention(attention, self.device, self.config._attn_implementation)
        self.attention = self.backend.name if self.backend is not None else "gather"
        if self.backend is not None and self.pools.keys:  # e.g. the Triton kernel's variants compiled now
            self.backend.warm_up(self.config.num_attention_heads, self.pools.keys[0], self.pools.values[0],
                                 self.sliding_window)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)  # for backends that need none

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,  # [B, Q] long, on device
        starts: list[int],  # [B] host: position of each row's first query token
        slots: list[int],  # [B] host: each row's sequence slot (its block table row)
        select: torch.Tensor | None = None,  # [B, n] long: query indices whose logits are wanted; None: all
        force_per_row: bool = False,  # per-row positions and mask even if every start is equal
    ) -> torch.Tensor:  # [B, n or Q, vocab] float32
        batch, q_len = tokens.shape
        dev = self.device
        grouped = not force_per_row and all(s == starts[0] for s in starts)
        kv_len = max(starts) + q_len
        offsets = torch.arange(q_len, device=dev)  # [Q]
        if grouped:
            positions = (offsets + starts[0])[None, :]  # [1, Q]
        else:
            positions = to_device(starts, dev)[:, None] + offsets  # [B, Q]
        slot_t = to_device(slots, dev)  # [B]
        meta = self._meta(positions, batch, slot_t, starts, slots, kv_len)
        mask = meta.mask if meta.mask is not None else self._no_mask  # [1 or B, 1, Q, kv_len]
        model_positions = positions if self.max_position is None else positions.clamp(max=self.max_position - 1)
        call = AttentionCall(self.pools, meta, self.backend, self.backend.plan(meta) if self.backend else None)
        hidden = self.base(
            input_ids=tokens,
            position_ids=model_positions.expand(batch, q_len),
            attention_mask=mask,
            use_cache=False,
            exspec_attention=call,
        ).last_hidden_state  # [B, Q, hidden]
        if select is not None:
            hidden = hidden.gather(1, select[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, n, hidden]
        logits = self.head(hidden)[..., : self.vocab_size].float()  # [B, n, vocab]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _meta(self, positions: torch.Tensor, batch: int, slot_t: torch.Tensor, starts: list[int], slots: list[int],
              kv_len: int) -> ForwardMeta:
        """The forward's write rows, block tables and lengths, from the device block table (no host sync).
        positions: [1 or B, Q]. Positions past the blocks a row owns (right padding) map to the null block."""
        bs = self.blocks.block_size
        q_len = positions.shape[1]
        n_blocks = -(-kv_len // bs)
        table = self.blocks.block_table.index_select(0, slot_t)  # [B, max_blocks_per_seq] int32
        if n_blocks > table.shape[1]:  # right padding past max_model_len: zero (null block) columns
            table = torch.cat([table, table.new_zeros(batch, n_blocks - table.shape[1])], dim=1)
        table = table[:, :n_blocks]  # [B, n_blocks]
        full = positions.expand(batch, q_len)  # [B, Q]
        physical = table.gather(1, full // bs).long()  # [B, Q]
        slot_mapping = (physical * bs + full % bs).reshape(-1)  # [B * Q]
        need_mask = self.backend is None or self.backend.wants_mask(q_len, self.sliding_window)
        return ForwardMeta(
            slot_mapping=slot_mapping,
            block_tables=table,
            seq_lens=to_device([s + q_len for s in starts], self.device, torch.int32),
            mask=self._mask(positions, kv_len) if need_mask else None,
            kv_len=kv_len,
            q_len=q_len,
            starts=tuple(starts),
            first_blocks=tuple(self.blocks.first_contiguous_block(s, st + q_len) for s, st in zip(slots, starts)),
            window=self.sliding_window,
        )

    def _mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Causal (and sliding-window) mask by absolute position. positions: [R, Q] -> [R, 1, Q, kv_len]."""
        keys = torch.arange(kv_len, device=self.device)  # [kv_len]
        allowed = keys[None, None, :] <= positions[:, :, None]  # [R, Q, kv_len]
        if self.sliding_window:
            allowed &= keys[None, None, :] > positions[:, :, None] - self.sliding_window
        allowed = allowed[:, None]
        if not self.float_mask:
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)


def _position_limit(config) -> int | None:
    from exspec.engine.config import position_limit_of  # (imported here: one definition of the keys)

    return position_limit_of(config)


def resolve_attention(name: str, device: torch.device, attn_implementation: str) -> backends.AttentionBackend | None:
    """The attention backend a runner uses (engine/backends/), resolved once. None for exspec's eager entry point
    (engine/attention.py): it reads gathered K/V under a float mask."""
    if name != backends.AUTO and name not in backends.names():
        raise ExspecError(f"attention backend must be {backends.AUTO} or one of {list(backends.names())}, got {name!r}")
    if attn_implementation != EXSPEC_ATTENTION:
        return None
    try:
        return backends.create(name, device)
    except ValueError as e:
        raise ExspecError(str(e)) from None


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        from exspec.errors import ModelLoadError

        raise ModelLoadError(
            "models that mix sliding-window and full-attention layers are not supported yet "
            f"(layer_types={sorted(set(layer_types))})"
        )
    if layer_types and layer_types[0] != "sliding_attention":
        return None
    return int(window)

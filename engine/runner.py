"""One model over its KV slot pool: a single forward primitive, `extend`, used for prefill, draft and verify."""

from __future__ import annotations


import torch

from exspec.engine.attention import NAME as EXSPEC_ATTENTION
from exspec.engine.attention_pool import BACKENDS, PoolPlan, flash_available, plan_runs
from exspec.engine.kv_cache import ForwardView, SlotKVCache
from exspec.errors import ExspecError


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Per-step host metadata (slots, positions, counts) onto the device without waiting for it: on CUDA
    the copy goes from pinned memory with non_blocking, so it never syncs the host with queued kernels."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _consecutive(slots: list[int]) -> tuple[int, int] | None:
    first = slots[0]
    return (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None


class ModelRunner:
    """Runs `extend` forwards of one causal LM: each row feeds Q tokens at positions start..start+Q-1.

    Two batch shapes, one code path:
    - grouped: every row has the same start. Positions are shared and the mask is one causal block
      [1, 1, Q, kv_len] broadcast over the batch: no padding, no per-row mask.
    - mixed: rows start at different positions. Each row gets its own positions and a [B, 1, Q, kv_len]
      mask (query at position p sees keys 0..p of its own slot). Rows shorter than Q are right-padded;
      padding queries write K/V past the row's length, where nothing reads before it is overwritten.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_len: int,
        vocab_size: int,
        attention: str | None = None,  # "gather" | "pool" | "flash"; None or "auto": the default for the device
    ) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = vocab_size  # logits are cut to the vocabulary shared with the other model
        self.cache = SlotKVCache(self.config.num_hidden_layers, num_slots, max_len)
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.float_mask = self.config._attn_implementation == "eager"  # eager adds the mask to the scores
        self.sliding_window = _sliding_window(self.config)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # Positions the model can embed (learned position tables): a rectangular verify pads rows near the end
        # of their context with columns past it; those columns are clamped here for the model alone (their
        # outputs are never used), while the cache and the mask keep the true positions.
        self.max_position = _position_limit(self.config)
        self.attention = resolve_attention(attention, self.device, self.config._attn_implementation)

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,  # [B, Q] long, on device
        starts: list[int],  # [B] host: position of each row's first query token
        slots: list[int],  # [B] host: each row's KV slot
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
        if kv_len > self.cache.max_len:
            # Only right-padding queries can reach past the pool (a late prefill chunk batched with a wider
            # one): real queries stop at max_model_len + k - 2. Park them on the pool's last position,
            # which no real query ever reads.
            positions = positions.clamp(max=self.cache.max_len - 1)
            kv_len = self.cache.max_len
        mask = self._mask(positions, kv_len)  # [1 or B, 1, Q, kv_len]
        slot_t = to_device(slots, dev)  # [B]
        plan = self._pool_plan(slots, starts, q_len, mask, slot_t)
        self.cache.view = ForwardView(
            slots=slot_t,
            positions=positions.expand(batch, q_len),
            kv_len=kv_len,
            slot_range=_consecutive(slots),
            read_pool=plan is not None,
        )
        model_positions = positions if self.max_position is None else positions.clamp(max=self.max_position - 1)
        extra = {"exspec_pool": plan} if plan is not None else {}
        hidden = self.base(
            input_ids=tokens,
            position_ids=model_positions.expand(batch, q_len),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            **extra,
        ).last_hidden_state  # [B, Q, hidden]
        self.cache.view = None
        if select is not None:
            hidden = hidden.gather(1, select[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, n, hidden]
        logits = self.head(hidden)[..., : self.vocab_size].float()  # [B, n, vocab]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _pool_plan(
        self, slots: list[int], starts: list[int], q_len: int, mask: torch.Tensor, slot_t: torch.Tensor
    ) -> PoolPlan | None:
        """How attention reads this forward's rows from the pools (None: the "gather" reference)."""
        if self.attention == "gather":
            return None
        pool_len = self.cache.max_len
        if self.attention == "flash":  # pragma: no cover - needs CUDA and flash_attn
            lengths = [min(s + q_len, pool_len) for s in starts]
            return PoolPlan(
                "flash", (), None, slot_t.to(torch.int32), to_device(lengths, self.device, torch.int32), self.sliding_window
            )
        # One query per row and no window: every key up to the row's own length is visible, no mask needed.
        need_mask = q_len > 1 or self.sliding_window is not None
        return PoolPlan("pool", plan_runs(slots, starts, q_len, pool_len), mask if need_mask else None, None, None, None)

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
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_attention(name: str | None, device: torch.device, attn_implementation: str) -> str:
    """The attention backend a runner uses (engine/attention_pool.py), resolved once.

    Default: "pool" on the CPU with exspec's attention function (attn_implementation "sdpa"), where it was
    measured; "gather" on CUDA (unmeasured there: "flash" or "pool" are opt-in) and for "eager" (it adds a float
    mask to the scores of gathered K/V). "flash" is never a default: it has not run in exspec's CI (no GPU).
    """
    name = None if name in (None, "auto") else name
    if name is not None and name not in BACKENDS:
        raise ExspecError(f"attention backend must be one of {list(BACKENDS)}, got {name!r}")
    if attn_implementation != EXSPEC_ATTENTION:
        return "gather"  # eager (or any other implementation) reads gathered K/V
    if name == "flash" and not flash_available(device):
        raise ExspecError("attention backend 'flash' needs a CUDA device and the flash_attn package")
    return name or ("pool" if device.type == "cpu" else "gather")


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

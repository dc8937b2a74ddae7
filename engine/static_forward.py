"""Static-shape forwards of one `ModelRunner` (issue 20, items 1 and 2 for the draft and verify forwards):
the shapes a captured graph needs, and the in-place inputs it replays with.

A `StaticForward` is one (batch bucket, query length) pair: the batch is padded to `bucket` rows (1, 2, 4, 8,
...) and every row feeds exactly `q_len` tokens (1 for a draft token, k + 1 for the verify). Its inputs live in
preallocated device buffers that `run` updates in place (`copy_`) before each call:

- `tokens` [bucket, Q], `positions` [bucket, Q], `block_tables` [bucket, n_blocks], `seq_lens` [bucket];
- `slot_mapping` [bucket * Q] (the K/V write rows) and `mask` [bucket, 1, Q, kv_len] are derived from them
  inside the forward (device ops, written into their buffers in place).

`n_blocks` is the block table's width plus the columns Q may run past it, so `kv_len = n_blocks * block_size`
is fixed: attention always covers the widest row a sequence may have and the mask (or the kernel's seq_lens)
hides the rest. Padding rows have an all-null block table row, so their K/V land in the null block 0 (never
read unmasked) and their logits are cut off by the caller (`run` returns the first B rows).

`forward` has no Python loop over rows or layers beyond the model's own modules, and no host sync: under
`torch.compile(fullgraph=True, dynamic=False)` it is one graph (tests/engine/test_fullgraph.py proves it on the
CPU). Attention goes through exspec's registered attention function with a backend made for static shapes:
on the CPU the `reference` gather + masked SDPA over the whole static width; on CUDA the paged Triton kernel as
the opaque operator `torch.ops.exspec.paged_attention`.

On CUDA `compile` captures the forward in CUDA graphs (`mode="reduce-overhead"`, one graph per (bucket, Q)): the
pools and buffers are marked static addresses (`mark_static`; a graph that mutates an input that is not static is
run uncaptured), each call starts a new CUDA-graph step and copies the rows it returns out of the graph's output
(a replay overwrites it), and the engine takes `graph_memory_bytes` (an estimate) out of the memory its KV pools are
sized from. Run on an H100 on 2026-11-24 (docs/BENCHMARKS.md section 0): outputs equal to eager's but for near-ties
(scripts/compile_check.py), a decode step 7.6x (1.5B) and 2.0x (8B) faster than eager, 30-70 s to compile each
(bucket, Q) at its first use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exspec.engine.attention import AttentionCall
from exspec.engine.backends import AttentionBackend
from exspec.engine.backends.reference import ReferenceBackend
from exspec.engine.kv_cache import NULL_BLOCK, ForwardMeta
from exspec.engine.runner import ModelRunner, to_device


# torch.compile options per device type: on the CPU `aot_eager` (a proof that the forward is one graph, fast to
# compile); on CUDA CUDA graphs through "reduce-overhead" (run on an H100, docs/BENCHMARKS.md section 0).
COMPILE_OPTIONS = {"cpu": {"backend": "aot_eager"}, "cuda": {"mode": "reduce-overhead"}}
# Every StaticForward compiles the same code (`forward`) with its own buffers: each is one Dynamo cache entry.
RECOMPILE_LIMIT = 64


def static_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes a static forward runs at for batches up to max_batch: 1, 2, 4 .. bucket_for(max_batch)."""
    return [1 << i for i in range(bucket_for(max_batch).bit_length())]


def static_widths(max_k: int, draft: bool) -> list[int]:
    """The query lengths Q of the static forwards a step runs with k up to max_k: the verify's k + 1 for k = 0 ..
    max_k; the draft's first forward of width 1 or 2 (2 after a full accept) and its later ones of 1 (none at
    max_k = 0: no drafting)."""
    if draft:
        return [1, 2] if max_k else []
    return list(range(1, max_k + 2))


def graph_memory_bytes(target: torch.nn.Module, draft: torch.nn.Module | None, max_batch: int, max_k: int,
                       vocab_size: int) -> int:
    """An upper estimate of what the captured graphs' memory pool holds on CUDA, taken out of the memory the KV
    pools are sized from: every (bucket, Q) graph (`static_buckets` x `static_widths`) keeps its output logits
    ([bucket, Q, vocab] in the model's dtype and in float32), plus one forward's working set at the largest shape
    (~24 hidden-sized and 3 intermediate-sized activations per token). AN ESTIMATE, NOT YET MEASURED ON A GPU."""
    buckets = static_buckets(max_batch)
    total = 0
    for model, q_lens in ((target, static_widths(max_k, draft=False)), (draft, static_widths(max_k, draft=True))):
        if model is None or not q_lens:
            continue
        cfg = model.config
        width = next(model.parameters()).element_size()
        total += sum(buckets) * sum(q_lens) * vocab_size * (width + 4)
        hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
        total += buckets[-1] * max(q_lens) * (24 * hidden + 3 * inter) * width
    return total


def bucket_for(batch: int) -> int:
    """The smallest power of two >= batch: the padded batch a static forward runs at."""
    return 1 << max(0, batch - 1).bit_length()


class PagedOpBackend(AttentionBackend):
    """The paged Triton kernel as one opaque operator (`torch.ops.exspec.paged_attention`): what a compiled or
    captured forward calls on CUDA (Dynamo does not trace into the launch). Not registered: static forwards only."""

    name = "triton_op"
    needs_mask = False

    def forward(self, query, k_cache, v_cache, plan: ForwardMeta, scale):
        from exspec.engine.kernels.paged_attention import paged_attention_op

        batch, heads, q_len, head_dim = query.shape
        out = query.new_empty(batch, q_len, heads, v_cache.shape[-1])  # [B, Q, heads, head_dim]
        scale = scale if scale is not None else head_dim**-0.5
        paged_attention_op(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, plan.window, out)
        return out


def static_backend(device: torch.device) -> AttentionBackend:
    """CUDA: the paged kernel as an operator (capture untested on a GPU); elsewhere: `reference`."""
    return PagedOpBackend() if device.type == "cuda" else ReferenceBackend()


class StaticForward:
    """One runner's forward at a fixed (bucket, q_len): buffers allocated once, refilled in place per call."""

    def __init__(self, runner: ModelRunner, bucket: int, q_len: int, backend: AttentionBackend | None = None) -> None:
        if runner.backend is None:
            raise ValueError("a static forward needs exspec's attention (attn_implementation exspec_sdpa), not eager")
        self.runner = runner
        self.bucket = bucket
        self.q_len = q_len
        dev = runner.device
        bs = runner.blocks.block_size
        self.n_blocks = runner.blocks.block_table.shape[1] + -(-q_len // bs)  # + columns Q may run past the table
        self.kv_len = self.n_blocks * bs
        self.backend = backend if backend is not None else static_backend(dev)
        self.offsets = torch.arange(q_len, device=dev)  # [Q]
        self.keys = torch.arange(self.kv_len, device=dev)  # [kv_len]
        self.tokens = torch.zeros(bucket, q_len, dtype=torch.long, device=dev)  # [bucket, Q]
        self.positions = self.offsets.repeat(bucket, 1)  # [bucket, Q]
        self.block_tables = torch.zeros(bucket, self.n_blocks, dtype=torch.int32, device=dev)  # [bucket, n_blocks]
        self.seq_lens = torch.full((bucket,), q_len, dtype=torch.int32, device=dev)  # [bucket]
        self.slot_mapping = torch.zeros(bucket * q_len, dtype=torch.long, device=dev)  # [bucket * Q]
        self.mask = torch.zeros(bucket, 1, q_len, self.kv_len, dtype=torch.bool, device=dev)  # [bucket, 1, Q, kv_len]
        self.meta = ForwardMeta(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            mask=self.mask,
            kv_len=self.kv_len,
            q_len=q_len,
            starts=(),
            first_blocks=(),
            window=runner.sliding_window,
        )
        self.call = AttentionCall(runner.pools, self.meta, self.backend, self.backend.plan(self.meta))
        self.compiled: Callable[[], torch.Tensor] | None = None
        self.graph = None  # torch.cuda.CUDAGraph after `capture`
        self.output: torch.Tensor | None = None  # [bucket, Q, vocab]: the captured graph's logits, rewritten by a replay

    def compile(self, **options) -> None:
        """Replace `forward` in `run` by `torch.compile(self.forward, fullgraph=True, dynamic=False, **options)`;
        no options: the device's COMPILE_OPTIONS."""
        if not options:
            options = COMPILE_OPTIONS.get(self.runner.device.type, COMPILE_OPTIONS["cpu"])
        if self.runner.device.type == "cuda":
            self.mark_static()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.compiled = torch.compile(self.forward, fullgraph=True, dynamic=False, **options)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """CUDA only: record `forward` into a torch.cuda.CUDAGraph that `run` replays (no compiler: the forward is
        static-shape and makes no host sync). Two warm-up forwards on a side stream first (Triton's JIT, cuBLAS
        workspaces); `pool` (torch.cuda.graph_pool_handle()) lets the engine's graphs share one memory pool. The
        warm-up and the capture read the buffers as built (null block tables): their K/V writes land in the null
        block. Run on an H100 (2026-11-27): tests/engine/test_cuda_graphs.py and scripts/gpu_check.sh's
        compile-check-cudagraph stage (docs/BENCHMARKS.md section 0)."""
        dev = self.runner.device
        if dev.type != "cuda":
            raise ValueError(f"capturing a CUDA graph needs a CUDA device, not {dev.type}")
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.output = self.forward()  # [bucket, Q, vocab]
        self.graph = graph

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads from or writes into in place: the model's pools and this forward's buffers."""
        pools = self.runner.pools
        return [*pools.keys, *pools.values, self.tokens, self.positions, self.block_tables, self.seq_lens,
                self.slot_mapping, self.mask, self.offsets, self.keys]

    def mark_static(self) -> None:
        """Mark `static_tensors` as static addresses for CUDA graphs. mode="reduce-overhead" skips the graph (runs it
        uncaptured, with only a log line) when it mutates an input whose address is not static, and this forward
        writes the pools and its derived buffers in place; marked, they are captured as they are, never copied."""
        for tensor in self.static_tensors():
            torch._dynamo.mark_static_address(tensor)

    def load(self, tokens: torch.Tensor, starts: list[int], slots: list[int]) -> None:
        """Copy one call's inputs into the buffers (host -> device without a sync). tokens: [B, Q], B <= bucket."""
        batch = tokens.shape[0]
        if batch > self.bucket or tokens.shape[1] != self.q_len:
            raise ValueError(f"tokens {tuple(tokens.shape)} do not fit bucket {self.bucket} x Q {self.q_len}")
        dev = self.runner.device
        starts_t = to_device(starts, dev)  # [B]
        slot_t = to_device(slots, dev)  # [B]
        table = self.runner.blocks.block_table  # [num_slots, max_blocks_per_seq] int32
        self.tokens[:batch].copy_(tokens)
        self.tokens[batch:].zero_()
        self.positions[:batch].copy_(starts_t[:, None] + self.offsets)
        self.positions[batch:].copy_(self.offsets.expand(self.bucket - batch, -1))
        self.block_tables[:batch, : table.shape[1]].copy_(table.index_select(0, slot_t))
        self.block_tables[:batch, table.shape[1] :].fill_(NULL_BLOCK)
        self.block_tables[batch:].fill_(NULL_BLOCK)
        self.seq_lens[:batch].copy_(starts_t + self.q_len)
        self.seq_lens[batch:].fill_(self.q_len)

    def forward(self) -> torch.Tensor:  # [bucket, Q, vocab] float32
        """The forward over the buffers: derives the write rows and the mask in place, runs the model. No host
        sync, no per-row Python: capturable."""
        runner = self.runner
        bs = runner.blocks.block_size
        positions = self.positions  # [bucket, Q]
        physical = self.block_tables.gather(1, positions // bs).long()  # [bucket, Q]
        self.slot_mapping.copy_((physical * bs + positions % bs).reshape(-1))
        allowed = self.keys[None, None, :] <= positions[:, :, None]  # [bucket, Q, kv_len]
        if runner.sliding_window:
            allowed = allowed & (self.keys[None, None, :] > positions[:, :, None] - runner.sliding_window)
        self.mask.copy_(allowed[:, None])
        model_positions = positions if runner.max_position is None else positions.clamp(max=runner.max_position - 1)
        hidden = runner.base(
            input_ids=self.tokens,
            position_ids=model_positions,
            attention_mask=self.mask,
            use_cache=False,
            exspec_attention=self.call,
        ).last_hidden_state  # [bucket, Q, hidden]
        logits = runner.head(hidden)[..., : runner.vocab_size].float()  # [bucket, Q, vocab]
        if runner.softcap:
            logits = torch.tanh(logits / runner.softcap) * runner.softcap
        return logits

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, starts: list[int], slots: list[int]) -> torch.Tensor:  # [B, Q, vocab]
        """`ModelRunner.extend(tokens, starts, slots)` at static shapes: load, forward (the captured graph after
        `capture`, compiled after `compile`), the first B rows of the logits."""
        self.load(tokens, starts, slots)
        if self.graph is not None:
            self.graph.replay()
            return self.output[: tokens.shape[0]].clone()  # the next replay overwrites the graph's output
        if self.compiled is not None and self.runner.device.type == "cuda":
            # CUDA graphs: each call is a new step, and a replay overwrites the graph's output, so the rows wanted
            # are copied out
            torch.compiler.cudagraph_mark_step_begin()
            return self.compiled()[: tokens.shape[0]].clone()
        logits = (self.compiled or self.forward)()  # [bucket, Q, vocab]
        return logits[: tokens.shape[0]]

"""Attention backends (engine/backends/): each backend's forward over paged pools matches SDPA over the dense
K/V (contiguous and scattered blocks, padding columns, grouped-query heads, sliding window); the attention entry
point writes through the slot mapping and hands attention the pools themselves; the registry resolves names; and every backend
that runs here gives the target's own greedy output in the scenarios that exercise the pools."""

from __future__ import annotations

import pytest
import torch
from tests.engine.conftest import BACKEND_PARAMS, use_triton
from tests.engine.test_engine_equivalence import MIXED, MIXED_MAX, assert_matches_reference
from tests.engine.test_kv_cache import _poison
from tests.support.driver import admit, prefill, run_to_end, step
from tests.support.models import random_prompts

from exspec.cli.settings import attention_backends
from exspec.engine import SamplingParams, backends
from exspec.engine.attention import AttentionCall, gqa_sdpa_forward
from exspec.engine.kernels import native
from exspec.engine.kv_cache import ForwardMeta, KVPools, gather_kv
from exspec.engine.runner import resolve_attention
from exspec.errors import ExspecError, ModelLoadError

CPU = torch.device("cpu")


@pytest.fixture
def backend(request, monkeypatch):
    if request.param == "triton":  # the engine-level cases build CPU engines (the `models` fixture)
        use_triton(monkeypatch, cpu_engines="models" in request.fixturenames)
    return request.param


# ---------------------------------------------------------------------------------------------- unit level


def _paged(dense: torch.Tensor, tables: list[list[int]], num_blocks: int, block_size: int) -> torch.Tensor:
    """dense [B, kv_heads, L, dim] laid out in blocks: [num_blocks + 1, block_size, kv_heads, dim], junk elsewhere."""
    pool = torch.randn(num_blocks + 1, block_size, dense.shape[1], dense.shape[3]) * 100
    for b, table in enumerate(tables):
        for i, block in enumerate(table):
            chunk = dense[b, :, i * block_size : (i + 1) * block_size].transpose(0, 1)  # [<=bs, kv_heads, dim]
            pool[block, : chunk.shape[0]] = chunk
    return pool


# Row 0's blocks contiguous, the others scattered; "mixed": rows of very different lengths (`sdpa`: one call per
# row, some short), "grouped": rows of one length, "similar": lengths within a fifth (`sdpa`: gathered, one call).
LAYOUTS = {
    "mixed": ([9, 2, 2, 13], [[1, 2, 3, 4, 5], [9, 6], [7, 12], [8, 10, 11, 13, 14]], (1, -1, -1, -1)),
    "grouped": ([9, 9, 9], [[1, 2, 3, 4], [9, 6, 5, 12], [7, 8, 10, 11]], (1, -1, -1)),
    "similar": ([9, 8, 7], [[1, 2, 3, 4], [9, 6, 5, 12], [7, 8, 10, 11]], (1, -1, -1)),  # `sdpa`: one masked call
}


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
@pytest.mark.parametrize("q_len, window", [(1, None), (3, None), (4, 6)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backend_forward_matches_sdpa_over_dense_kv(backend, q_len, window, layout):
    _check_forward(backend, q_len, window, layout)


@pytest.mark.parametrize("backend", [p for p in BACKEND_PARAMS if p.values[0] != "triton"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backend_forward_over_head_major_storage(backend, layout):
    """KVPools stores the pools head-major, [kv_heads, blocks, block_size, dim], behind the [blocks, block_size,
    kv_heads, dim] view every backend indexes: the views, the gathers and the batched call read it right."""
    for q_len, window in [(1, None), (3, None), (4, 6)]:
        _check_forward(backend, q_len, window, layout, head_major=True)


def _check_forward(backend: str, q_len: int, window: int | None, layout: str, head_major: bool = False) -> None:
    torch.manual_seed(0)
    # the triton kernel runs compiled on a CUDA machine (its interpreter is off there), interpreted on CPU tensors elsewhere
    device = torch.device("cuda") if backend == "triton" and torch.cuda.is_available() else CPU
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    starts, tables, first_blocks = LAYOUTS[layout]
    batch = len(starts)
    seq_lens = [s + q_len for s in starts]
    kv_len = max(seq_lens)
    n_blocks = -(-kv_len // bs)
    tables = [t[: -(-n // bs)] for t, n in zip(tables, seq_lens)]
    dense_k = torch.randn(batch, kv_heads, kv_len, dim)
    dense_v = torch.randn(batch, kv_heads, kv_len, dim)
    k_pool, v_pool = _paged(dense_k, tables, 14, bs), _paged(dense_v, tables, 14, bs)
    if head_major:  # stored [kv_heads, blocks, block_size, dim], seen as [blocks, block_size, kv_heads, dim]
        k_pool, v_pool = (p.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for p in (k_pool, v_pool))
    query = torch.randn(batch, heads, q_len, dim)
    positions = torch.tensor(starts)[:, None] + torch.arange(q_len)  # [B, Q]
    keys = torch.arange(kv_len)
    allowed = keys[None, None, :] <= positions[:, :, None]  # [B, Q, kv_len]
    if window:
        allowed &= keys[None, None, :] > positions[:, :, None] - window
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, dense_k, dense_v, attn_mask=allowed[:, None], enable_gqa=True
    ).transpose(1, 2)  # [B, Q, heads, dim]
    table_t = torch.zeros(batch, n_blocks, dtype=torch.int32)
    for b, t in enumerate(tables):
        table_t[b, : len(t)] = torch.tensor(t)
    impl = backends.create(backend, device)
    if device != CPU:
        query, k_pool, v_pool, allowed, table_t, ref = (t.to(device) for t in (query, k_pool, v_pool, allowed, table_t, ref))
    meta = ForwardMeta(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.long, device=device),
        block_tables=table_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        mask=allowed[:, None] if impl.wants_mask(q_len, window) else None,  # as the runner asks
        kv_len=kv_len,
        q_len=q_len,
        starts=tuple(starts),
        first_blocks=first_blocks,
        window=window,
    )
    ours = impl.forward(query, k_pool, v_pool, impl.plan(meta), dim**-0.5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_attention_entry_point_writes_through_the_slot_mapping_and_hands_the_backend_the_pools(models):
    config = models.pair("llama").target.config
    pools = KVPools(config, num_blocks=6, block_size=4, dtype=torch.float32, device=CPU)
    layers, kv_heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert len(pools.keys) == layers and pools.keys[0].shape == (7, 4, kv_heads, dim)
    k = torch.randn(2, kv_heads, 3, dim)  # [B, kv_heads, Q, dim]
    v = torch.randn(2, kv_heads, 3, dim)
    tables = torch.tensor([[3, 5], [2, 0]], dtype=torch.int32)
    # row 0 at positions 3, 4, 5 (blocks 3, 5); row 1 at 0, 1, 2 (block 2)
    mapping = torch.tensor([3 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2])
    meta = ForwardMeta(mapping, tables, torch.tensor([6, 3], dtype=torch.int32), None, 6, 3, (3, 0), (-1, 2), None)

    seen = {}

    class Spy(backends.AttentionBackend):
        def forward(self, query, k_cache, v_cache, plan, scale):
            seen.update(keys=k_cache, values=v_cache, plan=plan)
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    layer = torch.nn.Module()
    layer.layer_idx = 1  # the entry point writes the pools of the layer that calls it
    query = torch.randn(2, 2 * kv_heads, 3, dim)  # [B, heads, Q, dim]
    out, _ = gqa_sdpa_forward(layer, query, k, v, None, exspec_attention=AttentionCall(pools, meta, Spy(), "plan"))
    assert out.shape == (2, 3, 2 * kv_heads, dim) and seen["plan"] == "plan"
    keys, values = seen["keys"], seen["values"]
    assert keys is pools.keys[1] and values is pools.values[1]  # no copy: the pool itself
    assert not pools.keys[0].any()  # other layers untouched
    torch.testing.assert_close(keys[3, 3], k[0, :, 0])
    torch.testing.assert_close(keys[5, :2], k[0, :, 1:].transpose(0, 1))
    torch.testing.assert_close(values[2, :3], v[1].transpose(0, 1))
    gathered = gather_kv(keys, meta)  # what the eager entry point reads: [B, kv_heads, kv_len, dim]
    assert gathered.shape == (2, kv_heads, 6, dim) and gathered.data_ptr() != keys.data_ptr()
    torch.testing.assert_close(gathered[0, :, 3:6], k[0])
    with pytest.raises(ModelLoadError, match="no layer_idx"):
        gqa_sdpa_forward(torch.nn.Module(), query, k, v, None, exspec_attention=AttentionCall(pools, meta, Spy(), None))


def test_backend_registry_and_resolution(monkeypatch):
    assert attention_backends() == tuple(sorted(backends.names()))  # the CLI's list is the registry's
    assert {"native", "reference", "sdpa", "triton"} <= set(backends.names())
    # `native` where its kernel builds (tests/engine/test_native_kernel.py: `sdpa` where it cannot)
    cpu_default = "native" if native.available() else "sdpa"
    assert backends.default_backend(CPU) == cpu_default
    assert resolve_attention("auto", CPU, "exspec_sdpa").name == cpu_default
    assert resolve_attention("reference", CPU, "exspec_sdpa").name == "reference"
    assert resolve_attention("sdpa", CPU, "exspec_eager") is None  # eager adds a float mask to gathered K/V
    with pytest.raises(ExspecError, match="attention backend must be auto or one of"):
        resolve_attention("paged", CPU, "exspec_sdpa")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not backends.available_names(CPU).__contains__("triton")  # the CPU needs the interpreter
    with pytest.raises(ExspecError, match="cannot run on cpu"):
        resolve_attention("triton", CPU, "exspec_sdpa")
    with pytest.raises(TypeError, match="must live in engine/backends/other.py"):
        backends.register("other")(type("X", (backends.AttentionBackend,), {"__module__": "exspec.engine.backends.x"}))


# ---------------------------------------------------------------------------------------------- engine level


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_mixed_lengths_at_scattered_slots_and_blocks_match_target(models, arch, backend):
    # A pool just big enough for the rows' peak blocks and the kept holders': rows placed without knowing their
    # final lengths run into a neighbour and continue elsewhere, so some rows' blocks are scattered.
    pair, block_size, k = models.pair(arch, "noisy"), 4, 3
    need = sum(-(-(len(p) + m + k + 1) // block_size) for p, m in zip(MIXED[:8], MIXED_MAX[:8])) + 4
    per_block = sum(KVPools.bytes_per_block(m.config, block_size, torch.float32) for m in (pair.target, pair.draft))
    engine = models.engine(arch, "noisy", attention=backend, block_size=block_size, kv_cache_memory=per_block * need)
    assert engine.target.attention == engine.draft.attention == backend
    # Occupy every other slot and a block between each first: the batch's slots are scattered.
    holders = [admit(engine, [5, 6], SamplingParams()) for _ in range(8)]
    for h in holders[::2]:
        engine.free(h.seq_id)
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX[:8]]
    seen = []
    seqs, outs = run_to_end(engine, MIXED[:8], params, k,
                            before_step=lambda e, live: seen.extend(e.blocks.first_contiguous_block(s.slot, 1) for s in live))
    assert sorted(s.slot for s in seqs) != list(range(min(s.slot for s in seqs), min(s.slot for s in seqs) + 8))
    assert -1 in seen  # some rows' blocks are not contiguous
    assert_matches_reference(models, arch, MIXED[:8], seqs, MIXED_MAX[:8])
    assert outs[1].kind == "mixed"


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
def test_grouped_then_forced_mixed_match_target(models, backend):
    engine = models.engine("llama", "noisy", attention=backend)
    prompts = random_prompts([24] * 6, seed=61)
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=12), 4)
    assert outs[1].kind == "grouped"
    forced = models.engine("llama", "noisy", attention=backend, force_mixed=True)
    seqs2, outs2 = run_to_end(forced, prompts, SamplingParams(max_tokens=12), 2)
    assert outs2[1].kind == "mixed"
    for p, a, b in zip(prompts, seqs, seqs2):
        assert a.output_token_ids == b.output_token_ids == models.reference("llama", p, 12)


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
def test_chunked_prefill_with_padding_past_the_pool_matches_target(models, backend):
    engine = models.engine("qwen3", "noisy", max_model_len=160, attention=backend)
    a, d = random_prompts([150, 120], seed=31)
    sa = admit(engine, a, SamplingParams(max_tokens=30))
    sd = admit(engine, d, SamplingParams(max_tokens=12))
    prefill(engine, [(sa, 0, 100)])
    prefill(engine, [(sa, 100, 150), (sd, 0, 120)])  # padding past the pool
    live = [sa, sd]
    while live:
        step(engine, live, 4)
        live = [s for s in live if not s.finished]
    assert sa.output_token_ids == models.reference("qwen3", a, 10)
    assert sd.output_token_ids == models.reference("qwen3", d, 12)


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
def test_sliding_window_matches_target(models, backend):
    engine = models.engine("mistral", "window", attention=backend)
    prompts = MIXED[:6]
    seqs, _ = run_to_end(engine, prompts, SamplingParams(max_tokens=12), 3)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == models.reference("mistral", prompt, 12, target="window")


@pytest.mark.parametrize("backend", BACKEND_PARAMS, indirect=True)
def test_stale_kv_is_never_read(models, backend):
    """Poison everything no sequence may read, before every step: outputs do not change."""
    prompts = random_prompts([1, 9, 40, 77, 3, 55], seed=51)
    params = [SamplingParams(max_tokens=m) for m in (14, 13, 14, 7, 14, 11)]
    gen = torch.Generator().manual_seed(0)
    ks = [4, 1, 0, 6, 3]
    engine = models.engine("llama", "noisy", attention=backend)
    _poison(engine, [], gen)
    seqs, _ = run_to_end(engine, prompts, params, lambda i: ks[i % 5], before_step=lambda e, live: _poison(e, live, gen))
    for prompt, seq, prm in zip(prompts, seqs, params):
        assert seq.output_token_ids == models.reference("llama", prompt, prm.max_tokens)

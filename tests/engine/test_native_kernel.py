"""The CPU's paged attention kernel (engine/kernels/paged_attention_cpu.c through engine/kernels/native.py): against
SDPA over the dense K/V for every shape it takes (head dims with and without a multiple-of-8 part, grouped-query
heads, 1 to 8 queries, sliding window, padding rows, scattered blocks, both pool layouts, fp32/bf16/fp16); a row's
output bitwise the same whatever shares its batch and whatever the thread count; what it refuses; and its build:
cached, rebuilt for another source, and absent without a compiler, where the CPU's default backend is `sdpa`."""

from __future__ import annotations

import pytest
import torch

from exspec.engine import backends
from exspec.engine.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"the native kernel cannot build here: {native.unavailable_reason()}")


def _case(seq_lens, q_len, heads, kv_heads, dim, block_size, dtype=torch.float32, head_major=True, seed=0):
    """Pools holding each row's K/V in shuffled blocks (NaN everywhere else, the last block's tail included), the block
    tables, a query, and the dense K/V per row."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    per_row = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_row) + 3
    ids = (torch.randperm(num_blocks, generator=gen) + 1).tolist()  # block 0 is the null block
    max_blocks = max(max(per_row), 1) + 1
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    store = (kv_heads, num_blocks + 1, block_size, dim) if head_major else (num_blocks + 1, block_size, kv_heads, dim)
    # NaN wherever no row's key is: the kernel reads only the keys a query sees (SDPA under a mask would turn a NaN
    # it multiplies by zero into a NaN output)
    k_pool = torch.full(store, float("nan"), dtype=dtype)
    v_pool = torch.full(store, float("nan"), dtype=dtype)
    if head_major:
        k_pool, v_pool = k_pool.permute(1, 2, 0, 3), v_pool.permute(1, 2, 0, 3)  # [blocks, block, kv_heads, dim]
    dense = []
    for b, n in enumerate(seq_lens):
        row = [ids.pop() for _ in range(per_row[b])]
        tables[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        for i, block in enumerate(row):
            chunk = slice(i * block_size, min((i + 1) * block_size, n))
            k_pool[block, : chunk.stop - chunk.start] = k[chunk]
            v_pool[block, : chunk.stop - chunk.start] = v[chunk]
        dense.append((k, v))
    query = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    return query, k_pool, v_pool, tables, torch.tensor(seq_lens, dtype=torch.int32), dense


def _reference(query, dense, seq_lens, q_len, window, scale):
    """fp32 SDPA per row over its dense K/V under the causal (and window) mask: [B, Q, heads, dim]; zeros for a
    padding row (seq_len 0)."""
    out = torch.zeros(query.shape[0], q_len, query.shape[1], query.shape[3])
    for b, (k, v) in enumerate(dense):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n - q_len, n)[:, None]  # [Q, 1]
        keys = torch.arange(n)[None, :]
        allowed = keys <= pos
        if window:
            allowed &= keys > pos - window
        o = torch.nn.functional.scaled_dot_product_attention(
            query[b : b + 1].float(), k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
            attn_mask=allowed[None, None], scale=scale, enable_gqa=True)  # [1, heads, Q, dim]
        out[b] = o[0].transpose(0, 1)
    return out


SHAPES = [  # (seq_lens, q_len, heads, kv_heads, dim, block_size, window)
    ([37, 5, 16], 1, 4, 2, 64, 16, None),  # decode, whole vectors
    ([37, 5, 16], 5, 4, 2, 64, 16, None),  # a verify: each query its own causal length
    ([23, 40], 3, 6, 2, 12, 4, None),  # head_dim 12: one vector and four lanes one by one
    ([23, 40], 8, 3, 3, 20, 4, 7),  # no grouping, a window shorter than the queries' span
    ([9, 0, 30], 2, 8, 1, 8, 8, 4),  # a padding row (seq_len 0), eight heads on one kv head
    ([1], 1, 2, 1, 5, 16, None),  # one key, head_dim under a vector
]


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"case{i}" for i in range(len(SHAPES))])
def test_kernel_matches_sdpa_over_the_dense_kv(shape, head_major):
    seq_lens, q_len, heads, kv_heads, dim, bs, window = shape
    query, k_pool, v_pool, tables, lens, dense = _case(seq_lens, q_len, heads, kv_heads, dim, bs, head_major=head_major)
    scale = dim**-0.5
    ours = native.paged_attention_cpu(query, k_pool, v_pool, tables, lens, scale, window=window)
    assert ours.shape == (len(seq_lens), q_len, heads, dim) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, _reference(query, dense, lens, q_len, window, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools_are_read_exactly_and_accumulated_in_fp32(dtype):
    query, k_pool, v_pool, tables, lens, dense = _case([37, 5, 16], 5, 4, 2, 20, 16, dtype=dtype)
    ours = native.paged_attention_cpu(query, k_pool, v_pool, tables, lens, 0.2)
    assert ours.dtype == dtype
    # the reference reads the same rounded values in fp32: what remains is the output's rounding to the dtype
    ref = _reference(query, dense, lens, 5, None, 0.2).to(dtype)
    torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2)


def test_a_rows_output_is_bitwise_the_same_alone_in_any_batch_and_on_any_thread_count():
    query, k_pool, v_pool, tables, lens, _ = _case([37, 5, 16, 29], 3, 4, 2, 64, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_attention_cpu(query, k_pool, v_pool, tables, lens, 0.125)
        torch.set_num_threads(2)
        two = native.paged_attention_cpu(query, k_pool, v_pool, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = native.paged_attention_cpu(query[2:3], k_pool, v_pool, tables[2:3], lens[2:3], 0.125)
    assert torch.equal(alone[0], one[2])


def test_what_the_kernel_refuses():
    query, k_pool, v_pool, tables, lens, _ = _case([9, 5], 1, 4, 2, 8, 4)
    bad = tables.clone()
    bad[0, 0] = k_pool.shape[0]  # one past the pool's last block
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        native.paged_attention_cpu(query, k_pool, v_pool, bad, lens, 1.0)
    bad[0, 0] = -1
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        native.paged_attention_cpu(query, k_pool, v_pool, bad, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim contiguous"):
        native.paged_attention_cpu(query, k_pool.transpose(2, 3).contiguous().transpose(2, 3), v_pool, tables, lens, 1.0)
    with pytest.raises(ValueError, match="pools of"):
        native.paged_attention_cpu(query, k_pool.double(), v_pool.double(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        native.paged_attention_cpu(query, k_pool, v_pool, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="window"):
        native.paged_attention_cpu(query, k_pool, v_pool, tables, lens, 1.0, window=0)
    with pytest.raises(ValueError, match="heads"):
        native.paged_attention_cpu(query[:, :3], k_pool, v_pool, tables, lens, 1.0)


def test_the_library_is_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path))
    built = []
    real_build = native._build
    monkeypatch.setattr(native, "_build", lambda cc, out: (built.append(out), real_build(cc, out)))
    native._library.cache_clear()
    try:
        assert native.available()
        assert native.available()  # cached in the process
        native._library.cache_clear()
        assert native.available()  # and on disk: no second build
        assert len(built) == 1 and built[0].parent == tmp_path / "kernels" and built[0].exists()
        assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built[0].name]  # no temporary left behind
        read = native.Path.read_text
        monkeypatch.setattr(native.Path, "read_text", lambda self: read(self) + ("\n/* changed */" if self == native.SOURCE else ""))
        native._library.cache_clear()
        assert native.available() and len(built) == 2 and built[1] != built[0]  # another source, another library
    finally:
        native._library.cache_clear()


@pytest.mark.parametrize("env, why", [({"CC": "/nonexistent/cc"}, "no C compiler"), ({"CC": "false"}, "did not build"),
                                      ({"CC": "true"}, "did not build or load")])  # "builds" nothing: no file to load
def test_without_a_working_compiler_the_cpu_default_is_sdpa(monkeypatch, tmp_path, env, why):
    monkeypatch.setenv("EXSPEC_CACHE", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    native._library.cache_clear()
    try:
        assert not native.available() and why in native.unavailable_reason()
        cpu = torch.device("cpu")
        assert "native" not in backends.available_names(cpu) and backends.default_backend(cpu) == "sdpa"
        with pytest.raises(ValueError, match="cannot run on cpu"):
            backends.create("native", cpu)
        with pytest.raises(RuntimeError, match=why):
            native.paged_attention_cpu(torch.zeros(1, 1, 1, 8), torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8),
                                       torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
    finally:
        native._library.cache_clear()
    monkeypatch.undo()
    assert native.available()

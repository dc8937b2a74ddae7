"""Static-shape draft and verify forwards (engine/static_forward.py) are capturable: `torch.compile(fullgraph=True,
dynamic=False)` takes each one as a single graph (any graph break, host sync or untraceable side effect raises),
and the compiled forward gives the eager static forward's logits and the engine's normal `extend`'s.

For each architecture: the draft forward (Q = 1) and the verify forward (Q = k + 1) at two buckets (2 and 4),
each bucket run with fewer rows than it holds (padding rows) at mixed starts and scattered blocks. `aot_eager`
keeps compilation short; CUDA graph capture is NOT exercised here (no GPU on CI).
"""

from __future__ import annotations

import pytest
import torch
from tests.support.models import ARCHS, random_prompts

from exspec.engine.static_forward import StaticForward, bucket_for

pytestmark = pytest.mark.models

K = 4  # the verify's query length is K + 1
# (bucket, rows run): padding rows in both buckets
BUCKETS = [(2, 1), (4, 3)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _engine_with_rows(models, arch: str, variant: str, rows: int):
    """An engine whose first `rows` slots hold prompts of different lengths (mixed starts), with room for K + 1
    more positions, their blocks interleaved (row 0's blocks are not contiguous)."""
    engine = models.engine(arch, variant, max_num_seqs=4, max_model_len=64, max_num_speculative_tokens=K, attention="reference")
    lengths = [13, 5, 21, 9][:rows]
    prompts = random_prompts(lengths, seed=11)
    blocks = engine.blocks
    need = [blocks.blocks_for(length + K + 1) for length in lengths]
    ids: list[list[int]] = [[] for _ in lengths]
    next_id = 1
    for i in range(max(need)):  # interleave the slots' blocks: block i of each row in turn
        for s in range(len(lengths)):
            if i < need[s]:
                ids[s].append(next_id)
                next_id += 1
    for s, row in enumerate(ids):
        blocks.assign(s, row)
    assert rows == 1 or blocks.first_contiguous_block(0, lengths[0]) == -1  # row 0's blocks are not contiguous
    for slot, prompt in enumerate(prompts):
        tokens = torch.tensor([prompt])
        for runner in (engine.target, engine.draft):
            runner.extend(tokens, [0], [slot])
    return engine, lengths


def _compare(runner, q_len: int, bucket: int, rows: int, starts: list[int]):
    static = StaticForward(runner, bucket, q_len)
    tokens = torch.randint(3, runner.vocab_size, (rows, q_len), generator=torch.Generator().manual_seed(q_len))
    slots = list(range(rows))
    expected = runner.extend(tokens, starts, slots, force_per_row=True)  # [B, Q, V]: the engine's path
    pools = [p[1:].clone() for p in runner.pools.keys + runner.pools.values]  # every block but the null block
    eager = static.run(tokens, starts, slots)  # [B, Q, V]
    torch._dynamo.reset()
    static.compile(backend="aot_eager")
    compiled = static.run(tokens, starts, slots)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = static.run(tokens, starts, slots)  # a second call reuses the graph (dynamic=False: no recompile)
    # the static forwards wrote the same K/V as extend where rows own blocks; padding rows wrote the null block only
    for before, after in zip(pools, [p[1:] for p in runner.pools.keys + runner.pools.values]):
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # float rounding only (gemm order)
    for name, got in (("eager static", eager), ("compiled", compiled), ("compiled again", again)):
        assert got.shape == (rows, q_len, runner.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"{name} vs extend")
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), name


@pytest.mark.parametrize("arch, variant", [(a, "draft") for a in ARCHS] + [("mistral", "window")])
def test_draft_and_verify_forwards_compile_fullgraph(models, arch, variant):
    for bucket, rows in BUCKETS:
        engine, lengths = _engine_with_rows(models, arch, variant, rows)
        # draft: one token per row at each row's next position
        _compare(engine.draft, 1, bucket, rows, starts=list(lengths))
        # verify: K + 1 tokens per row from its next position
        _compare(engine.target, K + 1, bucket, rows, starts=list(lengths))


def test_bucket_for():
    assert [bucket_for(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


# The engine with EngineConfig.compile on: tests/engine/test_engine_equivalence.py (its `compiled` cases).


def test_static_addresses_marked_for_cuda_graphs_still_compile(models):
    """On CUDA `compile` marks the pools and buffers as static addresses (CUDA graphs skip a graph that mutates an
    input that is not); marked, the forward is still one graph and still matches `extend` (the capture itself is
    NOT exercised: no GPU on CI)."""
    engine, lengths = _engine_with_rows(models, "llama", "draft", 3)
    static = StaticForward(engine.target, 4, K + 1)
    static.mark_static()
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in static.static_tensors())
    assert len(static.static_tensors()) == 2 * engine.target.model.config.num_hidden_layers + 8
    tokens = torch.randint(3, engine.target.vocab_size, (3, K + 1), generator=torch.Generator().manual_seed(0))
    expected = engine.target.extend(tokens, list(lengths), [0, 1, 2], force_per_row=True)  # [3, K + 1, V]
    static.compile(backend="aot_eager")
    torch.testing.assert_close(static.run(tokens, list(lengths), [0, 1, 2]), expected, rtol=1e-4, atol=1e-4)

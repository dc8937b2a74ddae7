"""The paged KV: slot and block bookkeeping, admission limits, memory that follows the tokens held, the block
table and its null block, and the guarantee that K/V (and tokens) past a sequence's valid length are never
read, so rollback and block reuse need no copying or clearing."""

from __future__ import annotations

import pytest
import torch
from tests.support.driver import admit, prefill, run_to_end, step
from tests.support.models import EOS, random_prompts

from exspec.engine import CapacityError, InvalidRequestError, SamplingParams
from exspec.engine.kv_cache import SlotAllocator


def test_slot_allocator_hands_out_frees_and_reuses_slots():
    alloc = SlotAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and alloc.num_free == 0 and alloc.num_used == 3
    with pytest.raises(CapacityError, match="all 3 KV slots are in use"):
        alloc.allocate()
    alloc.free(got[1])
    assert alloc.num_free == 1
    assert alloc.allocate() == got[1]  # the freed slot is handed out again
    with pytest.raises(CapacityError):
        alloc.allocate()


def test_admitting_more_than_max_num_seqs_raises_capacity_error(models):
    engine = models.engine("llama", max_num_seqs=2)
    a = admit(engine, [5, 6, 7], SamplingParams())
    b = admit(engine, [8, 9], SamplingParams())
    assert engine.num_free_slots == 0 and {a.slot, b.slot} == {0, 1}
    with pytest.raises(CapacityError, match="max_num_seqs"):
        admit(engine, [10, 11], SamplingParams())
    engine.free(a.seq_id)
    assert a.slot == -1 and engine.num_free_slots == 1
    c = admit(engine, [10, 11], SamplingParams())
    assert c.slot in (0, 1) and c.slot != b.slot
    engine.free(a.seq_id)  # freeing twice is harmless
    assert engine.num_free_slots == 0


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        (list(range(4, 4 + 40)), "maximum sequence length is 40"),
        (list(range(4, 4 + 57)), "57 tokens"),
        ([5, 320, 6], "must be in \\[0, 320\\)"),
        ([5, -1], "must be in"),
    ],
)
def test_prompts_that_can_never_run_are_rejected(models, prompt, message):
    engine = models.engine("llama", max_num_seqs=2, max_model_len=40)
    with pytest.raises(InvalidRequestError, match=message):
        admit(engine, prompt, SamplingParams())
    assert engine.num_free_slots == 2  # nothing leaked


@torch.inference_mode()  # the pools are inference tensors
def _poison(engine, live, gen: torch.Generator) -> None:
    """Overwrite everything no sequence may read: in each model's pools every row but each live sequence's
    valid positions (target: up to its pending token; draft: up to draft_len) — the null block, free blocks,
    and the tails of owned blocks included; each token buffer past its length; every free slot entirely.
    Values are huge (but finite, so a masked-out key multiplied by a zero weight stays zero)."""
    owned = {s.slot: s for s in live}
    bs = engine.block_size
    for runner, bound in ((engine.target, lambda s: s.length - 1), (engine.draft, lambda s: s.draft_len)):
        keep = torch.zeros((engine.num_blocks + 1) * bs, dtype=torch.bool)  # pool rows a live sequence reads
        for slot, s in owned.items():
            pos = torch.arange(bound(s))
            keep[torch.tensor(engine.blocks.blocks(slot), dtype=torch.long)[pos // bs] * bs + pos % bs] = True
        for pool in runner.pools.keys + runner.pools.values:
            flat = pool.view(-1, *pool.shape[2:])  # [(num_blocks + 1) * block_size, kv_heads, head_dim]
            flat[~keep] = torch.randn(flat[~keep].shape, generator=gen) * 1e4
    for slot in range(engine.token_buf.shape[0]):
        start = owned[slot].length if slot in owned else 0
        n = engine.token_buf.shape[1] - start
        engine.token_buf[slot, start:] = torch.randint(0, engine.vocab_size, (n,), generator=gen)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("variant", ["noisy", "same"])
def test_stale_kv_past_valid_length_is_never_read(models, arch, variant):
    """Poisoning every position a sequence must not read, before prefill and between all steps, changes
    nothing: rejected drafts' K/V and padding writes are dead."""
    prompts = random_prompts([1, 9, 40, 77, 120, 3, 55, 16], seed=51)
    params = [SamplingParams(max_tokens=m) for m in (20, 13, 20, 7, 20, 16, 20, 11)]
    gen = torch.Generator().manual_seed(0)
    ks = [4, 1, 0, 6, 3]

    clean, _ = run_to_end(models.engine(arch, variant), prompts, params, lambda i: ks[i % 5])
    engine = models.engine(arch, variant)
    _poison(engine, [], gen)
    poisoned, outs = run_to_end(
        engine, prompts, params, lambda i: ks[i % 5], before_step=lambda e, live: _poison(e, live, gen)
    )
    assert [s.output_token_ids for s in poisoned] == [s.output_token_ids for s in clean]
    for prompt, seq, prm in zip(prompts, poisoned, params):
        assert seq.output_token_ids == models.reference(arch, prompt, prm.max_tokens)
    assert sum(o.num_accepted for out in outs for o in out.outputs) > 0


def test_poisoning_valid_kv_does_change_outputs(models):
    """The control for the test above: the same poison one position lower (into valid K/V) is seen."""
    prompts = random_prompts([30, 31], seed=52)
    params = SamplingParams(max_tokens=10)
    clean, _ = run_to_end(models.engine("llama", "noisy"), prompts, params, 3)

    @torch.inference_mode()
    def poison_valid(engine, live):
        bs = engine.block_size
        for pool in engine.target.pools.keys + engine.target.pools.values:
            for s in live:
                p = s.length - 2
                pool[engine.blocks.blocks(s.slot)[p // bs], p % bs] = 1e4

    bad, _ = run_to_end(models.engine("llama", "noisy"), prompts, params, 3, before_step=poison_valid)
    assert [s.output_token_ids for s in bad] != [s.output_token_ids for s in clean]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reused_slot_gives_the_same_output_as_a_fresh_engine(models, arch):
    """A long sequence fills its slot's K/V far past where the next, shorter owner will ever reach; the
    next owner's output equals a fresh engine's."""
    long_prompt, short_prompt = random_prompts([180, 12], seed=53)
    engine = models.engine(arch, "noisy", max_num_seqs=1)
    (first,), _ = run_to_end(engine, [long_prompt], SamplingParams(max_tokens=24, ignore_eos=True), 5, free=False)
    slot = first.slot
    engine.free(first.seq_id)
    (second,), _ = run_to_end(engine, [short_prompt], SamplingParams(max_tokens=24), 5, free=False)
    assert second.slot == slot == 0
    fresh_engine = models.engine(arch, "noisy", max_num_seqs=1)
    (fresh,), _ = run_to_end(fresh_engine, [short_prompt], SamplingParams(max_tokens=24), 5)
    assert second.output_token_ids == fresh.output_token_ids == models.reference(arch, short_prompt, 24)


@pytest.mark.parametrize("k", [2, 8])
def test_sequences_reaching_max_model_len_finish_with_length(models, k):
    max_model_len = 48
    lengths = [20, 30, 40, 44, 46, 47]
    prompts = random_prompts(lengths, seed=54)
    engine = models.engine("qwen3", "same", max_model_len=max_model_len)
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=100), k)
    for prompt, seq in zip(prompts, seqs):
        room = max_model_len - len(prompt)
        ref = models.reference("qwen3", prompt, room)
        assert seq.output_token_ids == ref
        if ref[-1] != EOS:
            assert seq.finish_reason == "length" and seq.length == max_model_len
    assert seqs[-1].finish_reason == "length" and len(seqs[-1].output_token_ids) == 1  # 47 + 1 from prefill
    assert engine.num_free_slots == engine.num_slots


# ------------------------------------------------------------------------------------------ paged blocks


def _block_manager(num_blocks: int, num_slots: int, max_blocks_per_seq: int, block_size: int = 4):
    from exspec.engine.kv_cache import BlockManager

    return BlockManager(num_blocks, block_size, num_slots, max_blocks_per_seq, torch.device("cpu"))


def test_block_manager_keeps_rows_contiguous_frees_and_reuses_blocks():
    blocks = _block_manager(num_blocks=10, num_slots=3, max_blocks_per_seq=6)
    assert blocks.num_free_blocks == 10 and blocks.blocks_for(9) == 3 and blocks.blocks_for(8) == 2
    assert blocks.free_runs() == [(1, 10)]
    blocks.grow([(0, 3), (1, 2)])
    # Row 1's first blocks go in the middle of the run after row 0 (4..10): row 0 keeps room to grow.
    assert blocks.blocks(0) == [1, 2, 3] and blocks.blocks(1) == [7, 8]  # block 0 is never handed out
    assert blocks.block_table[0].tolist() == [1, 2, 3, 0, 0, 0]  # past the owned blocks: the null block
    assert blocks.first_contiguous_block(0, 12) == 1 and blocks.first_contiguous_block(0, 13) == -1
    blocks.grow([(0, 5)])  # the blocks right after row 0's last one
    assert blocks.blocks(0) == [1, 2, 3, 4, 5] and blocks.free_runs() == [(6, 6), (9, 10)]
    blocks.grow([(2, 1)])  # the largest run, 9..10, follows row 1's last block: its middle
    assert blocks.blocks(2) == [10]
    blocks.grow([(1, 4)])  # 9 is free, 10 is taken: the end of the largest run left, 6; row 1 is scattered now
    assert blocks.blocks(1) == [7, 8, 9, 6] and blocks.first_contiguous_block(1, 1) == -1
    assert blocks.block_table[1].tolist() == [7, 8, 9, 6, 0, 0] and blocks.num_free_blocks == 0
    with pytest.raises(CapacityError, match="2 KV blocks needed, 0 of 10 free"):
        blocks.grow([(2, 2), (0, 6)])  # all or nothing
    assert blocks.blocks(2) == [10] and blocks.blocks(0) == [1, 2, 3, 4, 5] and blocks.block_table[2].tolist() == [10] + [0] * 5
    blocks.free(1)
    assert blocks.num_free_blocks == 4 and blocks.block_table[1].tolist() == [0] * 6
    assert blocks.free_runs() == [(6, 9)]  # the scattered row's blocks merge into one run
    blocks.grow([(0, 6)])
    assert blocks.blocks(0) == [1, 2, 3, 4, 5, 6] and blocks.first_contiguous_block(0, 24) == 1
    blocks.free(0)
    blocks.free(2)
    assert blocks.free_runs() == [(1, 10)] and blocks.num_free_blocks == 10
    with pytest.raises(CapacityError, match="at most 6"):
        blocks.grow([(0, 7)])


@pytest.mark.parametrize("prompt_blocks", [[1] * 8, [3, 1, 5, 2, 4, 1, 6, 2]])
def test_rows_admitted_back_to_back_and_grown_in_turn_stay_contiguous(prompt_blocks):
    """The offline pattern that interleaved rows under lowest-id-first: admit 8 rows one after another, then
    grow each a block per step in turn. With a pool 4x what they end up holding every row stays one run."""
    final = 16
    blocks = _block_manager(num_blocks=4 * 8 * final, num_slots=8, max_blocks_per_seq=final)
    for slot, n in enumerate(prompt_blocks):
        blocks.grow([(slot, n)])
    for n in range(2, final + 1):
        blocks.grow([(slot, max(n, p)) for slot, p in enumerate(prompt_blocks)])
        for slot in range(8):
            assert blocks.first_contiguous_block(slot, 1) == blocks.blocks(slot)[0], (n, slot, blocks.blocks(slot))
    assert blocks.num_free_blocks == 3 * 8 * final  # nothing reserved: memory follows the blocks held
    for slot in range(8):
        blocks.free(slot)
    assert blocks.free_runs() == [(1, 4 * 8 * final)]


def test_a_full_pool_hands_out_every_block():
    """No block is lost to placement: rows growing in turn fill the pool to its last block (rows that run into
    a neighbour continue elsewhere, scattered), and a row longer than any free run still gets its blocks."""
    blocks = _block_manager(num_blocks=37, num_slots=6, max_blocks_per_seq=37)
    held = [1, 1, 1, 1, 1]
    for slot in range(5):
        blocks.grow([(slot, 1)])
    while blocks.num_free_blocks:
        slot = min(range(5), key=lambda s: held[s])
        held[slot] += 1
        blocks.grow([(slot, held[slot])])
    owned = [b for s in range(5) for b in blocks.blocks(s)]
    assert sorted(owned) == list(range(1, 38)) and blocks.free_runs() == []
    with pytest.raises(CapacityError, match="1 KV blocks needed, 0 of 37 free"):
        blocks.grow([(5, 1)])
    for slot in (0, 2, 4):
        blocks.free(slot)
    free = [b for s, e in blocks.free_runs() for b in range(s, e + 1)]
    assert max(e - s + 1 for s, e in blocks.free_runs()) < len(free)  # no run holds them all
    blocks.grow([(5, len(free))])
    assert sorted(blocks.blocks(5)) == free and blocks.num_free_blocks == 0
    assert blocks.first_contiguous_block(5, 1) == -1


@pytest.mark.parametrize("seed", range(6))
def test_random_grow_and_free_against_a_reference(seed):
    """Random admissions, growth and frees (some all-or-nothing failures): every block owned at most once, the
    free runs are exactly the blocks no row owns (maximal runs), a new row's blocks land in a largest run when
    one holds them, the table mirrors the rows, and freeing everything leaves one run."""
    import random

    rng = random.Random(seed)
    num_blocks, slots, cap = rng.choice([(40, 5, 16), (200, 12, 40), (63, 8, 63)])
    blocks = _block_manager(num_blocks=num_blocks, num_slots=slots, max_blocks_per_seq=cap)
    for _ in range(400):
        live = [s for s in range(slots) if blocks.held(s)]
        if live and rng.random() < 0.2:
            blocks.free(rng.choice(live))
        else:
            picked = rng.sample(range(slots), rng.randint(1, 3))
            wants = [(s, min(cap, blocks.held(s) + rng.choice([1, 1, 1, 2, 5]))) for s in picked]
            need = sum(n - blocks.held(s) for s, n in wants)
            runs_before = blocks.free_runs()
            before = [list(blocks.blocks(s)) for s in range(slots)]
            if need > blocks.num_free_blocks:
                with pytest.raises(CapacityError):
                    blocks.grow(wants)
                assert [blocks.blocks(s) for s in range(slots)] == before and blocks.free_runs() == runs_before
            else:
                blocks.grow(wants)
                for s, n in wants:
                    assert blocks.blocks(s)[: len(before[s])] == before[s] and blocks.held(s) == n
                (s, n), = wants[:1]
                longest = max((e - b + 1 for b, e in runs_before), default=0)
                if not before[s] and n <= longest:  # the first row placed by this call saw runs_before
                    first = blocks.blocks(s)[0]
                    assert any(b <= first <= e and e - b + 1 == longest for b, e in runs_before)
                    assert blocks.first_contiguous_block(s, 1) == first
        owned = [b for s in range(slots) for b in blocks.blocks(s)]
        runs = blocks.free_runs()
        free = [b for s, e in runs for b in range(s, e + 1)]
        assert len(set(owned)) == len(owned) and sorted(owned + free) == list(range(1, num_blocks + 1))
        assert blocks.num_free_blocks == len(free)
        assert all(e + 1 < s2 for (_, e), (s2, _) in zip(runs, runs[1:]))  # maximal: neighbours were merged
        for s in range(slots):
            row = blocks.blocks(s)
            assert blocks.block_table[s].tolist() == row + [0] * (cap - len(row))
            if blocks.first_contiguous_block(s, 1) > 0:
                assert row == list(range(row[0], row[0] + len(row)))
    for s in range(slots):
        blocks.free(s)
    assert blocks.free_runs() == [(1, num_blocks)] and blocks.num_free_blocks == num_blocks


def _engine_with_blocks(models, num_blocks: int, **overrides):
    """An engine whose pool holds exactly num_blocks blocks (kv_cache_memory in bytes)."""
    from exspec.engine.kv_cache import KVPools

    pair = models.pair("llama", overrides.pop("variant", "noisy"))
    bs = overrides.get("block_size", 16)
    per_block = sum(KVPools.bytes_per_block(m.config, bs, torch.float32) for m in (pair.target, pair.draft))
    engine = models.engine("llama", "noisy", kv_cache_memory=per_block * num_blocks, **overrides)
    assert engine.num_blocks == num_blocks
    return engine


def test_kv_memory_follows_the_tokens_held(models):
    """Blocks in use are the sequences' tokens rounded up to blocks, not slots x max_model_len."""
    engine = models.engine("llama", "noisy", max_num_seqs=8, max_model_len=320)
    assert engine.num_blocks == 8 * 20 and engine.num_free_blocks == engine.num_blocks  # capped at 8 x 320 positions
    short = admit(engine, [5] * 5, SamplingParams(max_tokens=4))
    assert engine.num_blocks - engine.num_free_blocks == 1
    long = admit(engine, [6] * 100, SamplingParams(max_tokens=4))
    assert engine.num_blocks - engine.num_free_blocks == 1 + 7
    assert engine.blocks_needed(None, 100) == 7 and engine.blocks_needed(long.seq_id, 112) == 0
    assert engine.blocks_needed(long.seq_id, 113) == 1 and engine.blocks_needed(short.seq_id, 400) == 19  # capped
    engine.free(long.seq_id)
    assert engine.num_blocks - engine.num_free_blocks == 1
    engine.free(short.seq_id)
    assert engine.num_free_blocks == engine.num_blocks


def test_the_pool_is_sized_from_memory_and_refuses_only_a_max_model_len_one_sequence_cannot_fit(models):
    from exspec.errors import ConfigError

    engine = _engine_with_blocks(models, 20)  # exactly one sequence of 320 positions
    assert engine.num_free_blocks == 20 and engine.block_size == 16
    with pytest.raises(ConfigError, match=r"one sequence of max_model_len 320 needs 20 KV blocks of 16 positions .* holds 19"):
        _engine_with_blocks(models, 19)
    small = models.engine("llama", "noisy", kv_cache_memory=0.5)  # a fraction of the free memory, capped
    assert small.num_blocks == 16 * 20


def test_blocks_run_out_add_and_step_raise_capacity_error_before_any_change(models):
    """A pool of 12 blocks of 4 positions: admission and growth fail whole, and the engine goes on exactly
    as the target alone once blocks are freed."""
    engine = _engine_with_blocks(models, 12, block_size=4, max_model_len=48)
    a = admit(engine, list(range(10, 30)), SamplingParams(max_tokens=12))  # 20 tokens: 5 blocks
    b = admit(engine, list(range(40, 57)), SamplingParams(max_tokens=12))  # 17 tokens: 5 blocks
    assert engine.num_free_blocks == 2
    with pytest.raises(CapacityError, match="needs 3 KV blocks, 2 of 12 are free"):
        admit(engine, list(range(60, 70)), SamplingParams())
    assert engine.num_free_blocks == 2 and engine.num_free_slots == engine.num_slots - 2
    prefill(engine, [(a, 0, 20), (b, 0, 17)])
    # a at length 21 needs blocks for 21 + 4 = 25 positions (7), b for 22 (6): 3 more than the 2 free.
    assert engine.blocks_needed(a.seq_id, a.length + 4) == 2 and engine.blocks_needed(b.seq_id, b.length + 4) == 1
    lengths = (engine._seqs[a.seq_id].length, engine._seqs[b.seq_id].length)
    with pytest.raises(CapacityError):
        step(engine, [a, b], 4)
    assert engine.num_free_blocks == 2 and (engine._seqs[a.seq_id].length, engine._seqs[b.seq_id].length) == lengths
    engine.free(b.seq_id)  # preempted: recomputed from its prompt later
    while not a.finished:
        step(engine, [a], 4)
    engine.free(a.seq_id)
    assert engine.num_free_blocks == 12
    (b2,), _ = run_to_end(engine, [list(range(40, 57))], SamplingParams(max_tokens=12), 4)
    assert a.output_token_ids == models.reference("llama", list(range(10, 30)), 12)
    assert b2.output_token_ids == models.reference("llama", list(range(40, 57)), 12)


@pytest.mark.parametrize("variant", ["noisy", "disagree", "same"])
def test_rollback_across_block_boundaries_and_growth_over_many_blocks(models, variant):
    """Blocks of 4 positions, k = 5: every step's drafts cross a block boundary and rejected ones are rolled
    back by not advancing; each sequence grows over a dozen blocks, fragmented among its batchmates'."""
    engine = models.engine("llama", variant, block_size=4)
    prompts = random_prompts([3, 9, 17, 30], seed=55)
    seqs, outs = run_to_end(engine, prompts, SamplingParams(max_tokens=48, ignore_eos=True), 5, free=False)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == models.reference("llama", prompt, 48, eos_token_ids=())
        blocks = engine.blocks.blocks(seq.slot)
        assert len(blocks) >= -(-seq.length // 4) and len(blocks) >= 12 and 0 not in blocks
        table = engine.blocks.block_table[seq.slot].tolist()
        assert table[: len(blocks)] == blocks and set(table[len(blocks) :]) <= {0}
    assert len({b for s in seqs for b in engine.blocks.blocks(s.slot)}) == sum(len(engine.blocks.blocks(s.slot)) for s in seqs)
    for seq in seqs:
        engine.free(seq.seq_id)
    assert engine.num_free_blocks == engine.num_blocks and int(engine.blocks.block_table.abs().sum()) == 0


def test_assign_gives_exactly_the_ids_asked_and_frees_them_back():
    from exspec.engine.kv_cache import BlockManager

    blocks = BlockManager(8, 4, 3, 4, torch.device("cpu"))
    blocks.assign(0, [2, 5, 3])
    assert blocks.blocks(0) == [2, 5, 3] and blocks.first_contiguous_block(0, 12) == -1
    assert blocks.block_table[0].tolist() == [2, 5, 3, 0]
    assert blocks.num_free_blocks == 5 and blocks.free_runs() == [(1, 1), (4, 4), (6, 8)]
    blocks.assign(1, [6, 7])
    assert blocks.first_contiguous_block(1, 8) == 6
    with pytest.raises(CapacityError, match="not free"):
        blocks.assign(2, [1, 5])
    with pytest.raises(ValueError):
        blocks.assign(0, [1])
    blocks.free(0)
    blocks.free(1)
    assert blocks.free_runs() == [(1, 8)] and blocks.num_free_blocks == 8

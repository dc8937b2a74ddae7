"""The speculative decoding engine: admit sequences by id, prefill them, run speculative steps, free them."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch

from exspec.engine.config import KV_MEMORY_DEFAULT, EngineConfig
from exspec.engine.kv_cache import BlockManager, KVPools, SlotAllocator, available_memory
from exspec.engine.loader import ModelPair, load_model_pair
from exspec.engine.lookup import ngram_proposals
from exspec.engine.params import SamplingParams
from exspec.engine.runner import ModelRunner, to_device
from exspec.engine.sampling import (
    STREAM_DRAFT,
    STREAM_TARGET,
    RowParams,
    accept,
    accept_greedy,
    process_probs,
    read_logprobs,
    sample_from_probs,
    token_logprobs,
)
from exspec.engine.sequence import SeqState
from exspec.engine.static_forward import StaticForward, bucket_for, graph_memory_bytes, static_buckets, static_widths
from exspec.engine.types import PrefillBatch, SeqOutput, StepBatch, StepOutput
from exspec.errors import CapacityError, ConfigError, InvalidRequestError


class _Clock:
    """Wall time of a phase; on CUDA, events read after the step's one host sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Only after the host sync that follows `end` (a CUDA event must have completed to be read)."""
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


@dataclass(frozen=True)
class StepPlan:
    """One speculative step, resolved once from a `StepBatch`: every phase reads it, none changes it."""

    seq_ids: tuple[int, ...]  # [B] the batch's sequences, in order
    states: tuple[SeqState, ...]  # [B] their engine state (host)
    lengths: tuple[int, ...]  # [B] each row's length, pending token included (host)
    slots: tuple[int, ...]  # [B] each row's KV slot (host)
    row_k: tuple[int, ...]  # [B] each row's draft budget: 0 for opted-out rows, less near max_model_len
    k: int  # draft tokens proposed per row: max(row_k); the batch stays rectangular
    grouped: bool  # every length equal (and not forced mixed): shared positions, one causal mask
    generated: tuple[int, ...]  # [B] tokens each row has generated so far (min_tokens)
    slot_t: torch.Tensor  # [B] long
    len_t: torch.Tensor  # [B] long
    out_pos: torch.Tensor  # [B, k + 1] long: the position each emitted token lands at
    allow: torch.Tensor  # [B, k] bool: draft column j of row b may be accepted (j < row_k[b])
    rows: RowParams  # per-row sampling parameters
    penalties: Penalties | None  # what the penalties read of the rows' tokens; None: no row has penalties


@dataclass(frozen=True)
class Penalties:
    """What the presence, frequency and repetition penalties read of a batch's context (each row's tokens before the
    logits' columns, not the drafts), made once per step or prefill (`SpecEngine._penalties`) for every forward."""

    ids: torch.Tensor  # [B, L] long: each row's context tokens (past its length: its first token)
    counts: torch.Tensor  # [B, V] float: occurrences in the row's output (frequency, presence)
    held: torch.Tensor  # [B, V] bool: in the row's context, prompt included (repetition)
    rep: torch.Tensor  # [B, 1, 1] float: repetition_penalty (1: off)
    freq: torch.Tensor  # [B, 1, 1] float: frequency_penalty
    pres: torch.Tensor  # [B, 1, 1] float: presence_penalty


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [B, k] long: proposed tokens d_1..d_k
    probs: torch.Tensor | None  # [B, k, V]: the distributions q they were drawn from; None if all greedy


def _logprobs_width(states, field: str = "logprobs") -> int | None:
    """The most alternatives a row of the batch asks for (`field`: logprobs or prompt_logprobs), or None when no
    row asks."""
    asked = [n for n in (getattr(st.params, field) for st in states) if n is not None]
    return max(asked) if asked else None


class SpecEngine:
    """Batched speculative decoding over paged per-sequence KV (engine/kv_cache.py).

    The scheduler names sequences by id: `add(seq_id, prompt, params)`, then `prefill` and `step` batches of
    ids, then `free(seq_id)`. Each call does exactly one device-to-host transfer (the sampled tokens and
    acceptance counts). The engine never decides that a sequence is finished: it samples, the scheduler cuts.
    A sequence holds KV blocks for its prompt from `add`, gets the blocks a step may write at the start of
    that step, and returns them at `free`; when blocks run short, `add` and `step` raise CapacityError
    before changing anything (the scheduler checks `blocks_needed` first).
    """

    def __init__(self, config: EngineConfig, pair: ModelPair | None = None, seed: int = 0) -> None:
        self.config = config
        self.pair = pair if pair is not None else load_model_pair(config)
        self.tokenizer = self.pair.tokenizer
        self.model_name = self.pair.name
        self.eos_token_ids = self.pair.eos_token_ids
        self.vocab_size = self.pair.vocab_size
        slots, self.max_model_len = config.max_num_seqs, config.max_model_len
        # speculative_method "ngram": drafts from each row's own tokens (engine/lookup.py), no draft model
        self.lookup = config.speculative_method == "ngram"
        self.max_k = config.max_num_speculative_tokens if self.pair.draft is not None or self.lookup else 0
        # a lookup engine that may draft looks each row up again when a call commits (the next step's match)
        self.lookahead = self.lookup and self.max_k > 0
        pool_len = EngineConfig.token_pool_length(self.max_model_len, self.max_k)  # slack for a verify's k + 1
        att = config.attention
        dev = next(self.pair.target.parameters()).device
        self.block_size = config.block_size
        max_blocks = -(-self.max_model_len // self.block_size)
        self.num_blocks = self._pool_blocks(config, dev, max_blocks)
        self.blocks = BlockManager(self.num_blocks, self.block_size, slots, max_blocks, dev)
        try:
            self.target = ModelRunner(self.pair.target, self.blocks, self.vocab_size, attention=att)
            self.draft = (
                ModelRunner(self.pair.draft, self.blocks, self.vocab_size, attention=att)
                if self.pair.draft is not None
                else None
            )
        except torch.OutOfMemoryError as e:  # pragma: no cover - depends on the device
            raise ConfigError(f"cannot allocate {self.num_blocks} KV blocks: lower --kv-cache-memory") from e
        self.device = dev
        self.allocator = SlotAllocator(slots)
        self.token_buf = torch.zeros(slots, pool_len, dtype=torch.long, device=dev)  # [slots, pool_len]
        # n-gram lookup: each row's proposals for its next step, written when a call commits (`_look_ahead`)
        self.proposals = torch.zeros(slots, self.max_k, dtype=torch.long, device=dev) if self.lookahead else None
        self.temperature = torch.zeros(slots, device=dev)  # [slots]
        self.top_p = torch.ones(slots, device=dev)  # [slots]
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)  # [slots]
        self.seeds = torch.zeros(slots, dtype=torch.long, device=dev)  # [slots]
        empty = torch.empty(0, device=dev)
        # All rows greedy: nothing reads the per-row tensors (every use is behind `any_sampling`), so they stay empty.
        self._greedy_rows = RowParams(empty, empty, empty.long(), empty.long(), any_sampling=False, any_filter=False)
        self._seqs: dict[int, SeqState] = {}
        self._seed_rng = random.Random(seed)
        self._clock = _Clock(dev)
        self._static: dict[tuple[bool, int, int], StaticForward] = {}  # (draft?, bucket, Q): config.compile only
        # compile_mode "cudagraph": the memory pool the captured graphs share
        cudagraph = config.compile and config.compile_mode == "cudagraph"
        self._graph_pool = torch.cuda.graph_pool_handle() if cudagraph else None
        self._warm_up()
        if cudagraph:  # every graph before the first request: none is captured in the serving loop
            self.prepare_static()

    # ------------------------------------------------------------------ admission

    @property
    def has_draft(self) -> bool:
        """Whether steps can draft: a draft model, or n-gram lookup."""
        return self.draft is not None or self.lookup

    @property
    def has_draft_model(self) -> bool:
        """Whether the drafts come from a draft model (not n-gram lookup)."""
        return self.draft is not None

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def blocks_needed(self, seq_id: int | None, length: int) -> int:
        """New blocks the sequence must be given to hold positions [0, length) (positions past max_model_len
        are never held: they are padding); seq_id None: a sequence not yet added. 0 when it holds them."""
        want = self.blocks.blocks_for(min(length, self.max_model_len))
        if seq_id is None:
            return want
        return max(0, want - self.blocks.held(self._states([seq_id])[0].slot))

    def _pool_blocks(self, config: EngineConfig, device: torch.device, max_blocks: int) -> int:
        """KV blocks the pools get: the memory budget over both models' bytes per block, at most enough for
        max_num_seqs sequences of max_model_len. ConfigError (with the figures) if one such sequence cannot fit."""
        models = [m for m in (self.pair.target, self.pair.draft) if m is not None]
        per_block = sum(
            KVPools.bytes_per_block(m.config, config.block_size, next(m.parameters()).dtype) for m in models
        )
        mem = config.kv_cache_memory if config.kv_cache_memory is not None else KV_MEMORY_DEFAULT[device.type]
        if isinstance(mem, float):
            free = available_memory(device)
            if config.compile and device.type == "cuda":  # the captured graphs' pool first (an estimate, unmeasured)
                free = max(0, free - graph_memory_bytes(self.pair.target, self.pair.draft, config.max_num_seqs, self.max_k,
                                                         self.vocab_size))
            budget, what = int(mem * free), f"{mem:g} of the {free / 2**30:.2f} GiB free on {device.type}"
        else:
            budget, what = mem, "asked for"
        num = min(budget // per_block, config.max_num_seqs * max_blocks)
        if num < max_blocks:
            raise ConfigError(
                f"one sequence of max_model_len {self.max_model_len} needs {max_blocks} KV blocks of "
                f"{config.block_size} positions ({max_blocks * per_block / 2**30:.2f} GiB for the target and draft), "
                f"but the KV cache memory, {budget / 2**30:.2f} GiB ({what}), holds {num}: "
                "lower --max-model-len or raise --kv-cache-memory"
            )
        return num

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise InvalidRequestError if this prompt can never be admitted."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; the maximum sequence length is {self.max_model_len} "
                f"(prompt + at least one generated token)"
            )
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError if a parameter cannot reach a tensor of this engine."""
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(f"top_k must be in [0, {self.vocab_size}] (0: off), got {params.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.vocab_size:
                raise InvalidRequestError(f"{name} must be in [0, {self.vocab_size}], got {n}")
        out = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if out:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {out[:5]}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")

    def add(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admit a sequence under `seq_id`: take a slot and the blocks its prompt needs (CapacityError when
        either is short). Prefill comes later. Either the sequence is admitted whole or nothing changes."""
        if seq_id in self._seqs:
            raise InvalidRequestError(f"sequence id {seq_id} is already in use")
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        n = len(prompt_token_ids)
        if params.recomputed >= n:
            raise InvalidRequestError(f"recomputed must be below the prompt's {n} tokens, got {params.recomputed}")
        need = self.blocks_needed(None, n)
        if need > self.blocks.num_free_blocks:
            raise CapacityError(f"the prompt needs {need} KV blocks, {self.blocks.num_free_blocks} of {self.num_blocks} are free")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        slot = self.allocator.allocate()
        try:
            self.blocks.grow([(slot, need)])
            self.token_buf[slot, :n] = to_device(prompt_token_ids, self.device)
            # fill_ takes the value as a kernel argument; `t[slot] = value` copies a CPU scalar from pageable memory,
            # a host sync each on CUDA (four per admitted request, seen in an H100 trace, 2026-11-27)
            self.temperature[slot].fill_(params.temperature)
            self.top_p[slot].fill_(params.top_p)
            self.top_k[slot].fill_(params.top_k)
            self.seeds[slot].fill_(seed)
        except BaseException:
            self.blocks.free(slot)
            self.allocator.free(slot)
            raise
        state = SeqState(slot=slot, prompt_len=n, params=params, seed=seed, length=n)
        if params.min_tokens:  # the ids it suppresses, on the device once (no host copy in a step)
            state.stop_ids = to_device([t for t in (*self.eos_token_ids, *params.stop_token_ids)
                                        if t < self.vocab_size], self.device)
        if params.logit_bias:
            state.bias = (to_device([t for t, _ in params.logit_bias], self.device),
                          to_device([v for _, v in params.logit_bias], self.device, torch.float32))
        self._seqs[seq_id] = state

    def free(self, seq_id: int) -> None:
        """Give the sequence's slot and blocks back (a no-op for an unknown id). Its stale K/V is simply
        overwritten by the blocks' next owner."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.blocks.free(state.slot)
            self.allocator.free(state.slot)

    def _states(self, seq_ids) -> list[SeqState]:
        try:
            return [self._seqs[i] for i in seq_ids]
        except KeyError as e:
            raise InvalidRequestError(f"unknown sequence id {e.args[0]}") from None

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> StepOutput:
        """Feed prompt chunks into both caches (one batched forward each); sample the first token of
        every sequence whose prompt completes."""
        chunks = batch.chunks
        states = self._states(c.seq_id for c in chunks)
        for c, st in zip(chunks, states):
            if not (c.start == st.num_prefilled and c.start < c.end <= st.prompt_len):
                raise InvalidRequestError(
                    f"sequence {c.seq_id}: chunk [{c.start}, {c.end}) does not continue its prefill "
                    f"({st.num_prefilled} of {st.prompt_len} prompt tokens done)"
                )
        starts = [c.start for c in chunks]
        widths = [c.end - c.start for c in chunks]
        slots = [st.slot for st in states]
        q_len = max(widths)
        dev = self.device
        slot_t = to_device(slots, dev)
        tokens = self._tokens(slot_t, starts, q_len)  # [B, Q]
        last = to_device(widths, dev)[:, None] - 1  # [B, 1]
        # The draft takes the chunk only where its cache reaches the chunk's start (a prompt begun without
        # the draft is caught up by its first drafting step instead).
        fed = [batch.draft and self.draft is not None and st.draft_len == c.start for c, st in zip(chunks, states)]
        t0 = self._clock.mark()
        draft_logits = None  # [B, 1, V]: the draft's at each prompt's end, where every chunk fed it
        if all(fed):
            draft_logits = self.draft.extend(tokens, starts, slots, select=last)
        elif any(fed):
            idx = [i for i, f in enumerate(fed) if f]
            rows = to_device(idx, dev)  # [b]
            self.draft.extend(tokens[rows], [starts[i] for i in idx], [slots[i] for i in idx], select=last[rows])
        t1 = self._clock.mark()
        plan = self._fused_plan(batch, states) if draft_logits is not None else None
        if plan is not None:
            return self._fused_prefill(plan, chunks, tokens, starts, last, draft_logits, t0, t1)
        prompt_width = _logprobs_width(states, "prompt_logprobs")
        if prompt_width is None:
            raw = self.target.extend(tokens, starts, slots, select=last)  # [B, 1, V]
        else:  # the logits of every chunk position: each predicts the prompt's next token
            every = self.target.extend(tokens, starts, slots)  # [B, Q, V]
            nxt = self._tokens(slot_t, [s + 1 for s in starts], q_len)  # [B, Q]: the token each position predicts
            prompt_lp = token_logprobs(every, nxt, prompt_width).flatten(1)  # [B, Q * (1 + 2 * prompt_width)]
            raw = every.gather(1, last[:, :, None].expand(-1, -1, every.shape[-1]))  # [B, 1, V]
        rows = self._row_params(states, slot_t)
        positions = to_device([st.prompt_len for st in states], dev)[:, None]  # [B, 1]
        penalties = self._penalties(states, slot_t, [st.prompt_len for st in states])
        logits = self._adjust(raw, states, [0] * len(states), penalties)
        first = self._sample(logits, rows, positions)[:, 0]  # [B]
        self.token_buf[slot_t, positions[:, 0]] = first
        t2 = self._clock.mark()
        width = _logprobs_width(states)
        parts = [first[:, None]]  # [B, 1]
        if self.lookahead:  # each row's first lookup (rows whose prompt is not done: unused, redone when it is)
            parts.append(self._look_ahead(slot_t, positions[:, 0] + 1, max(st.prompt_len for st in states) + 1))
        if width is None and prompt_width is None:
            packed = torch.cat(parts, dim=1).tolist()  # [B, 1 (+ 1)]: the one host sync
        else:  # the tokens and their logprobs in one read: [B, 1 (+ 1) (+ 1 + 2 * width) (+ Q * (1 + 2 * prompt_width))]
            parts = [p.double() for p in parts]
            if width is not None:
                parts.append(token_logprobs(raw, first[:, None], width).flatten(1))
            if prompt_width is not None:
                parts.append(prompt_lp)
            packed = torch.cat(parts, dim=1).tolist()
        outputs = []
        lead = 1 + self.lookahead  # the token (and the match) before a row's logprobs
        after = lead + (0 if width is None else 1 + 2 * width)  # where a row's prompt logprobs start
        for chunk, st, row, draft_fed in zip(chunks, states, packed, fed):
            st.num_prefilled = chunk.end
            if draft_fed:
                st.draft_len = chunk.end
            done = chunk.end == st.prompt_len
            if done:
                st.length += 1
                if self.lookahead:
                    st.lookup_n = int(row[1])
            logprobs = prompt_logprobs = None
            if done and st.params.logprobs is not None:
                logprobs = read_logprobs(row[lead:], 1, width, st.params.logprobs)
            if st.params.prompt_logprobs is not None:
                # the chunk's positions start .. end - 1 predict tokens start + 1 .. end; the prompt's last
                # position predicts the first generated token, reported with `logprobs`
                num = min(chunk.end, st.prompt_len - 1) - chunk.start
                prompt_logprobs = (None,) if chunk.start == 0 else ()
                prompt_logprobs += read_logprobs(row[after:], num, prompt_width, st.params.prompt_logprobs)
            outputs.append(SeqOutput(chunk.seq_id, (int(row[0]),) if done else (), 0, 0, logprobs, prompt_logprobs,
                                     drafts_next=self._drafts_next(st)))
        return StepOutput(
            outputs=tuple(outputs),
            kind="prefill",
            batch_size=len(states),
            num_draft_tokens=0,
            accepted_per_position=(),
            draft_s=self._clock.seconds(t0, t1),
            verify_s=self._clock.seconds(t1, t2),
        )

    def _fused_plan(self, batch: PrefillBatch, states) -> StepPlan | None:
        """The step plan of a fused prefill (each chunk completes its prompt and was fed to the draft, k > 0, some
        row has room to draft, the blocks for the drafts free), or None: the prefill samples one token a row."""
        k = min(batch.num_draft_tokens, self.max_k)
        if k <= 0 or any(c.end != st.prompt_len for c, st in zip(batch.chunks, states)):
            return None
        if not any(st.params.use_speculation for st in states):
            return None
        if _logprobs_width(states, "prompt_logprobs") is not None:  # the unfused prefill reads every position
            return None
        try:
            plan = self._make_plan(tuple(c.seq_id for c in batch.chunks), states, k)
        except CapacityError:  # no blocks for the drafts' positions: prefill without them (nothing changed)
            return None
        return plan if plan.k > 0 else None  # every row at max_model_len - 1: no room for a draft

    def _fused_prefill(self, plan: StepPlan, chunks, tokens, starts, last, draft_logits, t0, t1) -> StepOutput:
        """The prompts' last chunks, already fed to the draft (`draft_logits` [B, 1, V], at each prompt's end):
        the draft proposes k tokens, and one target forward reads each chunk with its drafts and verifies them
        (Hugging Face assisted generation's first forward): a row emits up to k + 1 tokens, where an unfused
        prefill emits one and the first step verifies the drafts in a forward of its own."""
        dev = self.device
        draft = self._draft_loop(plan, draft_logits)  # tokens [B, k]
        k = plan.k
        cols = torch.arange(k + 1, device=dev)  # [k + 1]
        # Each row's drafts right after its chunk (rows shorter than the widest: over their padding).
        wide = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], k)], dim=1)  # [B, Q + k]
        wide.scatter_(1, last + 1 + cols[None, :k], draft.tokens)
        raw = self.target.extend(wide, starts, list(plan.slots), select=last + cols[None, :])  # [B, k + 1, V]
        logits = self._adjust(raw, plan.states, list(plan.generated), plan.penalties, draft.tokens)
        out_tokens, num_accepted = self._accept(plan, draft, logits)
        t3 = self._clock.mark()
        for chunk, st in zip(chunks, plan.states):
            st.num_prefilled = chunk.end
        # draft_s: the draft's prefill; its proposals are in verify_s with the fused forward
        out = self._commit(plan, out_tokens, num_accepted, raw, (t0, t1), (t1, t3))
        return replace(out, kind="prefill")

    # ------------------------------------------------------------------ speculative step

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> StepOutput:
        """One speculative step over any set of prefilled sequences: plan, draft, verify, accept, commit.

        Preserves, per row, exactly the output the target alone would give (greedy) or its distribution
        (sampling), whatever else is in the batch.
        """
        plan = self._plan(batch)
        t0 = self._clock.mark()
        by_model = plan.k > 0 and not self.lookup  # n-gram lookup has no draft cache to catch up
        draft_lens, caught_up = self._catch_up(plan) if by_model else (None, False)
        tc = self._clock.mark()
        draft = self._propose(plan, draft_lens) if by_model else self._lookup(plan) if plan.k > 0 else None
        t1 = self._clock.mark()
        raw = self._verify(plan, draft)  # [B, k + 1, V]
        drafts = draft.tokens if draft is not None else None
        logits = self._adjust(raw, plan.states, list(plan.generated), plan.penalties, drafts)
        tokens, num_accepted = self._accept(plan, draft, logits)  # [B, k + 1], [B]
        t2 = self._clock.mark()
        return self._commit(plan, tokens, num_accepted, raw, (t0, t1), (t1, t2), (t0, tc) if caught_up else None)

    def _plan(self, batch: StepBatch) -> StepPlan:
        """Resolve the batch: each row's draft budget, its blocks for the step, the batch shape, and the per-step
        device tensors. CapacityError, before any change, when the free blocks do not cover the batch."""
        states = self._states(batch.seq_ids)
        for sid, st in zip(batch.seq_ids, states):
            if st.num_prefilled < st.prompt_len or st.length >= self.max_model_len:
                raise InvalidRequestError(
                    f"sequence {sid} cannot step: prefilled {st.num_prefilled}/{st.prompt_len}, "
                    f"length {st.length} of at most {self.max_model_len}"
                )
        return self._make_plan(tuple(batch.seq_ids), states, batch.num_draft_tokens)

    def _make_plan(self, seq_ids: tuple[int, ...], states, num_draft_tokens: int) -> StepPlan:
        k = min(num_draft_tokens, self.max_k)
        lengths = tuple(st.length for st in states)
        # A row emits at most row_k + 1 tokens, so it never passes max_model_len.
        # n-gram lookup: a row whose lookup matched nothing at its last commit proposes nothing now (the same tokens)
        row_k = tuple(
            min(k, self.max_model_len - 1 - n) if st.params.use_speculation and st.lookup_n != 0 else 0
            for st, n in zip(states, lengths)
        )
        k = max(row_k)
        slots = tuple(st.slot for st in states)
        # The blocks this step may write (verify positions up to length - 1 + k): all rows or none.
        self.blocks.grow([(s, self.blocks.blocks_for(min(n + k, self.max_model_len))) for s, n in zip(slots, lengths)])
        dev = self.device
        slot_t = to_device(list(slots), dev)  # [B]
        len_t = to_device(list(lengths), dev)  # [B]
        cols = torch.arange(k + 1, device=dev)  # [k + 1]
        allow = cols[None, :k] < to_device(list(row_k), dev)[:, None]  # [B, k]
        return StepPlan(
            seq_ids=seq_ids,
            states=tuple(states),
            lengths=lengths,
            slots=slots,
            row_k=row_k,
            k=k,
            grouped=not self.config.force_mixed and all(n == lengths[0] for n in lengths),
            generated=tuple(st.num_generated for st in states),
            slot_t=slot_t,
            len_t=len_t,
            out_pos=len_t[:, None] + cols,  # [B, k + 1]
            allow=allow,
            rows=self._row_params(states, slot_t),
            penalties=self._penalties(states, slot_t, lengths),
        )

    def _catch_up(self, plan: StepPlan) -> tuple[list[int], bool]:
        """Feed the draft what it skipped (steps without drafts, a prompt prefilled without it) for the rows
        more than 2 tokens behind, in one forward of those rows only, up to (not including) the pending
        token. Returns each row's draft length after it (the state moves only at commit) and whether any
        row was fed."""
        draft_lens = [st.draft_len for st in plan.states]
        need = {i: n - 1 - d for i, (n, d) in enumerate(zip(plan.lengths, draft_lens)) if n - d > 2}
        if not need:
            return draft_lens, False
        dev = self.device
        # Rows far behind (a long prompt) and rows a few tokens behind do not share one padded width: each
        # forward takes the rows needing more than half its width (at most half of it padding), so a batch
        # costs at most about twice the tokens it feeds, in about log2(longest / shortest) forwards.
        order = sorted(need, key=lambda i: -need[i])
        while order:
            width = need[order[0]]
            group = [i for i in order if 2 * need[i] > width]
            order = order[len(group):]
            # As in _propose: a row less behind re-feeds cached positions (the same K/V); one shorter than the
            # width starts at 0, and its right padding lands at or past its pending position, rewritten below.
            starts = [max(plan.lengths[i] - 1 - width, 0) for i in group]
            slots = [plan.slots[i] for i in group]
            tokens = self._tokens(plan.slot_t[to_device(group, dev)], starts, width)  # [b, W]
            last = torch.zeros(len(group), 1, dtype=torch.long, device=dev)  # [b, 1]: logits are not used
            self.draft.extend(tokens, starts, slots, select=last, force_per_row=True)
        for i in need:
            draft_lens[i] = plan.lengths[i] - 1
        return draft_lens, True

    def _propose(self, plan: StepPlan, draft_lens: list[int]) -> Draft:
        """Feed the draft up to the pending token, then propose k tokens autoregressively."""
        dev = self.device
        mixed = not plan.grouped
        width = max(n - d for n, d in zip(plan.lengths, draft_lens))  # 1 normally, 2 after a full accept
        # Re-feeding an already cached position rewrites the same K/V, so every row can start `width`
        # back from its pending token; only rows shorter than `width` start at 0.
        starts = [max(n - width, 0) for n in plan.lengths]
        tokens = self._tokens(plan.slot_t, starts, width)  # [B, W]
        last = to_device([n - 1 - s for n, s in zip(plan.lengths, starts)], dev)[:, None]  # [B, 1]
        if self.config.compile:  # the static forward of width W (1 or 2): every draft forward of a step captured
            logits = self._forward(self.draft, tokens, starts, list(plan.slots), mixed)  # [B, W, V]
            logits = logits.gather(1, last[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, 1, V]
        else:
            logits = self.draft.extend(tokens, starts, list(plan.slots), select=last, force_per_row=mixed)  # [B, 1, V]
        return self._draft_loop(plan, logits)

    def _lookup(self, plan: StepPlan) -> Draft:
        """k draft tokens per row by n-gram lookup in its own tokens (engine/lookup.py): the proposals its last call
        left (`_look_ahead`); rows whose lookup matched nothing have row_k 0, so `allow` refuses theirs. A proposal is
        certain: where rows sample, its q is one-hot (accepted with probability p(d), `sampling.accept`)."""
        tokens = self.proposals[plan.slot_t, : plan.k]  # [B, k]
        probs = None
        if plan.rows.any_sampling:
            probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [B, k, V]
        return Draft(tokens, probs)

    def _look_ahead(self, slot_t: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Each row's lookup at its new `lengths` [B] over the first `width` positions of its tokens (at least the
        longest length): its max_k proposals into `self.proposals` for its next step; returns [B, 1] long, the
        matched suffix's length (0: none), for the call's one read."""
        hist = self.token_buf[slot_t, : min(width, self.token_buf.shape[1])]  # [B, T]
        cfg = self.config
        tokens, n = ngram_proposals(hist, lengths, self.max_k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.proposals[slot_t] = tokens  # [B, max_k]
        return n[:, None]

    def _drafts_next(self, st: SeqState) -> bool:
        """SeqOutput.drafts_next: whether the row proposes drafts in its next step if it gets k > 0."""
        return self.max_k > 0 and st.params.use_speculation and st.lookup_n != 0

    def _draft_loop(self, plan: StepPlan, logits: torch.Tensor) -> Draft:
        """k draft tokens per row from the draft's logits at the pending token ([B, 1, V]): k - 1 more forwards."""
        mixed = not plan.grouped
        proposed, probs = [], []
        for i in range(plan.k):
            before = torch.cat(proposed, dim=1) if proposed else None  # [B, i]: the drafts before this one
            logits = self._adjust(logits, plan.states, [g + i for g in plan.generated], plan.penalties, before)
            pos = plan.len_t[:, None] + i  # [B, 1]: where draft token i + 1 would land
            if plan.rows.any_sampling:
                q = process_probs(logits, plan.rows)  # [B, 1, V]
                tok = sample_from_probs(q, plan.rows.seeds, pos, STREAM_DRAFT)  # [B, 1]
                probs.append(q)
            else:
                tok = logits.argmax(-1)  # [B, 1]
            proposed.append(tok)
            if i < plan.k - 1:
                starts_i = [n + i for n in plan.lengths]
                logits = self._forward(self.draft, tok, starts_i, list(plan.slots), mixed)  # [B, 1, V]
        return Draft(torch.cat(proposed, dim=1), torch.cat(probs, dim=1) if probs else None)

    def _forward(self, runner: ModelRunner, tokens: torch.Tensor, starts: list[int], slots: list[int],
                 mixed: bool) -> torch.Tensor:  # [B, Q, V]
        """A draft token's or the verify's forward: `runner.extend`, or with `config.compile` the compiled
        static-shape forward of the batch's bucket and Q (engine/static_forward.py), built at its first use."""
        if not self.config.compile:
            return runner.extend(tokens, starts, slots, force_per_row=mixed)
        key = (runner is self.draft, bucket_for(tokens.shape[0]), tokens.shape[1])
        static = self._static.get(key)
        if static is None:  # compile_mode "inductor": built at its first use (cudagraph: all at start)
            static = self._build_static(key)
        return static.run(tokens, starts, slots)

    def static_keys(self) -> list[tuple[bool, int, int]]:
        """Every (draft?, bucket, Q) static forward a step of this engine can run with `config.compile`
        (static_forward.py's `static_buckets` up to max_num_seqs x `static_widths`, the set graph_memory_bytes
        counts)."""
        models = [False] + ([True] if self.draft is not None else [])
        return [(d, b, q) for d in models for b in static_buckets(self.config.max_num_seqs)
                for q in static_widths(self.max_k, draft=d)]

    def prepare_static(self) -> int:
        """Build every static forward of `static_keys` now (compile_mode "cudagraph": the engine does it when it
        starts, so no request waits for a capture, its warm-up forwards and Triton's compile of a new kernel
        variant in the serving loop, as the first GPU load test's did: docs/BENCHMARKS.md section 0). Returns how
        many were built."""
        missing = [key for key in self.static_keys() if key not in self._static]
        for key in missing:
            self._build_static(key)
        return len(missing)

    def _build_static(self, key: tuple[bool, int, int]) -> StaticForward:
        """The static forward of one (draft?, bucket, Q): captured (compile_mode "cudagraph") or compiled."""
        runner = self.draft if key[0] else self.target
        static = self._static[key] = StaticForward(runner, key[1], key[2])
        if self._graph_pool is not None:  # compile_mode "cudagraph"
            static.capture(self._graph_pool)
        else:
            static.compile()
        return static

    def _verify(self, plan: StepPlan, draft: Draft | None) -> torch.Tensor:
        """One target forward over [pending, d_1 .. d_k] per row: its raw logits [B, k + 1, V] (the request's
        adjustments, `_adjust`, not applied: logprobs read them raw)."""
        last_tok = self.token_buf[plan.slot_t, plan.len_t - 1][:, None]  # [B, 1]
        verify_in = torch.cat([last_tok, draft.tokens], dim=1) if draft is not None else last_tok  # [B, k + 1]
        starts = [n - 1 for n in plan.lengths]
        return self._forward(self.target, verify_in, starts, list(plan.slots), not plan.grouped)  # [B, k + 1, V]

    def _accept(self, plan: StepPlan, draft: Draft | None, logits: torch.Tensor):
        """Accept drafts (Leviathan et al. 2023; see `sampling.accept` for the terms) and write the emitted
        tokens into token_buf. returns tokens [B, k + 1] (the first a + 1 are the output), num_accepted [B]."""
        rows = plan.rows
        if draft is None:
            tokens = self._sample(logits, rows, plan.out_pos)  # [B, 1]
            num_accepted = torch.zeros(len(plan.seq_ids), dtype=torch.long, device=self.device)
        elif not rows.any_sampling:
            tokens, num_accepted = accept_greedy(draft.tokens, logits, plan.allow)
        else:
            target_probs = process_probs(logits, rows)  # [B, k + 1, V]
            tokens, num_accepted = accept(draft.tokens, draft.probs, target_probs, plan.allow, rows.seeds, plan.out_pos)
        cols = plan.out_pos.clamp(max=self.token_buf.shape[1] - 1)
        self.token_buf[plan.slot_t[:, None], cols] = tokens
        return tokens, num_accepted

    def _commit(self, plan: StepPlan, tokens, num_accepted, raw_logits, draft_span, verify_span,
                catchup_span=None) -> StepOutput:
        """The one host sync (the tokens, and their logprobs from the target's `raw_logits` [B, k + 1, V] where a
        row asks for them); advance each row's lengths by what it accepted. Rollback of rejected drafts is not
        advancing: nothing is copied. The spans are (start, end) clock marks, read after the sync."""
        k = plan.k
        width = _logprobs_width(plan.states)
        parts = [tokens, num_accepted[:, None]]  # [B, k + 1], [B, 1]
        shadow = self.lookahead and k == 0
        if shadow:  # a step without drafts: was the proposal its last call left the target's token? (read before
            # `_look_ahead` replaces it) 1 / 0, counted where the row had a proposal (lookup_n > 0)
            parts.append((self.proposals[plan.slot_t, :1] == tokens[:, :1]).long())  # [B, 1]
        if self.lookahead:  # each row's next lookup (read with the tokens: no sync of its own)
            parts.append(self._look_ahead(plan.slot_t, plan.len_t + num_accepted + 1, max(plan.lengths) + k + 1))
        if width is None:
            packed = torch.cat(parts, dim=1).tolist()  # [B, k + 2 (+ 1 + 1)]
        else:  # float64 holds every token id exactly: one read for all
            lp = token_logprobs(raw_logits, tokens, width).flatten(1)  # [B, (k + 1) * (1 + 2 * width)]
            packed = torch.cat([p.double() for p in parts] + [lp], dim=1).tolist()
        after = k + 2 + shadow + self.lookahead  # where a row's logprobs start
        shadow_rows = shadow_hits = 0
        seconds = self._clock.seconds
        outputs = []
        per_pos = [0] * k
        for sid, st, n, row, row_k in zip(plan.seq_ids, plan.states, plan.lengths, packed, plan.row_k):
            a = int(row[k + 1])
            for i in range(a):
                per_pos[i] += 1
            if k > 0:
                # Draft KV is valid through the accepted drafts it was fed (it is never fed d_k).
                st.draft_len = n + min(k - 1, a)
            st.length = n + a + 1
            if shadow and st.lookup_n > 0 and st.params.use_speculation:  # lookup_n: the match its proposal came from
                shadow_rows += 1
                shadow_hits += int(row[k + 2])
            if self.lookahead:
                st.lookup_n = int(row[after - 1])
            logprobs = None
            if st.params.logprobs is not None:
                logprobs = read_logprobs(row[after:], a + 1, width, st.params.logprobs)
            outputs.append(SeqOutput(sid, tuple(int(t) for t in row[: a + 1]), row_k, a, logprobs,
                                     drafts_next=self._drafts_next(st)))
        return StepOutput(
            outputs=tuple(outputs),
            kind="grouped" if plan.grouped else "mixed",
            batch_size=len(outputs),
            num_draft_tokens=k,
            accepted_per_position=tuple(per_pos),
            draft_s=seconds(*draft_span),
            verify_s=seconds(*verify_span),
            catchup_s=0.0 if catchup_span is None else seconds(*catchup_span),
            shadow_proposed=shadow_rows,
            shadow_accepted=shadow_hits,
        )

    # ------------------------------------------------------------------ helpers

    def _tokens(self, slot_t: torch.Tensor, starts: list[int], width: int) -> torch.Tensor:
        """token_buf[slot, start : start + width] per row ([B] slots, [B] host starts) -> [B, width]. Columns past
        the buffer (right padding only) read its last column."""
        cols = to_device(starts, self.device)[:, None] + torch.arange(width, device=self.device)  # [B, W]
        return self.token_buf[slot_t[:, None], cols.clamp(max=self.token_buf.shape[1] - 1)]

    def _row_params(self, states, slot_t: torch.Tensor) -> RowParams:
        any_sampling = any(not st.params.greedy for st in states)
        if not any_sampling:  # an all-greedy batch reads none of the per-row tensors: skip the four gathers
            return self._greedy_rows
        any_filter = any((not st.params.greedy) and (st.params.top_k > 0 or st.params.top_p < 1.0) for st in states)
        return RowParams(
            temperature=self.temperature[slot_t],
            top_p=self.top_p[slot_t],
            top_k=self.top_k[slot_t],
            seeds=self.seeds[slot_t],
            any_sampling=any_sampling,
            any_filter=any_filter,
        )

    def _sample(self, logits: torch.Tensor, rows: RowParams, positions: torch.Tensor) -> torch.Tensor:
        """A target token per row and position. logits [B, Q, V], positions [B, Q] -> [B, Q] long."""
        if not rows.any_sampling:
            return logits.argmax(-1)
        return sample_from_probs(process_probs(logits, rows), rows.seeds, positions, STREAM_TARGET)

    def _adjust(self, logits: torch.Tensor, states, generated: list[int], penalties: Penalties | None = None,
                drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The request's changes to a model's raw logits, before temperature and the filters, in vLLM's order:
        logit_bias added, the penalties (`_penalize`, over `penalties` and the `drafts` [B, D] before the
        columns), then (min_tokens) EOS and stop ids at zero probability while fewer than min_tokens are
        generated. Rows using none cost nothing; the bias and the stop ids are one scatter each, from the tensors
        made at `add` (no host copy).

        logits: [B, Q, V]; column j of row b produces generated token number generated[b] + j.
        """
        batch, q_len, vocab = logits.shape
        dev = logits.device
        biased = [st.bias for st in states if st.bias is not None]
        if biased:
            rows = [b for b, st in enumerate(states) if st.bias is not None for _ in st.params.logit_bias]
            rows = to_device(rows, dev)  # [E]: each entry's row
            ids, values = (torch.cat(parts) for parts in zip(*biased))  # [E] each: every biased row's entries
            bias = torch.zeros(batch, vocab, device=dev).index_put_((rows, ids), values)  # [B, V]
            logits = logits + bias[:, None, :]
        if penalties is not None:
            logits = self._penalize(logits, penalties, drafts)
        active = [st.params.min_tokens > g for st, g in zip(states, generated)]
        if not any(active):
            return logits
        on = [b for b, a in enumerate(active) if a]
        ids = torch.cat([states[b].stop_ids for b in on])  # [E]
        rows = to_device([b for b in on for _ in range(states[b].stop_ids.numel())], dev)  # [E]
        banned = torch.zeros(batch, vocab, dtype=torch.bool, device=dev).index_put_(
            (rows, ids), torch.ones_like(ids, dtype=torch.bool))  # [B, V]
        need = to_device([st.params.min_tokens - g for st, g in zip(states, generated)], dev)  # [B]
        cols_on = torch.arange(q_len, device=dev)[None, :] < need[:, None]  # [B, Q]
        return logits.masked_fill(cols_on[:, :, None] & banned[:, None, :], float("-inf"))

    def _penalties(self, states, slot_t: torch.Tensor, lengths) -> Penalties | None:
        """The rows' `Penalties` before a step's (or a prefill's) forwards: their tokens [0, lengths[b]) in
        token_buf; the output is the tokens past the engine's prompt and its last `recomputed` prompt tokens.
        None when no row has penalties."""
        if not any(st.params.has_penalties for st in states):
            return None
        batch, vocab, dev = len(states), self.vocab_size, self.device
        cols = torch.arange(max(lengths), device=dev)  # [L]
        held = cols[None, :] < to_device(list(lengths), dev)[:, None]  # [B, L]: in the row's context
        ids = self.token_buf[slot_t[:, None], cols[None, :]]  # [B, L]
        ids = torch.where(held, ids, ids[:, :1])  # past a row's length: its first token (held by every row)
        out_from = to_device([st.prompt_len - st.params.recomputed for st in states], dev)  # [B]
        output = (held & (cols[None, :] >= out_from[:, None])).float()  # [B, L]: in its output
        rep, freq, pres = (to_device([getattr(st.params, f) for st in states], dev, torch.float32)[:, None, None]
                           for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))  # [B, 1, 1]
        return Penalties(
            ids=ids,
            counts=torch.zeros(batch, vocab, device=dev).scatter_add_(1, ids, output),
            held=torch.zeros(batch, vocab, device=dev).scatter_add_(1, ids, held.float()) > 0,
            rep=rep, freq=freq, pres=pres,
        )

    @staticmethod
    def _penalize(logits: torch.Tensor, pen: Penalties, drafts: torch.Tensor | None) -> torch.Tensor:
        """Repetition, frequency and presence penalties (vLLM's apply_penalties). Column j of row b comes after
        the row's context (`pen`) and its first j + D + 1 - Q drafts: a verify's column j (Q = D + 1) after
        d_1 .. d_j, a draft forward's (Q = 1) after all D. The drafts count as output.

        Only the logits of those tokens change, so only they are read and written: each row's M = L + D token
        ids are gathered per column, penalised and scattered back (a token held several times writes the same
        value from each place; a draft not yet before a column stands in for the row's first token there), so
        the cost grows with the tokens held, not with the vocabulary times the columns.

        logits: [B, Q, V] -> [B, Q, V]; rows without penalties unchanged (their factors are 1 and 0).
        """
        q_len, dev = logits.shape[1], logits.device
        ids = pen.ids[:, None, :].expand(-1, q_len, -1)  # [B, Q, L]
        count = pen.counts.gather(1, pen.ids)[:, None, :].expand(-1, q_len, -1)  # [B, Q, L]
        seen = torch.ones_like(count, dtype=torch.bool)  # [B, Q, L]: every entry is in the context
        if drafts is not None and drafts.shape[1] > 0:
            d = drafts.shape[1]
            before = torch.arange(d, device=dev)[None, :] < torch.arange(q_len, device=dev)[:, None] + d + 1 - q_len
            before = before.float()  # [Q, D]: draft i comes before column j
            draft_ids = torch.where(before[None] > 0, drafts[:, None, :], ids[:, :, :1])  # [B, Q, D]
            ids = torch.cat([ids, draft_ids], dim=2)  # [B, Q, M]
            same = (ids[..., None] == drafts[:, None, None, :]).float()  # [B, Q, M, D]
            extra = (same * before[None, :, None, :]).sum(-1)  # [B, Q, M]: drafts before the column with its id
            count = torch.cat([count, pen.counts.gather(1, draft_ids.flatten(1)).view_as(draft_ids)], dim=2) + extra
            in_context = pen.held.gather(1, draft_ids.flatten(1)).view_as(draft_ids)  # [B, Q, D]
            seen = torch.cat([seen, in_context], dim=2) | (extra > 0)
        x = logits.gather(2, ids)  # [B, Q, M]
        x = torch.where(seen, torch.where(x > 0, x / pen.rep, x * pen.rep), x)
        return logits.scatter(2, ids, x - pen.freq * count - pen.pres * (count > 0).float())

    def _warm_up(self) -> None:
        """Allocate both pools and run each model once, so the first request pays no set-up cost."""
        tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.extend(tok, [0], [0])

"""The speculative decoding engine: admit sequences, prefill them, run speculative steps, free them."""

from __future__ import annotations

import itertools
import random
import time

import torch

from exspec.engine.config import EngineConfig
from exspec.errors import ExspecError, InvalidRequestError
from exspec.engine.kv_cache import SlotAllocator
from exspec.engine.loader import ModelPair, load_model_pair
from exspec.engine.params import SamplingParams
from exspec.engine.runner import ModelRunner, to_device
from exspec.engine.sampling import (
    STREAM_DRAFT,
    STREAM_TARGET,
    RowParams,
    accept,
    accept_greedy,
    process_probs,
    sample_from_probs,
)
from exspec.engine.sequence import Sequence
from exspec.engine.types import PrefillBatch, SeqOutput, StepBatch, StepOutput


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
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


class SpecEngine:
    """Batched speculative decoding over per-sequence KV slots.

    The engine owns every `Sequence` it admits: its slot, tokens and cache bounds. A scheduler picks
    which sequences run in each step and hands them over as a `StepBatch` / `PrefillBatch`.
    Each step does exactly one device-to-host transfer (the emitted tokens and acceptance counts).
    """

    def __init__(self, config: EngineConfig, pair: ModelPair | None = None, seed: int = 0) -> None:
        self.config = config
        self.pair = pair if pair is not None else load_model_pair(config)
        self.tokenizer = self.pair.tokenizer
        slots, self.max_model_len = config.max_num_seqs, config.max_model_len
        self.max_k = config.max_num_speculative_tokens if self.pair.draft is not None else 0
        # Slack past max_model_len: a verify step writes k + 1 positions from the last token on.
        pool_len = self.max_model_len + self.max_k + 1
        for model in (self.pair.target, self.pair.draft):
            limit = getattr(model.config, "n_positions", None) if model is not None else None  # learned positions
            if limit is not None and pool_len > limit:
                raise ExspecError(
                    f"max_model_len ({self.max_model_len}) + k ({self.max_k}) + 1 exceeds the model's "
                    f"{limit} learned positions: lower max_model_len"
                )
        vocab = self.pair.vocab_size
        self.vocab_size = vocab
        self.target = ModelRunner(self.pair.target, slots, pool_len, vocab)
        self.draft = ModelRunner(self.pair.draft, slots, pool_len, vocab) if self.pair.draft is not None else None
        self.device = self.target.device
        self.allocator = SlotAllocator(slots)
        dev = self.device
        self.token_buf = torch.zeros(slots, pool_len, dtype=torch.long, device=dev)  # [slots, pool_len]
        self.temperature = torch.zeros(slots, device=dev)  # [slots]
        self.top_p = torch.ones(slots, device=dev)  # [slots]
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)  # [slots]
        self.seeds = torch.zeros(slots, dtype=torch.long, device=dev)  # [slots]
        self.eos_token_ids = self.pair.eos_token_ids
        self._eos_set = frozenset(self.eos_token_ids)
        self._ids = itertools.count()
        self._seed_rng = random.Random(seed)
        self._clock = _Clock(dev)
        self._warm_up()

    # ------------------------------------------------------------------ admission

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

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

    def add(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Admit a sequence: take a slot (CapacityError when none is free). Prefill comes later."""
        self.check_prompt(prompt_token_ids)
        slot = self.allocator.allocate()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_token_ids),
            prompt_len=len(prompt_token_ids),
            params=params,
            seed=seed,
            slot=slot,
        )
        n = seq.prompt_len
        self.token_buf[slot, :n] = to_device(prompt_token_ids, self.device)
        self.temperature[slot] = params.temperature
        self.top_p[slot] = params.top_p
        self.top_k[slot] = params.top_k
        self.seeds[slot] = seed
        return seq

    def free(self, seq: Sequence) -> None:
        """Give the sequence's slot back. Its stale K/V is simply overwritten by the next owner."""
        if seq.slot >= 0:
            self.allocator.free(seq.slot)
            seq.slot = -1

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch) -> StepOutput:
        """Feed prompt chunks into both caches (one batched forward each); sample the first token of
        every sequence whose prompt completes."""
        chunks = batch.chunks
        seqs = [c.seq for c in chunks]
        starts = [c.start for c in chunks]
        widths = [c.end - c.start for c in chunks]
        slots = [s.slot for s in seqs]
        q_len = max(widths)
        dev = self.device
        slot_t = to_device(slots, dev)
        cols = to_device(starts, dev)[:, None] + torch.arange(q_len, device=dev)  # [B, Q]
        tokens = self.token_buf[slot_t[:, None], cols.clamp(max=self.token_buf.shape[1] - 1)]  # [B, Q]
        last = to_device(widths, dev)[:, None] - 1  # [B, 1]
        t0 = self._clock.mark()
        if self.draft is not None:
            self.draft.extend(tokens, starts, slots, select=last)
        t1 = self._clock.mark()
        logits = self.target.extend(tokens, starts, slots, select=last)  # [B, 1, V]
        rows = self._row_params(seqs, slot_t)
        positions = to_device([s.prompt_len for s in seqs], dev)[:, None]  # [B, 1]
        logits = self._suppress_stops(logits, seqs, [0] * len(seqs))
        first = self._sample(logits, rows, positions)[:, 0]  # [B]
        self.token_buf[slot_t, positions[:, 0]] = first
        t2 = self._clock.mark()
        first_ids = first.tolist()  # the one host sync
        outputs = []
        for chunk, tok in zip(chunks, first_ids):
            seq = chunk.seq
            seq.num_prefilled = chunk.end
            seq.draft_len = chunk.end if self.draft is not None else 0
            if chunk.end < seq.prompt_len:
                outputs.append(SeqOutput(seq.seq_id, (), 0, 0, None))
                continue
            new = self._append(seq, [tok])
            outputs.append(SeqOutput(seq.seq_id, new, 0, 0, seq.finish_reason))
        return StepOutput(
            outputs=tuple(outputs),
            kind="prefill",
            batch_size=len(seqs),
            num_draft_tokens=0,
            accepted_per_position=(),
            draft_s=self._clock.seconds(t0, t1),
            verify_s=self._clock.seconds(t1, t2),
        )

    # ------------------------------------------------------------------ speculative step

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> StepOutput:
        """One speculative step over any set of prefilled sequences.

        Draft k tokens per row (after catching the draft's cache up), verify all k + 1 positions with one
        target forward, accept, emit a + 1 tokens per row. Preserves, per row, exactly the output the target
        alone would give (greedy) or its distribution (sampling), whatever else is in the batch.
        """
        seqs = list(batch.seqs)
        dev = self.device
        allow_list = [s.params.use_speculation for s in seqs]
        k = batch.num_draft_tokens if (self.draft is not None and any(allow_list)) else 0
        k = min(k, self.max_k)
        lengths = [s.length for s in seqs]
        slots = [s.slot for s in seqs]
        grouped = not batch.force_mixed and all(n == lengths[0] for n in lengths)
        slot_t = to_device(slots, dev)  # [B]
        len_t = to_device(lengths, dev)  # [B]
        out_pos = len_t[:, None] + torch.arange(k + 1, device=dev)  # [B, k + 1]: where each emitted token lands
        rows = self._row_params(seqs, slot_t)
        generated = [s.num_generated for s in seqs]

        t0 = self._clock.mark()
        if k > 0:
            draft_tokens, draft_probs = self._draft(seqs, lengths, len_t, slots, slot_t, k, grouped, rows, generated)
        t1 = self._clock.mark()
        last_tok = self.token_buf[slot_t, len_t - 1][:, None]  # [B, 1]
        verify_in = torch.cat([last_tok, draft_tokens], dim=1) if k > 0 else last_tok  # [B, k + 1]
        starts = [n - 1 for n in lengths]
        logits = self.target.extend(verify_in, starts, slots, force_per_row=not grouped)  # [B, k + 1, V]
        logits = self._suppress_stops(logits, seqs, generated)
        allow = to_device(allow_list, dev, torch.bool)
        if k == 0:
            tokens = self._sample(logits, rows, out_pos)  # [B, 1]
            num_acc = torch.zeros(len(seqs), dtype=torch.long, device=dev)
        elif not rows.any_sampling:
            tokens, num_acc = accept_greedy(draft_tokens, logits, allow)
        else:
            target_probs = process_probs(logits, rows)  # [B, k + 1, V]
            tokens, num_acc = accept(draft_tokens, draft_probs, target_probs, allow, rows.seeds, out_pos)
        cols = out_pos.clamp(max=self.token_buf.shape[1] - 1)
        self.token_buf[slot_t[:, None], cols] = tokens
        t2 = self._clock.mark()
        packed = torch.cat([tokens, num_acc[:, None]], dim=1).tolist()  # the one host sync: [B, k + 2]

        outputs = []
        per_pos = [0] * k
        for seq, row, allowed in zip(seqs, packed, allow_list):
            a = row[-1]
            for i in range(a):
                per_pos[i] += 1
            if k > 0:
                # Draft KV is valid through the accepted drafts it was fed (it is never fed d_k).
                seq.draft_len = seq.length + min(k - 1, a)
            new = self._append(seq, row[: a + 1])
            outputs.append(SeqOutput(seq.seq_id, new, k if allowed else 0, a, seq.finish_reason))
        return StepOutput(
            outputs=tuple(outputs),
            kind="grouped" if grouped else "mixed",
            batch_size=len(seqs),
            num_draft_tokens=k,
            accepted_per_position=tuple(per_pos),
            draft_s=self._clock.seconds(t0, t1),
            verify_s=self._clock.seconds(t1, t2),
        )

    def _draft(self, seqs, lengths, len_t, slots, slot_t, k, grouped, rows: RowParams, generated):
        """Catch the draft cache up to the pending token, then propose k tokens autoregressively.

        returns draft_tokens [B, k] long, draft_probs [B, k, V] (None when every row is greedy).
        """
        dev = self.device
        width = max(n - s.draft_len for n, s in zip(lengths, seqs))  # 1 normally, 2 after a full accept
        # Re-feeding an already cached position rewrites the same K/V, so every row can start `width`
        # back from its pending token; only rows shorter than `width` start at 0.
        starts = [max(n - width, 0) for n in lengths]
        cols = to_device(starts, dev)[:, None] + torch.arange(width, device=dev)  # [B, W]
        tokens = self.token_buf[slot_t[:, None], cols]  # [B, W]
        last = to_device([n - 1 - s for n, s in zip(lengths, starts)], dev)[:, None]  # [B, 1]
        logits = self.draft.extend(tokens, starts, slots, select=last, force_per_row=not grouped)  # [B, 1, V]
        proposed, probs = [], []
        for i in range(k):
            logits = self._suppress_stops(logits, seqs, [g + i for g in generated])
            pos = len_t[:, None] + i  # [B, 1]: where draft token i + 1 would land
            if rows.any_sampling:
                q = process_probs(logits, rows)  # [B, 1, V]
                tok = sample_from_probs(q, rows.seeds, pos, STREAM_DRAFT)  # [B, 1]
                probs.append(q)
            else:
                tok = logits.argmax(-1)  # [B, 1]
            proposed.append(tok)
            if i < k - 1:
                logits = self.draft.extend(tok, [n + i for n in lengths], slots, force_per_row=not grouped)
        draft_tokens = torch.cat(proposed, dim=1)  # [B, k]
        return draft_tokens, (torch.cat(probs, dim=1) if probs else None)

    # ------------------------------------------------------------------ helpers

    def _row_params(self, seqs: list[Sequence], slot_t: torch.Tensor) -> RowParams:
        any_sampling = any(not s.params.greedy for s in seqs)
        any_filter = any((not s.params.greedy) and (s.params.top_k > 0 or s.params.top_p < 1.0) for s in seqs)
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

    def _suppress_stops(self, logits: torch.Tensor, seqs: list[Sequence], generated: list[int]) -> torch.Tensor:
        """min_tokens: EOS and stop ids get zero probability while fewer than min_tokens are generated.

        logits: [B, Q, V]; column j of row b produces generated token number generated[b] + j.
        """
        active = [s.params.min_tokens > g for s, g in zip(seqs, generated)]
        if not any(active):
            return logits
        batch, q_len, vocab = logits.shape
        banned = torch.zeros(batch, vocab + 1, dtype=torch.bool)  # built on the host: rare path
        for b, (seq, on) in enumerate(zip(seqs, active)):
            if on:
                ids = [t for t in (*self.eos_token_ids, *seq.params.stop_token_ids) if t < vocab]
                banned[b, ids] = True
        dev = logits.device
        need = to_device([s.params.min_tokens - g for s, g in zip(seqs, generated)], dev)  # [B]
        cols_on = torch.arange(q_len, device=dev)[None, :] < need[:, None]  # [B, Q]
        mask = cols_on[:, :, None] & banned[:, None, :vocab].to(dev, non_blocking=True)  # [B, Q, V]
        return logits.masked_fill(mask, float("-inf"))

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[int, ...]:
        """Append emitted tokens, stopping at EOS / stop ids / max_tokens / max_model_len; nothing after
        the stopping token is kept."""
        p = seq.params
        room = min(p.max_tokens - seq.num_generated, self.max_model_len - seq.length)
        kept: list[int] = []
        for tok in tokens[: max(room, 0)]:
            kept.append(tok)
            if (tok in self._eos_set and not p.ignore_eos) or tok in p.stop_token_ids:
                if seq.num_generated + len(kept) >= p.min_tokens:
                    seq.finish_reason = "stop"
                    seq.stop_token_id = tok
                    break
        seq.token_ids.extend(kept)
        if seq.finish_reason is None and (seq.num_generated >= p.max_tokens or seq.length >= self.max_model_len):
            seq.finish_reason = "length"
        return tuple(kept)

    def _warm_up(self) -> None:
        """Allocate both pools and run each model once, so the first request pays no set-up cost."""
        tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.extend(tok, [0], [0])

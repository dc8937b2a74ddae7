"""Streaming text with a real tokenizer (SmolLM2-135M-Instruct's byte-level BPE, 49152 tokens): the incremental
detokenizer's pieces concatenate to exactly the full decode, whatever the speculative steps' sizes; no U+FFFD from
multi-byte characters split across tokens, even when the output is cut inside one; stop strings that span tokens
stop at the same text and the same token count however the tokens arrive."""

from __future__ import annotations

import random

import pytest

from exspec.engine.params import SamplingParams
from exspec.scheduler.request import IncrementalDetokenizer, Request

TEXTS = [
    "Hello \U0001f389 world! \u4f60\u597d\uff0c\u4e16\u754c\u3002 caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 ok",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002 \U0001f600\U0001f44d\U0001f3fd \u5bb6\u65cf\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00f1 \u00e7 \u00f8 \u00e5 \U0001f1eb\U0001f1f7  two  spaces\n\nand 'quotes' don't",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}],
                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """ids in steps of 1 to 5 tokens, as speculative steps deliver them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i: i + n])
        i += n
    return out


def test_the_texts_split_characters_across_tokens(tok):
    """The premise: each text has tokens that decode alone to U+FFFD (part of a character)."""
    for text in TEXTS:
        ids = tok.encode(text)
        assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids))), text


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_full_decode_without_replacement_chars(tok, prompt, text):
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    for seed in range(10):
        detok = IncrementalDetokenizer(tok, prompt)
        steps = _chunks(ids, random.Random(seed))
        pieces = [detok.add(step, final=i == len(steps) - 1) for i, step in enumerate(steps)]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == full


@pytest.mark.parametrize("text", TEXTS)
def test_a_cut_inside_a_character_drops_the_incomplete_tail(tok, prompt, text):
    """max_tokens ending inside a multi-byte character: the text ends before it, never with U+FFFD."""
    ids = tok.encode(text)
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert cuts
    for n in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok, prompt)
        steps = _chunks(ids[:n], random.Random(n))
        out = "".join(detok.add(step, final=i == len(steps) - 1) for i, step in enumerate(steps))
        assert out == tok.decode(ids[:n]).rstrip("\ufffd")
        assert "\ufffd" not in out and tok.decode(ids).startswith(out)


def _spanning_stops(tok, ids: list[int]) -> list[tuple[str, int]]:
    """Three-character stop strings taken along the text that no single token holds whole (each spans a token
    boundary, some inside a multi-byte character), with the number of tokens up to the one that completes
    their first occurrence."""
    full = tok.decode(ids)
    found = []
    for a in range(len(full) - 2):
        stop = full[a: a + 3]
        need = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
        if stop not in tok.decode(ids[need - 1: need]) and stop.strip():
            found.append((stop, need))
    return found


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_spanning_tokens_stop_at_one_place_however_tokens_arrive(tok, prompt, text):
    ids = tok.encode(text)
    full = tok.decode(ids)
    stops = _spanning_stops(tok, ids)
    assert len(stops) >= 10
    for stop, need in stops:
        results = set()
        for seed in range(6):
            r = Request("r", list(prompt), SamplingParams(max_tokens=len(ids), stop=(stop, "@@never@@")), order=0)
            r.detok = IncrementalDetokenizer(tok, prompt)
            streamed, stopped = "", False
            steps = _chunks(ids, random.Random(seed))
            for i, step in enumerate(steps):
                piece, stopped, kept = r.add_tokens(tuple(step), engine_finished=i == len(steps) - 1)
                assert kept == len(step) or stopped
                streamed += piece
                if stopped:
                    break
            assert stopped and streamed == r.text
            results.add((streamed, len(r.output_token_ids)))
        assert results == {(full[: full.index(stop)], need)}, stop

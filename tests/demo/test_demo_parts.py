"""The demo builder's parts one by one: corpus, tokenizer, recipe, thread choice, cache and the target's
continuations. No full build here (test_demo_models.py builds the test-scale pair)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from exspec.demo import DemoBuildError, FORMAT_VERSION, MARKER, RECIPES, locate_pair
from exspec.demo import cache, corpus, distill, recipe, threads, tokenizer, train


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.build_corpus(0, RECIPES["test"].corpus_chars)


@pytest.fixture(scope="module")
def tok(texts):
    return tokenizer.train_tokenizer(texts, RECIPES["test"].vocab_size)


def test_corpus_is_chat_formatted_deterministic_and_sized(texts):
    assert texts == corpus.build_corpus(0, RECIPES["test"].corpus_chars)
    assert texts != corpus.build_corpus(1, RECIPES["test"].corpus_chars)
    assert all(t.startswith("<|user|>") and t.endswith("<|end|>") and "<|assistant|>" in t for t in texts)
    chars = sum(map(len, texts))
    assert RECIPES["test"].corpus_chars // 2 < chars < 4 * RECIPES["test"].corpus_chars


def test_render_chat_equals_the_tokenizer_template(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(messages, tokenize=False) == corpus.render_chat(messages)
    assert tok.chat_template == tokenizer.CHAT_TEMPLATE


def test_distillation_prompts_never_include_the_measured_questions():
    measured = {text for _, text in corpus.spec_bench_prompts(corpus.MEASURE_PROMPTS)}
    prompts = corpus.distill_prompt_texts(0, 192)
    assert len(prompts) == 192 and len(set(prompts)) == 192
    assert all(p.startswith("<|user|>") and p.endswith("<|end|><|assistant|>") for p in prompts)
    bodies = {p[len("<|user|>") : -len("<|end|><|assistant|>")] for p in prompts}
    assert not bodies & measured
    assert any(b in {r for _, r in corpus.spec_bench_prompts(480)} for b in bodies)  # SpecBench ones are there


def test_tokenizer_specials_and_chat_ids(tok, texts):
    assert tok.convert_tokens_to_ids(tokenizer.SPECIALS[:4]) == [
        tokenizer.UNK_ID, tokenizer.BOS_ID, tokenizer.PAD_ID, tokenizer.EOS_ID
    ]
    assert tok.eos_token == "<|end|>" and tok.pad_token_id == tokenizer.PAD_ID
    ids = tokenizer.chat_ids(tok, "Explain the json module.")
    assert tok.decode(ids) == "<|user|>Explain the json module.<|end|><|assistant|>"
    tokens = tokenizer.encode_corpus(tok, texts[:3])  # [N]
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tokens.tolist() == [t for x in texts[:3] for t in tok(x)["input_ids"]]


def test_recipe_for_names_the_allowed_scales():
    assert recipe.recipe_for("test") is RECIPES["test"]
    assert recipe.recipe_for("smollm2") is recipe.IMITATION_RECIPES["smollm2"]
    with pytest.raises(DemoBuildError, match=r"scale must be one of smollm2, tiny, test, got 'huge'"):
        recipe.recipe_for("huge")


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    r = RECIPES["tiny"]
    lrs = [train.lr_at(s, r) for s in range(r.steps)]
    assert lrs[0] == pytest.approx(r.lr / r.warmup) and lrs[r.warmup - 1] == pytest.approx(r.lr)
    assert all(a >= b for a, b in zip(lrs[r.warmup :], lrs[r.warmup + 1 :]))
    assert lrs[-1] == pytest.approx(r.lr / 10, rel=0.01)


def test_new_llama_has_the_shape_and_a_greedy_generation_config():
    r = RECIPES["test"]
    m = train.new_llama(r.target, r.vocab_size)
    assert (m.config.hidden_size, m.config.num_hidden_layers) == (r.target.hidden, r.target.layers)
    assert m.generation_config.do_sample is False and m.generation_config.eos_token_id == tokenizer.EOS_ID
    assert m.generation_config.top_k is None  # nothing a greedy generate() would warn about


# ----------------------------------------------------------------------------------------- threads


class _Clock:
    """A fake load average and step durations for ThreadTuner."""

    def __init__(self, monkeypatch, load: float, cores: int = 2):
        self.load = load
        monkeypatch.setattr(threads, "_load", lambda: self.load)
        monkeypatch.setattr(threads, "_cores", lambda: cores)


def test_thread_tuner_starts_from_the_load(monkeypatch):
    clock = _Clock(monkeypatch, load=0.2)
    assert threads.ThreadTuner(2).current == 2
    clock.load = 1.5
    assert threads.ThreadTuner(2).current == 1
    clock.load = 0.0
    assert threads.ThreadTuner(1).current == 1  # never more than the recipe allows


def test_thread_tuner_drops_to_one_thread_on_a_slow_step_and_follows_the_load(monkeypatch):
    clock = _Clock(monkeypatch, load=0.2)
    tuner = threads.ThreadTuner(2)
    before = torch.get_num_threads()
    try:
        for s in [0.2, 0.2, 0.21]:
            tuner.record(s)
        assert tuner.current == 2
        tuner.record(0.2 * threads.SLOW_FACTOR * 1.5)  # oversubscribed: drop at once
        assert tuner.current == 1
        clock.load = 0.0  # quiet again, but held at one thread for HOLD_STEPS
        for _ in range(threads.HOLD_STEPS - threads.RECHECK_STEPS):
            tuner.record(0.3)
        assert tuner.current == 1
        for _ in range(2 * threads.RECHECK_STEPS):
            tuner.record(0.3)
        assert tuner.current == 2
        clock.load = 2 + 1.5  # our 2 threads + 1.5 others: busy
        for _ in range(threads.RECHECK_STEPS):
            tuner.record(0.2)
        assert tuner.current == 1
        with tuner.step():
            assert torch.get_num_threads() == 1
        assert sum(tuner.used.values()) == 4 + threads.HOLD_STEPS + 2 * threads.RECHECK_STEPS + 1
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------- cache


def test_locate_pair_before_and_after_a_marker(tmp_path):
    where = locate_pair(tmp_path / "p", scale="test")
    assert where.target == tmp_path / "p" / "target" and where.draft == tmp_path / "p" / "draft"
    assert where.tokenizer == where.target and not where.built and "exspec demo-models" in where.note
    assert not (tmp_path / "p").exists()  # locating creates nothing
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / MARKER).write_text(json.dumps({"format_version": FORMAT_VERSION - 1, "seed": 0, "scale": "test"}))
    where = locate_pair(tmp_path / "p", scale="test")
    assert not where.built and f"format {FORMAT_VERSION - 1}" in where.note and "rebuilds" in where.note


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "m.json"
    cache.write_atomic(path, "one")
    cache.write_atomic(path, "two")
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_second_builder_says_it_waits_for_the_lock(tmp_path):
    held, release, said = threading.Event(), threading.Event(), []

    def holder():
        with cache.locked(tmp_path):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    with cache.locked(tmp_path, on_wait=said.append):
        assert release.is_set()  # only entered once the holder let go
    t.join()
    assert len(said) == 1 and "waiting" in said[0] and str(tmp_path) in said[0]
    with cache.locked(tmp_path, on_wait=said.append):  # free: no message
        pass
    assert len(said) == 1


# ----------------------------------------------------------------------------------------- continuations


def test_continuations_keep_the_prompt_order_and_greedy_rows_match_generate_alone(tok):
    r = RECIPES["test"]
    torch.manual_seed(0)
    target = train.new_llama(r.target, r.vocab_size).eval()
    prompts = corpus.distill_prompt_texts(0, 7)
    torch.manual_seed(1)
    out = distill.continue_prompts(target, tok, prompts, 6, progress=False)
    assert len(out) == len(prompts)
    for text, seq in zip(prompts, out):
        ids = tok(text)["input_ids"]
        assert seq[: len(ids)] == ids  # each row starts with its own prompt
        assert len(ids) < len(seq) <= len(ids) + 6 and tokenizer.PAD_ID not in seq
    for i in range(0, len(prompts), 2):  # greedy rows: the same as that prompt generated on its own
        ids = torch.tensor([tok(prompts[i])["input_ids"]])  # [1, P]
        with torch.inference_mode():
            alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                    eos_token_id=tokenizer.EOS_ID, pad_token_id=tokenizer.PAD_ID)
        assert out[i] == alone[0].tolist()
    torch.manual_seed(1)
    assert distill.continue_prompts(target, tok, prompts, 6, progress=False) == out  # seeded: repeatable

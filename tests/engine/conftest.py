"""`attention_backend`: a test module that uses it (`pytestmark = pytest.mark.usefixtures("attention_backend")`)
runs each of its tests with every attention backend that runs on the CPU (engine/backends/), `triton` under
the Triton interpreter when triton is installed. Every engine the test builds with attention "auto" gets it.

`engine_compile`: a test module that uses it runs each test with `EngineConfig.compile` off and on (every engine
built through `models.engine` / `models.config`; a test that builds its own EngineConfig reads `models.compile`).
Compile on, the draft's and the verify's forwards run compiled at static shapes with their own attention backend
(engine/static_forward.py), so compile-on cases run with the device's default backend only (prefill's backend is
covered by the compile-off cases). Compiling costs ~0.5 s per (bucket, Q) forward, ~8 s per engine on the tiny
models: by default only COMPILE_DEFAULT_CASES run compile on; EXSPEC_TEST_COMPILE=1 runs every compile-on case
(and makes every other `models.engine` compile too)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from tests.support.models import TEST_COMPILE

from exspec.engine import backends
from exspec.engine.static_forward import StaticForward


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

# the kernel can run here: triton imports, and CUDA or an interpreter recent enough (the root conftest sets
# TRITON_INTERPRET=1 when there is no CUDA)
HAS_TRITON = importlib.import_module("exspec.engine.kernels.paged_attention").available()
# the native kernel builds here (a C compiler)
HAS_NATIVE = importlib.import_module("exspec.engine.kernels.native").available()
# backend -> why it cannot run here (absent: it can)
_CANNOT_RUN = {name: why for name, cannot, why in [
    ("triton", not HAS_TRITON, "triton cannot run here (not installed, or its interpreter is older than 3.7)"),
    ("native", not HAS_NATIVE, "the native kernel cannot build here (no C compiler?)"),
] if cannot}
BACKEND_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(name in _CANNOT_RUN, reason=_CANNOT_RUN.get(name, "")))
    for name in backends.names()
]


def pytest_generate_tests(metafunc) -> None:
    if "attention_backend" in metafunc.fixturenames:
        metafunc.parametrize("attention_backend", BACKEND_PARAMS, indirect=True)
    if "engine_compile" in metafunc.fixturenames:
        metafunc.parametrize("engine_compile", [False, True], ids=["nocompile", "compiled"], indirect=True)


def use_triton(monkeypatch, cpu_engines: bool) -> None:
    """Prepare a `triton` case. Without CUDA: Triton's interpreter on. On a CUDA machine the interpreter stays off
    (set there, it sent every later launch, CUDA tensors too, to the interpreter, which fails: an H100, 2026-11-27),
    so a case whose engines hold CPU tensors skips (seen failing on an H100, 2026-11-24); the kernel runs compiled in
    test_paged_kernel.py, in test_attention_backends.py's unit cases and through the engine in test_engine_bf16.py."""
    if not torch_cuda_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif cpu_engines:
        pytest.skip("triton on CPU tensors needs the interpreter, which this CUDA machine's triton import did not enable")


@pytest.fixture
def attention_backend(request, monkeypatch) -> str:
    name = request.param
    if name == "triton":
        use_triton(monkeypatch, cpu_engines=True)
    monkeypatch.setattr(backends, "default_backend", lambda device: name)
    return name


# Under Triton's interpreter (CPU) one kernel launch costs ~0.2 s, so a whole generation takes 10 to 60 s and the
# ~110 triton cases of the equivalence and sampling files would take over an hour. On the CPU each scenario (test
# function) runs with `triton` once, on its first parameter set, except the statistical and 100-prompt ones and the
# scenarios whose attention shapes others already give the kernel (what they test beyond that is the engine's, and
# runs with every other backend); every case runs on CUDA (the kernel compiled) or with EXSPEC_TEST_TRITON_ALL=1.
# The kernel's own paths: tests/engine/test_paged_kernel.py and the triton cases of test_attention_backends.py.
TRITON_ALL = os.environ.get("EXSPEC_TEST_TRITON_ALL", "") not in ("", "0") or torch_cuda_available()
TRITON_TOO_SLOW_INTERPRETED = {
    "test_hundred_mixed_prompts_batch8_k4",
    "test_speculative_samples_follow_target_distribution",
    "test_fused_prefill_samples_follow_target_distribution",
    "test_statistical_check_has_power",
    "test_penalised_samples_follow_the_penalised_target",
    # 20 to 60 s each interpreted; the shapes they give attention (Q = 1 and k + 1 over mixed lengths, rows
    # rejecting or accepting every draft, reused slots and blocks) are the kept scenarios' and the backend tests'
    "test_always_disagreeing_draft_matches_target",  # as test_mixed_lengths_batch_matches_target's rollbacks
    "test_draft_with_padded_vocabulary",  # the vocabulary, not attention
    "test_engine_without_draft_matches_target",  # Q = 1: every draft forward of the kept ones (same kernel)
    "test_rows_without_speculation_mixed_with_speculating_rows",  # acceptance, not attention
    "test_sequences_admitted_and_finished_at_different_times",  # reused blocks: test_stale_kv_is_never_read
    "test_eos_finishes_sequence_and_nothing_after_it_leaks",  # stopping, not attention
    "test_steps_without_speculation_match_target",  # catch-up: test_prompts_prefilled_without_the_draft_...
    "test_identical_draft_emits_k_plus_one_per_step",  # whole accepts: the chunked-prefill and grouped ones
    "test_seeded_request_is_the_same_alone_and_in_any_batch",  # sampling, not attention
    # prefill forwards of mixed widths, Q up to 200 + k: the chunked-prefill scenarios' shapes
    "test_fused_prefill_verifies_drafts_and_matches_target",
    "test_fused_prefill_only_where_every_chunk_completes_its_prompt_and_fed_the_draft",
}


@pytest.fixture
def engine_compile(request, models, monkeypatch) -> bool:
    """Compile on: the test fails unless the engine's draft and verify forwards really ran compiled."""
    on = request.param
    monkeypatch.setattr(models, "compile", on)
    if not on:
        yield False
        return
    ran: list[bool] = []
    run = StaticForward.run

    def counted(self, *args, **kwargs):
        ran.append(self.compiled is not None)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(StaticForward, "run", counted)
    torch._dynamo.reset()  # each test compiles its own engines' forwards from scratch
    yield True
    torch._dynamo.reset()
    assert ran and all(ran), "compile on: the draft and verify forwards did not run compiled"


# Compile-on cases run by default (EXSPEC_TEST_COMPILE=1: all): test name -> the parameters a case must have. One
# mixed batch of 16 per architecture (buckets 16 down to 1 as rows finish, partial acceptance: every rollback path)
# and Mistral's sliding window.
COMPILE_DEFAULT_CASES = {
    "test_mixed_lengths_batch_matches_target": {"k": 3, "variant": "noisy"},
    "test_sliding_window_attention_matches_target": {},
}


# Scenarios compile cannot run: test name -> why.
COMPILE_NEVER = {"test_eager_attention_matches_target": "compile needs exspec's attention, not eager (EngineConfig refuses it)"}


def _skip_compile_cases(items) -> None:
    default_backend = backends.default_backend(torch.device("cpu"))
    for item in items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if not params or params.get("engine_compile") is not True:
            continue
        if item.originalname in COMPILE_NEVER:
            item.add_marker(pytest.mark.skip(reason=COMPILE_NEVER[item.originalname]))
            continue
        if params.get("attention_backend", default_backend) != default_backend:
            item.add_marker(pytest.mark.skip(reason="compile on: the static forwards use their own attention; "
                                                    f"prefill's backend is covered compile off ({default_backend} only)"))
            continue
        wanted = COMPILE_DEFAULT_CASES.get(item.originalname)
        if not TEST_COMPILE and (wanted is None or any(params.get(k) != v for k, v in wanted.items())):
            item.add_marker(pytest.mark.skip(reason="compile on: a few cases by default (EXSPEC_TEST_COMPILE=1: all)"))


# Engine-level scenarios of test_attention_backends.py whose `triton` case runs for one architecture on the CPU: the
# kernel sees the same attention shapes for each (the kernel's own tests vary heads, groups and head sizes).
TRITON_ONE_ARCH = {"test_mixed_lengths_at_scattered_slots_and_blocks_match_target"}


def pytest_collection_modifyitems(config, items) -> None:
    _skip_compile_cases(items)
    if TRITON_ALL:
        return
    seen: set[tuple[str, str]] = set()
    skip = pytest.mark.skip(reason="triton under the CPU interpreter: one case per scenario, not all scenarios "
                                   "(EXSPEC_TEST_TRITON_ALL=1: all)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        # the engine tests' `attention_backend`; or test_attention_backends.py's `backend` in a scenario run per
        # architecture (TRITON_ONE_ARCH: 40-80 s each interpreted, its first, Llama, kept)
        backend = callspec.params.get("attention_backend")
        if item.originalname in TRITON_ONE_ARCH:
            backend = callspec.params.get("backend")
        if backend != "triton":
            continue
        key = (str(item.path), item.originalname)
        if key in seen or item.originalname in TRITON_TOO_SLOW_INTERPRETED:
            item.add_marker(skip)
        seen.add(key)

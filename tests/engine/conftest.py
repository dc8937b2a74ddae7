"""`attention_backend`: a test module that uses it (`pytestmark = pytest.mark.usefixtures("attention_backend")`)
runs each of its tests with every attention backend that runs on the CPU (engine/backends/), `triton` under
the Triton interpreter when triton is installed. Every engine the test builds with attention "auto" gets it."""

from __future__ import annotations

import importlib
import os

import pytest

from exspec.engine import backends


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

# the kernel can run here: triton imports, and CUDA or an interpreter recent enough (the root conftest sets
# TRITON_INTERPRET=1 when there is no CUDA)
HAS_TRITON = importlib.import_module("exspec.engine.kernels.paged_attention").available()
BACKEND_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(name == "triton" and not HAS_TRITON, reason="triton cannot run here (not installed, or its interpreter is older than 3.7)"))
    for name in backends.names()
]


def pytest_generate_tests(metafunc) -> None:
    if "attention_backend" in metafunc.fixturenames:
        metafunc.parametrize("attention_backend", BACKEND_PARAMS, indirect=True)


@pytest.fixture
def attention_backend(request, monkeypatch) -> str:
    name = request.param
    if name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backends, "default_backend", lambda device: name)
    return name


# Under Triton's interpreter (CPU) one kernel launch costs ~0.2 s, so a whole generation takes 25 s or more and the
# ~110 triton cases of the equivalence and sampling files would take over an hour. On the CPU each scenario (test
# function) runs with `triton` once, on its first parameter set, except the statistical and 100-prompt ones; every
# case runs on CUDA (the kernel compiled) or with EXSPEC_TEST_TRITON_ALL=1.
TRITON_ALL = os.environ.get("EXSPEC_TEST_TRITON_ALL", "") not in ("", "0") or torch_cuda_available()
TRITON_TOO_SLOW_INTERPRETED = {
    "test_hundred_mixed_prompts_batch8_k4",
    "test_speculative_samples_follow_target_distribution",
    "test_statistical_check_has_power",
}


def pytest_collection_modifyitems(config, items) -> None:
    if TRITON_ALL:
        return
    seen: set[tuple[str, str]] = set()
    skip = pytest.mark.skip(reason="triton under the CPU interpreter: one case per scenario (EXSPEC_TEST_TRITON_ALL=1: all)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("attention_backend") != "triton":
            continue
        key = (str(item.path), item.originalname)
        if key in seen or item.originalname in TRITON_TOO_SLOW_INTERPRETED:
            item.add_marker(skip)
        seen.add(key)

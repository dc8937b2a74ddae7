"""`attention_backend`: a test module that uses it (`pytestmark = pytest.mark.usefixtures("attention_backend")`)
runs each of its tests with every attention backend that runs on the CPU (engine/backends/), `triton` under
the Triton interpreter when triton is installed. Every engine the test builds with attention "auto" gets it."""

from __future__ import annotations

import importlib

import pytest

from exspec.engine import backends

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

"""`attention_backend`: a test module that uses it (`pytestmark = pytest.mark.usefixtures("attention_backend")`)
runs each of its tests with every attention backend that runs on the CPU (engine/backends/), `triton` under
the Triton interpreter when triton is installed. Every engine the test builds with attention "auto" gets it."""

from __future__ import annotations

import importlib.util

import pytest

from exspec.engine import backends

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKEND_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(name == "triton" and not HAS_TRITON, reason="triton not installed"))
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

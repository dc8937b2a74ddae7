"""Test-only: put this folder (and the repository root) on PYTHONPATH and set EXSPEC_TEST_HOLD_FILE, and every
Python process started with that environment (e.g. the replicas deploy/replicas.py starts) holds each
speculative step (`SpecEngine.step`) while that file exists. Without the variable it does nothing. exspec
itself has no such hook; only tests put this folder on the path."""

import os

if os.environ.get("EXSPEC_TEST_HOLD_FILE"):
    from pathlib import Path

    from exspec.engine import SpecEngine
    from tests.support.gates import held_while_exists

    SpecEngine.step = held_while_exists(SpecEngine.step, Path(os.environ["EXSPEC_TEST_HOLD_FILE"]), timeout=300)

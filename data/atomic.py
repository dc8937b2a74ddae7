"""Write a file all at once or not at all: a temp file in the same directory, renamed over the target."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_lines_atomic(path: Path, lines: Iterable[str]) -> None:
    """Each of `lines` plus a newline, into `path` (whose directory must exist); a failure leaves no file."""
    path = Path(path).resolve()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

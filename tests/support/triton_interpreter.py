"""Triton's interpreter (CPU tensors) as the tests run it.

By default the interpreter checks every integer add, subtract and multiply for int32 overflow (`sanitize_overflow`):
each is cast to int64, computed again and compared against the bounds, all in Python, which was half of the engine's
interpreted tests' time. A kernel compiled for a GPU does none of it (the checks are device asserts, dropped without
`debug`), and the engine's tests' shapes are far from int32's range; the kernel's own tests
(tests/engine/test_paged_kernel.py) keep the checks on.
"""

from __future__ import annotations

import dataclasses


def set_overflow_checks(on: bool) -> bool | None:
    """Switch the interpreter's int32 overflow checks; returns what they were, None where this Triton has no such
    option or no interpreter (nothing changed)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow"):
        return None
    before = options.sanitize_overflow
    builder.options = dataclasses.replace(options, sanitize_overflow=on)
    return before

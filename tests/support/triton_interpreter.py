"""Triton's interpreter (CPU tensors) as the tests run it.

The interpreter's options hold `sanitize_overflow` (on by default) and `debug` (off). With the first on, every
integer add, subtract and multiply is cast to int64, computed again and compared against int32's bounds, all in
Python: half of the engine's interpreted tests' time. With `debug` off the comparison's device assert is then
dropped, so by default that work checks nothing (as compiled for a GPU, where the dead ops are removed). The tests
switch both off (tests/conftest.py) except the kernel's own tests (tests/engine/test_paged_kernel.py), which switch
both on: there an int32 overflow in the kernel's index arithmetic raises.
"""

from __future__ import annotations

import dataclasses


def set_overflow_checks(on: bool):
    """Switch the interpreter's int32 overflow checks and their asserts (`sanitize_overflow` and `debug`) on or
    off; returns its options before (for `restore_options`), None where this Triton has no such options or no
    interpreter (nothing changed)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or not hasattr(options, "debug"):
        return None
    builder.options = dataclasses.replace(options, sanitize_overflow=on, debug=on)
    return options


def restore_options(options) -> None:
    """Put back options that `set_overflow_checks` returned (nothing for None)."""
    if options is not None:
        from triton.runtime import interpreter

        interpreter.interpreter_builder.options = options

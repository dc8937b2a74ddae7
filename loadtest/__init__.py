"""`python -m exspec.loadtest`: load generation and reports against a running OpenAI-compatible server.
HTTP only: nothing here imports the engine, the scheduler, the offline benchmark, torch or transformers'
models (a tokenizer may be loaded to send prompts as token ids)."""

from exspec.loadtest.client import RequestInput, RequestResult
from exspec.data.reference import ReferenceError, ReferenceRow, compare_with_reference, read_reference, write_reference
from exspec.loadtest.report import format_table, summarize
from exspec.loadtest.runner import LoadConfig, LoadTestError, run_load

__all__ = [
    "LoadConfig",
    "LoadTestError",
    "ReferenceError",
    "ReferenceRow",
    "RequestInput",
    "RequestResult",
    "compare_with_reference",
    "format_table",
    "read_reference",
    "run_load",
    "summarize",
    "write_reference",
]

"""exspec load generation and benchmarks: `python -m loadtest` against a running server, and the offline
`exspec bench` (`loadtest.bench`, which imports the engine; import it explicitly)."""

from exspec.loadtest.client import RequestInput, RequestResult
from exspec.loadtest.report import format_table, summarize
from exspec.loadtest.runner import LoadConfig, LoadTestError, run_load

__all__ = ["LoadConfig", "LoadTestError", "RequestInput", "RequestResult", "format_table", "run_load", "summarize"]

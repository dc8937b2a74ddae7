"""Every error exspec raises on purpose, in one torch-free module. Each message names the problem (and the
field or flag, with its allowed range) so a CLI or the server can show it as it is."""


class ExspecError(Exception):
    """Base class of every error exspec raises on purpose."""


class ConfigError(ExspecError):
    """Flags, EXSPEC_* variables or a config value are invalid (the CLI exits with status 2)."""


class ModelLoadError(ExspecError):
    """A model or tokenizer directory is missing, is not a causal LM, or the pair does not match."""


class CapacityError(ExspecError):
    """The KV slot budget (slots or maximum sequence length) would be exceeded."""


class InvalidRequestError(ExspecError):
    """A request's prompt or sampling parameters are out of range (HTTP 400)."""


class QueueFullError(ExspecError):
    """The waiting queue is full (max_waiting): the server answers 429."""


class SchedulerClosedError(ExspecError):
    """The scheduler is shutting down or its step loop has died: the server answers 503."""


class InputError(ExspecError):
    """`exspec generate`: the input file or an argument is malformed."""


class BenchError(ExspecError):
    """`exspec bench`: an option is out of range or the model pair cannot run a method."""


class DemoBuildError(ExspecError):
    """The demo pair cannot be built or written (unwritable directory, foreign files in the way)."""


class DatasetError(ExspecError, ValueError):
    """A dataset name, file or size is invalid."""


class ReferenceError(ExspecError, ValueError):  # noqa: A001 (not the builtin: a reference *file* error)
    """A reference file is missing, malformed, or does not fit the run it is compared with."""


class SyntheticError(ExspecError, ValueError):
    """`exspec bench --synthetic`: an unknown synthetic shape name."""


class LoadTestError(ExspecError):
    """The load test: an option is invalid or the server cannot be used (message shown as-is, exit status 2)."""

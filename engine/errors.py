"""Errors the engine raises. Each names the problem so a CLI or server can show it as-is."""


class ExspecError(Exception):
    """Base class of every error exspec raises on purpose."""


class ModelLoadError(ExspecError):
    """A model or tokenizer directory is missing, is not a causal LM, or the pair does not match."""


class CapacityError(ExspecError):
    """The KV slot budget (slots or maximum sequence length) would be exceeded."""


class InvalidRequestError(ExspecError):
    """A request's prompt or sampling parameters are out of range."""

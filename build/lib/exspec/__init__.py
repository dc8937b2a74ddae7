"""exspec: batched speculative decoding done right."""

__version__ = "0.2.0"

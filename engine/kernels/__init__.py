"""exspec's own GPU kernels, written in Triton. `triton` is optional: importing this package never imports it
(the kernels are built on their first call); `available()` says whether they can run here."""

from exspec.engine.kernels.paged_attention import available, paged_attention, paged_attention_reference

__all__ = ["available", "paged_attention", "paged_attention_reference"]

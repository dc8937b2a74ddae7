"""exspec's own GPU kernels, written in Triton. `triton` is optional: importing this package never imports it
(the kernels are built on their first call); `available()` says whether they can run here. `paged_attention_op` is the same kernel registered as a PyTorch operator
(`torch.ops.exspec.paged_attention`) for forwards compiled with `fullgraph=True`."""

from exspec.engine.kernels.paged_attention import (
    available,
    paged_attention,
    paged_attention_op,
    paged_attention_reference,
)

__all__ = ["available", "paged_attention", "paged_attention_op", "paged_attention_reference"]

"""oneDNN-prepacked linear layers for CPU forwards.

On the CPU, over a few rows (a verify of k + 1 positions, a batch of rows) MKL's sgemm throughput barely rises,
while oneDNN with its weights reordered once into its blocked layout runs 2x to 3x faster (docs/BENCHMARKS-HISTORY.md,
"Few-row GEMM"): every multi-row forward goes to the prepacked weight. For one row it depends on the weight's size:
the oneDNN call costs about 7 us more than sgemm's, which large weights win back (caches exceeded, it is 1.2x to 2x
faster from 11 MiB up, 0.46x on SmolLM2's 108 MiB head) and small ones do not (2.8x slower at 256 x 256). One-row
forwards take the prepacked weight from `ONE_ROW_PACKED_MIN_ELEMENTS` (the measured crossover, 4 MiB of float32;
docs/BENCHMARKS.md section 3, "One-row forwards"), sgemm below it. The price is a second copy of every linear weight
(kept beside the original, which tied embeddings still share).

Selected by `prepack_linears` at load (`EngineConfig.gemm`, flag `--gemm`: "auto" packs float32 models on the
CPU; "default" turns it off). Numbers differ from sgemm by float rounding only (a different summation order).
"""

from __future__ import annotations


import torch

GEMM_MODES = ("packed", "default")
# One-row forwards of a weight with at least this many elements go to the prepacked copy, smaller ones to sgemm:
# `scripts/bench_one_row_gemm.py` put the crossover at 1024 x 1024 (1.0x) on one thread.
ONE_ROW_PACKED_MIN_ELEMENTS = 1 << 20


class _Packed:
    """The prepacked copy of a weight and the weight version it was packed from. Not copied by deepcopy
    (an opaque oneDNN tensor): a copy repacks at its first multi-row forward."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.version = -1

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()


class PackedLinear(torch.nn.Module):
    """A drop-in `nn.Linear` (same `weight` / `bias` parameters) with a oneDNN-prepacked copy used by every
    eager forward over several rows, and over one row when the weight is large (`ONE_ROW_PACKED_MIN_ELEMENTS`).
    The copy is refreshed whenever the weight is modified in place (its version counter moves)."""

    def __init__(self, linear: torch.nn.Linear, max_rows: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]: shared with the original (tied embeddings stay tied)
        self.bias = linear.bias  # [out] or None
        self.max_rows = max_rows
        self._packed = _Packed()
        self.one_row_packed = linear.weight.numel() >= ONE_ROW_PACKED_MIN_ELEMENTS

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor:  # weight: self.weight
        packed = self._packed
        if packed.version != weight._version or packed.tensor is None:
            with torch.no_grad():
                packed.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.max_rows)
            packed.version = weight._version
        return packed.tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        weight = self.weight  # [out, in] (one module attribute lookup: this runs ~30 times a forward)
        rows = x.numel() // self.in_features
        # Under torch.compile (engine/static_forward.py) the plain linear: the prepacked copy's lazy refresh is a
        # Python side effect a graph cannot hold (the compiler does its own weight layouts).
        # A packed model later moved off the CPU or out of float32 (a test's bf16 or CUDA copy): the plain linear.
        if ((rows == 1 and not self.one_row_packed) or weight.dtype != torch.float32 or not weight.is_cpu
                or torch.compiler.is_compiling()):
            return torch.nn.functional.linear(x, weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        packed = self._packed_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def gemm_mode(model: torch.nn.Module, requested: str = "auto") -> str:
    """The GEMM path for a loaded model, resolved once: `requested` ("auto": "packed" for float32 on the CPU)."""
    name = None if requested == "auto" else requested
    if name is not None and name not in GEMM_MODES:
        from exspec.errors import ExspecError

        raise ExspecError(f"gemm must be one of auto, {', '.join(GEMM_MODES)}, got {requested!r}")
    param = next(model.parameters())
    usable = param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if not usable:
        return "default"
    return name or "packed"


def prepack_linears(model: torch.nn.Module, requested: str = "auto") -> int:
    """Replace every `nn.Linear` of the model by a `PackedLinear` (in place) when the mode is "packed".
    Returns how many were replaced."""
    if gemm_mode(model, requested) != "packed":
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)

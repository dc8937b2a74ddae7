"""oneDNN-prepacked linear layers for CPU forwards.

On the CPU, over a few rows (a verify of k + 1 positions, a batch of rows) MKL's sgemm throughput barely rises,
while oneDNN with its weights reordered once into its blocked layout runs 2x to 3x faster (docs/BENCHMARKS-HISTORY.md,
"Few-row GEMM"): every multi-row forward goes to the prepacked weight. For one row it depends on the weight's size:
the oneDNN call costs about 7 us more than sgemm's, which large weights win back (caches exceeded, it is 1.2x to 2x
faster from 11 MiB up, 0.46x on SmolLM2's 108 MiB head) and small ones do not (2.8x slower at 256 x 256). One-row
forwards take the prepacked weight from `ONE_ROW_PACKED_MIN_ELEMENTS` (the measured crossover, 4 MiB of float32;
docs/BENCHMARKS.md section 3, "One-row forwards"), sgemm below it. The price is a second copy of every linear weight
(kept beside the original, which tied embeddings still share).

Row padding. A model whose weights do not fit in the caches streams them from memory on every forward, and then a
forward over one or two rows can cost more than one over four: oneDNN picks its kernel by the row count, and its
few-row kernels do not all stream weights equally well. On the 350m synthetic target (1.4 GB, AVX-512 EPYC, one
thread), a pass over its 121 large linears cold from memory took 77.7 / 93.1 / 64.7 / 58.8 / 58.4 / 80.1 ms for 1 / 2 /
3 / 4 / 6 / 8 rows, and 58.2 / 60.2 ms for one / two rows padded with zero rows to four (`scripts/bench_row_padding.py`,
docs/BENCHMARKS.md section 3). So at load `tune_row_padding` times a pass over the model's linears for each row count
up to `ROW_PAD_MAX_ROWS` (interleaved, the median of `ROW_PAD_REPEATS`) and pads a forward of m rows to the fewest
m' > m within `ROW_PAD_TIE` of the fastest, where that was at least `ROW_PAD_GAIN` faster than m; a model under
`ROW_PAD_MIN_BYTES` of linear weights (cache-resident: every test model) is not tuned. Padding rows are zeros and are cut from the output: a row's numbers depend on the padded row count only
through float rounding (the kernel's summation order), as they already do on the row count.

Selected by `prepack_linears` at load (`EngineConfig.gemm`, flag `--gemm`: "auto" packs float32 models on the
CPU and tunes the row padding; "unpadded" packs without padding; "default" turns it off). Numbers differ from
sgemm by float rounding only (a different summation order).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

GEMM_MODES = ("packed", "unpadded", "default")
# One-row forwards of a weight with at least this many elements go to the prepacked copy, smaller ones to sgemm:
# `scripts/bench_one_row_gemm.py` put the crossover at 1024 x 1024 (1.0x) on one thread.
ONE_ROW_PACKED_MIN_ELEMENTS = 1 << 20
ROW_PAD_MAX_ROWS = 8  # forwards of up to this many rows may be padded (tune_row_padding)
ROW_PAD_MIN_BYTES = 64 << 20  # linear weights below this fit in the caches of a server CPU: not tuned
ROW_PAD_GAIN = 0.10  # pad only where the padded row count measured at least 10% faster
ROW_PAD_TIE = 0.03  # among padded row counts within 3% of the fastest, the fewest rows
ROW_PAD_REPEATS = 5  # timed passes per row count (median)
ROW_PAD_SAMPLE_BYTES = 256 << 20  # the pass covers every j-th linear, j such that it reads about this much


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
    The copy is refreshed whenever the weight is modified in place (its version counter moves). `row_pad` (rows ->
    padded rows, set for a whole model by `tune_row_padding`) pads a forward's rows with zero rows."""

    row_pad: dict[int, int] = {}  # replaced (never mutated) by tune_row_padding
    row_pad_seconds: dict[int, float] = {}  # the medians it chose from (rows -> seconds a pass); {} when not tuned

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
        padded = self.row_pad.get(rows, rows)
        # Under torch.compile (engine/static_forward.py) the plain linear: the prepacked copy's lazy refresh is a
        # Python side effect a graph cannot hold (the compiler does its own weight layouts).
        # A packed model later moved off the CPU or out of float32 (a test's bf16 or CUDA copy): the plain linear.
        if ((padded == 1 and not self.one_row_packed) or weight.dtype != torch.float32 or not weight.is_cpu
                or torch.compiler.is_compiling()):
            return torch.nn.functional.linear(x, weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        if padded > rows:
            flat = torch.cat((flat, flat.new_zeros(padded - rows, self.in_features)))  # [padded, in]
        packed = self._packed_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")  # [padded, out]
        return out[:rows].reshape(*x.shape[:-1], self.out_features)


def gemm_mode(model: torch.nn.Module, requested: str = "auto") -> str:
    """The GEMM path for a loaded model, resolved once: `requested` ("auto": "packed" for float32 on the CPU, which
    tunes the row padding; "unpadded": packed without it)."""
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
    """Replace every `nn.Linear` of the model by a `PackedLinear` (in place) when the mode is "packed" or "unpadded",
    and for "packed" tune their row padding (`tune_row_padding`). Returns how many were replaced."""
    mode = gemm_mode(model, requested)
    if mode == "default":
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    if mode == "packed" and swaps:
        tune_row_padding(model)
    return len(swaps)


def choose_row_padding(seconds: dict[int, float], gain: float = ROW_PAD_GAIN,
                       tie: float = ROW_PAD_TIE) -> dict[int, int]:
    """rows -> padded rows, from the measured seconds of a pass at each row count: each m to the fewest m' > m within
    `tie` of the fastest m' > m, if that was at least `gain` faster than m itself (else m is not padded)."""
    pad = {}
    for m, t in seconds.items():
        above = [n for n in sorted(seconds) if n > m]
        if not above:
            continue
        fastest = min(seconds[n] for n in above)
        n = next(n for n in above if seconds[n] <= (1 + tie) * fastest)
        if seconds[n] <= (1 - gain) * t:
            pad[m] = n
    return pad


def tune_row_padding(model: torch.nn.Module, *, max_rows: int = ROW_PAD_MAX_ROWS, repeats: int = ROW_PAD_REPEATS,
                     min_bytes: int = ROW_PAD_MIN_BYTES, sample_bytes: int = ROW_PAD_SAMPLE_BYTES,
                     clock: Callable[[], float] = time.perf_counter) -> dict[int, int]:
    """Time a pass over the model's `PackedLinear`s (every j-th in model order, about `sample_bytes` of weights: more
    than any cache holds, as a forward streams them) for each row count 1..max_rows, `repeats` times interleaved (the
    order reversed every other round), and set on all of them the row padding `choose_row_padding` picks from the
    medians. A model whose linear weights total under `min_bytes` is not tuned (its weights stay in the caches:
    few-row forwards then cost about what their rows do). Returns the padding set ({}: none). About 1 s for the 350m
    synthetic target on one thread."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in {id(m.weight): m for m in linears}.values())
    for m in linears:
        m.row_pad, m.row_pad_seconds = {}, {}
    if not linears or size < min_bytes or linears[0].weight.dtype != torch.float32 or not linears[0].weight.is_cpu:
        return {}
    sample = linears[:: max(1, round(size / sample_bytes))]
    inputs = {(rows, n): torch.zeros(rows, n) for rows in range(1, max_rows + 1) for n in {m.in_features for m in sample}}
    seconds: dict[int, list[float]] = {rows: [] for rows in range(1, max_rows + 1)}
    order = list(seconds)
    with torch.no_grad():
        for round_ in range(repeats + 1):  # round 0 packs the weights and warms up, unrecorded
            for rows in order if round_ % 2 else order[::-1]:
                start = clock()
                for m in sample:
                    m(inputs[rows, m.in_features])
                if round_:
                    seconds[rows].append(clock() - start)
    medians = {rows: statistics.median(ts) for rows, ts in seconds.items()}
    pad = choose_row_padding(medians)
    for m in linears:
        m.row_pad, m.row_pad_seconds = pad, medians
    return pad


def _first_packed(model: torch.nn.Module | None) -> PackedLinear | None:
    return next((m for m in model.modules() if isinstance(m, PackedLinear)), None) if model is not None else None


def row_padding(model: torch.nn.Module | None) -> dict[int, int]:
    """The row padding `tune_row_padding` set on the model ({}: none, or not packed)."""
    first = _first_packed(model)
    return dict(first.row_pad) if first is not None else {}


def row_padding_times(model: torch.nn.Module | None) -> dict[int, float]:
    """What `tune_row_padding` measured: rows -> a pass's median seconds over the fastest row count's (1.0 is the
    fastest; {}: not tuned). Recorded so that a run's padding can be told apart from the load it was tuned under."""
    first = _first_packed(model)
    seconds = first.row_pad_seconds if first is not None else {}
    fastest = min(seconds.values(), default=0.0)
    return {rows: round(t / fastest, 3) for rows, t in seconds.items()} if fastest > 0 else {}

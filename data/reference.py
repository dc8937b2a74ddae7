"""The greedy reference file: what the target alone generates for each prompt, and the check against it.

A reference is a JSONL file, one row per prompt, written by `exspec bench --write-reference FILE` (the
target alone through our engine at k = 0, batch 1, with the target's top-2 logit gaps) or by
`python -m exspec.loadtest --write-reference FILE` (whatever the server returned: run it against a server
started with `--num-speculative-tokens 0` to record the target alone; no gaps). Each row:

    {"prompt_token_ids": [int, ...],   # the prompt, as token ids
     "output_token_ids": [int, ...],   # the generated ids (EOS kept when the run stopped on it)
     "max_tokens": int,                # the generation budget of the run
     "ignore_eos": bool,               # whether EOS was ignored
     "top2_gaps": [float, ...] | null, # per generated position: the target's top-1 minus top-2 logit
     "near_tie_eps": float | null,     # a divergence where the gap is below this is a near-tie
     "top1_logits": [float, ...] | null,  # per generated position: the target's top-1 logit (optional)
     "dtype": str | null,              # the dtype the reference ran in, e.g. "bfloat16" (optional)
     "source": str}                    # what produced the row

Greedy output equivalence: an output equals its reference token for token. When it does not, the first
differing position is a *near-tie* if the reference's top-2 gap there is below `near_tie_eps`, or, where the
row has its top-1 logits and dtype, at most NEAR_TIE_ULPS units in the last place of the top-1 logit in that
dtype (`is_near_tie`; batched kernels reduce in another order, and that can flip an argmax so close: bf16 logits
in [8, 16) are 0.0625 apart, so a gap of one such step is no evidence of a real divergence), *real* if it is
not, and *unclassified* when the reference carries no gaps. Torch-free: the load test reads this without a
model, the offline benchmark writes it and classifies its own divergences by the same rule (both import it from
here: neither may import the other).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from exspec.data.atomic import write_lines_atomic

from exspec.errors import ReferenceError


# fp32 keeps ~1e-6 relative error through a forward; bf16/fp16 keep 8/11 bits of mantissa.
NEAR_TIE_EPS = {"float32": 1e-3, "fp32": 1e-3, "bfloat16": 0.05, "bf16": 0.05, "float16": 0.05, "fp16": 0.05}
# Explicit significand bits per dtype: a logit x in that dtype is a multiple of ulp(x) = 2^(floor(log2|x|) - bits).
SIGNIFICAND_BITS = {"float32": 23, "fp32": 23, "bfloat16": 7, "bf16": 7, "float16": 10, "fp16": 10}
NEAR_TIE_ULPS = 2  # a gap of at most this many units in the last place of the top-1 logit is a near-tie


def ulp(x: float, dtype: str) -> float:
    """The spacing of `dtype`'s numbers at x (0 for x = 0 or not finite)."""
    if x == 0 or not math.isfinite(x):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(x))) - SIGNIFICAND_BITS[dtype])


def is_near_tie(gap: float, top1: float | None, dtype: str | None, eps: float | None = None) -> bool:
    """A top-2 gap a reduction order can flip: below eps (default NEAR_TIE_EPS[dtype]), or within NEAR_TIE_ULPS units
    in the last place of the top-1 logit in dtype (bf16 logits in [8, 16) are 0.0625 apart: a gap of 0.0625 there is
    one step); the second test only where top1 and dtype are known (a reference file may lack them)."""
    if eps is None:
        eps = NEAR_TIE_EPS[dtype]
    return gap < eps or (top1 is not None and dtype is not None and gap <= NEAR_TIE_ULPS * ulp(top1, dtype))


@dataclass(frozen=True)
class ReferenceRow:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    top2_gaps: list[float] | None = None  # [len(output_token_ids)] or None
    near_tie_eps: float | None = None
    source: str = ""
    top1_logits: list[float] | None = None  # [len(output_token_ids)] or None
    dtype: str | None = None  # one of SIGNIFICAND_BITS' names, or None


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts); None when identical."""
    if output == reference:
        return None
    return next((j for j, (a, r) in enumerate(zip(output, reference)) if a != r), min(len(output), len(reference)))


def write_reference(path: Path, rows: list[ReferenceRow]) -> None:
    """All rows or nothing: a temp file in the same directory, renamed over `path`."""
    path = Path(path).resolve()
    if not path.parent.is_dir():
        raise ReferenceError(f"reference directory {str(path.parent)!r} does not exist")
    write_lines_atomic(path, (json.dumps(asdict(row)) for row in rows))


def _int_list(value, where: str, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ReferenceError(f"{where}: {name!r} must be a list of integers")
    return value


def read_reference(path: Path) -> list[ReferenceRow]:
    """Every row of a reference file, checked field by field."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceError(f"reference file {str(path)!r} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReferenceError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ReferenceError(f"{where}: expected an object")
        prompt = _int_list(obj.get("prompt_token_ids"), where, "prompt_token_ids")
        output = _int_list(obj.get("output_token_ids"), where, "output_token_ids")
        if not prompt:
            raise ReferenceError(f"{where}: 'prompt_token_ids' is empty")
        max_tokens = obj.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ReferenceError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
        if len(output) > max_tokens:
            raise ReferenceError(f"{where}: {len(output)} output ids exceed max_tokens {max_tokens}")
        gaps = obj.get("top2_gaps")
        if gaps is not None and (not isinstance(gaps, list) or len(gaps) != len(output)
                                 or not all(isinstance(g, (int, float)) for g in gaps)):
            raise ReferenceError(f"{where}: 'top2_gaps' must be null or one number per output id")
        eps = obj.get("near_tie_eps")
        if eps is not None and (not isinstance(eps, (int, float)) or eps < 0):
            raise ReferenceError(f"{where}: 'near_tie_eps' must be null or a number >= 0, got {eps!r}")
        top1 = obj.get("top1_logits")
        if top1 is not None and (not isinstance(top1, list) or len(top1) != len(output)
                                 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in top1)):
            raise ReferenceError(f"{where}: 'top1_logits' must be null or one number per output id")
        dtype = obj.get("dtype")
        if dtype is not None and dtype not in SIGNIFICAND_BITS:
            names = ", ".join(SIGNIFICAND_BITS)
            raise ReferenceError(f"{where}: 'dtype' must be null or one of {names}, got {dtype!r}")
        rows.append(ReferenceRow(prompt, output, max_tokens, bool(obj.get("ignore_eos", False)), gaps, eps,
                                 str(obj.get("source", "")), top1, dtype))
    if not rows:
        raise ReferenceError(f"reference file {str(path)!r} holds no rows")
    return rows


def compare_with_reference(outputs: list[list[int]], references: list[ReferenceRow]) -> list[dict]:
    """One {index, position, gap, top1, kind} per output that differs from its reference row; kind is "near-tie",
    "real" or "unclassified" (see the module docstring); top1 is None where the row has no top-1 logits."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, references)):
        j = first_divergence(out, ref.output_token_ids)
        if j is None:
            continue
        gap = ref.top2_gaps[j] if ref.top2_gaps is not None and j < len(ref.top2_gaps) else None
        top1 = ref.top1_logits[j] if ref.top1_logits is not None and j < len(ref.top1_logits) else None
        if gap is None or ref.near_tie_eps is None:
            kind = "unclassified" if ref.top2_gaps is None else "real"
        else:
            kind = "near-tie" if is_near_tie(gap, top1, ref.dtype, ref.near_tie_eps) else "real"
        found.append({"index": i, "position": j, "gap": gap, "top1": top1, "kind": kind})
    return found

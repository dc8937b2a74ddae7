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
     "source": str}                    # what produced the row

Greedy output equivalence: an output equals its reference token for token. When it does not, the first
differing position is a *near-tie* if the reference's top-2 gap there is below `near_tie_eps` (batched
kernels reduce in another order, and that can flip an argmax so close), *real* if it is not, and
*unclassified* when the reference carries no gaps. Torch-free: the load test reads this without a model, the
offline benchmark writes it (both import it from here: neither may import the other).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from exspec.data.atomic import write_lines_atomic

from exspec.errors import ReferenceError


@dataclass(frozen=True)
class ReferenceRow:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    top2_gaps: list[float] | None = None  # [len(output_token_ids)] or None
    near_tie_eps: float | None = None
    source: str = ""


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
        rows.append(ReferenceRow(prompt, output, max_tokens, bool(obj.get("ignore_eos", False)), gaps, eps,
                                 str(obj.get("source", ""))))
    if not rows:
        raise ReferenceError(f"reference file {str(path)!r} holds no rows")
    return rows


def compare_with_reference(outputs: list[list[int]], references: list[ReferenceRow]) -> list[dict]:
    """One {index, position, gap, kind} per output that differs from its reference row; kind is "near-tie",
    "real" or "unclassified" (see the module docstring)."""
    found = []
    for i, (out, ref) in enumerate(zip(outputs, references)):
        j = first_divergence(out, ref.output_token_ids)
        if j is None:
            continue
        gap = ref.top2_gaps[j] if ref.top2_gaps is not None and j < len(ref.top2_gaps) else None
        if gap is None or ref.near_tie_eps is None:
            kind = "unclassified" if ref.top2_gaps is None else "real"
        else:
            kind = "near-tie" if gap < ref.near_tie_eps else "real"
        found.append({"index": i, "position": j, "gap": gap, "kind": kind})
    return found

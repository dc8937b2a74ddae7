"""The synthetic pairs' draft agreement as a function of `scale` (bench/synthetic.py): builds each named target
once, in memory, then for each scale rescales its later layers' o_proj and down_proj in place and measures the
teacher-forced agreement exactly as ensure_synthetic_pair does (the draft, the target's first layers, does not
depend on the scale). Nothing is saved. Used to choose SHAPES' scales for a wanted agreement.

    python scripts/synthetic_agreement.py --shapes 1b,8b --scales 0.005,0.01,0.015,0.02,0.03 --device cuda
    python scripts/synthetic_agreement.py --shapes tiny --scales 0.1,0.3 --device cpu     (a CPU smoke: seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from exspec.bench.synthetic import SHAPES, build_models, build_tokenizer, measure_agreement
from exspec.data import encode_prompts, load_questions


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--scales", type=_floats, default=[0.005, 0.01, 0.015, 0.02, 0.03])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8, help="SpecBench prompts (ensure_synthetic_pair uses 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = build_tokenizer(Path(tmp), shape.vocab_size)
        built = dataclasses.replace(shape, scale=1.0)
        target, draft = build_models(built, tokenizer, args.seed, args.device)
        questions = load_questions("specbench", args.prompts)
        prompts = [q[:256] for q in encode_prompts(tokenizer, questions, chat_template=False)]
        current = 1.0
        for scale in args.scales:
            for layer in target.model.layers[shape.draft_layers:]:
                layer.self_attn.o_proj.weight.mul_(scale / current)
                layer.mlp.down_proj.weight.mul_(scale / current)
            current = scale
            row = {"shape": name, "scale": scale, "agreement": round(measure_agreement(target, draft, prompts), 4),
                   "shipped_scale": shape.scale, "seconds": round(time.perf_counter() - start, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del target, draft
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

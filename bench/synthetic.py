"""`exspec bench --synthetic NAME`: a random Llama-shaped target and a draft that agrees with it, built in
seconds with no training and no download, for timing at real model shapes.

The target is a randomly initialised Llama whose decoder layers after the first `draft_layers` are scaled
down (their o_proj and down_proj weights times `scale`), so each adds only a small correction to the
residual stream. The draft is the target's own first `draft_layers` layers + final norm + lm_head, so it
predicts the target's next token most of the time: the agreement rate is measured on SpecBench prompts
and reported. Both are saved as model directories (config.json + safetensors + a byte-level BPE tokenizer
trained in a second on the bundled questions; the model's vocabulary may be larger than the tokenizer's,
which the loader accepts: ids past the tokenizer decode to nothing) and cached by name, shape and seed.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from exspec.data import encode_prompts, load_questions, read_rows
from exspec.demo.tokenizer import train_bpe
from exspec.engine.random_model import causal_lm_config, random_causal_lm
from exspec.bench.config import SYNTHETIC_CACHE, SYNTHETIC_NAMES
from exspec.errors import SyntheticError

DEFAULT_CACHE = SYNTHETIC_CACHE
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VERSION = 1  # bump when the construction changes: cached pairs of another version are rebuilt


@dataclass(frozen=True)
class SyntheticShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int  # the model's embedding rows (the tokenizer may have fewer)
    draft_layers: int = 1  # the draft keeps the target's first draft_layers layers
    scale: float = 0.05  # o_proj and down_proj of the later layers are multiplied by this
    build_dtype: str = "float32"  # dtype the weights are created and saved in
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192


SHAPES = {
    # scale chosen for a teacher-forced agreement near 0.7 on the CPU shapes (measured at seed 0: tiny 0.68, 350m
    # 0.71) and near 0.85 on the GPU shapes, as the GPU issue asks (scripts/synthetic_agreement.py on an H100,
    # 2026-11-24, seed 0: 1b 0.856 at 0.015; 8b 0.878 at 0.01, 0.808 at 0.015). The built pair reports its own.
    # For tests: builds in about a second.
    "tiny": SyntheticShape(64, 128, 4, 4, 2, 512, scale=0.3),
    # ~350M parameters, for a CPU.
    "350m": SyntheticShape(1024, 2816, 24, 16, 8, 32000, scale=0.02),
    # Llama 3.2 1B and Llama 3.1 8B shapes, for a GPU (created in bfloat16).
    "1b": SyntheticShape(2048, 8192, 16, 32, 8, 128256, scale=0.015, build_dtype="bfloat16"),
    "8b": SyntheticShape(4096, 14336, 32, 32, 8, 128256, scale=0.012, build_dtype="bfloat16"),
}
assert tuple(SHAPES) == SYNTHETIC_NAMES, "bench/config.py lists the synthetic shapes for the CLI"


def _dirname(name: str, shape: SyntheticShape, seed: int) -> str:
    return f"{name}-v{VERSION}-seed{seed}"


def build_tokenizer(out_dir: Path, vocab_size: int):
    """A byte-level BPE trained on the bundled questions (about a second), saved to out_dir."""
    texts = [t for name in ("specbench", "mtbench") for row in read_rows(name) for t in row.get("turns", [])]
    fast = train_bpe(texts, vocab_size, SPECIALS + ["<|user|>", "<|assistant|>"], eos_token="</s>",
                     chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out_dir)
    return fast


def _llama_config(shape: SyntheticShape, layers: int, tokenizer):
    return causal_lm_config(
        "llama", shape.vocab_size, layers=layers, hidden=shape.hidden_size, intermediate=shape.intermediate_size,
        heads=shape.num_heads, kv_heads=shape.num_kv_heads, positions=shape.max_position_embeddings,
        rope_theta=shape.rope_theta, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, architectures=["LlamaForCausalLM"],
    )


@torch.no_grad()
def build_models(shape: SyntheticShape, tokenizer, seed: int, device: str = "cpu"):
    """(target, draft) modules: the random target with its later layers scaled down, and its first layers."""
    dtype = getattr(torch, shape.build_dtype)
    torch.manual_seed(seed)
    with torch.device(device):  # created in place, in the build dtype: an 8b target never exists in fp32
        target = random_causal_lm(_llama_config(shape, shape.num_layers, tokenizer), dtype=dtype)
        for layer in target.model.layers[shape.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(shape.scale)
            layer.mlp.down_proj.weight.mul_(shape.scale)
        draft = random_causal_lm(_llama_config(shape, shape.draft_layers, tokenizer), dtype=dtype)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < shape.draft_layers}
    draft.load_state_dict(state)
    return target.eval(), draft.eval()


@torch.no_grad()
def measure_agreement(target, draft, prompts: list[list[int]]) -> float:
    """Share of positions where the draft's greedy next token equals the target's, teacher-forced on the
    prompts (one forward of each model per prompt)."""
    device = next(target.parameters()).device
    same = total = 0
    for p in prompts:
        ids = torch.tensor([p], device=device)  # [1, P]
        t = target(input_ids=ids).logits[0].argmax(-1)  # [P]
        d = draft(input_ids=ids).logits[0].argmax(-1)  # [P]
        same += int((t == d).sum())
        total += len(p)
    return same / total if total else math.nan


def ensure_synthetic_pair(name: str, cache_dir: Path = DEFAULT_CACHE, seed: int = 0, device: str = "cpu",
                          log=print) -> tuple[Path, Path, dict]:
    """(target_dir, draft_dir, info) of the named synthetic pair, built into cache_dir on first use.
    info: {"name", "shape", "seed", "agreement", "parameters"} (also in DIR/synthetic.json)."""
    if name not in SHAPES:
        raise SyntheticError(f"--synthetic must be one of {', '.join(SHAPES)}, got {name!r}")
    shape = SHAPES[name]
    root = Path(cache_dir).expanduser() / _dirname(name, shape, seed)
    marker = root / "synthetic.json"
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("shape") == asdict(shape):
            return root / "target", root / "draft", info
    if root.exists():
        shutil.rmtree(root)
    log(f"[synthetic] building {name} into {root}")
    tmp = root.with_name(root.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "target").mkdir(parents=True)
    tokenizer = build_tokenizer(tmp / "target", shape.vocab_size)
    target, draft = build_models(shape, tokenizer, seed, device)
    prompts = [p[:256] for p in encode_prompts(tokenizer, load_questions("specbench", 8), chat_template=False)]
    agreement = measure_agreement(target, draft, prompts)
    target.save_pretrained(tmp / "target")
    draft.save_pretrained(tmp / "draft")
    tokenizer.save_pretrained(tmp / "draft")
    info = {
        "name": name,
        "version": VERSION,
        "shape": asdict(shape),
        "seed": seed,
        "agreement": agreement,
        "agreement_measured_on": f"{len(prompts)} SpecBench prompts, teacher-forced next-token argmax, {device}",
        "parameters": {"target": sum(p.numel() for p in target.parameters()),
                       "draft": sum(p.numel() for p in draft.parameters())},
        "tokenizer_size": len(tokenizer),
    }
    (tmp / "synthetic.json").write_text(json.dumps(info, indent=2) + "\n")
    tmp.rename(root)
    log(f"[synthetic] {name}: draft agreement {agreement:.2f}, target {info['parameters']['target'] / 1e6:.1f}M "
        f"parameters, draft {info['parameters']['draft'] / 1e6:.1f}M")
    return root / "target", root / "draft", info

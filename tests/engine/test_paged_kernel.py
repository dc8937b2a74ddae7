"""The Triton paged-attention kernel (engine/kernels/paged_attention.py) against its plain PyTorch reference, and the
reference against a per-query loop of SDPA over keys gathered by hand.

On a machine without CUDA the kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py switches it on
before triton is imported): fp32 and fp16 there (numpy has no bfloat16), bf16 only on a GPU. Shapes are small because
the interpreter is slow. Every case scatters each row's blocks over a shuffled pool and poisons everything a row does
not own (the null block, unowned blocks, the slots past its length in its last block) with NaN: a kernel that reads
any of it returns NaN.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from exspec.engine.kernels import available, paged_attention, paged_attention_reference
from tests.support.triton_interpreter import restore_options, set_overflow_checks

kernel_module = importlib.import_module("exspec.engine.kernels.paged_attention")  # the package re-exports the function

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(not available(), reason="needs triton, and CUDA or TRITON_INTERPRET=1")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1.5e-3, rtol=1.5e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def kernel_under_test(monkeypatch):
    """Off CUDA: the interpreter checks each integer operation for int32 overflow here and raises on one (the other
    test files switch that off, tests/support/triton_interpreter.py), and key tiles of 16, so that these cases' rows
    of up to 63 keys span several tiles of the online softmax (the engine's interpreted tests run one tile of 128)."""
    if DEVICE.type == "cuda":
        yield
        return
    monkeypatch.setattr(kernel_module, "INTERPRETER_BLOCK_N", 16)
    before = set_overflow_checks(True)
    yield
    restore_options(before)


@needs_kernel
@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's checks (a compiled kernel drops them)")
def test_the_interpreter_raises_on_an_int32_overflow_here():
    """The checks above are live: a multiply past int32's range in a jitted function raises under the interpreter."""
    import triton
    import triton.language as tl

    def multiply(out_ptr, a, b):
        tl.store(out_ptr, a * b)

    out = torch.zeros(1, dtype=torch.int32)
    kernel = triton.jit(multiply)
    kernel[(1,)](out, 2**10, 2**15)
    assert out.item() == 2**25
    with pytest.raises(Exception, match="int32 overflow"):
        kernel[(1,)](out, 2**20, 2**15)


@dataclass
class Case:
    query: torch.Tensor  # [B, heads, Q, head_dim]
    k_cache: torch.Tensor  # [num_blocks + 1, block_size, kv_heads, head_dim], poisoned outside what rows own
    v_cache: torch.Tensor
    clean_k: torch.Tensor  # the same caches with zeros instead of NaN (the reference reads everything)
    clean_v: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    scale: float


def make_case(
    seq_lens: list[int],
    q_len: int,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Case:
    """Rows of the given lengths (0: a padding row), each owning ceil(len / block_size) blocks drawn from a shuffled
    pool; block table entries past a row's blocks are 0 (the null block), as the engine leaves them."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    max_blocks = max(need) + 1
    ids = (torch.randperm(num_blocks, generator=gen) + 1).tolist()  # physical blocks 1..num_blocks, shuffled
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    owned = torch.zeros(num_blocks + 1, block_size, dtype=torch.bool)  # [blocks, slots]: positions some row holds
    for row, (n, blocks) in enumerate(zip(seq_lens, need)):
        for logical in range(blocks):
            phys = ids.pop()
            tables[row, logical] = phys
            owned[phys, : min(block_size, n - logical * block_size)] = True
    shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    clean_k = torch.randn(shape, generator=gen) * owned[:, :, None, None]
    clean_v = torch.randn(shape, generator=gen) * owned[:, :, None, None]
    poison = ~owned[:, :, None, None]
    k_cache = clean_k.masked_fill(poison, float("nan"))
    v_cache = clean_v.masked_fill(poison, float("nan"))
    query = torch.randn(len(seq_lens), q_len, heads, head_dim, generator=gen).transpose(1, 2)  # [B, heads, Q, D] view
    to = dict(device=DEVICE, dtype=dtype)
    return Case(
        query.to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        clean_k.to(**to),
        clean_v.to(**to),
        tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        head_dim**-0.5,
    )


def run_kernel(case: Case, window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    return paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, window, out)


def run_reference(case: Case, window: int | None = None) -> torch.Tensor:
    """In fp32 from the same (exactly widened) inputs, so the tolerance measures only the kernel's rounding."""
    return paged_attention_reference(
        case.query.float(), case.clean_k.float(), case.clean_v.float(), case.block_tables, case.seq_lens, case.scale, window
    )


def assert_kernel_matches(case: Case, window: int | None = None) -> torch.Tensor:
    got = run_kernel(case, window)
    batch, heads, q_len, head_dim = case.query.shape
    assert got.shape == (batch, q_len, heads, head_dim) and got.dtype == case.query.dtype
    assert not got.isnan().any(), "the kernel read a position no row owns"
    torch.testing.assert_close(got.float(), run_reference(case, window), **TOL[case.query.dtype])
    padding = case.seq_lens == 0
    assert (got[padding] == 0).all(), "padding rows must give zeros"
    return got


# ------------------------------------------------------------------------------------------ the reference itself


def loop_reference(case: Case, window: int | None) -> torch.Tensor:
    """One SDPA call per (row, query) over keys gathered one by one through the block table (on the CPU)."""
    case = Case(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in vars(case).values()))
    batch, heads, q_len, head_dim = case.query.shape
    block_size, kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    out = torch.zeros(batch, q_len, heads, head_dim)
    for b in range(batch):
        n = int(case.seq_lens[b])
        for i in range(q_len):
            p = n - q_len + i
            first = 0 if window is None else max(0, p - window + 1)
            if n == 0:
                continue
            where = [(int(case.block_tables[b, j // block_size]), j % block_size) for j in range(first, p + 1)]
            keys = torch.stack([case.clean_k[blk, s] for blk, s in where], dim=1).float()  # [kv_heads, n_j, D]
            values = torch.stack([case.clean_v[blk, s] for blk, s in where], dim=1).float()
            q = case.query[b, :, i : i + 1].float()  # [heads, 1, D]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0), scale=case.scale
            )  # [heads, 1, D]
            out[b, i] = o[:, 0]
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_reference_matches_a_loop_of_sdpa(window):
    case = make_case([13, 0, 6, 22], q_len=5, heads=6, kv_heads=2, head_dim=8)
    torch.testing.assert_close(run_reference(case, window).cpu(), loop_reference(case, window), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the kernel

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (4, 4, 64), (6, 2, 24), (9, 3, 64)],  # GQA, MHA, non-power-of-two head_dim, SmolLM2's 3-head groups
)
def test_decode_q1(dtype, heads, kv_heads, head_dim):
    case = make_case([13, 0, 30, 1], q_len=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    assert_kernel_matches(case)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4])
def test_verify_q5_rows_of_different_lengths(dtype, window):
    """k + 1 = 5 queries per row, each row its own causal offset; a row of exactly Q keys (its first forward)."""
    case = make_case([5, 17, 0, 38], q_len=5, head_dim=64, block_size=16, dtype=dtype, seed=1)
    assert_kernel_matches(case, window)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 8])
def test_prefill_chunk_spans_blocks_and_query_tiles(dtype, window):
    """A 40-query chunk with 8 heads on 2 kv heads: 16 queries per program, so three query tiles, each over several
    key tiles and KV blocks; one row starts at 0 (a first chunk), one at 23 (a later chunk)."""
    case = make_case([40, 63, 0], q_len=40, heads=8, kv_heads=2, head_dim=16, block_size=16, dtype=dtype, seed=2)
    assert_kernel_matches(case, window)


@needs_kernel
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize(("q_len", "window"), [(1, None), (5, None), (5, 40)])
def test_split_keys_merge_to_the_same_output(monkeypatch, splits, q_len, window):
    """Flash-decoding (the GPU's choice at small batches, forced here): each program takes a share of a row's keys and a
    second kernel merges the shares; the short row leaves some shares empty, the padding row all of them."""
    monkeypatch.setattr(kernel_module, "_num_splits", lambda *args: splits)
    case = make_case([7, 0, 45], q_len=q_len, heads=6, kv_heads=2, head_dim=24, dtype=torch.float32, seed=5)
    assert_kernel_matches(case, window)


@needs_kernel
def test_window_wider_than_the_sequence_and_window_one():
    case = make_case([9, 21], q_len=3, seed=3)
    torch.testing.assert_close(run_kernel(case, window=100), run_kernel(case, window=None), atol=0, rtol=0)
    got = assert_kernel_matches(case, window=1)  # each query sees only its own key: the output is that key's value
    v = case.clean_v[case.block_tables[1, 20 // 4], 20 % 4]  # [kv_heads, D]: row 1's last position
    torch.testing.assert_close(got[1, -1], v.repeat_interleave(2, 0), atol=1e-6, rtol=1e-6)


@needs_kernel
def test_strided_query_and_out_are_honoured():
    case = make_case([11, 26], q_len=5, heads=4, kv_heads=1, head_dim=16, seed=4)
    contiguous = case.query.contiguous()  # [B, heads, Q, D] in its own layout
    base = torch.full((2, 5, 4, 32), 7.0, device=DEVICE)  # out is a strided view into a wider buffer
    out = base[..., :16]
    returned = paged_attention(contiguous, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, out=out)
    assert returned is out
    torch.testing.assert_close(out, run_reference(case), **TOL[torch.float32])
    assert (base[..., 16:] == 7.0).all(), "the kernel wrote outside out"


@needs_kernel
def test_all_padding_batch_gives_zeros():
    case = make_case([0, 0], q_len=2, spare_blocks=2)
    assert (run_kernel(case) == 0).all()


@needs_kernel
def test_operator_form_compiles_without_graph_breaks():
    """`torch.ops.exspec.paged_attention` writes `out` inside a `fullgraph=True` region (a graph break would raise)."""
    case = make_case([9, 21], q_len=3, seed=6)

    def forward(query):  # [B, heads, Q, D] -> [B, Q, heads, D]
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        torch.ops.exspec.paged_attention(query * 1.0, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, 4, out)
        return out * 2.0

    compiled = torch.compile(forward, fullgraph=True, dynamic=False, backend="aot_eager")
    torch.testing.assert_close(compiled(case.query), 2.0 * run_reference(case, 4), **TOL[torch.float32])


# ------------------------------------------------------------------------------------------ compiled variants


@pytest.mark.parametrize("multiprocessors", [108, 132])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 16), (3, 80), (4, 64), (4, 128), (8, 128), (16, 64)])
def test_every_launch_shape_is_one_of_the_kernel_variants(group, head_dim, multiprocessors):
    """Whatever a forward's batch, queries and block table width, its launch takes one of `kernel_variants` (what
    warm_up compiles): a new shape in the serving loop never means a new Triton compile (1-3 s; the stalls of the
    GPU load tests of 2026-11-27)."""
    variants = set(kernel_module.kernel_variants(group, head_dim))
    seen = set()
    for q_len in [*range(1, 70), 100, 127, 128, 129, 300, 2048]:
        block_m, block_q, block_n, _ = kernel_module._tiles(q_len, group, head_dim, True)
        q_tiles = -(-q_len // block_q)
        for batch in [1, 2, 3, 5, 8, 13, 32, 64, 256]:
            for capacity in [16, 48, 256, 1000, 4096, 8192, 131072]:
                splits = kernel_module.splits_for(q_tiles * batch * 8, capacity, block_n, multiprocessors)
                assert (block_m, splits) in variants, (q_len, batch, capacity)
                seen.add((block_m, splits))
    assert seen == variants  # and none of them is unreachable (each is a compile at start for nothing)


@pytest.fixture
def fresh_variants(monkeypatch):
    """An empty record of launched variants, not yet watching (as in a new process)."""
    monkeypatch.setattr(kernel_module, "_launched", set())
    monkeypatch.setattr(kernel_module, "_watching", False)


@needs_kernel
def test_warm_up_launches_every_variant_once_then_logs_a_new_one(fresh_variants, monkeypatch, caplog):
    case = make_case([23, 6], q_len=1, heads=4, kv_heads=2, head_dim=16, seed=8)
    gpu = kernel_module._gpu_multiprocessors(case.clean_k.device) is not None
    # BLOCK_M 16, 32, 64, each with every key split a GPU may pick (1, 2, 4, 8, 16); the CPU splits no keys
    expected = len(kernel_module.kernel_variants(2, 16, kernel_module.SPLITS if gpu else (1,)))
    assert expected == (3 * len(kernel_module.SPLITS) if gpu else 3)
    assert kernel_module.warm_up(4, case.clean_k, case.clean_v, None) == expected
    assert kernel_module.warm_up(4, case.clean_k, case.clean_v, None) == 0  # nothing new
    for q_len in (1, 5, 9, 20):  # decode, a verify, prefill chunks: every BLOCK_M
        assert_kernel_matches(make_case([23, 26], q_len=q_len, heads=4, kv_heads=2, head_dim=16, seed=8))
    assert "after warm_up" not in caplog.text
    assert kernel_module.warm_up(4, case.clean_k, case.clean_v, 3) == expected  # a window: variants of their own
    monkeypatch.setattr(kernel_module, "_num_splits", lambda *args: 3)  # a variant warm_up did not launch
    assert_kernel_matches(make_case([23, 26], q_len=1, heads=4, kv_heads=2, head_dim=16, seed=8))
    assert "launched for the first time after warm_up" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_len", "window"), [(1, None), (5, None), (5, 64), (200, None)])
def test_cuda_compiled_kernel_with_its_own_splits(dtype, q_len, window):
    """The compiled kernel on the GPU, with the split count it picks itself (decode at B = 2 over a 1500-key capacity
    splits its keys on any recent GPU), over 8B-shaped heads (32 on 8, head_dim 128) and a 16-position block."""
    case = make_case([1500, 37], q_len=q_len, heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=dtype, seed=7)
    if q_len == 1:
        assert kernel_module._num_splits(2 * 8, 1504, 64, DEVICE) > 1
    assert_kernel_matches(case, window)


_COMPILE_FOR_H100 = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("paged_attention", sys.argv[1])  # the module alone: torch, no exspec
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

attention, merge = module._kernel()
assert [attention.arg_names[i] for i in attention.do_not_specialize] == list(module._SHAPE_ARGS), attention.do_not_specialize
for dtype, q_len, group, head_dim, window, splits in [("bf16", 1, 4, 128, False, 4), ("fp32", 5, 3, 80, True, 1)]:
    block_m, block_q, block_n, block_d = module._tiles(q_len, group, head_dim, True)
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, KV_BLOCK=16, BLOCK_M=block_m, BLOCK_Q=block_q,
                  BLOCK_N=block_n, HAS_WINDOW=window, IEEE=dtype == "fp32", NUM_SPLITS=splits)
    sig = {name: "i32" for name in attention.arg_names}
    sig.update({name: "*" + dtype for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")})
    sig.update(bt_ptr="*i32", lens_ptr="*i32", part_ptr="*fp32", scale_log2="fp32", **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(attention, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=4, BLOCK_S=4)
    sig = {name: "i32" for name in merge.arg_names}
    sig.update(part_ptr="*fp32", o_ptr="*" + dtype, **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(merge, sig, consts), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernel itself (test_cuda_compiled_...)")
def test_kernels_compile_for_an_h100_without_one():
    """What the interpreter cannot show: the kernels lower to an sm_90 binary (Triton's own ptxas, no GPU needed), a
    bf16 decode with split keys plus the merge, and an fp32 verify with a window and a non-power-of-two head_dim; and
    the jitted kernel leaves the shape arguments (_SHAPE_ARGS) unspecialised."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("triton is not installed")
    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # compile, do not interpret
    source = ROOT / "engine" / "kernels" / "paged_attention.py"
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H100, str(source)], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_bench_script_refuses_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    result = subprocess.run([sys.executable, "scripts/bench_paged_kernel.py"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


def test_bad_shapes_and_dtypes_are_value_errors():
    case = make_case([5], q_len=1)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(case.query.half(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="heads"):
        paged_attention(case.query[:, :3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="window"):
        paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0, window=0)


# ------------------------------------------------------------------------------------------ triton stays optional


def test_exspec_imports_and_reports_no_kernel_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; "  # as if triton were not installed: importing it raises ImportError
        "import exspec, exspec.engine, exspec.engine.kernels as k; "
        "assert not k.available(); "
        "k.paged_attention_reference"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # so that only the missing triton can make available() False
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_interpreter_is_on_exactly_when_there_is_no_cuda():
    """tests/conftest.py switches the interpreter on for CPU runs only: a GPU run must compile the real kernel."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert interpreting == (not torch.cuda.is_available())

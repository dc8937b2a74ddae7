"""Paged attention over block tables: one Triton kernel for drafts (Q = 1), the verify (Q = k + 1) and prefill chunks.

The math, per row b, query head h and query index i (Q queries, `L = seq_lens[b]` keys once this forward's K/V are
written):

    position    p      = L - Q + i                       (bottom-right aligned causal mask: the last query is the
                                                          newest key; each row has its own offset)
    kv head     g      = h // (heads // kv_heads)        (grouped-query attention: consecutive query heads share one)
    visible     j      : 0 <= j <= p, and p - window < j when a sliding window is set
    key j lives at       k_cache[block_tables[b, j // block_size], j % block_size, g]   (same for values)
    out[b, i, h]       = sum_j softmax_j(scale * q . k_j) v_j          (zeros where nothing is visible: padding rows)

The softmax is computed online (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) over tiles of BLOCK_N keys,
in fp32 whatever the input dtype: a running maximum m, a running denominator l and an unnormalised accumulator acc,

    m' = max(m, max_j s_j);  l' = l * 2^(m - m') + sum_j 2^(s_j - m');  acc' = acc * 2^(m - m') + sum_j 2^(s_j - m') v_j

with s_j = scale * log2(e) * q . k_j (exp2 instead of exp), and out = acc / l at the end.

One program handles one (query tile, row, kv head): its BLOCK_M rows are BLOCK_Q queries x the GROUP query heads that
share the kv head, so each key tile is loaded once for the whole group (decode then fills tensor-core tiles with
heads instead of queries). Keys are gathered per key through the block table, so any block size works; the key loop
stops at the tile's last query position (causal) and starts at its first query's window (sliding window).

A decode launch with few programs (small B x kv_heads) cannot fill a GPU, so there the keys of each program are split
in NUM_SPLITS ranges (flash-decoding, Dao et al. 2023): each range's program stores its unnormalised (acc, m, l) and a
second kernel merges them, out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M) with M = max_s m_s. The number of
splits follows from shapes only (the block table's width, the GPU's size), never from the lengths on the device, and is
a power of two up to 16.

Compiled variants: the integers that follow a forward's shapes are not value-specialised (_SHAPE_ARGS), so a variant
is its constexprs and dtypes alone, one of `kernel_variants` per model (3 BLOCK_M x 5 split counts); `warm_up` launches
each once when a model's runner is built on CUDA, and a variant first launched after that is logged as a warning.

`triton` is imported on the first call, never by this module's import (exspec runs without it). On CPU tensors the
kernel runs under Triton's interpreter, which must be switched on (`TRITON_INTERPRET=1`) before the first call (Triton
reads it when a kernel is defined; tests/conftest.py sets it when there is no CUDA, before anything imports triton). `paged_attention_reference` is the same function in plain PyTorch (a dense gather and a masked
softmax), for tests and for devices without Triton.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os

import torch

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_version() -> tuple[int, ...] | None:
    """triton's (major, minor), or None when it does not import."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return None
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


# Triton 3.6's interpreter (with numpy 2.4) cannot take a loaded value as a loop bound; 3.7 to 3.9 run the kernel.
# Compiled for a GPU, 3.6 works (the GPU machines' version).
_MIN_INTERPRETER_VERSION = (3, 7)


def available() -> bool:
    """True when the kernel can run on this machine: triton imports, and there is a CUDA device, or Triton's
    interpreter is on (CPU tensors) and recent enough."""
    version = _triton_version()
    if version is None:
        return False
    return torch.cuda.is_available() or (_interpreting() and version >= _MIN_INTERPRETER_VERSION)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Integer arguments whose values follow a forward's shapes (its queries, its block table's width, the query's and the
# output's strides, the window): compiled without Triton's specialisation on their values (== 1, divisible by 16), so
# that a forward of a new shape reuses a compiled variant. Each variant is a Triton compile of 1-3 s (sm_90 on this
# project's CPUs), and in the serving loop such compiles were the 0.5-2 s stalls of the GPU load tests of 2026-11-27
# (docs/BENCHMARKS.md section 0). What is left of a variant is its constexprs and dtypes (`launch_key`), a bounded set
# that `warm_up` compiles when a model's runner is built.
_SHAPE_ARGS = ("q_len", "window", "max_blocks", "s_qb", "s_qh", "s_qq", "s_tb", "s_ob", "s_oq", "s_oh")
_MERGE_SHAPE_ARGS = ("q_len", "heads", "s_ob", "s_oq", "s_oh")
SPLITS = (1, 2, 4, 8, 16)  # the key splits a launch may take (powers of two: a bounded set of variants)


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (triton imported here, not at module import)."""
    import triton
    import triton.language as tl

    def paged_attention_kernel(
        q_ptr,  # [B, heads, Q, head_dim], any strides
        k_ptr,  # [num_blocks + 1, block_size, kv_heads, head_dim]
        v_ptr,  # [num_blocks + 1, block_size, kv_heads, head_dim]
        bt_ptr,  # [B, max_blocks] block tables
        lens_ptr,  # [B] keys per row after this forward's write (0: padding row)
        o_ptr,  # [B, Q, heads, head_dim], any strides (NUM_SPLITS == 1)
        part_ptr,  # [B, Q, heads, NUM_SPLITS, head_dim + 2] fp32: each split's acc, m, l (NUM_SPLITS > 1)
        scale_log2,  # scale * log2(e)
        q_len,  # Q
        window,  # sliding window (read only when HAS_WINDOW)
        max_blocks,  # block table width
        s_qb, s_qh, s_qq, s_qd,
        s_kb, s_ks, s_kh, s_kd,
        s_vb, s_vs, s_vh, s_vd,
        s_tb, s_tn,
        s_ob, s_oq, s_oh, s_od,
        HEAD_DIM: tl.constexpr,  # head_dim
        BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (>= 16), masked past HEAD_DIM
        GROUP: tl.constexpr,  # query heads per kv head
        KV_BLOCK: tl.constexpr,  # positions per KV block (block_size)
        BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q queries x GROUP heads (power of two, >= 16)
        BLOCK_Q: tl.constexpr,  # queries per program = BLOCK_M // GROUP
        BLOCK_N: tl.constexpr,  # keys per inner step
        HAS_WINDOW: tl.constexpr,
        IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot products (no TF32)
        NUM_SPLITS: tl.constexpr,  # > 1: the keys are split in NUM_SPLITS ranges, one program each (flash-decoding)
    ):
        tile = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        seq_len = tl.load(lens_ptr + b)

        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]: row r is query tile * BLOCK_Q + r // GROUP, head kvh * GROUP + r % GROUP
        q_idx = tile * BLOCK_Q + rows // GROUP  # [BLOCK_M]
        head = kvh * GROUP + rows % GROUP  # [BLOCK_M]
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)  # [BLOCK_M]
        pos = seq_len - q_len + q_idx  # [BLOCK_M] position of each row's query
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        d_ok = d < HEAD_DIM

        q = tl.load(
            q_ptr + b * s_qb + head[:, None] * s_qh + q_idx[:, None] * s_qq + d[None, :] * s_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]

        # Keys this tile can see: up to its last query's position (causal), from its first query's window.
        first_q = tile * BLOCK_Q
        last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
        hi = seq_len - q_len + last_q + 1  # <= seq_len; <= 0 for a padding row (no iteration)
        hi = tl.minimum(hi, max_blocks * KV_BLOCK)  # never read past the block table (a length beyond it is a bug upstream)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - q_len + first_q - window + 1, 0)
        if NUM_SPLITS > 1:  # this program's share: a whole number of key tiles (none when the row is short)
            per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = lo + split * per_split
            hi = tl.minimum(hi, lo + per_split)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max (finite: a row with nothing visible stays NaN-free)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running numerator
        kv_base = kvh.to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            j_ok = j < hi
            block = tl.load(bt_ptr + b * s_tb + (j // KV_BLOCK) * s_tn, mask=j_ok, other=0).to(tl.int64)  # [BLOCK_N]
            slot = j % KV_BLOCK  # [BLOCK_N]
            k = tl.load(
                k_ptr + block[None, :] * s_kb + slot[None, :] * s_ks + kv_base * s_kh + d[:, None] * s_kd,
                mask=j_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32
            else:
                s = tl.dot(q, k)  # [BLOCK_M, BLOCK_N] fp32 accumulation of fp16/bf16 products
            s = s * scale_log2
            visible = j_ok[None, :] & (j[None, :] <= pos[:, None])  # [BLOCK_M, BLOCK_N]
            if HAS_WINDOW:
                visible = visible & (j[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescales what was summed so far
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + block[:, None] * s_vb + slot[:, None] * s_vs + kv_base * s_vh + d[None, :] * s_vd,
                mask=j_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv  # [BLOCK_M, BLOCK_D]
            m_i = m_new

        if NUM_SPLITS == 1:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: acc is 0, so the output is 0
            o = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_D]
            tl.store(
                o_ptr + b * s_ob + q_idx[:, None] * s_oq + head[:, None] * s_oh + d[None, :] * s_od,
                o.to(o_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
        else:  # unnormalised: merge_splits rescales every split to the common maximum
            num_heads = GROUP * (tl.num_programs(2) // NUM_SPLITS)
            record = ((b * q_len + q_idx) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
            part = part_ptr + record.to(tl.int64) * (HEAD_DIM + 2)  # [BLOCK_M] each row's acc, then m, l
            tl.store(part[:, None] + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part + HEAD_DIM, m_i, mask=row_ok)
            tl.store(part + HEAD_DIM + 1, l_i, mask=row_ok)

    def merge_splits_kernel(
        part_ptr,  # [B, Q, heads, NUM_SPLITS, head_dim + 2] fp32
        o_ptr,  # [B, Q, heads, head_dim], any strides
        q_len,
        heads,
        s_ob, s_oq, s_oh, s_od,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    ):
        """One program per (row, query, head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s."""
        bqh = tl.program_id(0)  # (b * Q + i) * heads + h
        h = bqh % heads
        b = bqh // heads // q_len
        i = bqh // heads % q_len
        sp = tl.arange(0, BLOCK_S)  # [BLOCK_S]
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        s_ok = sp < NUM_SPLITS
        rec = part_ptr + (bqh.to(tl.int64) * NUM_SPLITS + sp) * (HEAD_DIM + 2)  # [BLOCK_S]
        m = tl.load(rec + HEAD_DIM, mask=s_ok, other=-1.0e30)  # [BLOCK_S]
        l = tl.load(rec + HEAD_DIM + 1, mask=s_ok, other=0.0)  # [BLOCK_S]
        acc = tl.load(rec[:, None] + d[None, :], mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # [BLOCK_S, BLOCK_D]
        w = tl.exp2(m - tl.max(m, 0))  # [BLOCK_S]
        total = tl.sum(l * w, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
        tl.store(o_ptr + b * s_ob + i * s_oq + h * s_oh + d * s_od, o.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    return (triton.jit(do_not_specialize=_indices(paged_attention_kernel, _SHAPE_ARGS))(paged_attention_kernel),
            triton.jit(do_not_specialize=_indices(merge_splits_kernel, _MERGE_SHAPE_ARGS))(merge_splits_kernel))


def _indices(fn, names: tuple[str, ...]) -> list[int]:
    """The positions of `names` among fn's parameters (every Triton takes do_not_specialize as indices)."""
    params = list(inspect.signature(fn).parameters)
    return [params.index(name) for name in names]


# Keys per inner step under Triton's interpreter (CPU tensors): the interpreter pays per operation in Python, not per
# element, so one wide tile that covers a test's whole context runs the key loop once (an interpreted engine test
# took 20% less than at 32). tests/engine/test_paged_kernel.py narrows it to make its cases span tiles.
INTERPRETER_BLOCK_N = 128


def _tiles(q_len: int, group: int, head_dim: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_D) for a forward of q_len queries, group heads per kv head."""
    block_d = max(16, _next_pow2(head_dim))
    block_m = max(16, min(_next_pow2(q_len * group), 64), _next_pow2(group))
    block_q = block_m // group
    block_n = (64 if block_d <= 64 else 32) if on_gpu else INTERPRETER_BLOCK_N
    return block_m, block_q, block_n, block_d


def _num_splits(programs: int, capacity: int, block_n: int, device: torch.device) -> int:
    """Key ranges per (query tile, row, kv head) so that a small decode batch still fills the GPU: about two programs
    per multiprocessor, each over at least 4 key tiles of the block table's capacity, rounded down to a power of two
    (SPLITS). Shapes only (no host sync). 1 off CUDA: the interpreter gains nothing from it."""
    multiprocessors = _gpu_multiprocessors(device)
    return 1 if multiprocessors is None else splits_for(programs, capacity, block_n, multiprocessors)


def splits_for(programs: int, capacity: int, block_n: int, multiprocessors: int) -> int:
    """`_num_splits` on a GPU of `multiprocessors` multiprocessors: one of SPLITS."""
    if programs >= multiprocessors:
        return 1
    wanted = max(1, min(-(-2 * multiprocessors // programs), capacity // (4 * block_n), SPLITS[-1]))
    return 1 << (wanted.bit_length() - 1)


def kernel_variants(group: int, head_dim: int, splits: tuple[int, ...] = SPLITS) -> list[tuple[int, int]]:
    """Every (BLOCK_M, NUM_SPLITS) a launch over `group` query heads per kv head can take, whatever its batch, queries
    and keys (`splits`: what `_num_splits` can return on the device, SPLITS on a GPU, (1,) off it): with the model's
    dtype, head_dim, block size and window, all there is to a compiled variant."""
    return [(block_m, n) for block_m in _block_ms(group, head_dim) for n in splits]


def _block_ms(group: int, head_dim: int) -> dict[int, int]:
    """Each BLOCK_M a launch can take (at most 64 rows, or one group), with the fewest queries that take it."""
    found: dict[int, int] = {}
    for q_len in range(64, 0, -1):
        found[_tiles(q_len, group, head_dim, True)[0]] = q_len
    return dict(sorted(found.items()))


def _gpu_multiprocessors(device: torch.device) -> int | None:
    """The CUDA device's multiprocessor count; None off CUDA (no key splits there)."""
    return _multiprocessors(device) if device.type == "cuda" else None


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(query, k_cache, v_cache, block_tables, seq_lens, window, out) -> None:
    """Shape and dtype checks (metadata only: no host sync, so a captured forward may call this)."""
    if query.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: query [B, heads, Q, head_dim] and caches [blocks, block_size, kv_heads, head_dim] of one "
            f"shape expected, got {tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, heads, q_len, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"paged_attention: {heads} heads of {head_dim} against kv_heads x head_dim {tuple(k_cache.shape[2:])}")
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"paged_attention: query and caches must share a dtype, got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(seq_lens.shape) != (batch,):
        raise ValueError(
            f"paged_attention: block_tables [B, max_blocks] and seq_lens [B] expected for B = {batch}, got "
            f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}"
        )
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1, got {window}")
    if out is not None and (tuple(out.shape) != (batch, q_len, heads, head_dim) or out.dtype != query.dtype):
        raise ValueError(f"paged_attention: out must be [B, Q, heads, head_dim] {query.dtype}, got {tuple(out.shape)} {out.dtype}")


def paged_attention(
    query: torch.Tensor,  # [B, heads, Q, head_dim] (any strides)
    k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32: physical block of each logical block of row b
    seq_lens: torch.Tensor,  # [B] int32: keys row b holds after this forward's write (= start_b + Q); 0: padding row
    scale: float,
    window: int | None = None,  # sliding window: the query at position p sees keys p - window < j <= p
    out: torch.Tensor | None = None,  # [B, Q, heads, head_dim]
) -> torch.Tensor:  # [B, Q, heads, head_dim]
    """Attention of each row's Q queries over its keys in the paged caches (see the module docstring for the math).
    No host sync: the launch grid depends on shapes only, so a captured graph can replay it."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, window, out)
    batch, heads, q_len, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = query.new_empty(batch, q_len, heads, head_dim)  # [B, Q, heads, head_dim]
    if batch == 0 or q_len == 0:
        return out
    if query.device.type != "cuda" and not _interpreting():
        raise RuntimeError("paged_attention: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before importing triton)")
    group = heads // kv_heads
    block_m, block_q, block_n, block_d = _tiles(q_len, group, head_dim, query.device.type == "cuda")
    q_tiles = (q_len + block_q - 1) // block_q
    splits = _num_splits(q_tiles * batch * kv_heads, block_tables.shape[1] * block_size, block_n, query.device)
    key = launch_key(query, k_cache, window, block_m, splits)
    if key not in _launched:
        _launched.add(key)
        if _watching:
            _log.warning("paged attention: kernel variant %s launched for the first time after warm_up: Triton "
                         "compiles it now (1-3 s); kernel_variants misses it", key)
    _launch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, out, block_m, splits)
    return out


def _launch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, out, block_m: int, splits: int) -> None:
    """The kernel (and the merge when splits > 1) at BLOCK_M = block_m over `splits` key ranges."""
    batch, heads, q_len, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    _, _, block_n, block_d = _tiles(q_len, group, head_dim, query.device.type == "cuda")
    block_q = block_m // group
    q_tiles = (q_len + block_q - 1) // block_q
    # [B, Q, heads, splits, head_dim + 2] fp32: per split its acc, m and l (a dummy when not split)
    parts = torch.empty((batch, q_len, heads, splits, head_dim + 2) if splits > 1 else (1,), device=query.device, dtype=torch.float32)
    attention, merge = _kernel()
    attention[(q_tiles, batch, kv_heads * splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, parts,
        scale * _LOG2E, q_len, window or 0, block_tables.shape[1],
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, KV_BLOCK=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, IEEE=query.dtype == torch.float32, NUM_SPLITS=splits,
        num_warps=4,
    )
    if splits > 1:
        merge[(batch * q_len * heads,)](
            parts, out, q_len, heads, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=_next_pow2(splits),
            num_warps=1,
        )


def launch_key(query: torch.Tensor, k_cache: torch.Tensor, window: int | None, block_m: int, splits: int) -> tuple:
    """What tells one compiled variant from another once the shape arguments are not specialised (_SHAPE_ARGS): the
    device, the dtype, the heads' layout, the cache's block size and strides, the window's presence, BLOCK_M and the
    key splits."""
    _, heads, _, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    return (query.device, query.dtype, heads // kv_heads, head_dim, block_size, tuple(k_cache.stride()),
            window is not None, block_m, splits)


_log = logging.getLogger(__name__)
_launched: set[tuple] = set()  # every launch_key this process has launched (and so compiled)
_watching = False  # set by warm_up: a launch_key first seen after it is logged


def warm_up(heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None) -> int:
    """Launch every variant of `kernel_variants` for one model's attention (its query heads, its pools, its window)
    once, on zeros in its pools' null block 0, so that Triton compiles them all now and none in the serving loop.
    Returns how many were launched for the first time. From then on a new variant is logged as a warning."""
    global _watching
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = heads // kv_heads
    first = 0
    splits = SPLITS if _gpu_multiprocessors(k_cache.device) is not None else (1,)
    queries = _block_ms(group, head_dim)  # BLOCK_M -> the fewest queries that launch it
    for block_m, n_splits in kernel_variants(group, head_dim, splits):
        q_len = queries[block_m]
        query = k_cache.new_zeros(1, q_len, heads, head_dim).transpose(1, 2)  # [1, heads, Q, head_dim]
        key = launch_key(query, k_cache, window, block_m, n_splits)
        if key in _launched:
            continue
        n_blocks = -(-q_len // block_size)
        tables = torch.zeros(1, n_blocks, dtype=torch.int32, device=k_cache.device)  # [1, n_blocks]: the null block
        lens = torch.full((1,), q_len, dtype=torch.int32, device=k_cache.device)  # [1]
        out = query.new_empty(1, q_len, heads, head_dim)  # [1, Q, heads, head_dim]
        _launch(query, k_cache, v_cache, tables, lens, head_dim**-0.5, window, out, block_m, n_splits)
        _launched.add(key)
        first += 1
    _watching = True
    return first


def paged_attention_reference(
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,  # [B, Q, heads, head_dim]
) -> torch.Tensor:  # [B, Q, heads, head_dim]
    """`paged_attention` in plain PyTorch, computed in fp32: every row's keys gathered densely up to the longest
    row (the block table's width), then a masked softmax. Any device; memory grows with B x max_blocks."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, window, out)
    batch, heads, q_len, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    kv_len = block_tables.shape[1] * block_size
    j = torch.arange(kv_len, device=query.device)  # [L] key positions
    slots = block_tables.long()[:, j // block_size] * block_size + j % block_size  # [B, L] rows of the flat pool
    keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].float()  # [B, L, kv_heads, head_dim]
    values = v_cache.reshape(-1, kv_heads, head_dim)[slots].float()  # [B, L, kv_heads, head_dim]
    keys = keys.repeat_interleave(heads // kv_heads, dim=2)  # [B, L, heads, head_dim]
    values = values.repeat_interleave(heads // kv_heads, dim=2)  # [B, L, heads, head_dim]
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=query.device)  # [B, Q]
    visible = j[None, None, :] <= pos[:, :, None]  # [B, Q, L]
    if window is not None:
        visible &= j[None, None, :] > pos[:, :, None] - window
    scores = torch.einsum("bhqd,blhd->bhql", query.float(), keys) * scale  # [B, heads, Q, L]
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible: all-masked -> 0
    result = torch.einsum("bhql,blhd->bqhd", probs, values).to(query.dtype)  # [B, Q, heads, head_dim]
    if out is None:
        return result
    out.copy_(result)
    return out


@torch.library.custom_op("exspec::paged_attention", mutates_args=("out",))
def paged_attention_op(
    query: torch.Tensor,  # [B, heads, Q, head_dim]
    k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    window: int | None,
    out: torch.Tensor,  # [B, Q, heads, head_dim], written
) -> None:
    """`paged_attention` into `out` as one opaque PyTorch operator (`torch.ops.exspec.paged_attention`), for forwards
    under `torch.compile(fullgraph=True)`: Dynamo cannot trace the launch itself under Triton's interpreter (and
    needs not look inside it on CUDA). Eager callers should call `paged_attention`: the operator's dispatch costs more
    than the launch at decode sizes."""
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, window, out)


@paged_attention_op.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, scale, window, out) -> None:
    return None

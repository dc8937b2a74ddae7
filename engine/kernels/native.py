"""The CPU's paged attention kernel (engine/kernels/paged_attention_cpu.c): built with the machine's C compiler on
first use, cached, loaded through ctypes.

It reads each row's K/V where its blocks lie in the pools (no gather into a buffer, whatever the block table), so
scattered rows cost what consecutive ones do (docs/BENCHMARKS.md section 4). Plain C (GCC vector extensions, OpenMP
over rows x kv heads), no torch headers: one `cc` call of about a second. The library is cached at
`$EXSPEC_CACHE/kernels/` (default `~/.cache/exspec/kernels/`) under a hash of the source, the compiler and its flags,
and the CPU's feature flags (`-march=native`), so a change of any of them builds anew. The compiler is `$CC` if set,
else the first of cc, gcc and clang found. No compiler, or a failed build: `available()` is False with
`unavailable_reason()` saying why, and the CPU's default backend is `sdpa`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from exspec.engine.gguf import default_cache_root

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
ABI = 2  # EXSPEC_PAGED_ABI of the source
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
OPENMP = "-fopenmp"  # dropped when the compiler has no OpenMP (one thread then)
_SYMBOL = {torch.float32: "exspec_paged_f32", torch.bfloat16: "exspec_paged_bf16", torch.float16: "exspec_paged_f16"}
_ERRORS = {1: "inconsistent sizes", 2: "out of memory", 3: "a block id outside the pool",
           4: "a dtype this build cannot read (the compiler has no _Float16)"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc if shutil.which(cc) else None
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), best effort."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(cc: str, out: Path) -> None:
    """Compile SOURCE into `out`, with OpenMP if the compiler has it; written beside and renamed, so that a
    concurrent build (another worker) never loads a half-written file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in ((OPENMP,), ()):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            done = None
            errors.append(f"{' '.join(cmd)}: {exc}")
        if done is not None and done.returncode == 0:
            os.replace(tmp, out)
            return
        if done is not None:
            errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-400:]}")
        Path(tmp).unlink(missing_ok=True)
    raise RuntimeError("; ".join(errors))


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not). Built once per machine and source, then loaded from the cache."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang; or $CC)"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, _version(cc), " ".join(FLAGS), OPENMP, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    path = default_cache_root() / "kernels" / f"paged_attention_cpu-{key}.so"
    try:
        if not path.exists():
            _log.info("building the CPU paged attention kernel with %s into %s", cc, path)
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
        if lib.exspec_paged_abi() != ABI:
            return None, f"{path}: ABI {lib.exspec_paged_abi()}, expected {ABI}"
    except (OSError, RuntimeError, AttributeError) as exc:  # AttributeError: a library without the entry points
        return None, f"the kernel did not build or load: {exc}"
    for name in _SYMBOL.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGTYPES
    return lib, ""


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def paged_attention_cpu(
    query: torch.Tensor,  # [B, heads, Q, head_dim] (any strides)
    k_cache: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]: head_dim contiguous, blocks x tokens
    v_cache: torch.Tensor,  # one token axis (the pools' head-major storage, or token-major); v_cache's strides k_cache's
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: keys row b holds after this forward's write (= start_b + Q); 0: padding
    scale: float,
    window: int | None = None,  # the query at position p sees keys p - window < j <= p
) -> torch.Tensor:  # [B, Q, heads, head_dim] in the query's dtype
    """Attention of each row's Q queries over its keys, read in place from the pools. Checks every pointer's shape,
    dtype, device and layout before the call: the C code trusts them."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"paged_attention_cpu: {why}")
    batch, heads, q_len, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    s_block, s_tok, s_head, s_dim = k_cache.stride()
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or s_dim != 1 or s_block != block_size * s_tok:
        raise ValueError(f"paged_attention_cpu: pools of one shape and strides, head_dim contiguous and a block's tokens "
                         f"one axis with the blocks' expected, got {tuple(k_cache.shape)} {k_cache.stride()}, "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}")
    if k_cache.shape[3] != head_dim or heads % kv_heads or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"paged_attention_cpu: {heads} heads of {head_dim} against pools {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}/{v_cache.dtype}")
    if k_cache.dtype not in _SYMBOL:
        raise ValueError(f"paged_attention_cpu: pools of {k_cache.dtype}: float32, bfloat16 or float16 expected")
    if any(t.device.type != "cpu" for t in (query, k_cache, v_cache, block_tables, seq_lens)):
        raise ValueError("paged_attention_cpu: CPU tensors only")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"paged_attention_cpu: block_tables [B, max_blocks] and seq_lens [B] for B = {batch}, got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention_cpu: window must be >= 1, got {window}")
    q32 = query.to(torch.float32).contiguous()  # [B, heads, Q, head_dim]
    tables = block_tables.to(torch.int32).contiguous()  # [B, max_blocks]
    lens = seq_lens.to(torch.int32).contiguous()  # [B]
    out = torch.empty(batch, q_len, heads, head_dim, dtype=torch.float32)  # [B, Q, heads, head_dim]
    if batch and q_len:
        rc = getattr(lib, _SYMBOL[k_cache.dtype])(
            q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, q_len, head_dim, block_size,
            k_cache.shape[0] * block_size, s_head, s_tok, window or 0, float(scale), torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"paged_attention_cpu: {_ERRORS.get(rc, f'error {rc}')}")
    return out if query.dtype == torch.float32 else out.to(query.dtype)

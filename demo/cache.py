"""Where the demo pair lives and whether a complete one is there: the cache directory, its marker files,
the build lock and the atomic moves that make a half-written pair impossible to reuse.

Layout of a pair directory (`default_demo_dir(scale)` or `--out`):
    target/      Hugging Face model directory of the target, with the tokenizer (the pair's one tokenizer)
    draft/       the same for the draft (same tokenizer files)
    demo-pair.json   written last: its presence means the pair is complete (MARKER)
    .lock        serializes two builds into the same directory
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from exspec.demo.recipe import DEFAULT_SCALE, FORMAT_VERSION, DemoBuildError

MARKER = "demo-pair.json"  # written last into out_dir: its presence means the pair is complete
MODEL_MARKER = "exspec_demo.json"  # inside target/ and draft/: marks directories this package may replace
ROLES = ("target", "draft")


def default_demo_dir(scale: str = DEFAULT_SCALE) -> Path:
    """Where the demo pair of this scale is cached: `$EXSPEC_CACHE` if set, else `~/.cache/exspec/demo`, for the
    default pair (SmolLM2); a folder of the scale's name inside it for any other (`tiny/`), so that building or
    serving one pair never replaces another (SmolLM2's takes minutes to build again)."""
    env = os.environ.get("EXSPEC_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "exspec" / "demo"
    return base if scale == DEFAULT_SCALE else base / scale


def cached_pair(out_dir: Path, *, seed: int = 0, scale: str = DEFAULT_SCALE) -> tuple[Path, Path] | None:
    """The complete pair in out_dir built with this seed, scale and format version, else None."""
    out_dir = Path(out_dir)
    try:
        info = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    want = {"format_version": FORMAT_VERSION, "seed": seed, "scale": scale}
    if not isinstance(info, dict) or any(info.get(k) != v for k, v in want.items()):
        return None
    target, draft = (out_dir / role for role in ROLES)
    for d in (target, draft):
        if not ((d / "config.json").is_file() and (d / "tokenizer.json").is_file() and (d / MODEL_MARKER).is_file()):
            return None
    return target, draft


@dataclass(frozen=True)
class PairLocation:
    """Where the demo pair is (or will be) and whether it is built, without building it."""

    target: Path  # target model directory
    draft: Path  # draft model directory
    tokenizer: Path  # the pair's tokenizer: saved in the target directory (the draft holds a copy)
    built: bool  # a complete pair for this seed, scale and format version is there
    note: str  # why it is not built (empty when it is)


def locate_pair(out_dir: Path, *, seed: int = 0, scale: str = DEFAULT_SCALE) -> PairLocation:
    """Where `exspec demo-models` puts (or put) the pair in out_dir, and whether a usable one is there."""
    out_dir = Path(out_dir).expanduser().absolute()
    target, draft = (out_dir / role for role in ROLES)
    built = cached_pair(out_dir, seed=seed, scale=scale) is not None
    note = ""
    if not built:
        try:
            info = json.loads((out_dir / MARKER).read_text())
            note = (f"a pair built with format {info.get('format_version')}, seed {info.get('seed')}, scale "
                    f"{info.get('scale')!r} is there; exspec demo-models rebuilds it (format {FORMAT_VERSION}, "
                    f"seed {seed}, scale {scale!r})")
        except (OSError, ValueError, AttributeError):
            note = "run `exspec demo-models` to build it (a few minutes)"
    return PairLocation(target=target, draft=draft, tokenizer=target, built=built, note=note)


def prepare_out_dir(out_dir: Path) -> Path:
    """out_dir as an absolute path, created if need be; DemoBuildError if it cannot be written."""
    out_dir = Path(out_dir).expanduser().absolute()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoBuildError(f"cannot create the output directory {str(out_dir)!r}: {e.strerror or e}") from e
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DemoBuildError(f"the output directory {str(out_dir)!r} is not writable")
    return out_dir


@contextlib.contextmanager
def locked(out_dir: Path, on_wait=None):
    """Hold out_dir/.lock (an exclusive flock) inside the block; `on_wait(message)` is called first when
    another process holds it (then this one waits for it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    try:
        fd = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DemoBuildError(f"cannot write to {str(out_dir)!r}: {e.strerror or e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(f"another process is building the demo pair in {out_dir}; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check_replaceable(out_dir: Path) -> None:
    """DemoBuildError if out_dir/target or out_dir/draft exists and was not written by this package."""
    for role in ROLES:
        existing = out_dir / role
        if existing.exists() and not (existing / MODEL_MARKER).is_file():
            raise DemoBuildError(
                f"{str(existing)!r} exists and was not written by exspec demo-models: "
                "move it away or choose another --out"
            )


def install_pair(built: Path, out_dir: Path, info: dict) -> tuple[Path, Path]:
    """Move built/target and built/draft into out_dir (same file system), then write the marker last."""
    (out_dir / MARKER).unlink(missing_ok=True)  # from here until the end the pair is incomplete
    for role in ROLES:
        dst = out_dir / role
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(built / role, dst)
    write_atomic(out_dir / MARKER, json.dumps(info, indent=2) + "\n")
    return out_dir / "target", out_dir / "draft"


def write_atomic(path: Path, text: str) -> None:
    """Write text to path so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

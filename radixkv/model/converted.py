"""Each GGUF file converted once per machine into a Hugging Face checkpoint kept on disk.

``gguf_cache_entry(path)`` returns the folder holding the file's conversion
(``config.json``, float32 ``model.safetensors``, the tokenizer's files), written the
first time it is asked for, from one read of the file (``radixkv.model.gguf_llama``;
files it does not cover go through ``transformers``, which parses a GGUF file three
times: config, tokenizer, weights, about 20 s for SmolLM2-135M on 2 cores). The folder
is named by the file's SHA-256, ``CONVERTER_VERSION`` and ``transformers``' version
(a newer converter writes a new folder) and holds a manifest of its files' sizes and
CRC-32s (zip's corruption check: 0.15 s for SmolLM2's 0.55 GB, where SHA-256 takes
0.35 s), written last: a folder whose files do not match it (corrupt, half written,
edited) is rebuilt, never used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bump when what a GGUF file is converted to changes: older folders are then left alone and rebuilt anew.
CONVERTER_VERSION = 1
MANIFEST = "radixkv_manifest.json"


def converted_cache_root() -> Path:
    """Where converted GGUF files are kept: ``$XDG_CACHE_HOME/radixkv/gguf`` (``~/.cache/radixkv/gguf``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixkv" / "gguf"


def _chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes, 8 MiB at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            yield chunk


def _crc32(path: Path) -> int:
    return functools.reduce(lambda crc, chunk: zlib.crc32(chunk, crc), _chunks(path), 0)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    for chunk in _chunks(path):
        h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The SHA-256 of a file version (size and mtime key the in-memory copy): 0.06 s for SmolLM2's 98 MB."""
    return _sha256(Path(path))


def _entry_name(digest: str) -> str:
    return f"{digest[:32]}-c{CONVERTER_VERSION}-t{importlib.metadata.version('transformers')}"


def entry_is_valid(entry: Path) -> bool:
    """Whether ``entry`` is a finished conversion whose files all match its manifest (size and CRC-32).
    O(bytes of the entry): 0.15 s for SmolLM2's 0.55 GB."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        return bool(files) and all((entry / name).stat().st_size == size and _crc32(entry / name) == crc
                                   for name, (size, crc) in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert(path: Path, into: Path) -> None:
    """Write ``path``'s Hugging Face checkpoint into the new folder ``into``, its manifest last: from one read of
    the file where ``radixkv.model.gguf_llama`` covers it, else through ``transformers``."""
    from safetensors.torch import save_file

    from radixkv.model.gguf_llama import llama_checkpoint

    config, state, tokenizer = llama_checkpoint(path) or _with_transformers(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(into / "model.safetensors"), metadata={"format": "pt"})
    (into / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer.save_pretrained(into)
    files = {p.name: (p.stat().st_size, _crc32(p)) for p in sorted(into.iterdir()) if p.is_file()}
    (into / MANIFEST).write_text(json.dumps({"source": path.name, "files": files}, indent=1))


def _with_transformers(path: Path) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``(config dict, float32 state dict, tokenizer)`` as ``transformers`` loads the file (three parses)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    state = dict(hf.state_dict())
    if hf.config.tie_word_embeddings:  # the head is the embedding: saved once
        state.pop("lm_head.weight", None)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain float32 now
    return config, state, tokenizer


def gguf_cache_entry(path: str | Path, root: Path | None = None) -> Path:
    """The folder holding the conversion of GGUF file ``path`` (a Hugging Face checkpoint), written first if it
    is missing or does not match its manifest (see the module docstring). ``root``: ``converted_cache_root()``
    by default. Concurrent first loads each convert; the first to finish is kept."""
    file = Path(path).resolve()
    stat = file.stat()
    root = converted_cache_root() if root is None else root
    entry = root / _entry_name(_file_digest(str(file), stat.st_size, stat.st_mtime_ns))
    if entry_is_valid(entry):
        return entry
    print(f"radixkv: converting {file.name} into {entry} (once for this file: seconds to a minute)", file=sys.stderr,
          flush=True)
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".{entry.name}.{os.getpid()}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _convert(file, work)
        if entry.exists():  # invalid (checked above) or written meanwhile by another process
            if entry_is_valid(entry):
                return entry
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(work, entry)
        except OSError:  # another process's conversion landed first
            if not entry_is_valid(entry):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entry


__all__ = ["CONVERTER_VERSION", "MANIFEST", "converted_cache_root", "entry_is_valid", "gguf_cache_entry"]

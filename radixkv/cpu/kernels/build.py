"""Building and loading a C++ extension so that no killed process can wedge the next one.

``torch.utils.cpp_extension.load`` takes its build lock (a ``lock`` file beside the
library, created exclusively and removed when done) on every load, even when the
library is up to date, and waits for that file to go away with no message. A process
killed while holding it (Ctrl-C during the first start, a timeout, an out-of-memory
kill) leaves the file behind, and every later load waits forever. ``load_extension``:

* loads an up-to-date library without any lock: the library's name carries a hash of
  everything it is built from, and a stamp beside it, written after a build finished
  and imported, says the file on disk is that build's;
* builds under an ``flock`` of its own, which the kernel releases when its holder dies,
  so holding it proves no live radixkv build owns torch's ``lock``: one found then is
  stale, removed with a one-line warning on stderr;
* waits for a live build in another process, saying so, and then loads what it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

LOCK_NAME = "radixkv_build.lock"  # the flock beside the library
STAMP_NAME = "radixkv_built"  # "<size> <mtime_ns>" of the library a finished build left


def build_directory(name: str) -> Path:
    """Where torch builds extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default root), created if needed."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def library_path(name: str, directory: Path) -> Path:
    from torch.utils.cpp_extension import LIB_EXT

    return directory / f"{name}{LIB_EXT}"


def _stamp(library: Path) -> str:
    stat = library.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def up_to_date(name: str, directory: Path) -> bool:
    """Whether ``directory`` holds a finished build of ``name`` (its stamp matches the library on disk)."""
    library, stamp = library_path(name, directory), directory / STAMP_NAME
    try:
        return stamp.read_text() == _stamp(library)
    except OSError:
        return False


def _import(name: str, directory: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library_path(name, directory))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def build_lock(directory: Path, what: str) -> Iterator[None]:
    """Hold the build lock of ``directory``: an ``flock`` (released by the kernel if its holder dies), with the
    holder's pid in the file; waits for a live holder, saying so on stderr. Once held, a torch ``lock`` file
    in ``directory`` can only be a killed build's: it is removed, with a one-line warning."""
    with open(directory / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "?"
            print(f"radixkv: waiting for process {owner}, which is building {what} in {directory}",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
            baton = directory / "lock"
            if baton.exists():
                print(f"radixkv: warning: removed {baton}, left by a build that was killed", file=sys.stderr,
                      flush=True)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension(name: str, sources: list[str], extra_cflags: list[str], extra_ldflags: list[str],
                   what: str) -> ModuleType:
    """The extension ``name`` built from ``sources`` with these flags, loaded; ``name`` must change whenever
    the sources or flags do (the caller hashes them into it). Loads a finished build without locking; builds
    otherwise (saying so on stderr: ``what`` names it), under ``build_lock``. Build errors propagate."""
    from torch.utils.cpp_extension import load

    directory = build_directory(name)
    if up_to_date(name, directory):
        return _import(name, directory)
    with build_lock(directory, what):
        if up_to_date(name, directory):  # built by the process this one waited for
            return _import(name, directory)
        print(f"radixkv: building {what} (once, tens of seconds; kept in {directory})", file=sys.stderr, flush=True)
        module = load(name, sources, extra_cflags=extra_cflags, extra_ldflags=extra_ldflags,
                      build_directory=str(directory), verbose=False)
        (directory / STAMP_NAME).write_text(_stamp(library_path(name, directory)))
        return module


__all__ = ["build_directory", "build_lock", "load_extension", "up_to_date"]

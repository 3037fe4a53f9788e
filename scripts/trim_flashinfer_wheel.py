#!/usr/bin/env python3
"""Rewrite flashinfer-python's wheel without the parts radixkv never uses, for the offline GPU check.

Usage: ``python3 scripts/trim_flashinfer_wheel.py IN.whl OUT_DIR`` writes ``OUT_DIR/<IN's file name>``
(the name stays valid: same distribution, version and tags), with ``*.dist-info/RECORD`` regenerated
(sha256 and size of every file) so that pip installs it like the original.

radixkv calls two wrappers only, ``BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")`` and
``BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")`` (plan/run, bf16/fp16, causal, no custom mask). Their
plans JIT-compile the FA2 batch prefill modules (primary + independent-stride paged), on sm90 the FA3
one (more than 64 query tokens per request) and the CUDA-core batch decode module. What stays:

* Python: every ``flashinfer`` module reachable from ``flashinfer/__init__.py`` through the import
  statements that run at import time (module level and class bodies, every branch of an ``if``/``try``),
  plus every module reachable, through any import statement at all (inside functions too, transitively),
  from the wrappers' and the JIT's modules (``DEEP_ROOTS``). This is static and a superset of what runs.
* Non-Python files next to a kept module (JSON configs, ``py.typed``), kernel sources excepted.
* What the prefill/decode JIT reads: ``data/include`` (FlashInfer's kernel headers),
  ``data/cutlass/include`` and ``data/cutlass/tools/util/include`` (CUTLASS/CuTe, FA3's sm90 path),
  ``data/cccl/libcudacxx`` (on the include path ahead of the toolkit's), and in ``data/csrc`` the
  ``batch_prefill*`` / ``batch_decode*`` sources and jinja templates and ``tvm_ffi_utils.h``.
* ``*.dist-info``; ``top_level.txt`` and ``entry_points.txt`` follow what was kept (the ``flashinfer``
  console script's ``flashinfer.__main__`` is not).

What goes, on 0.7.4 (101.3 MB, 14705 files -> 18.7 MB, 4117 files; 76 MB compressed cut): data/csrc's
other 4538 files (cake_*, kda, fused_moe, gdn, gemm, MoE and comm kernels: 43 MB); 2249 of the 3562 Python
modules, the ones no kept module imports, with the kernel sources beside them (the cake_* backend packages
12.5 MB, flashinfer/experimental 11.5 MB, moe_ep 3.7 MB, most of fused_moe 2.6 MB); data/cccl/cub and
thrust and data/spdlog (on the include path, never reached); the wheel's top-level build helpers (b12x,
build_backend.py, build_utils.py).

Why that is safe, checked on 0.7.4 with CUDA 13.0's nvcc (no GPU needed), from a ``pip install --no-index
--no-deps --target`` of the trimmed wheel in a fresh interpreter that has torch and nothing else besides
the GPU check's wheels:

* ``import flashinfer`` works (385 flashinfer modules load, the same as from the full wheel).
* With FLASHINFER_CUDA_ARCH_LIST=9.0a, the JitSpecs of the four modules above for bf16 and fp16 at head
  dims 64, 128 and 256 (24 specs, 174 generated .cu files) render from the trimmed package the same
  sources as from the full one, and ``nvcc -E`` of every one of them, with the exact flags of the spec's
  compile command, succeeds; they reach the same 1776 files as from the full wheel, 1141 of them in the
  package (the rest: the generated sources, the toolkit, tvm_ffi's headers, the C++ library, and
  curand_kernel.h, which CUTLASS's tools/util includes and a full CUDA toolkit has).
* The FA2 prefill module (bf16, head dim 128, 10 sources) compiles for sm_90a and links from the trimmed
  package with flashinfer's own ninja build (3.3 minutes on 2 cores); one FA3 source compiles too
  (2.7 minutes, 3.6 GB).

A new flashinfer version needs those checks again: the trim fails loudly when the wrappers or the JIT
entry points it starts from are missing, but it cannot see a new header dependency by itself.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import io
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGE = "flashinfer"
# The wrappers radixkv calls, the modules their plan/run go through, and the JIT that builds their kernels.
DEEP_ROOTS = ("flashinfer.prefill", "flashinfer.decode", "flashinfer.utils", "flashinfer.jit.core",
              "flashinfer.jit.cpp_ext", "flashinfer.jit.env")
DEEP_ROOT_PACKAGES = ("flashinfer.jit.attention",)  # and its submodules
WRAPPERS = {"flashinfer/prefill.py": "class BatchPrefillWithPagedKVCacheWrapper",
            "flashinfer/decode.py": "class BatchDecodeWithPagedKVCacheWrapper"}
# Directories under flashinfer/data that the prefill/decode JIT puts on the include path and reaches.
DATA_TREES = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/",
              "flashinfer/data/cutlass/tools/util/include/", "flashinfer/data/cccl/libcudacxx/")
# data/csrc's top level: the sources and templates the batch prefill/decode generators render.
CSRC_FILES = re.compile(r"flashinfer/data/csrc/(batch_prefill[^/]*|batch_decode[^/]*|tvm_ffi_utils\.h)")
KERNEL_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".c", ".cc", ".cpp", ".inl", ".cubin", ".ptx", ".jinja")


def python_modules(names: Iterable[str]) -> dict[str, tuple[str, bool]]:
    """Module name -> (path in the wheel, is a package) for every .py file under the package."""
    mods = {}
    for name in names:
        if name.startswith(PACKAGE + "/") and name.endswith(".py"):
            parts = name[:-3].split("/")
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (name, is_pkg)
    return mods


def imported_names(source: bytes, module: str, is_pkg: bool, in_functions: bool) -> set[str]:
    """Every dotted name an import statement of ``source`` may load (``from a import b`` may load a.b)."""
    package = module if is_pkg else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(nodes: Iterable[ast.AST]) -> None:
        for node in nodes:
            if not in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # runs only when called
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names.add(target)
                names.update(f"{target}.{alias.name}" for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(source).body)
    return names


def kept_modules(wheel: zipfile.ZipFile) -> set[str]:
    """The import-time closure of the package plus the any-import closure of the wrappers and the JIT."""
    mods = python_modules(wheel.namelist())
    deep = [m for m in mods if m in DEEP_ROOTS or m in DEEP_ROOT_PACKAGES
            or m.startswith(tuple(p + "." for p in DEEP_ROOT_PACKAGES))]
    missing = set(DEEP_ROOTS) - set(deep)
    if missing or PACKAGE not in mods:
        raise SystemExit(f"trim_flashinfer_wheel: the wheel lacks {sorted(missing) or [PACKAGE]}; "
                         "a flashinfer this script was not checked against")
    for path, marker in WRAPPERS.items():
        if marker not in wheel.read(path).decode():
            raise SystemExit(f"trim_flashinfer_wheel: {path} has no '{marker}'; not the API radixkv uses")
    seen: dict[str, bool] = {}  # module -> followed through imports inside functions too
    todo = [(PACKAGE, False)] + [(m, True) for m in deep]
    while todo:
        module, in_functions = todo.pop()
        if module in seen and (seen[module] or not in_functions):
            continue
        seen[module] = in_functions
        path, is_pkg = mods[module]
        parent = module.rpartition(".")[0]
        while parent and parent not in mods:  # a namespace package (no __init__.py)
            parent = parent.rpartition(".")[0]
        if parent:
            todo.append((parent, False))  # importing a module runs its packages' __init__ first, not their functions
        for name in imported_names(wheel.read(path), module, is_pkg, in_functions):
            while name and name not in mods:  # `from a import b`: b is a submodule or a name in a
                name = name.rpartition(".")[0]
            if name:
                todo.append((name, in_functions))
    return set(seen)


def keep_predicate(wheel: zipfile.ZipFile) -> Callable[[str], bool]:
    """Whether a file of the wheel stays (see the module docstring)."""
    mods = python_modules(wheel.namelist())
    kept = {mods[m][0] for m in kept_modules(wheel)}
    kept_dirs = {path.rpartition("/")[0] for path in kept}

    def keep(name: str) -> bool:
        if name in kept or ".dist-info/" in name:
            return True
        if not name.startswith(PACKAGE + "/") or name.endswith(".py"):
            return False
        if name.startswith(PACKAGE + "/data/"):
            return name.startswith(DATA_TREES) or CSRC_FILES.fullmatch(name) is not None
        return name.rpartition("/")[0] in kept_dirs and not name.endswith(KERNEL_SUFFIXES)

    return keep


def record_line(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def trim(src: Path, out_dir: Path) -> Path:
    """Write the trimmed copy of wheel ``src`` into ``out_dir`` under the same name; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / src.name
    with zipfile.ZipFile(src) as wheel:
        keep = keep_predicate(wheel)
        infos = [i for i in wheel.infolist() if not i.is_dir() and keep(i.filename)]
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        top_level = {i.filename.split("/")[0].removesuffix(".py") for i in infos if ".dist-info/" not in i.filename}
        rows = []
        # written next to dest and renamed, so that OUT_DIR may be IN's own folder
        part = Path(tempfile.mkstemp(dir=out_dir, prefix=src.name, suffix=".part")[1])
        try:
            with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as out:
                for info in infos:
                    if info.filename == record:
                        continue
                    data = wheel.read(info)
                    base = info.filename.rpartition("/")[2]
                    if ".dist-info/" in info.filename and base == "top_level.txt":
                        data = "".join(f"{n}\n" for n in sorted(top_level)).encode()
                    elif ".dist-info/" in info.filename and base == "entry_points.txt":
                        data = drop_missing_entry_points(data.decode(), keep).encode()
                        if not data:
                            continue
                    info.compress_type = zipfile.ZIP_DEFLATED
                    out.writestr(info, data)
                    rows.append(record_line(info.filename, data))
                text = io.StringIO()
                csv.writer(text, lineterminator="\n").writerows(rows + [[record, "", ""]])
                out.writestr(wheel.getinfo(record), text.getvalue().encode())
            part.chmod(0o644)  # mkstemp makes it 0600
            part.replace(dest)
        finally:
            part.unlink(missing_ok=True)
    return dest


def drop_missing_entry_points(text: str, keep: Callable[[str], bool]) -> str:
    """entry_points.txt without the entries whose module the trim dropped (pip would install a broken script),
    and without sections left empty."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.lstrip().startswith("["):
            sections.append((line, []))
            continue
        match = re.match(r"\s*[^=\s#]+\s*=\s*([\w.]+)", line)
        if match:
            path = match.group(1).replace(".", "/")
            if not (keep(path + ".py") or keep(path + "/__init__.py")):
                continue
        if line.strip() and sections:
            sections[-1][1].append(line)
    return "".join(f"{head}\n" + "".join(f"{e}\n" for e in entries) for head, entries in sections if entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path, help="flashinfer_python-*.whl")
    parser.add_argument("out_dir", type=Path, help="folder for the trimmed wheel (same file name)")
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        parser.error(f"no such wheel: {args.wheel}")
    before = args.wheel.stat().st_size
    dest = trim(args.wheel, args.out_dir)
    with zipfile.ZipFile(args.wheel) as a, zipfile.ZipFile(dest) as b:
        n_in, n_out = len(a.infolist()), len(b.infolist())
    print(f"{dest.name}: {before / 2**20:.1f} MiB, {n_in} files -> {dest.stat().st_size / 2**20:.1f} MiB, "
          f"{n_out} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

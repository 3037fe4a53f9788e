#!/usr/bin/env python3
"""Compile the FlashInfer kernels the GPU check uses, in parallel, before the tests need them.

FlashInfer JIT-compiles one module per (kernel, dtype, head dim) on first use, and the tests would build
them one after another. Two steps, each printing how long it took:

1. Every module the steps use, built where ``plan`` will look for it: each module's own ninja run in its
   own build folder (FlashInfer's ``JitSpec.build``), WORKERS modules at a time with MAX_JOBS / WORKERS
   compile jobs each, the FA3 modules first (ten sources of about a CPU-minute each). Not FlashInfer's
   ``build_jit_specs``: its one ninja run keeps the build log and header dependencies in the JIT folder
   above the modules', so the module's own ninja, which ``plan`` runs, finds no record of the objects and
   compiles them all again (on an H200, 12 modules in 259 s, then 116 s more for the first configuration
   alone). The specs are the ones the wrappers' ``plan`` asks for (FA2 batch prefill and batch decode, and
   FA3 prefill on Hopper); they come from FlashInfer's internal generators, so a FlashInfer without them
   skips this step and step 2 compiles instead.
2. In this process, one dtype and head dim after another: radixkv's flashinfer backend plans and runs a
   100-token prefill (FA3 on Hopper), a 16-token prefill (FA2) and a decode; the first plan of a module
   loads it (its ninja finds nothing to do), or builds it (with all MAX_JOBS) when step 1 did not. Not in
   worker processes: on an H200, four spawned workers had not finished loading 200 s after starting, while
   one configuration built and ran in this process in 122 s from nothing.

Run by scripts/gpu_check.sh with FLASHINFER_CUDA_ARCH_LIST, FLASHINFER_WORKSPACE_BASE and MAX_JOBS set.

``--pack FILE`` writes every built module (``<name>/<name>.so`` of FlashInfer's JIT folder) into one
tar.xz; ``--unpack FILE`` puts such an archive's modules into FlashInfer's AOT folder (``<flashinfer>/data/
aot``), from which ``JitSpec.build_and_load`` loads a module as it is, with no ninja run and no compiling,
and step 1 skips them: a later run loads what an earlier one built. ``--versions FILE`` writes what the check
ran on as JSON (``versions``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
NUM_KV_HEADS, GROUP, PAGE_SIZE = 2, 4, 16
WORKERS = 4  # modules compiled at once in step 1
# (label, new tokens, cached prefix tokens) of the one request of each step
STEPS = (("prefill of 100 tokens", 100, 0), ("prefill of 16 tokens", 16, 0), ("decode", 1, 37))


def module_specs(configs: list[tuple[str, int]], fa3: bool) -> list:
    """The JIT specs the wrappers' ``plan`` asks for, per dtype and head dim: FA3 prefill (``fa3``: on Hopper),
    FA2 batch prefill and batch decode; the FA3 ones first (the longest builds). FlashInfer's internal
    generators: another FlashInfer may lack them (ImportError, AttributeError, TypeError)."""
    import torch
    from flashinfer.jit.attention import modules as gen

    first, rest = [], []
    for dtype_name, head_dim in configs:
        dt = getattr(torch, dtype_name)
        # the arguments plan() passes: q/kv/out dtype, int32 page indptr, head dims, no RoPE,
        # no sliding window, no soft cap, no fp16 QK reduction, no per-token scales
        args = (dt, dt, dt, torch.int32, head_dim, head_dim, 0, False, False, False, False)
        if fa3:
            first.append(gen.gen_batch_prefill_module("fa3", *args))
        rest.append(gen._gen_batch_prefill_primary_module("fa2", *args))
        rest.append(gen.gen_batch_decode_module(*args[:9]))
    return first + rest


def prebuild(configs: list[tuple[str, int]]) -> None:
    """Step 1: build every module the steps use, each in its own folder, WORKERS at a time."""
    import torch

    try:
        specs = module_specs(configs, fa3=torch.cuda.get_device_capability() == (9, 0))  # FA3 is sm90 only
        # a module already in FlashInfer's AOT folder (gpu_check.sh --jit-archive put it there) loads as it is
        specs = [spec for spec in specs if not getattr(spec, "is_aot", False)]
        build = [spec.build for spec in specs]  # JitSpec.build: write build.ninja, run ninja in build_dir
    except (ImportError, AttributeError, TypeError) as e:  # another FlashInfer's internals
        print(f"step 1 skipped, this FlashInfer's JIT internals differ ({type(e).__name__}: {e})", flush=True)
        return
    if not specs:
        print("step 1: every module is prebuilt (FlashInfer's AOT folder), nothing to compile", flush=True)
        return
    total_jobs = int(os.environ["MAX_JOBS"])
    workers = max(1, min(WORKERS, total_jobs, len(specs)))
    jobs = max(1, total_jobs // workers)
    os.environ["MAX_JOBS"] = str(jobs)  # run_ninja reads it: -j per module
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(workers) as pool:  # each thread waits on its own ninja process
            list(pool.map(lambda b: b(need_lock=True), build))
    finally:
        os.environ["MAX_JOBS"] = str(total_jobs)
    print(f"step 1: {len(specs)} modules built, {workers} at a time with {jobs} jobs each, in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def warm(dtype_name: str, head_dim: int) -> list[str]:
    """Step 2 for one dtype and head dim: plan and run each step once on a fresh pool; a line per step."""
    import numpy as np
    import torch

    from radixkv.attention import AttentionBatch, make_backend
    from radixkv.memory.kv_pool import KVPool

    dtype = getattr(torch, dtype_name)
    pool = KVPool(1, NUM_KV_HEADS, head_dim, num_slots=4096, page_size=PAGE_SIZE, dtype=dtype, device="cuda")
    backend = make_backend("flashinfer", pool, NUM_KV_HEADS * GROUP)
    lines = []
    for label, new, prefix in STEPS:
        # slots fill whole pages in order from page 1 (page_table's requirement)
        batch = AttentionBatch([prefix], [new], [np.arange(PAGE_SIZE, PAGE_SIZE + prefix + new, dtype=np.int64)])
        q = torch.randn(new, NUM_KV_HEADS * GROUP, head_dim, dtype=dtype, device="cuda")
        t0 = time.perf_counter()
        backend.plan(batch)
        out = backend.run(q, 0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if not torch.isfinite(out).all():
            raise RuntimeError(f"{label}: non-finite output")
        kernel = "decode" if new == 1 else getattr(backend._prefill, "_backend", "?")  # FlashInfer's pick: fa2/fa3
        lines.append(f"{dtype_name:>8} head dim {head_dim:3d}  {label:<22} ({kernel}): {seconds:6.1f} s")
    return lines


def built_modules(*folders: Path) -> list[Path]:
    """Every module in FlashInfer's JIT or AOT folders: ``<folder>/<name>/<name>.so``, one per name."""
    found = {so.name: so for folder in folders for so in folder.glob("*/*.so") if so.stem == so.parent.name}
    return [found[name] for name in sorted(found)]


def pack(folders: list[Path], archive: Path) -> int:
    """The modules of ``folders`` (the JIT folder's built ones, the AOT folder's loaded ones) into ``archive``
    (tar.xz of ``<name>/<name>.so``, nothing else): how many."""
    modules = built_modules(*folders)
    with tarfile.open(archive, "w:xz") as tar:
        for so in modules:
            tar.add(so, arcname=f"{so.parent.name}/{so.name}")
    return len(modules)


def unpack(archive: Path, aot_dir: Path) -> int:
    """``pack``'s modules into FlashInfer's AOT folder ``aot_dir``: how many. An archive with any other member
    (a path out of the folder, a link) is refused whole (SystemExit)."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        bad = [m.name for m in members if not (m.isfile() and re.fullmatch(r"(\w[\w.-]*)/\1\.so", m.name))]
        if bad:
            raise SystemExit(f"gpu_warmup: {archive} holds more than FlashInfer modules: {bad[:3]}")
        aot_dir.mkdir(parents=True, exist_ok=True)
        tar.extractall(aot_dir, members=members, filter="data")
    return len(members)


def versions() -> dict:
    """What the check runs on: the device and its compute capability, the driver, torch and the CUDA it was
    built with, nvcc, FlashInfer, transformers, Python (None for what is missing)."""
    import importlib.metadata
    import platform
    import subprocess

    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def last_line(command: list[str]) -> str | None:
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return (run.stdout.strip().splitlines() or [None])[-1] if run.returncode == 0 else None

    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else None,
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "driver": last_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "torch": torch.__version__, "cuda": torch.version.cuda, "nvcc": last_line(["nvcc", "--version"]),
            "flashinfer": version("flashinfer-python"), "transformers": version("transformers"),
            "python": platform.python_version()}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--versions":
        found = versions()
        Path(sys.argv[2]).write_text(json.dumps(found, indent=2) + "\n")
        print(json.dumps(found))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] in ("--pack", "--unpack"):
        from flashinfer.jit import env  # FlashInfer's folders, as it computes them here (arch, workspace)

        if sys.argv[1] == "--pack":
            count = pack([env.FLASHINFER_JIT_DIR, env.FLASHINFER_AOT_DIR], Path(sys.argv[2]))
            print(f"packed {count} modules into {sys.argv[2]}")
        else:
            print(f"unpacked {unpack(Path(sys.argv[2]), env.FLASHINFER_AOT_DIR)} modules into {env.FLASHINFER_AOT_DIR}")
        return 0
    configs = [(d, h) for d in DTYPES for h in HEAD_DIMS]
    total_jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    os.environ["MAX_JOBS"] = str(total_jobs)
    t0 = time.perf_counter()
    prebuild(configs)
    failed = False
    for d, h in configs:
        try:
            print("\n".join(warm(d, h)), flush=True)
        except Exception as e:  # report every configuration, then fail
            failed = True
            print(f"{d:>8} head dim {h:3d}  FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    print(f"warm-up: {len(configs)} configurations in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

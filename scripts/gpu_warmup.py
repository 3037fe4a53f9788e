#!/usr/bin/env python3
"""Compile the FlashInfer kernels the GPU check uses, in parallel, before the tests need them.

FlashInfer JIT-compiles one module per (kernel, dtype, head dim) on first use, and the tests would build
them one after another. Two steps, each printing how long it took:

1. One ninja run over every module (FlashInfer's ``build_jit_specs``), so that MAX_JOBS compile jobs stay
   busy across modules: an FA3 module alone is ten sources of about two CPU-minutes each, which one
   module's own build would spread over ten jobs at most. The specs are the ones the wrappers' ``plan``
   asks for (FA2 batch prefill and batch decode, and FA3 prefill on Hopper); they come from FlashInfer's
   internal generators, so a FlashInfer without them skips this step and step 2 compiles instead.
2. In this process, one dtype and head dim after another: radixkv's flashinfer backend plans and runs a
   100-token prefill (FA3 on Hopper), a 16-token prefill (FA2) and a decode; the first plan of a module
   loads it, or builds it (with all MAX_JOBS) when step 1 did not. Not in worker processes: on an H200,
   four spawned workers started after step 1 (12 modules in 224 s) had not finished loading 200 s later,
   while one configuration built and ran in this process in 122 s from nothing.

Run by scripts/gpu_check.sh with FLASHINFER_CUDA_ARCH_LIST, FLASHINFER_WORKSPACE_BASE and MAX_JOBS set.
"""

from __future__ import annotations

import os
import sys
import time

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
NUM_KV_HEADS, GROUP, PAGE_SIZE = 2, 4, 16
# (label, new tokens, cached prefix tokens) of the one request of each step
STEPS = (("prefill of 100 tokens", 100, 0), ("prefill of 16 tokens", 16, 0), ("decode", 1, 37))


def prebuild(configs: list[tuple[str, int]]) -> None:
    """Step 1: build every module the steps use with one ninja run."""
    import torch

    try:
        from flashinfer.jit.attention import modules as gen
        from flashinfer.jit.core import build_jit_specs

        fa3 = torch.cuda.get_device_capability() == (9, 0)  # FlashInfer's FA3 kernels are sm90 only
        specs = []
        for dtype_name, head_dim in configs:
            dt = getattr(torch, dtype_name)
            # the arguments plan() passes: q/kv/out dtype, int32 page indptr, head dims, no RoPE,
            # no sliding window, no soft cap, no fp16 QK reduction, no per-token scales
            args = (dt, dt, dt, torch.int32, head_dim, head_dim, 0, False, False, False, False)
            specs.append(gen._gen_batch_prefill_primary_module("fa2", *args))
            if fa3:
                specs.append(gen.gen_batch_prefill_module("fa3", *args))
            specs.append(gen.gen_batch_decode_module(*args[:9]))
    except (ImportError, AttributeError, TypeError) as e:  # another FlashInfer's internals
        print(f"step 1 skipped, this FlashInfer's JIT internals differ ({type(e).__name__}: {e})", flush=True)
        return
    t0 = time.perf_counter()
    build_jit_specs(specs)
    print(f"step 1: {len(specs)} modules built with MAX_JOBS={os.environ.get('MAX_JOBS')} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def warm(dtype_name: str, head_dim: int) -> list[str]:
    """Step 2 for one dtype and head dim: plan and run each step once on a fresh pool; a line per step."""
    import numpy as np
    import torch

    from radixkv.attention import AttentionBatch, make_backend
    from radixkv.kv_pool import KVPool

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


def main() -> int:
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

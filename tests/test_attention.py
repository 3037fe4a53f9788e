"""KV pool and the PyTorch reference attention backend (the oracle), on the CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from attention_cases import dense_attention, make_case

from radixkv.attention import AttentionBatch, TorchReferenceBackend, make_backend
from radixkv.attention.flashinfer_backend import page_table
from radixkv.memory.kv_pool import KVPool

CASES = {
    "prefill without prefix": ([0], [7]),
    "prefix mid-page": ([5], [6]),
    "prefix page-aligned": ([16], [9]),
    "decodes": ([12, 3], [1, 1]),
    "mixed prefill, prefix prefill and decode": ([0, 17, 31, 4], [9, 5, 1, 1]),
}


@pytest.mark.parametrize("small_prefill", [0, 256])  # chunks after a prefix: SDPA with a mask / written out
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_dense_causal_attention(case, page_size, small_prefill):
    prefix, new = CASES[case]
    pool, batch, q, dense = make_case(prefix, new, page_size)
    backend = TorchReferenceBackend(pool, num_qo_heads=q.shape[1], small_prefill=small_prefill)
    backend.plan(batch)
    out = backend.run(q, 0)
    torch.testing.assert_close(out, dense_attention(q, dense, prefix, new, group=2), atol=1e-5, rtol=1e-5)


def test_prefix_reuse_is_exact_two_steps_equal_one():
    """Attention of a prompt computed in two steps (cached prefix, then the rest) equals one full prefill."""
    pool, batch, q, dense = make_case([0], [12], 4)
    backend = TorchReferenceBackend(pool, num_qo_heads=q.shape[1])
    backend.plan(batch)
    full = backend.run(q, 0)
    slots = batch.slots[0]
    for p in (1, 4, 5, 8, 11):
        backend.plan(AttentionBatch([p], [12 - p], [slots]))
        torch.testing.assert_close(backend.run(q[p:], 0), full[p:], atol=1e-6, rtol=1e-6)


def test_pool_store_and_page_view():
    pool = KVPool(2, 2, 4, num_slots=10, page_size=4)
    assert pool.num_slots == 8 and pool.num_pages == 2
    k = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)
    pool.store(1, k, -k, np.array([5, 2]))
    kp, vp = pool.pages(1)
    assert kp.shape == (2, 4, 2, 4)
    torch.testing.assert_close(kp[1, 1], k[0])
    torch.testing.assert_close(vp[0, 2], -k[1])
    assert pool.k[0].abs().sum() == 0


def test_pool_sized_from_bytes():
    pool = KVPool(4, 2, 8, max_bytes=10_000, page_size=4, dtype=torch.bfloat16)
    assert pool.bytes_per_slot == 2 * 4 * 2 * 8 * 2
    assert pool.num_slots == (10_000 // pool.bytes_per_slot) // 4 * 4


@pytest.mark.parametrize("kwargs", [dict(), dict(num_slots=8, max_bytes=100), dict(num_slots=8, dtype=torch.int8),
                                    dict(num_slots=2, page_size=4)])
def test_pool_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        KVPool(1, 1, 4, **kwargs)


def test_store_shape_mismatch_is_a_clear_error():
    pool = KVPool(1, 2, 4, num_slots=8)
    with pytest.raises(ValueError, match="store"):
        pool.store(0, torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), [0, 1])


def test_batch_metadata_is_validated():
    with pytest.raises(ValueError):
        AttentionBatch([2], [3], [np.arange(4)])
    batch = AttentionBatch([0, 4], [3, 1], [np.arange(3), np.arange(5)])
    assert batch.qo_indptr.tolist() == [0, 3, 4] and batch.num_tokens == 4


def test_page_table_csr():
    indptr, indices, last = page_table([np.arange(8, 14), np.array([4, 5, 6, 7, 0, 1])], page_size=4)
    assert indptr.tolist() == [0, 2, 4] and indices.tolist() == [2, 3, 1, 0] and last.tolist() == [2, 2]
    assert indptr.dtype == np.int32 and indices.dtype == np.int32
    with pytest.raises(ValueError, match="whole pages"):
        page_table([np.array([1, 2, 3])], page_size=4)


def test_make_backend_choices():
    pool = KVPool(1, 2, 4, num_slots=8)
    assert make_backend("auto", pool, 4).name == "torch-cascade" or torch.cuda.is_available()  # float32: the oracle
    assert make_backend("torch", pool, 4).name == "torch"
    assert make_backend("torch-cascade", pool, 4).name == "torch-cascade"
    with pytest.raises(ValueError):
        make_backend("triton", pool, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_backend("torch", pool, 3)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_backend("flashinfer", pool, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "torch-cascade", "cpu"])
def test_an_empty_step_gives_an_empty_output(name, dtype):
    """A step with no requests (a driver that plans before anything is admitted) returns ``[0, heads, dim]``."""
    pool = KVPool(1, 2, 64, num_slots=8, dtype=dtype)
    if name == "cpu":
        from radixkv.cpu.kernels import cpu_kernels_unavailable_reason

        if reason := cpu_kernels_unavailable_reason():
            pytest.skip(reason)
    backend = make_backend(name, pool, 4)
    assert backend.name == name
    backend.plan(AttentionBatch([], [], []))
    out = backend.run(torch.zeros(0, 4, 64, dtype=dtype), 0)
    assert out.shape == (0, 4, 64) and out.dtype == dtype


def shared_prefix_decodes(shared: int, own: list[int], dtype=torch.float32, mixed_prefill: bool = False):
    """Decodes whose slot lists start with the same ``shared`` slots, plus an optional prefill row."""
    g = torch.Generator().manual_seed(1)
    total = shared + sum(own) + 64
    pool = KVPool(1, 2, 16, num_slots=total, dtype=dtype)
    pool.store(0, torch.randn(total, 2, 16, generator=g).to(dtype), torch.randn(total, 2, 16, generator=g).to(dtype),
               np.arange(total))
    base, slots, start = np.arange(shared), [], shared
    for n in own:
        slots.append(np.concatenate([base, np.arange(start, start + n)]))
        start += n
    prefix, new = [len(s) - 1 for s in slots], [1] * len(slots)
    if mixed_prefill:
        slots.append(np.concatenate([base[:10], np.arange(start, start + 6)]))
        prefix.append(10)
        new.append(6)
    q = torch.randn(sum(new), 4, 16, generator=g).to(dtype)
    return pool, AttentionBatch(prefix, new, slots), q


@pytest.mark.parametrize("shared,own", [(80, [1, 5, 30]), (200, [3, 3]), (70, [1, 1, 1, 1]), (10, [4, 9])])
@pytest.mark.parametrize("mixed_prefill", [False, True])
def test_shared_prefix_decode_equals_reference(shared, own, mixed_prefill):
    """Two-level decode (shared prefix read once, then each request's own slots) is exact in float32."""
    from radixkv.attention import SharedPrefixTorchBackend

    pool, batch, q = shared_prefix_decodes(shared, own, mixed_prefill=mixed_prefill)
    ref, cascade = TorchReferenceBackend(pool, 4), SharedPrefixTorchBackend(pool, 4)
    ref.plan(batch)
    cascade.plan(batch)
    assert (cascade.decode.shared is not None) == (shared >= cascade.decode.min_shared)
    torch.testing.assert_close(cascade.run(q, 0), ref.run(q, 0), atol=1e-5, rtol=1e-5)


def test_shared_prefix_decode_bfloat16_close_to_reference():
    from radixkv.attention import SharedPrefixTorchBackend

    pool, batch, q = shared_prefix_decodes(300, [7, 40, 2], dtype=torch.bfloat16)
    ref, cascade = TorchReferenceBackend(pool, 4), SharedPrefixTorchBackend(pool, 4)
    ref.plan(batch)
    cascade.plan(batch)
    torch.testing.assert_close(cascade.run(q, 0).float(), ref.run(q, 0).float(), atol=2e-2, rtol=2e-2)


def test_shared_slot_prefix_leaves_every_request_a_slot_of_its_own():
    from radixkv.attention.shared_prefix import shared_slot_prefix

    assert shared_slot_prefix([np.arange(5), np.arange(5)]) == 4
    assert shared_slot_prefix([np.arange(5), np.array([0, 1, 7, 8])]) == 2
    assert shared_slot_prefix([np.array([3]), np.array([3, 4])]) == 0


@pytest.mark.parametrize("backend,loads_cpu_path", [("torch", False), ("torch-cascade", False), ("auto", True)])
def test_only_auto_and_cpu_load_the_cpu_speed_path(backend, loads_cpu_path):
    """A 16-bit model on the CPU served by a PyTorch backend, through the engine and through ``build_forward``,
    imports no module of ``radixkv.cpu`` (in a fresh interpreter, so no other test's imports count); with
    ``auto`` it does, which shows the check sees the package when it is loaded."""
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import torch
        from radixkv import LLM, SamplingParams
        from radixkv.attention import AttentionBatch
        from radixkv.memory.kv_pool import KVPool
        from radixkv.model import load_model
        from radixkv.forward import build_forward
        from radixkv.model.step import run_step

        llm = LLM("tiny-random", attention_backend="{backend}", dtype="bfloat16", kv_cache_tokens=256)
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
        model = load_model("tiny-random", dtype=torch.bfloat16).model
        cfg = model.config
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=64, dtype=torch.bfloat16)
        forward, attn = build_forward(model, pool, "{backend}")
        run_step(forward, pool, attn, [[5, 6, 7]], AttentionBatch([0], [3], [np.arange(3)]))
        print(attn.name, any(m == "radixkv.cpu" or m.startswith("radixkv.cpu.") for m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    name, loaded = done.stdout.split()[-2:]
    assert loaded == str(loads_cpu_path)
    assert name == backend or backend == "auto"

"""KV pool and the PyTorch reference attention backend (the oracle), on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_cases import dense_attention, make_case

from radixkv.attention import AttentionBatch, TorchReferenceBackend, make_backend
from radixkv.attention.flashinfer_backend import page_table
from radixkv.kv_pool import KVPool

CASES = {
    "prefill without prefix": ([0], [7]),
    "prefix mid-page": ([5], [6]),
    "prefix page-aligned": ([16], [9]),
    "decodes": ([12, 3], [1, 1]),
    "mixed prefill, prefix prefill and decode": ([0, 17, 31, 4], [9, 5, 1, 1]),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_dense_causal_attention(case, page_size):
    prefix, new = CASES[case]
    pool, batch, q, dense = make_case(prefix, new, page_size)
    backend = TorchReferenceBackend(pool, num_qo_heads=q.shape[1])
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
    assert isinstance(make_backend("auto", pool, 4), TorchReferenceBackend) or torch.cuda.is_available()
    assert isinstance(make_backend("torch", pool, 4), TorchReferenceBackend)
    with pytest.raises(ValueError):
        make_backend("triton", pool, 4)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_backend("flashinfer", pool, 4)

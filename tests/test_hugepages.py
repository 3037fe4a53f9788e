"""radixkv.cpu.hugepages: the same tensors as torch's, in memory advised for 2 MiB pages."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

from radixkv.cpu import hugepages
from radixkv.memory.kv_pool import KVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_is_a_zeroed_writable_contiguous_tensor_of_the_shape_and_dtype(dtype):
    shape = (3, 1000, 700)  # over MIN_BYTES, and not a whole number of huge pages
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert not t.any()
    t[2, 999, 699] = 5
    t[0, 0, 0] = -1
    assert t.sum().item() == 4


def test_small_zeros_are_plain_tensors():
    t = hugepages.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()
    assert t.numel() * t.element_size() < hugepages.MIN_BYTES


def test_pack_copies_values_page_aligned_and_independent_of_the_sources():  # 2.2 MB: over MIN_BYTES
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(1100, 1000, generator=g).to(torch.bfloat16), torch.randint(0, 255, (333,), generator=g,
               dtype=torch.uint8), torch.randn(5, 7, 8, generator=g).to(torch.float16)]
    kept = [s.clone() for s in sources]
    packed = hugepages.pack(sources)
    for src, dst in zip(sources, packed, strict=True):
        assert dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous()
        assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr()
        if hasattr(mmap, "MADV_HUGEPAGE"):  # elsewhere pack() makes plain copies
            assert dst.data_ptr() % hugepages.ALIGN == 0
    sources[0].zero_()
    assert torch.equal(packed[0], kept[0])  # a copy, not a view of the source
    packed[1].fill_(7)  # tensors of one buffer do not overlap
    assert torch.equal(packed[0], kept[0]) and torch.equal(packed[2], kept[2]) and (packed[1] == 7).all()


def test_packed_tensors_keep_their_memory_alive():
    packed = hugepages.pack([torch.ones(1 << 20), torch.full((10,), 3.0)])
    last = packed[1]
    del packed
    gc.collect()
    assert (last == 3.0).all()


def test_small_pack_is_plain_copies():
    src = [torch.arange(6.0).view(2, 3)[:, 1:]]  # non-contiguous
    (out,) = hugepages.pack(src)
    assert torch.equal(out, src[0]) and out.is_contiguous()


def test_kv_pool_layers_are_separate_zeroed_views_of_one_buffer():
    pool = KVPool(4, 3, 64, num_slots=4096, dtype=torch.bfloat16)  # 12 MiB in all
    views = pool.k + pool.v
    assert all(t.shape == (4096, 3, 64) and t.is_contiguous() and not t.any() for t in views)
    starts = sorted(t.data_ptr() for t in views)
    nbytes = 4096 * 3 * 64 * 2
    assert all(b - a >= nbytes for a, b in zip(starts, starts[1:], strict=False))
    pool.k[1].fill_(1)
    assert pool.k[1].all() and not pool.v[1].any() and not pool.k[2].any()


def test_a_pool_moves_into_huge_pages_with_what_it_holds():
    """``KVPool.reallocate(hugepages.zeros)`` (what ``radixkv.cpu.accelerate`` does) keeps every stored row, and
    the layers stay separate views of the one new buffer; a buffer of the wrong shape is refused."""
    pool = KVPool(4, 3, 64, num_slots=4096, dtype=torch.bfloat16)  # 12 MiB in all: over MIN_BYTES
    k = torch.randn(5, 3, 64).to(torch.bfloat16)
    pool.store(2, k, -k, np.array([7, 0, 4095, 9, 1]))
    old = pool.k[2].data_ptr()
    pool.reallocate(hugepages.zeros)
    assert pool.k[2].data_ptr() != old
    torch.testing.assert_close(pool.k[2][[7, 0, 4095, 9, 1]], k, atol=0, rtol=0)
    torch.testing.assert_close(pool.v[2][[7, 0, 4095, 9, 1]], -k, atol=0, rtol=0)
    assert int(pool.k[2].ne(0).any(-1).any(-1).sum()) == 5 and not pool.k[1].any() and not pool.v[3].any()
    pool.k[3].fill_(1)
    assert not pool.v[3].any() and not pool.k[2][10:4095].any()
    with pytest.raises(ValueError, match="reallocate"):
        pool.reallocate(lambda shape, dtype: torch.zeros(3, dtype=dtype))


def test_where_memory_cannot_be_advised_the_helpers_are_plain_torch(monkeypatch):
    monkeypatch.setattr(hugepages, "_ADVICE", None)  # as on a platform without MADV_HUGEPAGE
    t = hugepages.zeros((1100, 1000), torch.float32)
    assert t.shape == (1100, 1000) and not t.any()
    src = torch.arange(1100 * 1000, dtype=torch.float32).view(1100, 1000)
    (p,) = hugepages.pack([src])
    assert torch.equal(p, src) and p.data_ptr() != src.data_ptr()

"""Tests for ``SlotAllocator``: page-aligned allocation of KV slot indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv import OutOfSlotsError, SlotAllocator


def state(a: SlotAllocator):
    return a.num_free, a.capacity


def test_capacity_and_num_free():
    a = SlotAllocator(10)
    assert a.capacity == 10 and a.num_free == 10
    a.check_invariants()


def test_capacity_rounds_down_to_whole_pages():
    a = SlotAllocator(10, page_size=4)
    assert a.capacity == 8 and a.num_free == 8
    assert SlotAllocator(3, page_size=4).capacity == 0


def test_alloc_and_free_page_size_1():
    a = SlotAllocator(10)
    x = a.alloc(3)
    assert isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1
    assert len(x) == 3 and len(set(x.tolist())) == 3
    assert all(0 <= s < 10 for s in x.tolist())
    assert a.num_free == 7
    y = a.alloc(7)
    assert not set(x.tolist()) & set(y.tolist())
    assert a.num_free == 0
    a.free(x)
    assert a.num_free == 3
    a.free(y)
    assert a.num_free == 10
    a.check_invariants()


def test_alloc_zero_returns_empty_int64():
    a = SlotAllocator(4)
    z = a.alloc(0)
    assert z.dtype == np.int64 and z.size == 0
    assert a.num_free == 4
    a.free(z)  # freeing nothing is fine
    a.free([])
    assert a.num_free == 4


def test_first_allocations_are_in_order():
    a = SlotAllocator(8, page_size=4)
    assert a.alloc(5).tolist() == [0, 1, 2, 3, 4]
    assert a.num_free == 0


@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
def test_allocations_start_on_page_boundary_and_take_whole_pages(page_size):
    a = SlotAllocator(64, page_size=page_size)
    seen = set()
    for n in [1, 3, page_size, page_size + 1, 2 * page_size - 1]:
        if -(-n // page_size) * page_size > a.num_free:
            break
        before = a.num_free
        x = a.alloc(n)
        assert len(x) == n
        assert x[0] % page_size == 0, "allocation must start on a page boundary"
        # the slots fill whole pages in order: every page used starts at a multiple of page_size
        pages = x // page_size
        for p in np.unique(pages):
            in_page = x[pages == p]
            assert in_page.tolist() == list(range(p * page_size, p * page_size + len(in_page)))
        assert before - a.num_free == -(-n // page_size) * page_size, "whole pages are taken"
        assert not seen & set(x.tolist())
        seen |= set(x.tolist())
        a.check_invariants()


def test_partial_last_page_held_until_all_its_slots_are_freed():
    a = SlotAllocator(16, page_size=4)
    x = a.alloc(5)  # pages 0 and 1; slots 5..7 of page 1 are held
    assert x.tolist() == [0, 1, 2, 3, 4]
    assert a.num_free == 8
    a.free([0, 1])
    assert a.num_free == 8, "page 0 is not free until all of its slots are"
    a.free([2, 3])
    assert a.num_free == 12
    a.free([4])
    assert a.num_free == 16
    a.check_invariants()


def test_partial_page_tail_slots_cannot_be_freed():
    a = SlotAllocator(8, page_size=4)
    a.alloc(5)
    with pytest.raises(ValueError):
        a.free([5])  # held as part of page 1, never handed out
    assert a.num_free == 0
    a.check_invariants()


def test_freed_pages_are_reused():
    a = SlotAllocator(8, page_size=4)
    x = a.alloc(8)
    a.free(x[4:])
    y = a.alloc(3)
    assert y.tolist() == [4, 5, 6]
    assert a.num_free == 0
    with pytest.raises(OutOfSlotsError):
        a.alloc(1)


def test_out_of_slots_raises_and_changes_nothing():
    a = SlotAllocator(8, page_size=4)
    x = a.alloc(3)
    before = state(a)
    assert issubclass(OutOfSlotsError, MemoryError)
    with pytest.raises(OutOfSlotsError):
        a.alloc(5)  # needs 2 pages, 1 free
    with pytest.raises(MemoryError):
        a.alloc(100)
    assert state(a) == before
    a.check_invariants()
    y = a.alloc(4)  # the free page is still there
    assert y.tolist() == [4, 5, 6, 7]
    a.free(x)
    a.free(y)
    assert a.num_free == 8


def test_out_of_slots_page_size_1():
    a = SlotAllocator(3)
    a.alloc(2)
    with pytest.raises(OutOfSlotsError):
        a.alloc(2)
    assert a.num_free == 1
    assert len(a.alloc(1)) == 1
    assert a.num_free == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises_and_changes_nothing(page_size):
    a = SlotAllocator(16, page_size=page_size)
    x = a.alloc(8)
    a.free(x[:4])
    before = state(a)
    with pytest.raises(ValueError):
        a.free(x[:4])
    assert state(a) == before
    with pytest.raises(ValueError):  # a mix of live and already-freed slots: nothing is freed
        a.free(x[2:6])
    assert state(a) == before
    a.check_invariants()
    a.free(x[4:])
    assert a.num_free == 16


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_never_allocated_raises(page_size):
    a = SlotAllocator(16, page_size=page_size)
    x = a.alloc(4)
    before = state(a)
    with pytest.raises(ValueError):
        a.free([9])
    with pytest.raises(ValueError):
        a.free([x[0], 12])  # one good slot, one never allocated: nothing changes
    assert state(a) == before
    a.free(x)
    assert a.num_free == 16
    a.check_invariants()


@pytest.mark.parametrize("bad", [[-1], [16], [100], [0, 16]])
def test_free_out_of_range_raises(bad):
    a = SlotAllocator(16)
    a.alloc(16)
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == 0
    a.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_same_slot_twice_in_one_call_raises(page_size):
    a = SlotAllocator(8, page_size=page_size)
    x = a.alloc(4)
    with pytest.raises(ValueError):
        a.free([x[0], x[0]])
    assert a.num_free == 8 - 4
    a.free(x)
    assert a.num_free == 8


def test_free_accepts_lists_numpy_and_torch():
    a = SlotAllocator(9)
    x = a.alloc(9)
    a.free(x[:3].tolist())
    a.free(np.asarray(x[3:6], dtype=np.int32))
    t = torch.tensor(x[6:].tolist())
    a.free(t)
    assert t.tolist() == x[6:].tolist()  # the caller's object is not modified
    assert a.num_free == 9


def test_negative_alloc_raises():
    a = SlotAllocator(4)
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert a.num_free == 4


def test_bad_constructor_arguments():
    with pytest.raises(ValueError):
        SlotAllocator(8, page_size=0)
    with pytest.raises(ValueError):
        SlotAllocator(-1)


def test_reset_frees_everything():
    a = SlotAllocator(12, page_size=4)
    a.alloc(9)
    a.reset()
    assert a.num_free == 12
    assert a.alloc(12).tolist() == list(range(12))


@given(
    page_size=st.sampled_from([1, 2, 3, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 10**6)), max_size=40),
)
def test_random_alloc_free_matches_a_page_model(page_size, ops):
    """A model: pages are free or not; a page is free again once all its handed-out slots are back."""
    a = SlotAllocator(24, page_size=page_size)
    live: set[int] = set()
    for is_alloc, n, pick in ops:
        if is_alloc:
            pages_needed = -(-n // page_size)
            free_pages = a.num_free // page_size
            if pages_needed > free_pages:
                with pytest.raises(OutOfSlotsError):
                    a.alloc(n)
                continue
            x = a.alloc(n).tolist()
            assert not live & set(x)
            if x:
                assert x[0] % page_size == 0
            live |= set(x)
        elif live:
            ordered = sorted(live)
            k = pick % len(ordered)
            chunk = ordered[k : k + 1 + pick % 5]
            a.free(chunk)
            live -= set(chunk)
        live_pages = {s // page_size for s in live}
        assert a.num_free == a.capacity - len(live_pages) * page_size
        a.check_invariants()
    a.free(sorted(live))
    assert a.num_free == a.capacity

"""The host tier beside a CUDA pool: pinned host memory, copies on a side stream (``KVMover``), checked bit for
bit (skipped without CUDA; ``scripts/gpu_check.sh`` runs it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv import LLM, SamplingParams
from radixkv.cache.tiered import Copy
from radixkv.kv_transfer import KVMover
from radixkv.memory.kv_pool import KVPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(dtype):
    device = KVPool(3, 2, 64, num_slots=256, page_size=16, dtype=dtype, device="cuda")
    host = KVPool(3, 2, 64, num_slots=512, page_size=16, dtype=dtype, pin_memory=True)
    assert host._kv.is_pinned()
    device._kv.copy_(torch.randn(device.buffer_shape, device="cuda").to(dtype))
    original = device._kv.clone()
    mover = KVMover(device, host)
    src, mid, back = np.arange(32, 96), np.arange(400, 464), np.arange(160, 224)
    mover(Copy("device", "host", src, mid))
    mover(Copy("host", "device", mid, back))
    mover.wait()  # no synchronize: the compute stream's reads below must see the loads through wait() alone
    assert torch.equal(host._kv[:, :, 400:464].to("cuda"), original[:, :, 32:96])
    assert torch.equal(device._kv[:, :, 160:224], original[:, :, 32:96])
    assert torch.equal(device._kv[:, :, :160], original[:, :, :160])  # nothing else moved


def test_engine_with_a_host_tier_matches_one_big_pool():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 500, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 500, (40,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = []
    for settings in ({"kv_cache_tokens": 512, "host_kv_cache_tokens": 4096}, {"kv_cache_tokens": 4608}):
        llm = LLM("tiny-random", device="cuda", dtype="float32", **settings)
        outs.append([[o.token_ids for o in llm.generate(prompts, params)] for _ in range(2)])
        llm.check_idle()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loads_behind_a_busy_side_stream_land_in_their_own_slots(dtype):
    """Many loads queued behind a side stream kept busy, while the compute stream makes and fills new tensors of
    the index's size (which would take an index's memory, were it made there and dropped before its scatter
    ran): every loaded slot holds its own source slot's KV bit for bit, and no other slot changed."""
    device = KVPool(2, 2, 64, num_slots=4096, page_size=16, dtype=dtype, device="cuda")
    host = KVPool(2, 2, 64, num_slots=4096, page_size=16, dtype=dtype, pin_memory=True)
    host._kv.copy_(torch.randn(host.buffer_shape).to(dtype))
    device._kv.copy_(torch.randn(device.buffer_shape, device="cuda").to(dtype))
    before = device._kv.clone()
    mover = KVMover(device, host)
    rng = np.random.default_rng(0)
    dst = rng.permutation(4096)[:3072].reshape(48, 64)  # 48 loads of 64 slots each, no slot twice
    src = rng.permutation(4096)[:3072].reshape(48, 64)
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(200_000_000)  # the side stream busy for a while (about 0.1 s): the loads queue behind it
    for s, d in zip(src, dst, strict=True):
        mover(Copy("host", "device", s, d))
        torch.zeros(64, dtype=torch.long, device="cuda").fill_(7)  # the compute stream reuses freed memory at once
    mover.wait()
    got = device._kv.index_select(2, torch.as_tensor(dst.ravel(), device="cuda")).cpu()
    assert torch.equal(got, host._kv[:, :, torch.as_tensor(src.ravel())])
    untouched = torch.ones(4096, dtype=torch.bool)
    untouched[torch.as_tensor(dst.ravel())] = False
    assert torch.equal(device._kv[:, :, untouched.cuda()], before[:, :, untouched.cuda()])


def test_timed_copies_beside_a_cuda_pool_are_read_without_waiting_and_stay_bit_exact():
    """A timed mover (the engine's ``record_steps``) times the side stream's part with CUDA events: a copy still
    running is left for a later ``take_times``, one done is counted once, and timing changes no byte."""
    device = KVPool(3, 2, 64, num_slots=256, page_size=16, dtype=torch.bfloat16, device="cuda")
    host = KVPool(3, 2, 64, num_slots=512, page_size=16, dtype=torch.bfloat16, pin_memory=True)
    device._kv.copy_(torch.randn(device.buffer_shape, device="cuda").to(torch.bfloat16))
    original = device._kv.clone()
    mover = KVMover(device, host, timed=True)
    mover(Copy("device", "host", np.arange(32, 96), np.arange(400, 464)))
    mover(Copy("host", "device", np.arange(400, 464), np.arange(160, 224)))
    mover.wait()
    torch.cuda.synchronize()
    times = mover.take_times()
    assert {k: v[0] for k, v in times.items()} == {("device", "host"): 64, ("host", "device"): 64}
    assert all(seconds > 0 for _, seconds in times.values()) and mover.take_times() == {}
    assert torch.equal(device._kv[:, :, 160:224], original[:, :, 32:96])


def test_an_engine_recording_steps_on_cuda_times_its_host_loads():
    llm = LLM("tiny-random", device="cuda", dtype="float32", kv_cache_tokens=64, host_kv_cache_tokens=512,
              record_steps=True)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for prompt in (list(range(3, 51)), list(range(100, 148)), list(range(3, 51))):
        llm.generate([prompt], params)
    torch.cuda.synchronize()
    log = llm.step_log + [llm.mover.take_times()]  # a copy still running when the last step ended comes now
    loaded = sum(r.loaded_tokens for r in log[:-1]) + sum(n for (s, _), (n, _) in log[-1].items() if s == "host")
    assert loaded == llm.stats()["loaded_tokens"] > 0 and sum(r.load_seconds for r in log[:-1]) >= 0

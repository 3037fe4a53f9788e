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

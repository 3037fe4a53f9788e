"""``batch_invariant=True``: a token's logits are the same bits whichever requests share its step, so greedy
outputs do not depend on batching (a pool's size, a host tier, preemptions). And the one-token prefill
chunk (a prompt cached but for its last token) runs the prefill kernel, as its prompt did, not a decode's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from radixkv import LLM, SamplingParams
from radixkv.attention import AttentionBatch
from radixkv.config import EngineConfig
from radixkv.cpu.capabilities import cpu_capabilities
from radixkv.cpu.flash_prefill import FlashPrefill


@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 40), (64, 36)])  # (64, 36): no tiles
def test_packed_linear_rows_do_not_depend_on_the_batch(avx2_kernels, shape):
    from radixkv.cpu.linear import PackedLinear

    torch.manual_seed(0)
    fan_in, fan_out = shape
    compute = cpu_capabilities().compute_dtype(torch.bfloat16)  # float32 where oneDNN lacks bfloat16 (AVX2)
    layer = PackedLinear(nn.Linear(fan_in, fan_out).bfloat16(), compute_dtype=compute,
                         small_kernels=avx2_kernels, batch_invariant=True)
    assert (layer.tiles is None) == (fan_out % 8 != 0)
    x = torch.randn(70, fan_in).bfloat16()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for start, rows in [(0, 2), (0, 3), (0, 5), (0, 16), (0, 17), (3, 33), (1, 69), (0, 70)]:
        assert torch.equal(layer(x[start : start + rows]), alone[start : start + rows]), (start, rows)
    assert layer(x[:0]).shape == (0, fan_out)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (120,), generator=g).tolist()
    return [shared + torch.randint(3, 500, (int(k),), generator=g).tolist()
            for k in torch.randint(5, 90, (n,), generator=g)]


def test_greedy_outputs_alone_equal_batched(avx2_kernels):
    llm = LLM("tiny-random", dtype="bfloat16", batch_invariant=True, kv_cache_tokens=4096)
    assert not isinstance(llm.backend.prefill, FlashPrefill)  # AMX's cascade prefill depends on the chunk
    prompts, params = _prompts(6, 1), SamplingParams(max_new_tokens=12, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    llm.flush_cache()  # each alone computes its whole prompt too
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    llm.check_idle()


def test_host_tier_and_preemptions_keep_one_pools_outputs_in_bfloat16(avx2_kernels):
    """A small pool preempts and loads from the host tier; one large pool does neither: the same bits. On
    SmolLM2's shapes (random weights): without ``batch_invariant`` 4 of these 16 outputs differ here."""
    prompts, params = _prompts(8, 2), SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs, stats = [], []
    for settings in ({"kv_cache_tokens": 320, "host_kv_cache_tokens": 4096}, {"kv_cache_tokens": 4416}):
        llm = LLM("smollm2-135m-random", batch_invariant=True, **settings)
        turns = []
        history = [list(p) for p in prompts]
        for _ in range(2):  # a second turn reuses the first's prompt and output
            got = [o.token_ids for o in llm.generate(history, params)]
            turns.append(got)
            history = [h + g + [7, 8, 9] for h, g in zip(history, got, strict=True)]
        outs.append(turns)
        stats.append(llm.stats())
        llm.check_idle()
    assert stats[0]["preemptions"] > 0 and stats[0]["loaded_tokens"] > 0  # the small pool did both
    assert stats[1]["preemptions"] == 0
    assert outs[0] == outs[1]


def test_batch_invariant_needs_the_cpu_kernels_path():
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM("tiny-random", dtype="float32", batch_invariant=True, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant="yes")
    assert EngineConfig().batch_invariant is False


def test_one_token_prefill_chunk_is_not_a_decode():
    slots = [np.arange(10), np.arange(10, 15), np.arange(15, 22)]
    flagged = AttentionBatch([9, 4, 0], [1, 1, 7], slots, prefilling=[True, False, True])
    assert flagged.prefills() == [0, 2] and flagged.decodes() == [1]
    plain = AttentionBatch([9, 4, 0], [1, 1, 7], slots)
    assert plain.prefills() == [2] and plain.decodes() == [0, 1]
    with pytest.raises(ValueError, match="prefill chunk"):
        AttentionBatch([9, 4, 0], [1, 1, 7], slots, prefilling=[True, False, False])
    with pytest.raises(ValueError, match="one flag per request"):
        AttentionBatch([9, 4, 0], [1, 1, 7], slots, prefilling=[True])


def test_resumed_prompt_recomputes_its_last_token_with_the_prefill_kernel(avx2_kernels):
    """The batch-invariant cpu backend's last row of a prompt: the same output computed in its prompt's chunk or
    alone (on an AMX CPU too, where the default prefill is a cascade split where the cached prefix ends)."""
    from radixkv.cpu import CpuPagedBackend
    from radixkv.memory.kv_pool import KVPool

    torch.manual_seed(0)
    pool = KVPool(1, 2, 64, num_slots=512, dtype=torch.bfloat16)
    pool.k[0].copy_(torch.randn_like(pool.k[0]))
    pool.v[0].copy_(torch.randn_like(pool.v[0]))
    backend = CpuPagedBackend(pool, 6, batch_invariant=True)
    assert not isinstance(backend.prefill, FlashPrefill)
    q = torch.randn(40, 6, 64).bfloat16()
    backend.plan(AttentionBatch([100], [40], [np.arange(140)], prefilling=[True]))
    whole = backend.run(q, 0)
    backend.plan(AttentionBatch([139], [1], [np.arange(140)], prefilling=[True]))
    assert torch.equal(backend.run(q[-1:], 0), whole[-1:])

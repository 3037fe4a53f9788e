"""FlashInfer and the reference backend against the float32 oracle on a GPU (skipped elsewhere), and, on
any machine, the check that the tolerance they are held to is meaningful.

Run on a GPU machine with ``bash scripts/gpu_check.sh`` (``--wheels DIR`` offline). The tolerance and
why it is that: ``tests/attention_cases.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from attention_cases import FAULTS, assert_within_rounding, dense_attention, make_case, make_layered_case

from radixkv.attention import (
    FLASHINFER_HEAD_DIMS,
    FlashInferUnavailableError,
    TorchReferenceBackend,
    flashinfer_unavailable_reason,
    make_backend,
)
from radixkv.memory.kv_pool import KVPool
from radixkv.model.loader import TINY_CONFIG

NO_GPU = "needs CUDA" if not torch.cuda.is_available() else (
    "needs flashinfer (the gpu extra)" if importlib.util.find_spec("flashinfer") is None else None)

# (num_kv_heads, query heads per KV head, head_dim)
SHAPES = {"smollm2-135m: 9 / 3 heads, dim 64": (3, 3, 64), "4 query heads per KV head, dim 128": (2, 4, 128)}
CASES = {  # (prefix_lens, new_lens)
    "prefill without prefix": ([0, 0], [37, 64]),
    "prefix mid-page": ([21, 5], [19, 40]),
    "prefix page-aligned": ([32, 64], [16, 33]),
    "decodes": ([100, 17, 64], [1, 1, 1]),
    "decodes filling their last page exactly": ([15, 31, 47], [1, 1, 1]),
    "mixed prefill, prefix prefill and decode": ([0, 48, 77, 9], [50, 20, 1, 1]),
    # more than 64 query tokens in a request: FlashInfer takes FA3 on Hopper (FA2 below), as the engine's chunks do
    "1,024-token chunk after a prefix, with a decode": ([200, 0, 90], [1024, 300, 1]),
}
DTYPES = [torch.bfloat16, torch.float16]
SEEDS = [0, 1, 2]
LAYERS = 2


def gpu_case(case: str, shape: str, page_size: int, dtype: torch.dtype, seed: int):
    prefix, new = CASES[case]
    kv_heads, group, head_dim = SHAPES[shape]
    return make_layered_case(prefix, new, page_size, kv_heads, group, head_dim, LAYERS, dtype, "cuda", seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))
def test_gpu_backend_matches_float32_oracle(backend, case, shape, page_size, dtype, seed):
    """Two layers planned once; bfloat16 and float16; FlashInfer and the reference on the same GPU pool."""
    pool, batch, qs, dense = gpu_case(case, shape, page_size, dtype, seed)
    attn = make_backend(backend, pool, qs[0].shape[1])
    assert attn.name == backend
    attn.plan(batch)  # once per step, then every layer
    group = SHAPES[shape][1]
    for layer in range(LAYERS):
        out = attn.run(qs[layer], layer)
        assert out.shape == qs[layer].shape and out.dtype == dtype and out.device.type == "cuda"
        oracle = dense_attention(qs[layer], dense[layer], *CASES[case], group=group)
        assert_within_rounding(out, oracle, dtype, f"{backend}, layer {layer}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tolerance_separates_rounding_from_a_wrong_mask_or_page(shape, dtype):
    """On any machine: the reference backend's rounding stays within a quarter of the bound in every GPU case
    (so a correct kernel passes with room), and each fault of ``FAULTS`` moves some output of every case
    it applies to by 0.1 or more and beyond the bound (so a wrong mask or page fails)."""
    kv_heads, group, head_dim = SHAPES[shape]
    for case, (prefix, new) in sorted(CASES.items()):
        for page_size in (1, 16):
            for seed in SEEDS:
                pool, batch, q, dense = make_case(prefix, new, page_size, kv_heads, group, head_dim, dtype,
                                                  seed=seed)
                ref = TorchReferenceBackend(pool, q.shape[1])
                ref.plan(batch)
                oracle = dense_attention(q, dense, prefix, new, group)
                assert assert_within_rounding(ref.run(q, 0), oracle, dtype, case) <= 0.25, case
                for fault in FAULTS:
                    if fault == "prefix ignored" and not any(prefix):
                        continue  # nothing to ignore
                    wrong = dense_attention(q, dense, prefix, new, group, fault=fault, page_size=page_size)
                    with pytest.raises(AssertionError):
                        assert_within_rounding(wrong, oracle, dtype)
                    assert (wrong - oracle).abs().max() >= 0.1, (case, fault, page_size, seed)


def test_auto_never_picks_flashinfer_for_what_it_cannot_run():
    """float32 (FlashInfer has no float32 kernels) and head dims outside 64/128/256 (``tiny-random``'s is 16):
    ``auto`` serves them on the PyTorch path and says why; asking for ``flashinfer`` is a clear error."""
    tiny_head_dim = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    assert tiny_head_dim not in FLASHINFER_HEAD_DIMS
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype, head_dim, says in [(torch.float32, 64, "bfloat16, float16"),
                                  (torch.bfloat16, tiny_head_dim, "64, 128, 256")]:
        pool = KVPool(1, 2, head_dim, num_slots=32, dtype=dtype, device=device)
        assert says in flashinfer_unavailable_reason(pool)
        with pytest.warns(UserWarning) if device == "cuda" else contextlib.nullcontext():
            backend = make_backend("auto", pool, 4)
        # the PyTorch path on a GPU; on a CPU the compiled kernels where they serve a 16-bit pool
        assert backend.name in (("torch-cascade",) if device == "cuda" else ("torch-cascade", "cpu"))
        with pytest.raises(FlashInferUnavailableError, match=says) as err:
            make_backend("flashinfer", pool, 4)
        assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)


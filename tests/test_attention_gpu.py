"""FlashInfer against the reference backend, per request (GPU only; skipped elsewhere).

Run on a GPU machine with ``bash scripts/gpu_check.sh``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from attention_cases import make_case

from radixkv.attention import TorchReferenceBackend, make_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (the gpu extra)"),
]

CASES = {
    "prefill without prefix": ([0, 0], [37, 64]),
    "prefix mid-page": ([21, 5], [19, 40]),
    "prefix page-aligned": ([32, 64], [16, 33]),
    "decodes": ([100, 17, 64], [1, 1, 1]),
    "mixed prefill, prefix prefill and decode": ([0, 48, 77, 9], [50, 20, 1, 1]),
}
TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_flashinfer_matches_reference(case, page_size, dtype):
    prefix, new = CASES[case]
    pool, batch, q, _ = make_case(prefix, new, page_size, num_kv_heads=2, group=4, head_dim=128, dtype=dtype,
                                  device="cuda")
    fi = make_backend("flashinfer", pool, q.shape[1])
    ref = TorchReferenceBackend(pool, q.shape[1])
    fi.plan(batch)
    ref.plan(batch)
    torch.testing.assert_close(fi.run(q, 0), ref.run(q, 0), **TOL[dtype])

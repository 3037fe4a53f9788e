"""A GPU's floors under the engine's figures, like the CPU's (``bench_engine.floors``), for ``bench_engine
--device cuda``.

``gpu_rates`` measures this GPU now: its memory read bandwidth, its bfloat16 GEMM rate, and the cost of one
kernel launch, eager and inside a CUDA graph. ``gpu_floors`` turns those rates and a model's shape
(``model_shape``) into a lower bound on each figure; it is arithmetic alone, tested on a CPU with given
rates. ``floor_rows`` sets our figures against them.
"""

from __future__ import annotations

import torch
from torch import nn

from radixkv.cpu.linear import PackedLinear
from radixkv.decode_graphs import capture

# The kernels a decode step needs at the least, for the launch bound: per layer, the two RMSNorms (residual
# add fused in), the QKV, output, gate-up and down GEMMs, RoPE, the KV store, attention and SiLU-and-multiply,
# as vLLM's fused kernels run a Llama layer; per step, the embedding, the final norm and the LM head.
KERNELS_PER_LAYER, KERNELS_PER_STEP = 10, 3
DECODE_BATCHES = (1, 8, 64)


def model_shape(model: nn.Module) -> dict:
    """What the floors (these and the CPU's ``bench_engine.floors``) read of a model: its linear weights
    (``params``, packed ones included; the LM head's share ``head``), bytes per weight and per K/V value, K/V
    bytes per token over all layers, and its layers."""
    cfg = model.config
    size = next(model.parameters()).element_size()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    return {"params": sum(m.in_features * m.out_features for m in linears), "head": cfg.hidden_size * cfg.vocab_size,
            "bytes": size, "kv_bytes_per_token": cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * size,
            "layers": cfg.num_layers}


def gpu_floors(shape: dict, rates: dict, context: int, prefill_tokens: int | None = None,
               decode_steps: int = 0) -> dict:
    """Lower bounds (milliseconds; ``end_to_end_s`` in seconds) from ``gpu_rates``' ``read_gb_s``,
    ``gemm_tflop_s``, ``launch_us_graph`` and ``launch_us_eager``. O(1).

    * ``decode_ms_b{B}`` (B in ``DECODE_BATCHES``), each request after ``context`` tokens: the most of one
      read of every linear weight and of the batch's K/V at the read bandwidth, the rows' linear FLOPs at the
      GEMM rate, and the step's kernels (``KERNELS_PER_LAYER`` x layers + ``KERNELS_PER_STEP``) at one graph
      launch each; each alone is a lower bound, so their maximum is.
    * ``prefill_ms_per_token``: its linear FLOPs, LM head left out (only the last token needs it).
    * ``end_to_end_s`` (given ``prefill_tokens``): those tokens plus ``decode_steps`` batch-8 steps.
    * ``launch_bound_ms_eager`` / ``_graph``: the step's kernels at one launch each, eager and replayed.
    """
    bandwidth, flop_rate = rates["read_gb_s"] * 1e9, rates["gemm_tflop_s"] * 1e12
    kernels = KERNELS_PER_LAYER * shape["layers"] + KERNELS_PER_STEP
    launches = {mode: kernels * rates[f"launch_us_{mode}"] / 1e3 for mode in ("eager", "graph")}
    weights = shape["params"] * shape["bytes"]

    def decode_ms(rows: int) -> float:
        memory = (weights + rows * context * shape["kv_bytes_per_token"]) / bandwidth
        return max(1e3 * memory, 1e3 * 2 * rows * shape["params"] / flop_rate, launches["graph"])

    out = {"prefill_ms_per_token": 1e3 * 2 * (shape["params"] - shape["head"]) / flop_rate,
           **{f"decode_ms_b{b}": decode_ms(b) for b in DECODE_BATCHES},
           "launch_bound_ms_eager": launches["eager"], "launch_bound_ms_graph": launches["graph"]}
    if prefill_tokens is not None:
        out["end_to_end_s"] = (prefill_tokens * out["prefill_ms_per_token"] + decode_steps * out["decode_ms_b8"]) / 1e3
    return out


def floor_rows(ours: dict, floor: dict, eager: dict | None = None) -> list[dict]:
    """Each figure both have: ours, its floor, ours / floor (1 is the floor itself), and where ``eager`` has
    it, the figure without graphs and eager / ours (the graphs' speed-up)."""
    rows = []
    for key in (*(f"decode_ms_b{b}" for b in DECODE_BATCHES), "prefill_ms_per_token", "end_to_end_s"):
        if key in ours and key in floor:
            row = {"figure": key, "ours": ours[key], "floor": floor[key], "ratio": ours[key] / floor[key]}
            if eager and key in eager:
                row |= {"eager": eager[key], "graphs_speedup": eager[key] / ours[key]}
            rows.append(row)
    return rows


def _best_ms(fn, repeats: int) -> float:
    """The best of ``repeats`` timed calls (after one untimed), in milliseconds on the GPU's own clock."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def gpu_rates(device: str = "cuda", repeats: int = 5, launches: int = 2000) -> dict:
    """This GPU now, the best of ``repeats`` runs each (a floor takes the best rate).

    ``read_gb_s``: a 1 GiB float32 sum (every byte read once). ``gemm_tflop_s``: an 8192-cubed bfloat16
    matmul. ``launch_us_eager``: ``launches`` one-element adds launched one by one, per add (the CPU's launch
    path, since the GPU finishes each long before the next arrives); ``launch_us_graph``: the same adds
    captured in one CUDA graph and replayed, per add.
    """
    with torch.cuda.device(device):
        x = torch.ones(256 << 20, device=device)
        read = x.numel() * x.element_size() / (_best_ms(x.sum, repeats) / 1e3)
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        gemm = 2 * 8192**3 / (_best_ms(lambda: a @ a, repeats) / 1e3)
        one = torch.zeros(1, device=device)

        def adds():
            for _ in range(launches):
                one.add_(1)

        eager = _best_ms(adds, repeats)
        graph, _ = capture(adds, device)
        replayed = _best_ms(graph.replay, repeats)
    return {"read_gb_s": read / 1e9, "gemm_tflop_s": gemm / 1e12, "launch_us_eager": 1e3 * eager / launches,
            "launch_us_graph": 1e3 * replayed / launches}

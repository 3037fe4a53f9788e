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

3. this machine's memory read bandwidth and GEMM rate, measured in the same
   run, and the floors they put under the micro-figures and the end-to-end
   time (``machine_rates``, ``floors``): the machine class comes with
   different CPUs and memory phases, and a target can be out of reach on one;

and prints our figures, this machine's floors and the targets that need no
peer. ``--peer PATH`` reads the JSON that vLLM's CPU build wrote on this
machine (``../shared/peers/vllm_cpu_multiturn.py --out PATH``; how to set
it up: ``../shared/peers/README.md``) and prints each figure as a ratio,
ours over the peer's: end to end (radix against prefix caching on, none
against off), mean TTFT per turn, decode at batch 1 and 8, prefill per
token; the engine's speed targets are stated as those ratios. No peer
figure lives in this file: run the peer beside us, in the same hour. Writes
``results/bench_engine.json``.

``--device cuda`` (``gpu_main``) runs the same workload and micro-figures on a
GPU, with FlashInfer and with the PyTorch backend on the same GPU, decode at
batch 1, 8 and 64 both replayed from CUDA graphs (as the engine runs it) and
eager, ``transformers``' figures, and this GPU's floors under ours
(``experiments.gpu_floors``: memory read bandwidth, bfloat16 GEMM rate, a
kernel launch's cost eager and in a graph), and writes
``results/bench_engine-cuda.json``; ``scripts/gpu_check.sh`` runs it in full
(``--model smollm2-135m-random`` where the GGUF file is not installed);
``--quick`` is a short run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from experiments.common import environment, parser, run_cli, table, with_ext
from experiments.gpu_floors import model_shape
from experiments.multiturn import CACHES as MULTITURN_CACHES
from experiments.multiturn import parse_args as multiturn_args
from experiments.multiturn import run_cache, summarize
from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch
from radixkv.config import DTYPES
from radixkv.cpu.linear import linear_compute_dtype
from radixkv.forward import build_forward
from radixkv.memory.kv_pool import KVPool
from radixkv.model import load_model
from radixkv.model.loader import resolve_dtype
from radixkv.model.step import run_step
from radixkv.timing import interleaved, seconds, timed

CACHES = tuple(c for c in MULTITURN_CACHES if c != "hash-v0")  # the v0 baseline is hash_vs_radix's, not this bench's

PEER_KEYS = {"on": "vllm_cpu_prefix_on", "off": "vllm_cpu_prefix_off"}  # vllm_cpu_multiturn.py's result keys
# The targets against the peer, as ratios ours / peer's: (figure, bound); a ratio at or below the bound is met.
PEER_TARGETS = (("end_to_end_s", 1.0), ("decode_ms_b1", 1.2), ("decode_ms_b8", 1.2))


def ours_micro(model, context: int, repeats: int, rng, backend: str = "auto", batches: tuple[int, ...] = (1, 8),
               graphs: bool = False) -> dict:
    """Prefill of ``context`` tokens and decode steps at each of ``batches`` (1 and 8 at least) through the
    engine's attention backend, on the model's device (each timed call waits for a GPU to finish); with
    ``graphs`` (FlashInfer on CUDA), each decode replayed from its CUDA graph too (``decode_ms_b{B}_graphs``)."""
    cfg = model.config
    p = next(model.parameters())
    rows = max(batches)
    slots_total = (rows + 1) * (context + 8) + 64
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=slots_total + int(graphs), dtype=p.dtype,
                  device=p.device)  # with graphs, the last slot is their padding page's (of one slot)
    forward, attn = build_forward(model, pool, backend)  # as the engine serves it
    alloc = SlotAllocator(slots_total)
    toks = rng.integers(3, cfg.vocab_size, context).tolist()
    seqs = [alloc.alloc(context + 1) for _ in range(max(rows, 8))]

    def step(tokens, batch: AttentionBatch):
        def run():
            run_step(forward, pool, attn, tokens, batch)
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)
        return run

    prefill = timed(step([toks], AttentionBatch([0], [context], [seqs[0][:context]])), repeats)
    for s in seqs[1:]:  # every context filled, so decode reads real K/V
        step([toks], AttentionBatch([0], [context], [s[:context]]))()

    def decode(rows: list[np.ndarray]):
        return step([[toks[0]]] * len(rows), AttentionBatch([context] * len(rows), [1] * len(rows), rows))

    shared = [np.concatenate([seqs[0][:500], s[500:]]) for s in seqs[:8]]  # a 500-token system prompt in common
    steps = {**{f"decode_ms_b{b}": decode(seqs[:b]) for b in batches}, "decode_ms_b8_shared500": decode(shared)}
    if graphs:
        from radixkv.decode_graphs import DecodeGraphs

        captured = DecodeGraphs(model, pool, attn, rows)

        def replayed(seq_slots: list[np.ndarray]):
            batch = AttentionBatch([context] * len(seq_slots), [1] * len(seq_slots), seq_slots)

            def run():
                captured.prepare([toks[0]] * len(seq_slots), batch)
                captured.replay()
                torch.cuda.synchronize(p.device)
            return run

        steps |= {f"decode_ms_b{b}_graphs": replayed(seqs[:b]) for b in batches}
    return {"prefill_ms_per_token": 1e3 * prefill / context,
            **{k: 1e3 * v for k, v in interleaved(steps, rounds=4, per_round=repeats).items()}}


def transformers_micro(hf, context: int, repeats: int, rng) -> dict:
    """The same three figures for ``transformers``' own forward with its dynamic KV cache."""
    toks = torch.as_tensor(rng.integers(3, hf.config.vocab_size, (8, context)), device=hf.device)
    done = torch.cuda.synchronize if toks.is_cuda else lambda: None  # a GPU's figure waits for the GPU
    out = {}
    with torch.inference_mode():
        prefill = timed(lambda: (hf(toks[:1], use_cache=False), done()), repeats)
        out["prefill_ms_per_token"] = 1e3 * prefill / context
        for b in (1, 8):
            past = hf(toks[:b], use_cache=True).past_key_values

            def step(b=b, past=past):
                hf(toks[:b, :1], past_key_values=past, use_cache=True)
                past.crop(-1)  # back to the same context for every repeat
                done()

            out[f"decode_ms_b{b}"] = 1e3 * timed(step, repeats * 4)
    return out


def machine_rates(model: nn.Module, repeats: int = 5, rows: int = 1024) -> dict:
    """This machine now, for ``floors``: the best of ``repeats`` runs each, since a floor takes the best rate.

    ``read_gb_s``: memory read bandwidth, a 512 MB float32 sum (every byte
    read once). ``gemm_gflop_s``: the best of PyTorch's matmul and (where the
    build has it) oneDNN's packed linear, in the dtype ``pack_linears``
    multiplies ``model``'s weights in, at its largest prefill shape (``rows``
    tokens through ``[hidden] -> [2 x intermediate]``).
    """
    def best(fn) -> float:
        fn()
        return min(seconds(fn) for _ in range(repeats))

    x = torch.ones(128 << 20)
    read = x.numel() * x.element_size() / best(x.sum)
    del x
    cfg = model.config
    dtype = linear_compute_dtype(model) or next(model.parameters()).dtype
    a = torch.randn(rows, cfg.hidden_size).to(dtype)
    w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size).to(dtype)
    gemm_s = best(lambda: torch.nn.functional.linear(a, w))
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        gemm_s = min(gemm_s, best(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")))
    return {"read_gb_s": read / 1e9, "gemm_gflop_s": 2 * a.numel() * w.shape[0] / gemm_s / 1e9,
            "gemm_dtype": str(dtype).removeprefix("torch.")}


def best_rates(*measured: dict) -> dict:
    """The best of each rate over several ``machine_rates`` results (taken on both sides of the micro-figures),
    so that a slow moment during one probe cannot put a floor above what the engine measured."""
    return measured[0] | {k: max(m[k] for m in measured) for k in ("read_gb_s", "gemm_gflop_s")}


def floors(model: nn.Module, rates: dict, context: int, prefill_tokens: int | None = None,
           decode_steps: int = 0) -> dict:
    """Lower bounds on the micro-figures (same keys, milliseconds) from ``machine_rates``.

    A prefill token costs at least its linear layers' FLOPs at the GEMM rate
    (attention and the LM head left out); a decode step with ``context``
    tokens per request at least one read of every linear weight (LM head
    included; at batch 1, layers with exact 4-bit codes at their coded size,
    as ``coded_linear`` reads them) and of its K/V at the read bandwidth, and
    at least its rows' linear FLOPs (LM head included, attention left out)
    at the GEMM rate, whichever is more: on a CPU with a slow FMA (a Zen 1
    runs 44 GFLOP/s a core) batch 8 is bound by arithmetic, not memory.
    ``end_to_end_s`` (given ``prefill_tokens``) adds ``decode_steps`` batch-8
    steps to those prefill tokens: the main job's decode contexts average
    about ``context``.
    """
    shape = model_shape(model)
    params, head, size, kv_per_token = shape["params"], shape["head"], shape["bytes"], shape["kv_bytes_per_token"]
    bandwidth = rates["read_gb_s"] * 1e9

    saved_b1 = sum(m.in_features * m.out_features * size - m.coded.nbytes for m in model.modules()
                   if getattr(m, "coded", None) is not None and m.coded_rows >= 1)  # linears with 4-bit codes

    flop_rate = rates["gemm_gflop_s"] * 1e9

    def decode_ms(rows: int, kv_tokens: int, saved: int = 0) -> float:
        memory = (params * size - saved + kv_per_token * kv_tokens) / bandwidth
        return 1e3 * max(memory, 2 * rows * params / flop_rate)

    out = {"prefill_ms_per_token": 1e3 * 2 * (params - head) / flop_rate,
           "decode_ms_b1": decode_ms(1, context, saved_b1), "decode_ms_b8": decode_ms(8, 8 * context),
           "decode_ms_b8_shared500": decode_ms(8, min(500, context) + 8 * max(0, context - 500))}
    if prefill_tokens is not None:
        out["end_to_end_s"] = (prefill_tokens * out["prefill_ms_per_token"] + decode_steps * out["decode_ms_b8"]) / 1e3
    return out


def read_peer(path: str | Path) -> dict:
    """The peer's figures from the JSON ``vllm_cpu_multiturn.py --out PATH`` wrote, under this bench's names:
    ``end_to_end_s`` (prefix caching on; ``end_to_end_no_cache_s`` off, where it ran), ``ttft_mean_t{k}``
    and ``cached_per_req_t{k}`` per turn, ``prefill_ms_per_token``, ``decode_ms_b1``, ``decode_ms_b8``
    (medians over its repeats), and ``source`` (version, dtype, workload digest). ``ValueError`` when the
    file is missing or is not that script's output."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--peer {path}: no such file; write it with ../shared/peers/vllm_cpu_multiturn.py "
                         "--out PATH (../shared/peers/README.md)")
    try:
        data = json.loads(path.read_text())
        on = data[PEER_KEYS["on"]]
        summary, micro = on["summary"], on["micro"]["summary"]
        out = {"end_to_end_s": summary["total_s_median"],
               "prefill_ms_per_token": micro["prefill_ms_per_tok_engine_median"],
               "decode_ms_b1": micro["decode_bs1_ms_per_step_median"],
               "decode_ms_b8": micro["decode_bs8_ms_per_step_median"],
               "source": {k: on.get(k) for k in ("vllm_version", "dtype", "block_size", "workload_digest")}}
        for turn in summary["per_turn"]:
            out[f"ttft_mean_t{turn['turn']}"] = turn["mean_ttft_s_median"]
            out[f"cached_per_req_t{turn['turn']}"] = float(np.mean(turn["cached_per_request"]))
        off = (data.get(PEER_KEYS["off"]) or {}).get("summary")
        if off:
            out["end_to_end_no_cache_s"] = off["total_s_median"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--peer {path}: not the output of vllm_cpu_multiturn.py --out ({type(e).__name__}: "
                         f"{e})") from None
    return out


def ratios(summary: dict[str, dict], ours: dict, peer: dict) -> list[dict]:
    """Each figure the peer has: ours, the peer's, and ours / peer's (below 1: we are faster)."""
    radix, none = summary["radix"], summary["none"]
    rows = [("end_to_end_s", radix["end_to_end_s"]), ("end_to_end_no_cache_s", none["end_to_end_s"])]
    rows += [(k, radix[k]) for k in sorted(radix) if k.startswith("ttft_mean_t")]
    rows += [(k, ours[k]) for k in ("prefill_ms_per_token", "decode_ms_b1", "decode_ms_b8")]
    return [{"figure": k, "ours": v, "peer": peer[k], "ratio": v / peer[k]} for k, v in rows
            if k in peer and peer[k]]


def targets(summary: dict[str, dict], ours: dict, floor: dict | None = None, peer: dict | None = None) -> list[dict]:
    """Each target: our figure, the bound it must meet, whether it does, this machine's floor (or None), and
    whether that floor leaves the bound reachable here. Against a ``peer`` (``read_peer``) the speed
    targets are ratios ours / peer's, and so are their floors (this machine's floor / the peer's figure)."""
    radix, hash_, none = summary["radix"], summary["hash"], summary["none"]
    floor = floor or {}
    rows = [  # (target, ours, bound, met, floor)
        ("radix mean TTFT turns>=2 / none's <= 1/3", radix["ttft_mean_later"] / none["ttft_mean_later"], 1 / 3,
         radix["ttft_mean_later"] <= none["ttft_mean_later"] / 3, None),
        ("radix prefill tokens <= hash's", radix["prefill_tokens"], hash_["prefill_tokens"],
         radix["prefill_tokens"] <= hash_["prefill_tokens"], None),
        ("engine overhead share of step time < 10%", radix["overhead_share"], 0.10, radix["overhead_share"] < 0.10,
         None),
    ]
    if peer is not None:
        mine = {"end_to_end_s": radix["end_to_end_s"], **ours}
        for key, bound in PEER_TARGETS:
            ratio = mine[key] / peer[key]
            ratio_floor = floor[key] / peer[key] if key in floor else None
            rows.append((f"{key} / vLLM-CPU's <= {bound:g}", ratio, bound, ratio <= bound, ratio_floor))
        turns = sorted(k for k in radix if k.startswith("cached_per_req_t") and k in peer)
        cached, theirs = [radix[k] for k in turns], [peer[k] for k in turns]
        rows.append(("radix cached tokens per request > vLLM-CPU's (each turn)", cached, theirs,
                     all(c > v for c, v in zip(cached, theirs, strict=True)), None))
    # reachable: False where this machine's floor is already above the bound, so no code can meet it here
    return [{"target": t, "ours": o, "bound": b, "met": bool(m), "floor": f,
             "reachable": f is None or f <= b} for t, o, b, m, f in rows]


def fmt(x) -> str:
    if isinstance(x, list):
        return "/".join(f"{v:.0f}" for v in x)
    return f"{x:.3g}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags as given; ``main`` resolves ``--dtype`` once the device is known."""
    p = parser(__doc__.splitlines()[0], "results/bench_engine")
    p.add_argument("--model", default="smollm2-135m", help="a built-in name, a HF directory or a .gguf file")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the model's own (SmolLM2-135M: bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--context", type=int, default=1024, help="tokens of context for the micro-figures")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per micro-figure (medians)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' micro-figures")
    p.add_argument("--peer", default=None,
                   help="the JSON of ../shared/peers/vllm_cpu_multiturn.py --out PATH, run on this machine: "
                        "print ours / the peer's for each figure")
    p.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N for the GPU run (gpu_main)")
    p.add_argument("--quick", action="store_true",
                   help="with --device cuda: 4 sessions x 2 turns, 512-token contexts, 2 repeats (the GPU check)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.dtype = resolve_dtype(args.dtype, args.model, args.device)
    if args.device != "cpu":
        return gpu_main(args)
    peer = read_peer(args.peer) if args.peer else None  # a bad file fails before the long run
    torch.set_num_threads(args.threads)
    mt = multiturn_args(["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed)])
    summary = {}
    for cache in CACHES:
        rows, wall, _ = run_cache(cache, mt)
        summary[cache] = summarize(cache, rows, wall)
    cols = ["cache", "end_to_end_s", "prefill_tokens", "hit_rate", *[f"ttft_mean_t{t}" for t in range(1, 5)],
            *[f"cached_per_req_t{t}" for t in range(1, 5)], "overhead_share"]
    print(table(list(summary.values()), cols, {c: ".3g" for c in cols if c != "cache"}))
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), keep_hf=not args.no_transformers)
    rng = np.random.default_rng(args.seed)
    hf = loaded.hf_model  # before ours_micro packs our copy of the weights
    before = machine_rates(loaded.model, args.repeats)
    micro = {"ours": ours_micro(loaded.model, args.context, args.repeats, rng)}
    rates = best_rates(before, machine_rates(loaded.model, args.repeats))
    floor = floors(loaded.model, rates, args.context, summary["radix"]["prefill_tokens"],  # packed: codes known
                   mt.turns * (mt.max_new_tokens - 1))
    if hf is not None:
        micro["transformers"] = transformers_micro(hf.to(getattr(torch, args.dtype)), args.context, args.repeats, rng)
    if peer is not None:
        micro["vllm_cpu_peer"] = {k: peer[k] for k in ("prefill_ms_per_token", "decode_ms_b1", "decode_ms_b8")}
    micro["floor_here"] = {k: v for k, v in floor.items() if k != "end_to_end_s"}
    figs = ["prefill_ms_per_token", "decode_ms_b1", "decode_ms_b8", "decode_ms_b8_shared500"]
    print(table([{"engine": k, **v} for k, v in micro.items()], ["engine", *figs], {c: ".3g" for c in figs}))
    print(f"this machine now: memory reads {rates['read_gb_s']:.1f} GB/s, {rates['gemm_dtype']} GEMM "
          f"{rates['gemm_gflop_s']:.0f} GFLOP/s (floor_here: the micro-figures' lower bounds at these rates)")
    compared = ratios(summary, micro["ours"], peer) if peer is not None else []
    if compared:
        print(f"against the peer ({peer['source']}): ours / peer's, below 1 is faster")
        print(table(compared, ["figure", "ours", "peer", "ratio"], {c: ".3g" for c in ("ours", "peer", "ratio")}))
    else:
        print("no --peer: our figures and this machine's floors only (../shared/peers/README.md runs the peer)")
    checks = targets(summary, micro["ours"], floor, peer)
    for c in checks:
        here = "" if c["floor"] is None else f", floor here {fmt(c['floor'])}"
        here += "" if c["reachable"] else " (out of reach on this machine: its floor is above the bound)"
        print(f"[{'met' if c['met'] else 'MISSED':6s}] {c['target']}: ours {fmt(c['ours'])}, bound {fmt(c['bound'])}"
              f"{here}")
    result = {"config": vars(args), "env": environment(), "machine": rates, "floors": floor, "multiturn": summary,
              "micro": micro, "peer": peer, "ratios": compared, "targets": checks}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print("wrote", out)
    return result


GPU_BACKENDS = ("flashinfer", "torch")


def gpu_main(args) -> dict:
    """The main job's workload and the micro-figures on a GPU, with FlashInfer (decode replayed from CUDA graphs,
    as the engine runs it, and eager) and with the PyTorch backend on the same GPU, ``transformers``' figures,
    and this GPU's floors under ours (``experiments.gpu_floors``): absolute times (a dedicated GPU is steady)."""
    from experiments.gpu_floors import DECODE_BATCHES, floor_rows, gpu_floors, gpu_rates

    if args.quick:
        args.context, args.repeats = min(args.context, 512), min(args.repeats, 2)
    shape = ["--sessions", "4", "--turns", "2"] if args.quick else []
    summary, micro = {}, {}
    before = gpu_rates(args.device, args.repeats)
    # one copy of the model for the micro-figures: on a GPU build_forward serves it as it is, unchanged
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device,
                        keep_hf=not args.no_transformers)
    for backend in GPU_BACKENDS:
        mt = multiturn_args(["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed), "--device",
                             args.device, "--attention-backend", backend, *shape])
        for cache in CACHES:
            rows, wall, _ = run_cache(cache, mt)
            summary[f"{backend}/{cache}"] = summarize(cache, rows, wall) | {"backend": backend}
        micro[backend] = ours_micro(loaded.model, args.context, args.repeats, np.random.default_rng(args.seed),
                                    backend, DECODE_BATCHES, graphs=backend == "flashinfer")
    eager = multiturn_args(["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed), "--device",
                            args.device, "--attention-backend", "flashinfer", "--no-cuda-graphs", "--caches", "radix",
                            *shape])
    rows, wall, _ = run_cache("radix", eager)  # the main job end to end with every decode eager
    summary["flashinfer-eager/radix"] = summarize("radix", rows, wall) | {"backend": "flashinfer-eager"}
    if loaded.hf_model is not None:
        hf = loaded.hf_model.to(device=args.device, dtype=getattr(torch, args.dtype))
        micro["transformers"] = transformers_micro(hf, args.context, args.repeats, np.random.default_rng(args.seed))
    after = gpu_rates(args.device, args.repeats)
    rates = {k: max(before[k], after[k]) if k.endswith("_s") else min(before[k], after[k]) for k in before}
    radix = summary["flashinfer/radix"]
    floor = gpu_floors(model_shape(loaded.model), rates, args.context, radix["prefill_tokens"],
                       mt.turns * (mt.max_new_tokens - 1))
    fi = micro["flashinfer"]
    ours = {"prefill_ms_per_token": fi["prefill_ms_per_token"], "end_to_end_s": radix["end_to_end_s"],
            **{f"decode_ms_b{b}": fi[f"decode_ms_b{b}_graphs"] for b in DECODE_BATCHES}}
    compared = floor_rows(ours, floor, eager={"end_to_end_s": summary["flashinfer-eager/radix"]["end_to_end_s"],
                                              **{f"decode_ms_b{b}": fi[f"decode_ms_b{b}"] for b in DECODE_BATCHES}})
    turns = range(1, mt.turns + 1)
    cols = ["backend", "cache", "end_to_end_s", "prefill_tokens", "hit_rate", *[f"ttft_mean_t{t}" for t in turns],
            "overhead_share"]
    print(table(list(summary.values()), cols, {c: ".3g" for c in cols if c not in ("backend", "cache")}))
    figs = ["prefill_ms_per_token", *(f"decode_ms_b{b}{g}" for g in ("", "_graphs") for b in DECODE_BATCHES),
            "decode_ms_b8_shared500"]
    print(table([{"engine": k, **v} for k, v in micro.items()], ["engine", *figs], {c: ".3g" for c in figs}))
    device = torch.cuda.get_device_name(torch.device(args.device))
    print(f"on {device}, {args.dtype}, {args.context}-token contexts: memory reads {rates['read_gb_s']:.0f} GB/s, "
          f"bfloat16 GEMM {rates['gemm_tflop_s']:.0f} TFLOP/s, a kernel launch {rates['launch_us_eager']:.2f} us "
          f"eager, {rates['launch_us_graph']:.2f} us in a graph")
    print(table(compared, ["figure", "ours", "floor", "ratio", "eager", "graphs_speedup"],
                {c: ".3g" for c in ("ours", "floor", "ratio", "eager", "graphs_speedup")}))
    result = {"config": vars(args), "env": environment() | {"gpu": device}, "machine": rates, "floors": floor,
              "multiturn": summary, "micro": micro, "floor_rows": compared}
    out = with_ext(args.out + ("-cuda" if args.out == "results/bench_engine" else ""), ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print("wrote", out)
    return result


if __name__ == "__main__":
    run_cli(main)

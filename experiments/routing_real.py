"""Routers on real replicas: the main job's multi-turn chat over more sessions than one replica's cache holds.

Two (``--replicas``) ``smollm2-135m`` engines as Ray actors (``radixkv.cluster.Cluster``), one CPU each,
serve ``--sessions`` conversations of ``--turns`` turns (a shared system prompt, then each turn's user
message; every prompt is the whole history, answers included). A turn's prompts are sent together, in a
seeded shuffled order (the same for every router), and the next turn waits for them. Each router gets a
fresh cluster. Per router: hit rate (cached prompt tokens over prompt tokens), TTFT p50 / p99 (seconds
from a request's arrival at its replica to its first token; a turn's requests arrive together, so queueing
counts), wall seconds and requests per replica. Rows and the config go to ``--out``.

    python -m experiments.routing_real --routers round_robin,affinity
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from experiments.common import HelpFormatter, add_settings, names_from
from experiments.multiturn import VOCAB
from radixkv.routing import ROUTERS
from radixkv.workloads import TokenSource


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a built-in name, a HF directory or a .gguf file")
    p.add_argument("--routers", default="round_robin,affinity", help=f"comma-separated subset of {sorted(ROUTERS)}")
    p.add_argument("--replicas", type=int, default=2, help="engines, one Ray actor each")
    p.add_argument("--sessions", type=int, default=16, help="conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-tokens", type=int, default=500, help="shared system prompt length")
    p.add_argument("--user-tokens", type=int, default=150, help="new user tokens per turn")
    p.add_argument("--max-new-tokens", type=int, default=32, help="generated tokens per turn")
    add_settings(p, "capacity_tokens", capacity_tokens=6144)  # about half the sessions' histories per replica
    p.add_argument("--cpus-per-replica", type=int, default=1, help="Ray CPUs and torch threads per replica")
    p.add_argument("--seed", type=int, default=0, help="seed for the workload and the turn order")
    p.add_argument("--out", default="docs/figures/routing_real",
                   help="results path without extension: writes .jsonl and .png")
    return p


def run_router(router: str, args) -> list[dict]:
    """Every turn of every session through a fresh cluster behind ``router``: one row per request."""
    from radixkv import SamplingParams
    from radixkv.cluster import Cluster

    src = TokenSource(args.seed, vocab_size=VOCAB.get(args.model, 512))
    system = src.span(args.system_tokens).tolist()
    users = [[src.span(args.user_tokens).tolist() for _ in range(args.turns)] for _ in range(args.sessions)]
    order_rng = np.random.default_rng(args.seed)
    params = {"capacity_tokens": args.capacity_tokens} if router == "affinity" else None
    history = [list(system) for _ in range(args.sessions)]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    with Cluster(args.model, replicas=args.replicas, router=router, router_params=params,
                 num_cpus_per_replica=args.cpus_per_replica, kv_cache_tokens=args.capacity_tokens,
                 seed=args.seed) as cluster:
        cluster.generate([system], SamplingParams(max_new_tokens=1))  # warm-up, as the main job does
        t0 = time.perf_counter()
        for turn in range(args.turns):
            order = order_rng.permutation(args.sessions)
            prompts = [history[s] + users[s][turn] for s in order]
            first = len(cluster.decisions)
            outs = cluster.generate(prompts, sp)
            for k, (s, out) in enumerate(zip(order, outs, strict=True)):
                history[s] = prompts[k] + out.token_ids
                rows.append({"router": router, "session": int(s), "turn": turn,
                             "replica": cluster.decisions[first + k], "prompt_tokens": out.num_prompt_tokens,
                             "cached_tokens": out.num_cached_tokens, "ttft": out.ttft, "latency": out.latency})
        wall = time.perf_counter() - t0
        cluster.check_idle()
    for r in rows:
        r["wall"] = wall
    return rows


def summarize(rows: list[dict]) -> dict:
    ttft = np.array([r["ttft"] for r in rows])
    prompt = sum(r["prompt_tokens"] for r in rows)
    per = np.bincount([r["replica"] for r in rows])
    return {"router": rows[0]["router"], "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt,
            "ttft_p50": float(np.median(ttft)), "ttft_p99": float(np.percentile(ttft, 99)),
            "wall": rows[0]["wall"], "requests_per_replica": per.tolist(),
            "computed_per_replica": [sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows if r["replica"] == i)
                                     for i in range(len(per))]}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    routers = names_from(args.routers, ROUTERS, "--routers")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args), indent=2) + "\n")
    summaries = []
    with open(out / "rows.jsonl", "w") as f:
        for router in routers:
            rows = run_router(router, args)
            f.writelines(json.dumps(r) + "\n" for r in rows)
            summaries.append(summarize(rows))
            print(json.dumps(summaries[-1]), flush=True)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    print("| router | hit rate | TTFT p50 (s) | TTFT p99 (s) | wall (s) | requests per replica |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for s in summaries:
        print(f"| {s['router']} | {s['hit_rate']:.3f} | {s['ttft_p50']:.2f} | {s['ttft_p99']:.2f} | {s['wall']:.1f} "
              f"| {s['requests_per_replica']} |")
    return summaries


if __name__ == "__main__":
    main()

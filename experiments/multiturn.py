"""The main job: multi-turn chat served by none / hash / radix prefix caching on a real model.

``python -m experiments.multiturn`` (defaults: SmolLM2-135M in bfloat16 on the
CPU, 2 threads). A shared system prompt, several sessions, several turns;
each turn's prompt is the whole history, previous answers included, plus new
user tokens; turn k of every session is served together. The same workload
and KV budget go through every cache. Prints a table per cache, the ratios
against ``none``, writes ``results/multiturn-<timestamp>.jsonl`` (one row per
request, each with the full config) and a PNG of TTFT by turn index.
"""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import environment, parser, save_figure, table, write_rows  # noqa: E402
from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.workloads import TokenSource  # noqa: E402


def run_cache(cache: str, args, system: np.ndarray, user_turns: list[list[np.ndarray]]) -> tuple[list[dict], float]:
    """Serve every turn of every session through one engine; rows per request and wall seconds."""
    llm = LLM(args.model, prefix_cache=cache, page_size=args.page_size, block_size=args.block_size,
              kv_cache_tokens=args.kv_cache_tokens, eviction_policy=args.eviction_policy,
              schedule_policy=args.schedule_policy, chunked_prefill_size=args.chunked_prefill_size,
              dtype=args.dtype, seed=args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    history = [list(system) for _ in range(args.sessions)]
    rows = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        prompts = [history[s] + user_turns[s][turn].tolist() for s in range(args.sessions)]
        outs = llm.generate(prompts, params)
        for s, out in enumerate(outs):
            history[s] = prompts[s] + out.token_ids
            rows.append({"cache": cache, "session": s, "turn": turn, "prompt_tokens": out.num_prompt_tokens,
                         "cached_tokens": out.num_cached_tokens, "generated": len(out.token_ids),
                         "ttft": out.ttft, "latency": out.latency})
    wall = time.perf_counter() - t0
    stats = llm.stats()
    for r in rows:
        r.update(engine_stats=stats, config=llm.config.to_dict())
    return rows, wall


def summarize(cache: str, rows: list[dict], wall: float) -> dict:
    sel = [r for r in rows if r["cache"] == cache]
    prompt = sum(r["prompt_tokens"] for r in sel)
    cached = sum(r["cached_tokens"] for r in sel)
    out = {"cache": cache, "end_to_end_s": wall, "hit_rate": cached / prompt, "prefill_tokens": prompt - cached,
           "throughput_tok_s": sum(r["generated"] for r in sel) / wall}
    for t in sorted({r["turn"] for r in sel}):
        ttft = np.array([r["ttft"] for r in sel if r["turn"] == t])
        out[f"ttft_mean_t{t + 1}"] = float(ttft.mean())
        out[f"cached_per_req_t{t + 1}"] = float(np.mean([r["cached_tokens"] for r in sel if r["turn"] == t]))
    ttft_all = np.array([r["ttft"] for r in sel])
    out.update(ttft_p50=float(np.median(ttft_all)), ttft_p99=float(np.percentile(ttft_all, 99)))
    return out


def plot(rows: list[dict], caches: list[str]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for cache in caches:
        turns = sorted({r["turn"] for r in rows if r["cache"] == cache})
        ax.plot([t + 1 for t in turns], [np.mean([r["ttft"] for r in rows if r["cache"] == cache and r["turn"] == t])
                                          for t in turns], marker="o", label=cache)
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Time to first token by turn index")
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/multiturn")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--caches", default="none,hash,radix")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--user-tokens", type=int, default=150)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--eviction-policy", default="lru")
    p.add_argument("--schedule-policy", default="lpm")
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = 49152 if args.model == "smollm2-135m" else 512
    src = TokenSource(args.seed, vocab_size=vocab)
    system = src.span(args.system_tokens)
    user_turns = [[src.span(args.user_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    caches = args.caches.split(",")
    rows, summary = [], []
    for cache in tqdm(caches, desc="caches"):
        cache_rows, wall = run_cache(cache, args, system, user_turns)
        rows += cache_rows
        summary.append(summarize(cache, cache_rows, wall))
    base = next((s for s in summary if s["cache"] == "none"), None)
    for s in summary:
        if base:
            s["speedup_vs_none"] = base["end_to_end_s"] / s["end_to_end_s"]
    turns = range(1, args.turns + 1)
    cols = ["cache", "end_to_end_s", "hit_rate", "prefill_tokens", "throughput_tok_s", "ttft_p50", "ttft_p99",
            *[f"ttft_mean_t{t}" for t in turns], *[f"cached_per_req_t{t}" for t in turns]]
    if base:
        cols.append("speedup_vs_none")
    print(table(summary, cols, {c: ".2f" for c in cols if c not in ("cache", "prefill_tokens")}))
    out = args.out if args.out != "results/multiturn" else f"results/multiturn-{time.strftime('%Y%m%d-%H%M%S')}"
    for r in rows:
        r.update(args=vars(args), env=environment())
    print("wrote", write_rows(out, rows + [{"summary": summary, "args": vars(args)}]),
          save_figure(plot(rows, caches), out))
    return summary


if __name__ == "__main__":
    main()

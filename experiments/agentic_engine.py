"""``experiments.agentic --engine``: a few agentic sessions through the real engine, and the simulator's
prediction of the same run.

The sessions are scaled down to fit a small model's context: each 64-token block of a prompt becomes one
token (its global block id hashed into the vocabulary, so equal blocks are equal tokens), a partial last
block one token of its own; pauses are removed. A session's streams stay closed loops: a request is added
to the engine (``add_request``, then ``step`` until it finishes) once the previous request of its stream
has finished. Each session contributes its leading requests whose scaled prompt fits ``max_prompt``
tokens. The simulator then replays the same prompts, output lengths and parent links under the engine's
budgets (``preemption=True``: memory grows as the engine's does); it predicts each request's hit exactly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from experiments.common import table, write_rows
from radixkv import LLM, SamplingParams
from radixkv.sim import simulate
from radixkv.workloads import Request
from radixkv.workloads import agentic as agentic_workload


def scaled_requests(requests: list[Request], vocab: int, max_prompt: int, per_session: int) -> list[Request]:
    """Each session's first ``per_session`` requests (in ``rid`` order) whose scaled prompt fits ``max_prompt``
    tokens and whose parent was kept, one token per block (see the module doc), no pauses."""
    kept: dict[int, int] = {}  # old rid -> new rid
    count: dict[object, int] = {}
    out: list[Request] = []
    for r in requests:
        if count.get(r.session, 0) >= per_session or (r.parent is not None and r.parent not in kept):
            continue
        ids = r.prompt.block_ids()
        tokens = [_token(int(b), vocab) for b in ids] + ([_token(-(r.rid + 1), vocab)] if r.prompt.tail else [])
        if not 2 <= len(tokens) <= max_prompt:
            continue
        kept[r.rid] = len(out)
        count[r.session] = count.get(r.session, 0) + 1
        out.append(Request(0.0, r.session, np.asarray(tokens, dtype=np.int64), r.output_len, rid=len(out),
                           parent=None if r.parent is None else kept[r.parent], meta=dict(r.meta)))
    return out


def _token(key: int, vocab: int) -> int:
    """A token id in ``[3, vocab)`` for a block id (or, negative, a request's own partial block)."""
    digest = hashlib.blake2b(key.to_bytes(16, "little", signed=True), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab - 3)


def run_engine(llm: LLM, requests: list[Request], max_new_tokens: int) -> list[int]:
    """Serve ``requests`` on ``llm`` as closed loops (a request is added once its parent finished; pauses
    removed): each request's cached prompt tokens, in ``rid`` order. Outputs are ``max_new_tokens`` long."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    children: dict[int, list[int]] = {}
    for r in requests:
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r.rid)
    engine_id: dict[int, int] = {}
    hits: dict[int, int] = {}

    def send(rid: int) -> None:
        engine_id[llm.add_request(requests[rid].prompt.tolist(), params)] = rid

    for r in requests:
        if r.parent is None:
            send(r.rid)
    while llm.has_unfinished():
        ready = []
        for out in llm.step():
            rid = engine_id[out.request_id]
            hits[rid] = out.num_cached_tokens
            ready += children.get(rid, [])
        for child in sorted(ready):  # as the simulator's feed sends requests ready at one time: by rid
            send(child)
    llm.check_idle()
    return [hits[r.rid] for r in requests]


def engine_slice(requests: list[Request], model: str, sessions: int, max_prompt: int, per_session: int,
                 kv_cache_tokens: int, max_new_tokens: int = 8) -> list[dict]:
    """One row per request of the slice: the engine's hit, the simulator's prediction, whether they agree."""
    first = list(dict.fromkeys(r.session for r in requests))[:sessions]
    llm = LLM(model, prefix_cache="radix", page_size=1, kv_cache_tokens=kv_cache_tokens, schedule_policy="fcfs",
              max_batch_tokens=512, chunked_prefill_size=256)
    vocab = llm.model.config.vocab_size
    chosen = [r for r in requests if r.session in set(first)]
    # the slice keeps whole parent chains: renumber the chosen requests' links to positions in ``chosen``
    position = {r.rid: i for i, r in enumerate(chosen)}  # a parent is of the same session: always chosen
    local = [Request(r.arrival, r.session, r.prompt, max_new_tokens, rid=i,
                     parent=None if r.parent is None else position[r.parent], meta=r.meta)
             for i, r in enumerate(chosen)]
    scaled = scaled_requests(local, vocab, max_prompt, per_session)
    engine_hits = run_engine(llm, scaled, max_new_tokens)
    cfg = llm.config
    res = simulate(scaled, "radix", capacity_tokens=cfg.kv_cache_tokens, page_size=1, schedule_policy="fcfs",
                   max_running=cfg.max_running, seed=cfg.seed, in_batch_sharing=cfg.in_batch_sharing,
                   max_batch_tokens=cfg.max_batch_tokens, chunked_prefill_size=cfg.chunked_prefill_size,
                   preemption=True)
    sim_hits = [row["hit"] for row in res.per_request]
    return [{"rid": r.rid, "session": r.session, "stream": r.meta["stream"], "prompt_len": r.prompt_len,
             "engine_hit": e, "simulator_hit": s, "equal": e == s, "model": model,
             "kv_cache_tokens": cfg.kv_cache_tokens}
            for r, e, s in zip(scaled, engine_hits, sim_hits, strict=True)]


def engine_part(args, out: Path) -> list[dict]:
    """``--engine``: the slice through the engine and the simulator's prediction, ``OUT/engine.jsonl``."""
    requests = agentic_workload(args.trace, concurrency=1, seed=args.seed, sessions=args.engine_sessions,
                                split=args.split)
    rows = engine_slice(requests, args.model, args.engine_sessions, args.engine_max_prompt, args.engine_requests,
                        args.engine_kv_tokens)
    rows = [{**r, "config": {k: getattr(args, k) for k in ("trace", "seed", "model", "engine_sessions",
                                                            "engine_requests", "engine_max_prompt",
                                                            "engine_kv_tokens")}} for r in rows]
    path = write_rows(out / "engine", rows)
    agree = sum(r["equal"] for r in rows)
    print(table(rows, ["rid", "session", "stream", "prompt_len", "engine_hit", "simulator_hit", "equal"]))
    print(f"the simulator predicts {agree} of {len(rows)} requests' hits exactly "
          f"(engine hit rate {sum(r['engine_hit'] for r in rows) / max(sum(r['prompt_len'] for r in rows), 1):.3f}); "
          f"wrote {path}")
    return rows

"""vLLM v0's Automatic Prefix Caching, point by point, as radixkv's ``hash-v0`` cache does it.

``python -m experiments.v0_walkthrough`` prints one section per point of DefTruth's article "Prefix
Caching: RadixAttention and vLLM Automatic Prefix Caching" (docs/v0_walkthrough.md copies the output):
block keys, the prefix tree the keys form, the prefill and decode phases, generated KV, multi-turn use,
the cases that hit nothing, eviction order, prefill after a cached prefix, and switching it on.

Caches are driven directly (``HashV0Cache``, blocks of 4 tokens, with ``serve_once``, the request
lifecycle the engine and the simulator share) or through the engine on the local ``tiny-random`` model
(``LLM(..., block_size=4, kv_cache_tokens=256)``, greedy, ``ignore_eos``), so the run takes seconds and
downloads nothing. Hash keys are printed as labels (#1, #2, ...): on Python < 3.12 ``hash(None)``, the
default namespace's part of a key, changes from process to process, so raw values would not reproduce.
Writes ``results/v0_walkthrough.json`` (config, environment, results).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from experiments.common import HelpFormatter, environment, run_cli, with_ext
from radixkv import LLM, HashV0Cache, RadixCache, SamplingParams, SlotAllocator
from radixkv.attention import AttentionBatch
from radixkv.cache import CACHES
from radixkv.cache.lifecycle import serve_once

MODEL = "tiny-random"
BLOCK = 4
KV_TOKENS = 256
PROMPT = list(range(1, 11))  # 10 tokens: two full blocks and half of a third


def engine(cache: str, **settings: Any) -> LLM:
    """The walk-through's engine: tiny-random, blocks of 4, a 256-token KV pool."""
    return LLM(MODEL, prefix_cache=cache, block_size=BLOCK, kv_cache_tokens=KV_TOKENS, **settings)


def greedy(n: int) -> SamplingParams:
    # ignore_eos: every answer has exactly n tokens, so block counts do not depend on the random weights
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def v0() -> tuple[HashV0Cache, SlotAllocator]:
    return HashV0Cache(block_size=BLOCK), SlotAllocator(128, page_size=BLOCK)


class Labels:
    """Names hash keys #1, #2, ... in order of first sight (raw keys do not reproduce across processes)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def __call__(self, key: int) -> str:
        return self.names.setdefault(key, f"#{len(self.names) + 1}")


def blocks_of(tokens: Sequence[int]) -> str:
    return " | ".join(" ".join(map(str, tokens[i : i + BLOCK])) for i in range(0, len(tokens), BLOCK))


def keys_of(cache: HashV0Cache, tokens: Sequence[int], label: Labels, namespace: Hashable = None) -> list[str]:
    return [label(cache.hash_of_block(list(tokens), i, namespace)[0]) for i in range(len(tokens) // BLOCK)]


# ----------------------------------------------------------------------------------------------- points
def point_block_identity() -> dict:
    """A block's key hashes the whole prefix up to the block's end, plus the adapter (v0's hash_of_block)."""
    cache, label = HashV0Cache(block_size=BLOCK), Labels()
    prompt = list(range(12))
    rows = []
    for i, key in enumerate(keys_of(cache, prompt, label)):
        end = (i + 1) * BLOCK
        assert cache.hash_of_block(prompt, i)[0] == hash((tuple(prompt[:end]), None))  # nothing but the prefix
        rows.append({"block": i, "tokens": prompt[end - BLOCK : end], "hashed_tokens": end, "key": key})
    for row, key in zip(rows, keys_of(cache, prompt, label, namespace="lora-1"), strict=True):
        row["key_lora-1"] = key
    for r in rows:
        print(f"  block {r['block']} [{blocks_of(r['tokens'])}]: hash of tokens 0..{r['hashed_tokens'] - 1} "
              f"({r['hashed_tokens']} tokens) = key {r['key']}; under adapter 'lora-1': key {r['key_lora-1']}")
    fresh = HashV0Cache(block_size=BLOCK)
    fresh.insert(prompt, np.arange(12))
    hashed = fresh.stats()["hashed_tokens"]
    print(f"  inserting the 12 tokens hashes {hashed} tokens (4 + 8 + 12); an L-token request about L^2 / (2 x 4)")
    return {"blocks": rows, "insert_hashed_tokens": hashed}


def point_prefix_tree() -> dict:
    """The flat table of whole-prefix keys acts as a prefix tree: a key names its path from the root."""
    cache, label = HashV0Cache(block_size=BLOCK), Labels()
    prompts = {"A": list(range(12)), "B": list(range(8)) + [60, 61, 62, 63], "C": [9] * 4 + list(range(4, 12))}
    keys = {name: keys_of(cache, p, label) for name, p in prompts.items()}
    for name, p in prompts.items():
        print(f"  {name} [{blocks_of(p)}] -> keys {' '.join(keys[name])}")
    cache.insert(prompts["A"], np.arange(12))
    hits = {name: cache.match_prefix(prompts[name]).length for name in ("B", "C")}
    print(f"  with A cached: B matches {hits['B']} tokens (same first two blocks, same keys); C matches "
          f"{hits['C']} (its blocks 1-2 are A's tokens under other keys)")
    cache.insert(prompts["B"], np.arange(100, 112))
    cache.insert(prompts["C"], np.arange(200, 212))
    cache.check_invariants()
    print("\n".join("  " + line for line in cache.pretty_print().splitlines()))
    return {"keys": keys, "hits_with_A_cached": hits, "blocks": cache.num_blocks, "tree": cache.pretty_print()}


def point_phase_hashes() -> dict:
    """Prefill caches the prompt's full blocks; hash-v0 caches a decode-filled block at once, hash at finish.

    The block being filled carries no real key (v0's fake hash) and is never matched; when it fills, v0
    promotes it to its real key. radixkv's v1 (``hash``) and the tree insert generated tokens at finish.
    """
    out = {}
    for name in ("hash-v0", "hash", "radix"):
        llm = engine(name)
        llm.add_request(PROMPT, greedy(8))
        steps = []
        while llm.has_unfinished():
            llm.step()
            steps.extend([s.computed, s.cached] for s in llm.running)
        out[name] = {"computed_cached": steps, "cached_at_finish": llm.cache.total_size}
        trail = " ".join(f"{c}/{k}" for c, k in steps)
        print(f"  {name:8s} computed/cached after each step: {trail}; after finish {llm.cache.total_size} cached")
    return out


def shared_slots(llm: LLM) -> dict:
    a, b = llm.running
    return {"computed": [a.computed, b.computed], "cached": [a.cached, b.cached],
            "shared_slots": len(np.intersect1d(a.slots, b.slots)), "slots_in_use": llm.allocator.num_used}


def point_generated_kv() -> dict:
    """Generated KV is cached as it fills blocks: others hit it while it decodes, and duplicates are freed.

    With hash-v0 a request sent while another decodes already hits that one's answer, and a promoted
    block whose key is cached already moves the request onto the cached copy (its own copy is freed).
    """
    out: dict[str, Any] = {"concurrent_hit": {}, "twins_before_finish": {}}
    for name in ("hash-v0", "hash"):
        llm = engine(name)
        llm.add_request(PROMPT, greedy(8))
        for _ in range(3):  # prefill, then two decodes: 12 tokens computed, the third block full
            llm.step()
        follower = llm.running[0].tokens[:12] + [300, 301, 302]
        rid = llm.add_request(follower, greedy(2))
        done = {}
        while llm.has_unfinished():
            done |= {o.request_id: o for o in llm.step()}
        out["concurrent_hit"][name] = done[rid].num_cached_tokens
        print(f"  {name:8s} request 2, sent while request 1 decodes (1's prompt + first 2 answer tokens + 3 new): "
              f"hits {done[rid].num_cached_tokens}")
    for name in ("hash-v0", "hash"):
        llm = engine(name)
        for _ in range(2):  # two identical greedy requests: the same KV, computed twice
            llm.add_request(PROMPT, greedy(8))
        for _ in range(7):  # prefill and six decodes: 16 tokens each, the last step before they finish
            llm.step()
        out["twins_before_finish"][name] = state = shared_slots(llm)
        print(f"  {name:8s} two identical requests, 16 tokens computed each: cached {state['cached']}, "
              f"{state['shared_slots']} slots shared, {state['slots_in_use']} slots in use")
        while llm.has_unfinished():
            llm.step()
    return out


def point_multi_turn() -> dict:
    """Turn 2 resends turn 1's prompt and answer: the full blocks the answer filled are hits."""
    out = {}
    for name in ("hash-v0", "hash", "radix", "none"):
        llm = engine(name)
        t1 = llm.generate([PROMPT], greedy(8))[0]
        turn2 = t1.prompt_token_ids + t1.token_ids + [400, 401, 402, 403]
        hit = llm.generate([turn2], greedy(4))[0].num_cached_tokens
        out[name] = {"turn2_tokens": len(turn2), "turn2_hit": hit, "answer_tokens_hit": max(0, hit - len(PROMPT))}
        print(f"  {name:8s} turn 2 ({len(turn2)} tokens = prompt 10 + answer 8 + 4 new) hits {hit}: "
              f"{out[name]['answer_tokens_hit']} of them from turn 1's answer")
    return out


def edge_case(serve: Callable[[Any, SlotAllocator], int]) -> dict:
    """One scenario run on hash-v0 (block 4) and, for contrast, the radix tree (page 1)."""
    out = {}
    for name, (cache, alloc) in {"hash-v0": v0(), "radix": (RadixCache(page_size=1), SlotAllocator(128))}.items():
        out[name] = serve(cache, alloc)
        cache.check_invariants()
    return out


def twice(first: list[int], second: list[int], output: Sequence[int] = (), namespace: Hashable = None
          ) -> Callable[[Any, SlotAllocator], int]:
    """Serve ``first`` (with ``output``), then ``second``; the second one's hit."""
    def serve(cache: Any, alloc: SlotAllocator) -> int:
        serve_once(cache, alloc, first, output)
        return serve_once(cache, alloc, second, namespace=namespace)
    return serve


def point_no_hit_cases() -> dict:
    """Where v0 hits nothing or less: full blocks only, whole-prefix keys, at least one token computed."""
    answer2, answer6 = [70, 71], [70, 71, 72, 73, 74, 75]
    cases = {
        "prompt shorter than a block (3 tokens, sent twice)": twice([1, 2, 3], [1, 2, 3]),
        "first token differs (12 tokens, the other 11 equal)": twice(list(range(12)), [99] + list(range(1, 12))),
        "another adapter (namespace 'lora-1')": twice(list(range(12)), list(range(12)), namespace="lora-1"),
        "answer fills no block (prompt 8 + answer 2; turn 2 = both + 3)":
            twice(list(range(8)), list(range(8)) + answer2 + [80, 81, 82], answer2),
        "answer fills a block (prompt 8 + answer 6; turn 2 = both + 3)":
            twice(list(range(8)), list(range(8)) + answer6 + [80, 81, 82], answer6),
        "exactly 2 blocks, resent (at least one token is computed)": twice(list(range(8)), list(range(8))),
        "exactly 2 blocks, resent with one more token": twice(list(range(8)), list(range(9))),
    }
    out = {title: edge_case(serve) for title, serve in cases.items()}
    cache, alloc = v0()
    serve_once(cache, alloc, list(range(8)))
    out["raw match_prefix of the resent 2 blocks"] = {"hash-v0": cache.match_prefix(list(range(8))).length}
    width = max(map(len, out))
    for title, hits in out.items():
        print(f"  {title:{width}s}  " + "  ".join(f"{k} {v:2d}" for k, v in hits.items()))
    return out


def block_stamps(cache: HashV0Cache) -> dict[int, tuple[int, int]]:
    """First slot of each reachable block -> (last access, hashed tokens), from ``to_dict``."""
    stamps = {}

    def walk(node: dict, depth: int) -> None:
        for child in node["children"]:
            stamps[child["indices"][0]] = (child["last_access"], depth * BLOCK)
            walk(child, depth + 1)

    walk(cache.to_dict(), 1)
    return stamps


def point_eviction_order() -> dict:
    """v0's evictor: of the unreferenced blocks, the least recently accessed first, ties to the deepest."""
    cache = HashV0Cache(block_size=BLOCK)
    names = {}  # first slot of each block -> a readable name
    for prompt, base, tag in ((list(range(12)), 0, "X"), ([20 + t for t in range(8)], 100, "Y")):
        cache.insert(prompt, np.arange(base, base + len(prompt)))  # X at clock 1, Y at clock 2
        names |= {base + BLOCK * i: f"{tag}{i} [{blocks_of(prompt[BLOCK * i : BLOCK * (i + 1)])}]"
                  for i in range(len(prompt) // BLOCK)}
    cache.match_prefix(list(range(BLOCK)))  # clock 3: only X's first block is accessed
    stamps = block_stamps(cache)
    order = []
    while cache.total_size:
        first = int(cache.evict(1)[0])  # the smallest request frees one block: the next in line
        order.append(first)
        last, depth = stamps[first]
        print(f"  evicted {names[first]}: last access {last}, {depth} hashed tokens")
    return {"order": [names[s].split()[0] for s in order],
            "last_access_and_hashed_tokens": {names[s].split()[0]: stamps[s] for s in order}}


def record_batches(llm: LLM) -> list[AttentionBatch]:
    """Keep every ``AttentionBatch`` the engine plans (this instance's backend ``plan``, wrapped)."""
    seen: list[AttentionBatch] = []
    plan = llm.backend.plan

    def recording(batch: AttentionBatch) -> None:
        seen.append(batch)
        plan(batch)

    llm.backend.plan = recording
    return seen


def point_prefix_prefill() -> dict:
    """A prefill after a cached prefix reads the prefix's KV from the paged pool; outputs equal a no-cache run.

    vLLM v0 had two kernels (plain attention on a cold prompt, the prefix-prefill kernel after a cached
    prefix); radixkv has one paged prefill path for both, whose causal mask is offset by the prefix.
    """
    first, second = list(range(1, 13)), list(range(1, 13)) + [500, 501, 502, 503, 504, 505]
    out: dict[str, Any] = {}
    for name in ("hash-v0", "none"):
        llm = engine(name)
        seen = record_batches(llm)
        llm.generate([first], greedy(4))
        cached = llm.cache.match_prefix(first).indices  # request 1's blocks, as the cache holds them
        seen.clear()
        res = llm.generate([second], greedy(4))[0]
        ab = seen[0]  # the step that prefilled request 2 (it runs alone)
        p, n, slots = ab.prefix_lens[0], ab.new_lens[0], np.asarray(ab.slots[0])
        prefill = getattr(llm.backend, "prefill", llm.backend)  # a split backend's prefill part (FlashInfer: itself)
        out[name] = {"backend": llm.backend.name, "prefill_part": type(prefill).__name__,
                     "prefix_len": p, "new_len": n, "slots": len(slots), "hit": res.num_cached_tokens,
                     "prefix_pages": sorted(set((slots[:p] // BLOCK).tolist())),
                     "prefix_is_request_1s_blocks": bool(p) and np.array_equal(slots[:p], cached[:p]),
                     "tokens": res.token_ids}
        o = out[name]
        where = (f"prefix read from pool pages {o['prefix_pages']}, request 1's cached blocks: "
                 f"{o['prefix_is_request_1s_blocks']}" if p else "no cached prefix, the whole prompt computed")
        print(f"  {name:8s} request 2 ({len(second)} tokens, hit {res.num_cached_tokens}): prefill row prefix_len "
              f"{p}, new_len {n}, {len(slots)} slots, prefill by {o['backend']}'s {o['prefill_part']}\n"
              f"           {where}")
    out["outputs_equal"] = out["hash-v0"]["tokens"] == out["none"]["tokens"]
    print(f"  request 2's 4 generated tokens equal with and without the cache: {out['outputs_equal']}")
    return out


def point_offline_online() -> dict:
    """Offline: LLM(enable_prefix_caching=True); online: radixkv serve --enable-prefix-caching."""
    shared = list(range(1, 17))
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(3)]
    out: dict[str, Any] = {}
    for flag in (True, False):
        llm = LLM(MODEL, enable_prefix_caching=flag, prefix_cache="hash-v0", block_size=BLOCK,
                  kv_cache_tokens=KV_TOKENS)
        outputs = llm.generate(prompts[:1], greedy(4)) + llm.generate(prompts[1:], greedy(4))  # 1, then 2 more
        s = llm.stats()
        out[f"enable_prefix_caching={flag}"] = row = {
            "cache": type(llm.cache).__name__, "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
            "prefill_tokens": s["prefill_tokens"], "tokens": [o.token_ids for o in outputs]}
        print(f"  enable_prefix_caching={flag!s:5s} -> {row['cache']}: {row['cached_tokens']} of "
              f"{row['prompt_tokens']} prompt tokens cached, {row['prefill_tokens']} prefilled")
    out["outputs_equal"] = out["enable_prefix_caching=True"]["tokens"] == out["enable_prefix_caching=False"]["tokens"]
    out["cli_caches"] = list(CACHES)
    print(f"  outputs equal: {out['outputs_equal']}")
    print("  online: radixkv serve MODEL --prefix-cache hash-v0 [--enable-prefix-caching | "
          "--no-enable-prefix-caching]; the experiments take --caches from " + ",".join(CACHES))
    return out


# JSON key -> (section title, the function that prints and returns it), in the article's order
POINTS: dict[str, tuple[str, Callable[[], dict]]] = {
    "block_identity": ("1. hash RadixAttention: a block's identity", point_block_identity),
    "prefix_tree": ("2. the hash prefix tree", point_prefix_tree),
    "phase_hashes": ("3. prefix and generate phase hashes", point_phase_hashes),
    "generated_kv": ("4. generated KV caching", point_generated_kv),
    "multi_turn": ("5. multi-turn use", point_multi_turn),
    "no_hit_cases": ("6. edge cases where nothing is hit", point_no_hit_cases),
    "eviction_order": ("7. eviction order", point_eviction_order),
    "prefix_prefill": ("8. prefix-prefill kernel vs plain attention", point_prefix_prefill),
    "offline_online": ("9. turning it on, offline and online", point_offline_online),
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", default="results/v0_walkthrough",
                   help="results path without extension (as for the other experiments): writes .json")
    args = p.parse_args(argv)
    results = {}
    for key, (title, fn) in POINTS.items():
        print(f"== {title}\n   {fn.__doc__.splitlines()[0]}")  # the docstring's summary says what it shows
        results[key] = fn()
    config = {"model": MODEL, "block_size": BLOCK, "kv_cache_tokens": KV_TOKENS, "radix_page_size": 1,
              "sampling": "greedy, ignore_eos", "attention_backend": "auto"}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "env": environment(), "results": results}, indent=2,
                              default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))
    print("wrote", out)
    return results


if __name__ == "__main__":
    run_cli(main)

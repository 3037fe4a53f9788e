"""Show, claim by claim, how the radix tree and the hash-block cache differ.

Every claim in docs/hash_vs_radix.md is backed by one section of this
command's output: ``python -m experiments.hash_vs_radix``. Each section serves
the same requests through a ``RadixCache`` (page 1) and a ``HashBlockCache``
(block 4) with the request lifecycle the simulator and engine use.
"""

from __future__ import annotations

import argparse
import json

from experiments.common import HelpFormatter, run_cli, with_ext
from radixkv import HashBlockCache, RadixCache, SlotAllocator
from radixkv.cache.lifecycle import serve_once

BLOCK = 4


def serve(cache, alloc: SlotAllocator, prompt: list[int], output: list[int] = ()) -> int:
    hit = serve_once(cache, alloc, prompt, output)
    cache.check_invariants()
    return hit


def fresh() -> dict[str, tuple]:
    return {
        "radix(page=1)": (RadixCache(page_size=1), SlotAllocator(64, page_size=1)),
        f"hash(block={BLOCK})": (HashBlockCache(block_size=BLOCK), SlotAllocator(64, page_size=BLOCK)),
    }


def claim_granularity() -> dict:
    """14 prompt tokens of which 10 are shared with a cached prompt."""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(14)))
        out[name] = serve(cache, alloc, list(range(10)) + [90, 91, 92, 93])
    return out


def claim_partial_last_block() -> dict:
    """A cold 10-token prompt: what stays cached afterwards."""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(10)))
        out[name] = cache.total_size
    return out


def claim_generated_tokens() -> dict:
    """Prompt 6 + answer 6; the next turn sends prompt + answer + 2 new tokens."""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(6)), list(range(100, 106)))
        out[name] = {
            "cached_after_turn_1": cache.total_size,
            "hit_on_turn_2": serve(cache, alloc, list(range(6)) + list(range(100, 106)) + [200, 201]),
        }
    return out


def claim_full_hit_rule() -> dict:
    """An exactly-2-block (8-token) prompt sent twice, then with one more token."""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(8)))
        out[name] = {"resent": serve(cache, alloc, list(range(8))), "plus_one": serve(cache, alloc, list(range(9)))}
    return out


def claim_eviction_unit() -> dict:
    """After two 13-token prompts sharing 6 tokens, evict(1): how many tokens does the smallest eviction free?"""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(13)))
        serve(cache, alloc, list(range(6)) + [50] * 7)
        out[name] = {"freed_by_evict(1)": int(cache.evict(1).size), "still_cached": cache.total_size}
    return out


def claim_what_is_hashed() -> dict:
    """What each cache stores for prompts [0..11] and [0..5, 50 x 6]."""
    out = {}
    for name, (cache, alloc) in fresh().items():
        serve(cache, alloc, list(range(12)))
        serve(cache, alloc, list(range(6)) + [50] * 6)
        out[name] = cache.pretty_print()
    return out


CLAIMS = {
    "granularity (14 tokens, 10 shared)": claim_granularity,
    "partial last block (cold 10-token prompt, tokens cached)": claim_partial_last_block,
    "generated tokens (multi-turn)": claim_generated_tokens,
    "full-hit rule (at least one token computed)": claim_full_hit_rule,
    "eviction unit": claim_eviction_unit,
    "what each cache holds": claim_what_is_hashed,
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--out", default="results/hash_vs_radix",
                        help="results path without extension (as for the other experiments): writes .json")
    parser.add_argument("--seed", type=int, default=0, help="unused: the examples are fixed (kept for a uniform CLI)")
    args = parser.parse_args(argv)
    results = {}
    for title, fn in CLAIMS.items():
        results[title] = fn()
        print(f"== {title}: {fn.__doc__}")
        for name, value in results[title].items():
            print(f"{name}:\n{value}" if isinstance(value, str) else f"  {name:14s} {value}")
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {"block_size": BLOCK, "page_size": 1}, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    run_cli(main)

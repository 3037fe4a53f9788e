"""The best hit rate a workload allows: unlimited capacity and a perfect order (the simulator's reference)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from radixkv.cache.base import match_for_prefill
from radixkv.cache.radix import RadixCache
from radixkv.workloads.request import Request


def upper_bound(requests: Sequence[Request], page_size: int = 1) -> float:
    """The best hit rate of this workload: unlimited capacity and a perfect order.

    Every distinct prefix is computed once: a page of a prompt is a hit for
    every request that reaches it within its cacheable prefix (all but the
    last token, whole pages), except the one request that must compute it.
    A page costs nothing to anyone if some request generated it (a previous
    turn's answer) or some request computes it anyway beyond its cacheable
    prefix. Computed exactly from the workload; O(total tokens) memcmp work.
    """
    tree = RadixCache(page_size=page_size)
    slot = 0
    for r in requests:  # every sequence whose KV gets computed: prompt + output[:-1]
        prompt = r.tokens()
        seq = prompt if r.output is None else np.concatenate([prompt, r.output[:-1]])
        tree.insert(seq, np.arange(slot, slot + len(seq)), r.namespace)
        slot += len(seq)
    reach_cap: Counter = Counter()  # node -> requests reaching it within their cacheable prefix
    reach_all: Counter = Counter()  # node -> requests whose whole-page prompt reaches it
    generated: Counter = Counter()  # node -> requests that generated it (past their prompt)

    def climb(node, counts: Counter, stop=None) -> None:
        while node.parent is not None and node is not stop:
            counts[node] += 1
            node = node.parent

    def ends(r: Request):
        prompt = r.tokens()
        cap = match_for_prefill(tree, prompt, r.namespace).node
        end_prompt = tree.match_prefix(prompt, r.namespace).node
        end_seq = None
        if r.output is not None and r.output_len > 1:
            end_seq = tree.match_prefix(np.concatenate([prompt, r.output[:-1]]), r.namespace).node
        return cap, end_prompt, end_seq

    for r in requests:  # first pass: the matches split the tree at every end point
        ends(r)
    for r in requests:  # second pass: no more splits, so nodes keep their length while counted
        cap, end_prompt, end_seq = ends(r)
        climb(cap, reach_cap)
        climb(end_prompt, reach_all)
        if end_seq is not None:
            climb(end_seq, generated, stop=end_prompt)
    # a node computed anyway (by a longer prompt, or as a generated answer) is a hit for all who reach it
    hits = sum(len(node) * (a if reach_all[node] > a or node in generated else a - 1)
               for node, a in reach_cap.items())
    total = sum(r.prompt_len for r in requests)
    return hits / total if total else 0.0

"""Policies that rank entries by what keeping them is worth: the prefill time they save (GreedyDual-Size-
Frequency) and a learned estimate of their reuse."""

from __future__ import annotations

from radixkv.cache.eviction.base import Entry, EvictionPolicy, Live, check_param


class Cost(EvictionPolicy):
    """GreedyDual-Size-Frequency (Cherkasova, 1998), an entry's cost being the prefill time it saves.

    H(entry) = L + (1 + hit_count) x cost / tokens, where cost is the time to prefill the entry's tokens
    after its prefix (``depth``) under the simulator's cost model (``prefill_per_token`` per token plus
    ``attention_per_pair`` per (new, attended) token pair), so cost / tokens grows with depth: deep entries,
    whose attention is dearer, are kept longer. The smallest H goes first; L, the inflation, becomes the H of
    each entry evicted, so entries not used for a while sink below fresh ones. O(log n) per push and pop.

    Args:
        prefill_per_token: seconds per prefilled token (default ``CostModel()``'s, the engine's CPU).
        attention_per_pair: seconds per attended pair (default ``CostModel()``'s). Only their ratio changes
            the order; ``experiments.eviction`` passes a GPU preset's.
    """

    name = "cost"
    params = ("prefill_per_token", "attention_per_pair")

    def __init__(self, prefill_per_token: float = 3.5e-4, attention_per_pair: float = 2.0e-8):
        check_param("cost", "prefill_per_token", prefill_per_token, 0.0)
        check_param("cost", "attention_per_pair", attention_per_pair, 0.0)
        if not prefill_per_token + attention_per_pair > 0:
            raise ValueError("cost: prefill_per_token and attention_per_pair cannot both be 0")
        self.prefill_per_token, self.attention_per_pair = float(prefill_per_token), float(attention_per_pair)
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.inflation = 0.0

    def saved_per_token(self, entry: Entry) -> float:
        """Prefill seconds per token of ``entry`` after its prefix."""
        return self.prefill_per_token + self.attention_per_pair * (entry.depth + (len(entry) + 1) / 2)

    def priority(self, entry: Entry) -> float:
        return self.inflation + (1 + entry.hit_count) * self.saved_per_token(entry)

    def pop(self, live: Live) -> Entry | None:
        item = self.heap.pop(live)
        if item is None:
            return None
        self.inflation = max(self.inflation, item[0])
        return item[1]

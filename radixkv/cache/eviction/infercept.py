"""``infercept``: the eviction side of InferCept's choice at each interception (ICML 2024; the rule and the
schedule policy that makes it: ``radixkv.scheduling.infercept``).

A path left by an answer that called a tool is **preserved** (held for the interception's expected duration)
or goes **first** (discarded; over a host tier, demoted to it first: the swap), as the ``infercept`` schedule
policy decided for that finish by minimum waste; ``hold`` seconds where nothing was decided. The rest of the
order is ``Pins``'s.

Args:
    hold: seconds a path is held after a tool call where nothing was decided, > 0 (default 10).
"""

from __future__ import annotations

from radixkv.cache.eviction.pins import Pins


class InferCeptRetention(Pins):
    """See the module doc."""

    name = "infercept"

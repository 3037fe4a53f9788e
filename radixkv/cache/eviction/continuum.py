"""``continuum``: the eviction side of Continuum's time-to-live (arXiv 2511.02230; the rule and the schedule
policy that computes it: ``radixkv.scheduling.continuum``).

A path left by an answer that called a tool is **pinned** for the TTL the ``continuum`` schedule policy chose
for that finish by the paper's cost-benefit rule (0: not pinned), ``hold`` seconds where none was chosen;
when the TTL runs out the path is ranked with the rest (``Pins``, which says the rest of the order).

Args:
    hold: seconds a path is pinned after a tool call where no TTL was chosen, > 0 (default 10).
"""

from __future__ import annotations

from radixkv.cache.eviction.pins import Pins


class ContinuumPins(Pins):
    """See the module doc."""

    name = "continuum"

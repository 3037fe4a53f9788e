"""``Cluster``: N ``LLM`` replicas as Ray actors behind the same ``Router`` objects as the simulator.

    with Cluster("tiny-random", replicas=2, router="round_robin", kv_cache_tokens=1024) as cluster:
        outs = cluster.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=8))
        cluster.decisions   # [0, 1]: the replica of each request, in routing order

Routing is one code path with the simulator's cluster: a ``LoadTracker`` counts what the driver sent and
what came back, and the router sees its ``views()``. ``generate`` routes every prompt first, in order,
then sends each replica its share as one call and gathers; only then are the requests finished (in input
order), so decisions depend only on the prompts and their order, as in the simulator with every arrival
at time 0. Routers that read cache events (``EventRouter``) get each replica's events, stamped in the
actor with the wall clock and fed in order, on the cluster's clock (seconds since it started).

A replica whose actor dies is marked dead and killed; its requests are released and routed again, once
each, to the live ones (``RuntimeError`` when none is left, or a request has lost two replicas).

``radixkv.cluster.fleet`` is what ``Cluster`` (``radixkv.cluster.batch``) and the server's ``ClusterEngine``
(``radixkv.serving.replicas``) share: Ray, one replica actor base, the router and its tracker, the fan-out
to every live replica, and the replicas' prompt rules (``radixkv.inputs.Prompts``), with which the driver
tokenizes and checks prompts as the replicas would. Needs Ray (``pip install 'radixkv[ray]'``);
``import radixkv`` never imports it.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - the ray extra is missing
    raise ImportError("radixkv.cluster needs Ray: pip install 'radixkv[ray]' (make install does)") from e

from radixkv.cluster.batch import Cluster
from radixkv.cluster.fleet import ACTOR_LOST, EventBuffer, Fleet, ReplicaActor, build_llm

__all__ = ["ACTOR_LOST", "Cluster", "EventBuffer", "Fleet", "ReplicaActor", "build_llm"]

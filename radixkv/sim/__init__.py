"""The simulator: one engine (``simulate``) or a cluster of replicas behind a router (``simulate_cluster``).

``radixkv.sim.engine`` replays a workload through the real caches and scheduling policies on a modelled
clock; ``radixkv.sim.cluster`` runs N of those engines on one clock, with a ``radixkv.routing`` router
choosing each request's replica. Torch-free.
"""

from __future__ import annotations

from radixkv.bounds import upper_bound
from radixkv.cost import CostModel, StepRecord
from radixkv.sim.cluster import ClusterResult, cluster_references, simulate_cluster
from radixkv.sim.engine import simulate
from radixkv.sim.replica import SimResult
from radixkv.stack import SIMULATOR_DEFAULTS, StackConfig

__all__ = ["SIMULATOR_DEFAULTS", "ClusterResult", "CostModel", "SimResult", "StackConfig", "StepRecord",
           "cluster_references", "simulate", "simulate_cluster", "upper_bound"]

"""Scheduling: the admission policies (``policies``, ``session``), the scheduler core the engine and the
simulator share (``core``: one request record, one step's admission, memory, preemption, chunking and
commits), and the prefetch of agent sessions' contexts from the lower tiers (``prefetch``)."""

from radixkv.scheduling.core import Batch, RequestState, Scheduler, causal_pairs
from radixkv.scheduling.policies import (
    FCFS,
    POLICIES,
    Candidate,
    DFSWeight,
    InBatchPrefixSharing,
    LongestPrefixMatch,
    RandomOrder,
    SchedulePolicy,
    admission_order,
    make_policy,
)

__all__ = ["Batch", "Candidate", "DFSWeight", "FCFS", "InBatchPrefixSharing", "LongestPrefixMatch", "POLICIES",
           "RandomOrder", "RequestState", "SchedulePolicy", "Scheduler", "admission_order", "causal_pairs",
           "make_policy"]

"""``Cluster``: N ``LLM`` replicas as Ray actors behind the router, with ``LLM``'s batch interface."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable, Sequence

import ray

from radixkv.cluster.fleet import ACTOR_LOST, Fleet, ReplicaActor, build_llm
from radixkv.config import SamplingParams
from radixkv.engine import RequestOutput
from radixkv.inputs import batch_arguments


class _BatchReplica(ReplicaActor):
    """One ``LLM`` in a Ray actor; the engine is built by ``start``, so a bad model is an ordinary error."""

    def start(self, model: str, settings: dict, events: bool) -> tuple:
        return self.attach(build_llm(model, settings, self.threads), events)

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            namespace: Hashable) -> tuple[list[RequestOutput], list, float]:
        """Serve these (already checked) prompts to completion: their outputs in order, the cache events
        since the last call, and the share of KV slots held after (as the simulator's cluster reports it).
        A failure withdraws them and leaves the engine as ``LLM.generate`` does."""
        llm, rids, done = self.llm, [], {}
        try:
            for ids, sp in zip(prompts, params, strict=True):
                rids.append(llm.add_request(ids, sp, namespace))
            while len(done) < len(rids):
                done.update((o.request_id, o) for o in llm.step())
        except BaseException:
            llm.scheduler.withdraw(set(rids))
            raise
        return [done[r] for r in rids], self.events.drain(), 1 - llm.allocator.num_free / llm.allocator.capacity

    def stats(self) -> dict:
        return self.llm.stats()

    def check_idle(self) -> None:
        self.llm.check_idle()

    def call(self, fn):
        return fn(self.llm)


class Cluster:
    """N ``LLM(model, **engine_settings)`` replicas as Ray actors; see the module docstring.

    ``address``: join that Ray cluster (default: start one on this machine, or use the one running).
    ``num_cpus_per_replica``: each actor's Ray CPUs and torch threads. ``router``/``router_params``:
    ``make_router``'s. ``decisions``: the replica of each request routed (retries too), in routing order.
    """

    def __init__(self, model: str, replicas: int = 1, router: str = "affinity", address: str | None = None,
                 router_params: dict | None = None, num_cpus_per_replica: int = 1, **engine_settings):
        self.fleet = Fleet(_BatchReplica, model, replicas, router, address, router_params, num_cpus_per_replica,
                           engine_settings)
        self.router, self.tracker, self.decisions = self.fleet.router, self.fleet.tracker, self.fleet.decisions
        self.actors = self.fleet.actors
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 namespace: Hashable = None) -> list[RequestOutput]:
        """``LLM.generate`` across the replicas: one ``RequestOutput`` per prompt, in input order, each
        ``request_id`` unique in the cluster. Bad prompts raise ``ValueError`` before anything is routed."""
        prompts, params = batch_arguments(prompts, params)
        check = self.fleet.prompts.check
        jobs = {next(self._ids): (check(p, sp), sp) for p, sp in zip(prompts, params, strict=True)}
        where: dict[int, int] = {}  # request id -> replica, while it is outstanding
        try:
            for rid, (ids, sp) in jobs.items():  # every prompt routed before any finishes
                where[rid] = self.fleet.route(rid, ids, sp, namespace)
            outs, events = self._gather(jobs, where, namespace)
        except BaseException:
            for rid in where:
                self.tracker.done(rid)
            raise
        try:
            for replica, evs in events.items():  # what the caches did, then what finished (as in the simulator)
                self.fleet.observe(replica, evs)
        finally:
            for rid in jobs:
                outs[rid].request_id = rid
                self.fleet.finish(rid, outs[rid].prompt_token_ids + outs[rid].token_ids[:-1], namespace)
        return [outs[rid] for rid in jobs]

    def chat(self, conversations, params: SamplingParams | None = None) -> list[RequestOutput]:
        """``LLM.chat`` across the replicas (the chat template applied on the driver, as each replica would)."""
        return self.generate(self.fleet.prompts.conversations(conversations), params)

    def _gather(self, jobs: dict, where: dict[int, int], namespace: Hashable) -> tuple[dict, dict]:
        """Send each replica its routed requests as one call; collect outputs by request id and events by
        replica. A replica that dies has its requests routed again, once each."""
        pending: dict = {}  # ref -> (replica, request ids)
        outs: dict[int, RequestOutput] = {}
        events: dict[int, list] = collections.defaultdict(list)
        retried: set[int] = set()

        def send(rids: list[int]) -> None:
            for replica in sorted({where[r] for r in rids}):
                mine = [r for r in rids if where[r] == replica]
                ref = self.actors[replica].run.remote([jobs[r][0] for r in mine], [jobs[r][1] for r in mine],
                                                      namespace)
                pending[ref] = (replica, mine)

        send(list(jobs))
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            replica, rids = pending.pop(ref)
            try:
                got, evs, self.fleet.kv_used[replica] = ray.get(ref)
            except ACTOR_LOST:
                self._reroute(replica, rids, jobs, where, retried, namespace)
                send(rids)
                continue
            except Exception:  # the replica's own error: the others finish their share, then it is raised
                ray.wait(list(pending), num_returns=len(pending))
                raise
            outs.update(zip(rids, got, strict=True))
            events[replica].extend(evs)
        return outs, events

    def _reroute(self, replica: int, rids: list[int], jobs: dict, where: dict[int, int], retried: set[int],
                 namespace: Hashable) -> None:
        """``replica`` died holding ``rids``: mark it dead, release them, and route them again."""
        self.fleet.lost(replica)
        for rid in rids:
            self.tracker.done(rid)
            del where[rid]
        twice = [r for r in rids if r in retried]
        if twice:
            raise RuntimeError(f"requests {twice} lost a second replica ({replica}); they are not retried again")
        retried.update(rids)
        for rid in rids:
            ids, sp = jobs[rid]
            where[rid] = self.fleet.route(rid, ids, sp, namespace)  # RuntimeError when no replica is left

    def stats(self) -> list[dict | None]:
        """Each replica's ``LLM.stats()`` (None for a dead one)."""
        return self.fleet.each("stats")

    def check_idle(self) -> None:
        """``LLM.check_idle()`` on every live replica (its ``AssertionError`` comes through)."""
        self.fleet.each("check_idle")

    def shutdown(self) -> None:
        """Kill the actors (and stop Ray if this cluster started it)."""
        self.fleet.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()



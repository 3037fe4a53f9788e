"""``radixkv.cluster``: tiny-random replicas as Ray actors on a local Ray (2 CPUs, no dashboard),
behind the simulator's routers; and ``radixkv serve --replicas 2``. Skipped where Ray is not installed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_fixture import running_server  # noqa: E402

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.cluster import Cluster  # noqa: E402
from radixkv.sim import simulate_cluster  # noqa: E402
from radixkv.workloads.request import Request  # noqa: E402

KV = 1024
SP = SamplingParams(max_new_tokens=6, ignore_eos=True)
SYSTEM = list(range(3, 40))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def reference(prompts, sp: SamplingParams = SP) -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny-random", kv_cache_tokens=KV).generate(prompts, sp)]


def idle_views(cluster: Cluster) -> bool:
    return all(v.running == v.waiting == v.outstanding_tokens == 0 for v in cluster.tracker.views())


class TestRoundRobin:
    """One 2-replica cluster for the class; the last test kills its replicas."""

    @pytest.fixture(scope="class")
    def cluster(self):
        with Cluster("tiny-random", replicas=2, router="round_robin", kv_cache_tokens=KV) as cluster:
            yield cluster

    def test_same_tokens_as_one_llm_decisions_alternate_and_stats_per_replica(self, cluster):
        prompts = [SYSTEM + [100 + i] for i in range(5)]
        outs = cluster.generate(prompts, SP)
        assert [o.token_ids for o in outs] == reference(prompts)
        assert [o.prompt_token_ids for o in outs] == prompts
        assert cluster.decisions == [0, 1, 0, 1, 0]
        assert len({o.request_id for o in outs}) == 5
        stats = cluster.stats()
        assert len(stats) == 2 and [s["prompt_tokens"] for s in stats] == [3 * 38, 2 * 38]
        assert [s["decode_tokens"] for s in stats] == [3 * 5, 2 * 5]  # the first token comes with the prefill
        cluster.check_idle()
        assert idle_views(cluster)
        again = cluster.generate(prompts[:2], SP, namespace="tenant-a")  # a namespace of its own: no hits
        assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]
        assert cluster.decisions[5:] == [1, 0] and all(o.num_cached_tokens == 0 for o in again)

    def test_bad_input_is_a_value_error_before_anything_is_routed(self, cluster):
        routed = len(cluster.decisions)
        for prompts, params in [([[1, 2], []], SP), ([[1, 99999]], SP), ([[1] * (KV + 10)], SP),
                                ([[1], [2]], [SP]), ({1, 2}, SP)]:
            with pytest.raises(ValueError):
                cluster.generate(prompts, params)
        with pytest.raises(ValueError, match="no tokenizer"):
            cluster.chat([{"role": "user", "content": "hi"}])
        assert len(cluster.decisions) == routed and idle_views(cluster)
        assert cluster.generate([5, 6, 7], SP)[0].token_ids == reference([[5, 6, 7]])[0]  # one prompt of ids

    def test_a_dead_replica_s_requests_are_retried_on_the_live_one(self, cluster):
        prompts = [SYSTEM + [200 + i] for i in range(4)]
        want = reference(prompts)
        ray.kill(cluster.actors[1])  # between calls: the driver learns of it when its share fails
        routed = len(cluster.decisions)
        outs = cluster.generate(prompts, SP)
        assert [o.token_ids for o in outs] == want
        new = cluster.decisions[routed:]
        assert sorted(new[:4]) == [0, 0, 1, 1] and new[4:] == [0, 0]  # replica 1's two, routed again
        assert cluster.tracker.alive == [True, False] and idle_views(cluster)
        stats = cluster.stats()
        assert stats[1] is None and stats[0]["prompt_tokens"] > 0
        cluster.check_idle()
        routed = len(cluster.decisions)
        assert [o.token_ids for o in cluster.generate(prompts[:3], SP)] == want[:3]
        assert cluster.decisions[routed:] == [0, 0, 0]  # only the live one from now on
        ray.kill(cluster.actors[0])
        with pytest.raises(RuntimeError, match="replicas are dead"):
            cluster.generate(prompts, SP)
        assert idle_views(cluster)
        with pytest.raises(RuntimeError, match="replicas are dead"):
            cluster.generate(prompts, SP)


def test_kv_events_route_by_what_each_replica_caches_and_match_the_simulator():
    """Each actor's cache events reach the driver's router: a conversation's next turn goes to the replica
    that holds its history; the decisions are the simulated cluster's on the same requests."""
    rng = np.random.default_rng(0)
    a, b = (list(map(int, rng.integers(3, 500, 120))) for _ in range(2))
    params = dict(replicas=2, router="kv_events")  # its block size comes from the cache's page size
    with Cluster("tiny-random", kv_cache_tokens=KV, page_size=4, **params) as cluster:
        assert cluster.router.block_size == 4
        first = cluster.generate([a, b], SP)
        second_prompts = [b + first[1].token_ids + [7], a + first[0].token_ids + [8]]
        second = cluster.generate(second_prompts, SP)
        assert cluster.decisions == [0, 1, 1, 0]
        assert second[0].num_cached_tokens >= len(b) and second[1].num_cached_tokens >= len(a)
        cluster.check_idle()
    turn = [Request(0.0, i, np.array(p), 6, output=np.array(o.token_ids)) for i, (p, o) in
            enumerate(zip([a, b], first, strict=True))]
    turn += [Request(1000.0, 2 + i, np.array(p), 6) for i, p in enumerate(second_prompts)]
    sim = simulate_cluster(turn, capacity_tokens=KV, page_size=4, references=False, **params)
    assert sim.decisions == [0, 1, 1, 0]


def test_affinity_decides_the_same_on_ray_as_in_the_simulator():
    """radixkv's router, on the same request stream (6 sessions x 4 turns, turns shuffled, each request carrying
    its session), sends every request to the same replica on the Ray cluster as in the simulated cluster; in
    the last turn every session sends a prompt unrelated to its history (a sub-agent's), and the session hint
    keeps it on its replica all the same."""
    rng = np.random.default_rng(1)
    histories = [SYSTEM + list(map(int, rng.integers(3, 500, 40 + 10 * s))) for s in range(6)]
    params = dict(replicas=2, router="affinity", router_params={"capacity_tokens": KV})
    rounds: list[list[Request]] = []
    where: dict[str, set[int]] = {}
    with Cluster("tiny-random", kv_cache_tokens=KV, **params) as cluster:
        for turn in range(4):
            order = rng.permutation(6)
            if turn == 3:
                histories = [list(map(int, rng.integers(3, 500, 30))) for _ in range(6)]
            prompts = [histories[s] for s in order]
            sps = [SamplingParams(max_new_tokens=6, ignore_eos=True, session=f"s{s}") for s in order]
            outs = cluster.generate(prompts, sps)
            rounds.append([Request(100.0 * turn, f"s{s}", np.array(p), 6, output=np.array(o.token_ids))
                           for s, p, o in zip(order, prompts, outs, strict=True)])
            for s, o, d in zip(order, outs, cluster.decisions[-6:], strict=True):
                histories[s] = histories[s] + o.token_ids + list(map(int, rng.integers(3, 500, 8)))
                where.setdefault(f"s{s}", set()).add(d)
        ray_decisions = list(cluster.decisions)
        assert cluster.router.counts["session"] > 0
        cluster.check_idle()
    stream = [r for rnd in rounds for r in rnd]
    sim = simulate_cluster(stream, capacity_tokens=KV, references=False, **params)
    assert sim.decisions == ray_decisions
    assert len(set(ray_decisions)) == 2 and all(len(v) == 1 for v in where.values())


def test_bad_arguments_fail_before_or_without_leaving_actors():
    with pytest.raises(ValueError, match="unknown router"):
        Cluster("tiny-random", replicas=2, router="no-such-router")
    with pytest.raises(ValueError, match="replicas"):
        Cluster("tiny-random", replicas=0)
    with pytest.raises(ValueError, match="CPUs"):
        Cluster("tiny-random", replicas=3)  # the local Ray has 2
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        Cluster("/no-such-model-anywhere", replicas=2)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2:  # its actors were killed: their CPUs come back
        assert time.monotonic() < deadline, "the failed cluster's actors still hold their CPUs"
        time.sleep(0.1)


def test_import_radixkv_does_not_import_ray():
    code = "import sys, radixkv, radixkv.serve, radixkv.serving.app, radixkv.routing; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def samples(base: str, name: str) -> dict[str, float]:
    """``name``'s value by its ``replica`` label."""
    text = httpx.get(f"{base}/metrics").text
    return {s.labels.get("replica"): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_server_with_two_replicas_streams_reports_per_replica_and_survives_one_dying():
    args = ("tiny-random", "--kv-cache-tokens", str(KV), "--replicas", "2", "--router", "round_robin")
    prompts = [SYSTEM + [300 + i] for i in range(4)]
    want = reference(prompts)
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with running_server(*args) as (base, app):
        engine = app.state.engine
        for p, w in zip(prompts[:3], want[:3], strict=True):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": p, **body}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == w
        with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": prompts[3], "stream": True, **body},
                          timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want[3] and len(chunks) > 2
        assert engine.fleet.decisions == [0, 1, 0, 1]
        assert samples(base, "radixkv:generation_tokens_total") == {"0": 12.0, "1": 12.0}
        assert samples(base, "radixkv:replica_up") == {"0": 1.0, "1": 1.0}
        assert samples(base, "radixkv:num_requests_running") == {"0": 0.0, "1": 0.0}
        cache = httpx.get(f"{base}/v1/cache").json()["replicas"]
        assert [c["replica"] for c in cache] == [0, 1] and all(c["invariants_hold"] for c in cache)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": [1, 99999]}).status_code == 400
        long = {"prompt": prompts[0], "stream": True, **body, "max_tokens": 500}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as r:  # a client gone mid-stream
            lines = r.iter_lines()
            next(lines), next(lines)
        deadline = time.monotonic() + 30
        # the replica drops its lock and the driver's tracker its count, in either order: wait for both
        while (any(c["protected_size"] for c in httpx.get(f"{base}/v1/cache").json()["replicas"])
               or engine.fleet.tracker.views()[0].running):
            assert time.monotonic() < deadline, "the dropped stream was not aborted (its replica lock or router count)"
            time.sleep(0.05)
        assert engine.fleet.decisions == [0, 1, 0, 1, 0]
        ray.kill(engine.fleet.actors[1])
        for p, w in zip(prompts[:2], want[:2], strict=True):  # the first goes to replica 1, dies there, is retried
            r = httpx.post(f"{base}/v1/completions", json={"prompt": p, **body}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == w
        assert engine.fleet.decisions[5:] == [1, 0, 0]
        assert samples(base, "radixkv:replica_up") == {"0": 1.0, "1": 0.0}
        assert httpx.get(f"{base}/v1/cache").json()["replicas"][1] is None


def test_server_feeds_each_replica_s_cache_events_to_kv_events():
    """Two conversations sent at once spread by load; each next turn goes where its history is cached."""
    args = ("tiny-random", "--kv-cache-tokens", str(KV), "--page-size", "4", "--replicas", "2",
            "--router", "kv_events")  # its block size comes from --page-size
    a, b = list(range(3, 120)), list(range(200, 320))
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def both(base: str):
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json={"prompt": p, **body})
                                          for p in (a, b)))

    with running_server(*args) as (base, app):
        decisions = app.state.engine.fleet.decisions
        first = [r.json()["choices"][0]["token_ids"] for r in asyncio.run(both(base))]
        assert sorted(decisions) == [0, 1]
        for prompt, out in [(b, first[1]), (a, first[0]), (b, first[1])]:
            turn = prompt + out + [5]
            r = httpx.post(f"{base}/v1/completions", json={"prompt": turn, **body}, timeout=60).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt)
        assert decisions[2:] == [decisions[1], decisions[0], decisions[1]]


def test_routing_real_experiment_writes_its_rows_config_and_summary(tmp_path):
    from experiments import routing_real

    out = tmp_path / "real"
    summaries = routing_real.main(["--model", "tiny-random", "--routers", "affinity", "--sessions", "3", "--turns",
                                   "2", "--system-tokens", "30", "--user-tokens", "10", "--max-new-tokens", "3",
                                   "--kv-cache-tokens", "512", "--out", str(out)])
    assert summaries[0]["router"] == "affinity" and 0 < summaries[0]["hit_rate"] < 1
    assert sum(summaries[0]["requests_per_replica"]) == 6
    assert len((out / "rows.jsonl").read_text().splitlines()) == 6
    assert {"config.json", "summary.json"} <= {p.name for p in out.iterdir()}
    with pytest.raises(ValueError, match="--routers"):
        routing_real.main(["--routers", "nope", "--out", str(out)])

"""The server's Prometheus metrics: vLLM's names and meanings under a ``radixkv:`` prefix, so dashboards
built for vLLM carry over. Every series is labelled with ``model_name`` and ``prefix_cache``, and behind
``radixkv serve --replicas N`` with ``replica`` too (the gauges then read from each replica at scrape time).

Token counters count tokens: ``prefix_cache_queries_total`` the prompt tokens looked up at admission,
``prefix_cache_hits_total`` those found cached (vLLM's meaning), ``prompt_tokens_total`` and
``generation_tokens_total``. With a host tier (``--host-kv-cache-tokens``) the hits split by tier:
``prefix_cache_hits_by_tier_total{tier=...}`` (device, host, and storage where the engine has it), and
vLLM's names for what lies beyond the device
tier, ``external_prefix_cache_queries_total`` (prompt tokens the device tier did not hold, looked up below
it) and ``external_prefix_cache_hits_total`` (those the host tier had, loaded). Each server gets its own
registry (several can run in one process, as the tests do).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixkv.cache.tiers import DEVICE, REPORTED

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)


SERIES = (  # attribute, kind, name, help
    ("queries", "counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission."),
    ("hits", "counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache at admission."),
    ("prompt_tokens", "counter", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("generation_tokens", "counter", "generation_tokens", "Tokens generated."),
    ("preemptions", "counter", "num_preemptions", "Requests preempted (their KV freed, recomputed later)."),
    ("evicted_tokens", "counter", "evicted_tokens", "KV slots the prefix cache gave up under memory pressure."),
    ("external_queries", "counter", "external_prefix_cache_queries",
     "Prompt tokens the device tier did not hold, looked up in the lower tiers at admission."),
    ("external_hits", "counter", "external_prefix_cache_hits", "Prompt tokens found in the lower tiers (loaded)."),
    ("requests", "counter", "request_success", "Requests finished (any finish reason)."),
    ("running", "gauge", "num_requests_running", "Requests running in the engine."),
    ("waiting", "gauge", "num_requests_waiting", "Requests waiting to be admitted."),
    ("kv_usage", "gauge", "kv_cache_usage_perc", "Fraction of KV slots held by requests, 0 to 1 (vLLM's)."),
    ("ttft", "histogram", "time_to_first_token_seconds", "Seconds from arrival to the first token."),
    ("itl", "histogram", "inter_token_latency_seconds", "Seconds between a request's consecutive tokens."),
    ("e2e", "histogram", "e2e_request_latency_seconds", "Seconds from arrival to the last token."),
)
KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
ENGINE_COUNTERS = ("preemptions", "evicted_tokens", "external_queries", "external_hits")  # read at scrape time


def engine_gauges(llm) -> dict:
    """What the gauges and the engine's own counters read, taken on the engine's thread."""
    stats = llm.stats()
    free = llm.allocator.num_free + llm.cache.evictable_size  # as vLLM: cached blocks no request holds are free
    by_tier = stats["hit_tokens_by_tier"]
    return {"preemptions": stats["preemptions"], "evicted_tokens": stats["evicted_tokens"],
            "external_queries": stats["prompt_tokens"] - by_tier[DEVICE] if llm.cache.tiers else 0,
            "external_hits": stats["cached_tokens"] - by_tier[DEVICE], "tier_hits": dict(by_tier),
            "running": len(llm.running), "waiting": len(llm.waiting),
            "kv_usage": 1 - free / llm.allocator.capacity if llm.allocator.capacity else 0.0}


class Series:
    """One engine's series (one replica's, behind ``--replicas N``): the metrics as attributes."""

    def __init__(self, families: dict, labels: dict):
        for attr, family in families.items():
            if attr != "tier_hits":
                setattr(self, attr, family.labels(**labels))
        self._tier_family, self._labels = families["tier_hits"], labels
        self.tier_hits = {tier: self._tier_family.labels(**labels, tier=tier) for tier in REPORTED}  # by tier name
        self._last = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._last_tier: dict[str, int] = {}

    def update(self, gauges: dict) -> None:
        """Gauges and the engine's counters from ``engine_gauges``."""
        for name in ENGINE_COUNTERS:
            getattr(self, name).inc(max(0, gauges[name] - self._last[name]))
            self._last[name] = gauges[name]
        for tier, hits in gauges["tier_hits"].items():
            if tier not in self.tier_hits:  # a tier the engine reports beyond the usual ones (storage)
                self.tier_hits[tier] = self._tier_family.labels(**self._labels, tier=tier)
            self.tier_hits[tier].inc(max(0, hits - self._last_tier.get(tier, 0)))
            self._last_tier[tier] = hits
        for name in ("running", "waiting", "kv_usage"):
            getattr(self, name).set(gauges[name])


class ServerMetrics:
    """The counters, gauges and histograms of one server; ``render()`` is the ``/metrics`` body.

    ``replica(i)`` is one engine's ``Series`` (``replica(None)``: the one engine's). ``replicas=N``
    (``radixkv serve --replicas N``) labels every series with its ``replica`` (0 to N-1) and adds
    ``replica_up``.
    """

    def __init__(self, model_name: str, prefix_cache: str, replicas: int | None = None):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "prefix_cache": prefix_cache}
        names = [*labels, "replica"] if replicas else list(labels)
        families = {attr: KINDS[kind](f"radixkv:{name}", doc, names, registry=self.registry,
                                      **({"buckets": LATENCY_BUCKETS} if kind == "histogram" else {}))
                    for attr, kind, name, doc in SERIES}
        families["tier_hits"] = Counter("radixkv:prefix_cache_hits_by_tier", "Prompt tokens found cached at "
                                        "admission, by the tier they came from.", [*names, "tier"],
                                        registry=self.registry)
        if replicas:
            families["up"] = Gauge("radixkv:replica_up", "1 while the replica serves, 0 once it died.", names,
                                   registry=self.registry)
        self._series = [Series(families, labels | ({"replica": str(i)} if replicas else {}))
                        for i in range(replicas or 1)]

    def replica(self, index: int | None) -> Series:
        """Replica ``index``'s series (the one engine's for None)."""
        return self._series[index or 0]

    def update(self, gauges: list[dict | None]) -> None:
        """Each engine's ``engine_gauges``, one per replica (None for a dead one: its gauges go to 0, and
        ``replica_up`` with them behind ``--replicas N``)."""
        for series, g in zip(self._series, gauges, strict=True):
            if hasattr(series, "up"):
                series.up.set(0 if g is None else 1)
            if g is not None:
                series.update(g)
            else:
                for name in ("running", "waiting", "kv_usage"):
                    getattr(series, name).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The server's Prometheus metrics: vLLM's names and meanings under a ``radixkv:`` prefix, so dashboards
built for vLLM carry over. Every series is labelled with ``model_name`` and ``prefix_cache``.

Token counters count tokens: ``prefix_cache_queries_total`` the prompt tokens looked up at admission,
``prefix_cache_hits_total`` those found cached (vLLM's meaning), ``prompt_tokens_total`` and
``generation_tokens_total``. Each server gets its own registry (several can run in one process, as the
tests do).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """The counters, gauges and histograms of one server; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str, prefix_cache: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "prefix_cache": prefix_cache}
        names = list(labels)

        def counter(name: str, doc: str):
            return Counter(f"radixkv:{name}", doc, names, registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str):
            return Gauge(f"radixkv:{name}", doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str):
            return Histogram(f"radixkv:{name}", doc, names, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(**labels)

        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache at admission.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV freed, recomputed later).")
        self.evicted_tokens = counter("evicted_tokens", "KV slots the prefix cache gave up under memory pressure.")
        self.requests = counter("request_success", "Requests finished (any finish reason).")
        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV slots held by requests, 0 to 1 (vLLM's).")
        self.ttft = histogram("time_to_first_token_seconds", "Seconds from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Seconds between a request's consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.")
        self._last = {"preemptions": 0, "evicted_tokens": 0}

    def after_step(self, llm) -> None:
        """Gauges and the engine's own counters, read on the engine thread after a step."""
        stats = llm.stats()
        for name, metric in (("preemptions", self.preemptions), ("evicted_tokens", self.evicted_tokens)):
            metric.inc(max(0, stats[name] - self._last[name]))
            self._last[name] = stats[name]
        self.running.set(len(llm.running))
        self.waiting.set(len(llm.waiting))
        free = llm.allocator.num_free + llm.cache.evictable_size  # as vLLM: cached blocks no request holds are free
        self.kv_usage.set(1 - free / llm.allocator.capacity if llm.allocator.capacity else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

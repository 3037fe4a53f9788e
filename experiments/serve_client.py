"""The HTTP side of ``experiments.serve_bench``: one streamed ``/v1/completions`` request, timed (TTFT,
gaps between chunks, end to end, the usage's token counts), the async client that sends it, and the server's
Prometheus prefix-cache counters read before and after a run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any


class ServerError(ValueError):
    """The server did not answer as the benchmark needs (no health, a failed warm-up or flush)."""


def import_httpx() -> Any:
    """httpx, or its successor httpx2 where only that is installed (the same API)."""
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx
    return httpx


def payload(prompt: list[int], max_tokens: int, args: argparse.Namespace) -> dict:
    """The ``/v1/completions`` body: a token-id prompt, streamed, usage in the last chunk."""
    body: dict[str, Any] = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": args.temperature, "top_p": args.top_p, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.answer_tokens == "server":
        body["return_token_ids"] = True
    if args.temperature > 0:
        body["seed"] = args.seed
    return body


def sse_json(line: str) -> dict | None:
    """The JSON object of one server-sent-events line; None for blank lines, comments, other fields, ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None


def read_chunk(chunk: dict, rec: dict, start: float, last: float | None) -> float | None:
    """Fold one streamed chunk into ``rec`` (TTFT, inter-chunk gaps, token ids, usage); the time of the last
    chunk with content."""
    now = time.perf_counter()
    if chunk.get("error"):
        rec["error"] = f"server error: {json.dumps(chunk['error'])[:300]}"
        return last
    if chunk.get("usage"):
        rec["usage"] = chunk["usage"]
    choice = (chunk.get("choices") or [{}])[0]
    ids = choice.get("token_ids") or []
    if not (choice.get("text") or ids):
        return last
    rec["chunks"] += 1
    rec["token_ids"] = (rec.get("token_ids") or []) + list(ids)
    if last is None:
        rec["ttft"] = now - start
    else:
        rec["itl"].append(now - last)
    return now


async def stream_completion(client: Any, body: dict, rec: dict, start: float) -> None:
    """Send one streamed completion and read its chunks into ``rec``."""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec["error"] = f"HTTP {resp.status_code}: {text[:300]}"
            return
        last = None
        async for line in resp.aiter_lines():
            chunk = sse_json(line)
            if chunk is not None:
                last = read_chunk(chunk, rec, start, last)
                if rec["error"]:
                    return


async def timed_request(client: Any, prompt: list[int], max_tokens: int, args: argparse.Namespace) -> dict:
    """One request, timed: ``ok``, ``error``, ``ttft``, ``itl``, ``e2e`` and the usage's token counts."""
    httpx = import_httpx()
    rec: dict[str, Any] = {"ok": False, "error": None, "ttft": None, "itl": [], "e2e": None, "chunks": 0,
                           "usage": None, "token_ids": None}
    start = time.perf_counter()
    try:
        await asyncio.wait_for(stream_completion(client, payload(prompt, max_tokens, args), rec, start),
                               args.timeout)
    except asyncio.TimeoutError:
        rec["error"] = f"timed out after {args.timeout} s"
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - start
    usage = rec.pop("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    rec.update(prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
               cached_tokens=details.get("cached_tokens"))
    if rec["error"] is None and rec["ttft"] is None:
        rec["error"] = "no token arrived"
    if rec["completion_tokens"] is None and rec["error"] is None:
        rec["completion_tokens"] = len(rec["token_ids"] or []) or rec["chunks"]
    rec["ok"] = rec["error"] is None
    return rec


def make_client(base_url: str, args: argparse.Namespace, timeout: float) -> Any:
    """An async HTTP client for the server's root URL; no proxies from the environment, no connection cap
    (``--max-concurrency`` caps the load, a pool limit would add queueing to the TTFT)."""
    httpx = import_httpx()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def parse_prefix_metrics(text: str) -> dict[str, float] | None:
    """The summed ``<ns>:prefix_cache_queries_total`` and ``<ns>:prefix_cache_hits_total`` samples of a
    Prometheus text page (any namespace, any labels); None where it has neither."""
    names = {"prefix_cache_queries_total": "queries", "prefix_cache_hits_total": "hits"}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, rest = (line.split("{", 1)[0], line.rsplit("}", 1)[1]) if "{" in line else line.split(None, 1)
        key = names.get(name.split(":")[-1])
        if key is None:
            continue
        with contextlib.suppress(ValueError, IndexError):
            totals[key] = totals.get(key, 0.0) + float(rest.split()[0])
    return totals or None


async def prefix_metrics(client: Any) -> dict[str, float] | None:
    """The server's prefix-cache counters from ``GET /metrics``; None where it has no such page or counters."""
    try:
        resp = await client.get("/metrics", timeout=10.0)
    except import_httpx().HTTPError:
        return None
    return parse_prefix_metrics(resp.text) if resp.status_code == 200 else None


def metrics_delta(before: dict | None, after: dict | None) -> dict:
    """The run's share of the counters: queried and hit tokens, and their ratio (None where unknown)."""
    if not before or not after or "queries" not in after or "hits" not in after:
        return {"metrics_queries": None, "metrics_hits": None, "hit_rate_metrics": None}
    queries = after["queries"] - before.get("queries", 0.0)
    hits = after["hits"] - before.get("hits", 0.0)
    return {"metrics_queries": queries, "metrics_hits": hits, "hit_rate_metrics": hits / queries if queries else None}

"""experiments.serve_bench against a stub OpenAI-compatible server: every workload at a tiny size, the
closed loop of multi-turn sessions, the results file, --compare with a stub per cache. No timing thresholds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402

from experiments import serve_bench  # noqa: E402
from experiments.common import read_rows  # noqa: E402
from radixkv.workloads.synthetic import multi_turn  # noqa: E402

VOCAB = 512
TINY_MT = ["--workload", "multi-turn", "--sessions", "2", "--turns", "3", "--system-tokens", "20", "--user-tokens",
           "5", "--max-new-tokens", "4", "--vocab-size", str(VOCAB), "--max-context", "2048", "--no-progress"]


# ---------------------------------------------------------------- the stub server


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Stub:
    """What the stub server saw and holds: prompts received, sequences cached (prompt + answer)."""

    def __init__(self, cache: str, token_ids: bool, api_key: str | None):
        self.cache, self.token_ids, self.api_key = cache, token_ids, api_key
        self.prompts: list[list[int]] = []
        self.seen: list[list[int]] = []
        self.queries = self.hits = 0
        self.flushes = 0

    def complete(self, prompt: list[int], n: int) -> tuple[list[int], dict]:
        """A deterministic answer and the usage, cached tokens as a radix cache with page 1 would count them."""
        hit = 0 if self.cache == "none" else min(max((lcp(prompt, s) for s in self.seen), default=0), len(prompt) - 1)
        out = [(sum(prompt) + 7 * i) % VOCAB for i in range(n)]
        self.prompts.append(prompt)
        self.seen.append(prompt + out)
        self.queries += len(prompt)
        self.hits += hit
        return out, {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": hit}}


def stub_app(stub: Stub, model: str = "stub-model") -> fastapi.FastAPI:
    app = fastapi.FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/flush_cache")
    async def flush():
        stub.seen.clear()
        stub.flushes += 1
        return {}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE radixkv:prefix_cache_queries_total counter\n"
            f'radixkv:prefix_cache_queries_total{{model_name="{model}"}} {float(stub.queries)}\n'
            f'radixkv:prefix_cache_queries_created{{model_name="{model}"}} 1.7e9\n'
            f'radixkv:prefix_cache_hits_total{{model_name="{model}"}} {float(stub.hits)}\n')

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        if stub.api_key and request.headers.get("authorization") != f"Bearer {stub.api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        if body["model"] != model:
            return JSONResponse({"error": {"message": f"no model {body['model']}"}}, status_code=404)
        out, usage = stub.complete(body["prompt"], body["max_tokens"])
        return StreamingResponse(events(body, out, usage, stub.token_ids), media_type="text/event-stream")

    return app


async def events(body: dict, out: list[int], usage: dict, token_ids: bool):
    for i, t in enumerate(out):
        choice = {"index": 0, "text": f" w{t}", "logprobs": None, "finish_reason": "length" if i == len(out) - 1
                  else None}
        if token_ids and body.get("return_token_ids"):
            choice["token_ids"] = [t]
        yield f"data: {json.dumps({'id': 'c', 'object': 'text_completion', 'choices': [choice]})}\n\n"
        await asyncio.sleep(0)
    if body.get("stream_options", {}).get("include_usage"):
        yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stub_server(cache: str = "radix", token_ids: bool = True, api_key: str | None = None) -> Iterator[tuple]:
    """The stub on 127.0.0.1 in a thread; yields its URL and its ``Stub``."""
    stub, port = Stub(cache, token_ids, api_key), free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(stub), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the stub server did not start"
    try:
        yield f"http://127.0.0.1:{port}", stub
    finally:
        server.should_exit = True
        thread.join(10)


def run_stub_process(port: int, cache: str) -> None:
    """The stub as its own process, as ``--compare`` starts a server (SIGINT stops it)."""
    uvicorn.run(stub_app(Stub(cache, True, None)), host="127.0.0.1", port=port, log_level="warning")


# ---------------------------------------------------------------- the tests


def requests_of(path: Path) -> tuple[list[dict], list[dict]]:
    rows = read_rows(path)
    return [r for r in rows if r.get("kind") == "request"], [r for r in rows if r.get("kind") == "summary"]


def check_summary(s: dict, n: int) -> None:
    assert s["requests"] == s["ok"] == n and s["failed"] == 0
    for name in ("ttft", "itl", "e2e"):
        assert 0 <= s[f"{name}_p50"] <= s[f"{name}_p90"] <= s[f"{name}_p99"]
        assert s[f"{name}_mean"] > 0
    assert s["request_throughput"] > 0 and s["output_tok_s"] > 0
    assert s["config"]["model"] == "stub-model" and "git_commit" in s["env"]


def test_multi_turn_sessions_are_closed_loops_over_the_servers_answers(tmp_path):
    with stub_server(api_key="sk-test") as (url, stub):
        summary = serve_bench.main([*TINY_MT, "--base-url", url + "/v1", "--model", "stub-model", "--api-key",
                                    "sk-test", "--flush-cache", "--warmup-requests", "2", "--out",
                                    str(tmp_path / "mt")])
    reqs, sums = requests_of(tmp_path / "mt.jsonl")
    assert len(reqs) == 6 and len(sums) == 1 and summary[0]["ok"] == 6
    check_summary(sums[0], 6)
    assert sums[0]["config"]["api_key"] == "<redacted>" and "sk-test" not in (tmp_path / "mt.jsonl").read_text()
    assert stub.flushes == 1 and len(stub.prompts) == 2 + 6  # warm-up requests are sent, not recorded
    prompts = stub.prompts[2:]
    for s in (0, 1):
        turns = sorted((r for r in reqs if r["session"] == s), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2] and all(r["answer_source"] == "server" for r in turns)
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur["prompt_len"] == cur["prompt_tokens"] == prev["prompt_len"] + 4 + 5
            assert cur["cached_tokens"] == prev["prompt_len"] + 4  # the previous prompt and the server's answer
    later = [(a, b) for a in prompts for b in prompts if len(b) == len(a) + 9 and b[:len(a)] == a]
    assert len(later) == 4  # turns 2 and 3 of both sessions: the previous prompt, its answer, 5 new tokens
    for a, b in later:
        assert b[len(a):len(a) + 4] == [(sum(a) + 7 * i) % VOCAB for i in range(4)]  # the stub's answer
    assert sums[0]["hit_rate_usage"] == pytest.approx(sums[0]["hit_rate_metrics"])
    assert sums[0]["metrics_queries"] == sums[0]["prompt_tokens"] == sum(map(len, prompts))
    assert (tmp_path / "mt.png").exists()


def test_without_token_ids_the_workloads_answers_stand_in(tmp_path):
    with stub_server(token_ids=False) as (url, stub):
        serve_bench.main([*TINY_MT, "--base-url", url, "--model", "stub-model", "--warmup-requests", "0",
                          "--out", str(tmp_path / "w")])
    reqs, _ = requests_of(tmp_path / "w.jsonl")
    assert all(r["answer_source"] == "workload" for r in reqs)
    workload = multi_turn(seed=0, sessions=2, turns=3, system_tokens=20, session_prefix_tokens=0, user_tokens=5,
                          output_tokens=4, vocab_size=VOCAB)
    assert sorted(r.prompt.tolist() for r in workload) == sorted(stub.prompts)


def test_shared_prefix_groups_with_poisson_arrivals_and_a_concurrency_cap(tmp_path):
    with stub_server() as (url, stub):
        serve_bench.main(["--workload", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
                          "--gsp-system-prompt-len", "30", "--gsp-question-len", "6", "--gsp-output-len", "3",
                          "--vocab-size", str(VOCAB), "--request-rate", "500", "--max-concurrency", "2",
                          "--base-url", url, "--model", "stub-model", "--no-progress", "--out", str(tmp_path / "g")])
    reqs, sums = requests_of(tmp_path / "g.jsonl")
    check_summary(sums[0], 6)
    assert sorted(r["group"] for r in reqs) == [0, 0, 0, 1, 1, 1]
    assert all(r["prompt_len"] == 36 and r["completion_tokens"] == 3 for r in reqs)
    assert len({r["arrival"] for r in reqs}) == 6  # Poisson: distinct start times
    assert sum(r["cached_tokens"] >= 30 for r in reqs) == 4  # all but each group's first hit its system prompt
    assert len(stub.prompts) == 7


def test_trace_replay_scales_blocks_and_clips_to_the_context(tmp_path):
    trace = tmp_path / "trace.jsonl"
    records = [(0, 1000, [0, 1]), (10, 1500, [0, 1, 2]), (20, 700, [3, 4]), (30, 1024, [0, 1])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 600, "hash_ids": ids})
                             + "\n" for t, n, ids in records))
    with stub_server() as (url, stub):
        serve_bench.main(["--trace", str(trace), "--trace-block-tokens", "8", "--time-scale", "0.5",
                          "--max-context", "28", "--vocab-size", str(VOCAB), "--base-url", url, "--model",
                          "stub-model", "--no-progress", "--out", str(tmp_path / "t")])
    reqs, sums = requests_of(tmp_path / "t.jsonl")
    check_summary(sums[0], 4)
    assert sums[0]["config"]["workload"] == "trace"
    assert [r["arrival"] for r in reqs] == pytest.approx([0.0, 0.005, 0.01, 0.015])
    assert [r["max_tokens"] for r in reqs] == [10] * 4  # ceil(600 * 8 / 512)
    assert [r["prompt_len"] + r["clipped"] for r in reqs] == [16, 24, 11, 16]  # ceil(n * 8 / 512)
    assert [r["prompt_len"] for r in reqs] == [16, 18, 11, 16] and sums[0]["clipped_requests"] == 1
    by_len = {len(p): p for p in stub.prompts[1:]}  # after the warm-up; the two 16-token prompts are equal
    assert sorted(len(p) for p in stub.prompts[1:]) == [11, 16, 16, 18] and len(set(map(tuple, stub.prompts))) == 4
    assert by_len[18][:16] == by_len[16] and by_len[11][:8] != by_len[16][:8]  # shared blocks, shared tokens


def test_failed_requests_are_counted_not_fatal(tmp_path):
    with stub_server() as (url, _):
        summary = serve_bench.main([*TINY_MT, "--base-url", url, "--model", "other", "--warmup-requests", "0",
                                    "--out", str(tmp_path / "f")])
        with pytest.raises(serve_bench.ServerError, match="warm-up"):
            serve_bench.main([*TINY_MT, "--base-url", url, "--model", "other", "--out", str(tmp_path / "f2")])
    assert summary[0]["failed"] == 6 and summary[0]["ok"] == 0 and summary[0]["ttft_p50"] is None
    assert "HTTP 404" in summary[0]["first_error"]
    reqs, _ = requests_of(tmp_path / "f.jsonl")
    assert sum("HTTP 404" in r["error"] for r in reqs) == 2  # each session's first turn; the rest are skipped


def test_flags_are_checked_before_any_work():
    for bad in (["--base-url", "http://10.1.2.3:8000"], ["--base-url", "ftp://127.0.0.1"], ["--compare", "lru"],
                ["--sessions", "0"], ["--model", "unknown-model"], ["--max-new-tokens", "9000"],
                ["--sessions", "100", "--turns", "100"], ["--request-rate", "0"]):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(bad)
    args = serve_bench.parse_args(["--base-url", "http://10.1.2.3:8000/v1/", "--allow-remote"])
    assert args.base_url == "http://10.1.2.3:8000" and args.flush_cache is False
    args = serve_bench.parse_args(["--compare", "radix,none", "--kv-cache-tokens", "4096", "--server-args", "--x 1"])
    assert args.flush_cache is True and args.vocab_size == 49152 and args.max_context == 8192
    cmd = serve_bench.server_command(args, "radix", 1234)
    assert cmd[1:6] == ["-m", "radixkv.serve", "smollm2-135m", "--prefix-cache", "radix"]
    assert cmd[-4:] == ["--kv-cache-tokens", "4096", "--x", "1"] and "--page-size" not in cmd


def test_prometheus_counters_are_read_with_any_labels_and_namespace():
    text = ('# HELP x\nvllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30\nvllm:prefix_cache_hits_total 60\n'
            'vllm:gpu_prefix_cache_queries_total 999\nvllm:prefix_cache_hits_created 5\n')
    assert serve_bench.parse_prefix_metrics(text) == {"queries": 150.0, "hits": 60.0}
    assert serve_bench.parse_prefix_metrics("other_total 3\n") is None
    assert serve_bench.metrics_delta({"queries": 10, "hits": 0}, {"queries": 110, "hits": 25})["hit_rate_metrics"] \
        == 0.25


def test_compare_serves_each_cache_in_its_own_process(tmp_path, monkeypatch):
    tests = Path(__file__).resolve().parent
    code = (f"import sys; sys.path[:0] = [{str(tests.parent)!r}, {str(tests)!r}]; import test_serve_bench as t; "
            "t.run_stub_process(int(sys.argv[1]), sys.argv[2])")
    started = []

    def command(args, cache, port):
        started.append(port)
        return [sys.executable, "-c", code, str(port), cache]

    monkeypatch.setattr(serve_bench, "server_command", command)
    summary = serve_bench.main([*TINY_MT, "--compare", "radix,none", "--model", "stub-model", "--server-timeout",
                                "60", "--out", str(tmp_path / "c")])
    assert [s["run"] for s in summary] == ["radix", "none"] and all(s["ok"] == 6 for s in summary)
    assert summary[0]["hit_rate_usage"] > 0 == summary[1]["hit_rate_usage"]
    assert summary[1]["hit_rate_metrics"] == 0 and summary[0]["hit_rate_metrics"] > 0
    rows = read_rows(tmp_path / "c.jsonl")
    rel = next(r for r in rows if r.get("kind") == "ratios")["ratios"]
    assert [r["run"] for r in rel] == ["radix", "none"] and rel[1]["ttft_p50_vs"] == 1.0
    assert all(r["baseline"] == "none" for r in rel)
    for port in started:  # each server was stopped: nothing listens on its port
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert (tmp_path / "c-server-radix.log").exists() and (tmp_path / "c.png").exists()



@pytest.mark.slow
def test_against_radixkv_serve_the_next_turn_hits_the_servers_answer(tmp_path):
    """The real server (tiny-random, one cache): turn 2 finds turn 1's prompt and answer cached, all but the
    answer's last token (whose KV was never computed)."""
    pytest.importorskip("radixkv.serving.app")
    summary = serve_bench.main(["--compare", "radix", "--model", "tiny-random", "--sessions", "2", "--turns", "2",
                                "--system-tokens", "32", "--user-tokens", "8", "--max-new-tokens", "4", "--dtype",
                                "float32", "--page-size", "1", "--kv-cache-tokens", "1024", "--server-timeout", "120",
                                "--no-progress", "--out", str(tmp_path / "r")])
    assert summary[0]["ok"] == 4 and summary[0]["answers_from_server"] == 4
    assert summary[0]["hit_rate_usage"] == pytest.approx(summary[0]["hit_rate_metrics"])
    reqs, _ = requests_of(tmp_path / "r.jsonl")
    for r in reqs:
        if r["turn"] == 1:
            assert r["prompt_tokens"] == 40 + 4 + 8 and r["cached_tokens"] == 40 + 4 - 1

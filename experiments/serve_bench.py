"""The online benchmark: load from radixkv.workloads sent to any OpenAI-compatible server.

``python -m experiments.serve_bench --base-url http://127.0.0.1:30000 --model smollm2-135m``
drives a server that is already running (radixkv's, vLLM's, SGLang's: anything
with ``POST /v1/completions``). Prompts are sent as lists of token ids, so no
tokenizer has to agree; ``--vocab-size`` keeps them inside the model's
vocabulary and ``--max-context`` inside its context (both known for the
built-in models). Only loopback URLs are accepted unless ``--allow-remote``.

``python -m experiments.serve_bench --compare radix,hash,none`` starts
``python -m radixkv.serve MODEL --prefix-cache C`` on a free local port once
per cache, waits for ``GET /health``, runs the same load against it, stops it
(SIGINT, then SIGKILL after ``--stop-timeout``) and prints the ratios against
``none`` (or the first cache): ``x_vs`` is run / baseline, so below 1 is
better for latencies and above 1 for throughputs. Server flags
(``--kv-cache-tokens``, ``--page-size``, ...) are passed through where given;
each server's output goes to ``<out>-server-<cache>.log``.

Workloads (``--workload``):

* ``multi-turn`` (default; the main job's shape: 8 sessions x 4 turns, a
  500-token shared system prompt, 150 user tokens and 32 answer tokens per
  turn) as closed-loop sessions: turn k+1 is sent when turn k's answer has
  arrived (plus ``--think-time``), and its prompt is turn k's prompt, the
  answer's token ids, then the new user tokens. The answer's ids are the
  server's own when it returns them (the request asks with the extra field
  ``return_token_ids: true``, as vLLM does; ids are read from
  ``choices[0].token_ids`` of each streamed chunk); a server that does not
  return them gets the workload's own answer tokens as a stand-in, of the
  length the server generated (``answer_source`` in each record says which).
  With the stand-in a server caches each turn's prompt but not its own
  answer, so hits per turn are lower by the answer length than a real chat's.
  ``--answer-tokens workload`` always uses the stand-in (and never asks).
* ``shared-prefix``: SGLang bench_serving's generated-shared-prefix shape
  (``--gsp-*`` flags, SGLang's names; its published defaults are 64 groups x
  16 prompts, 2,048-token system prompts, 128-token questions, 256 output
  tokens; ours are smaller so a CPU server finishes).
* ``trace`` (or just ``--trace PATH``): a Mooncake trace replay. Each 512-token
  block of the trace becomes ``--trace-block-tokens`` tokens (prompts and
  outputs are scaled by that over 512), so prompts keep their shared blocks
  but fit a small model; the block ids are hashed into the vocabulary.
  ``--num-requests`` records are replayed.

Arrivals: with ``--request-rate R`` requests (multi-turn: sessions) start as
a Poisson process at R per second; without it all start at once, except a
trace, which keeps its timestamps times ``--time-scale``. ``--max-concurrency``
caps the requests in flight. Every request asks for ``max_tokens`` = its
output length with ``ignore_eos: true`` (``--no-ignore-eos`` drops it), is
streamed (``stream_options.include_usage``) and is cut after ``--timeout``
seconds. Before a run, ``--warmup-requests`` short requests that share no
tokens with the workload warm the server (not counted), and ``--flush-cache``
posts ``--flush-endpoint`` (``/flush_cache``; the default under ``--compare``).

Reports, one row per run (a table on stdout):

* ``request_throughput``: finished requests per second of the run (first send
  to last answer); ``input_tok_s`` / ``output_tok_s`` / ``total_tok_s``:
  prompt and generated tokens per second from the servers' ``usage``.
* ``ttft``: time to the first streamed chunk carrying text or token ids;
  ``itl``: gaps between successive such chunks, pooled over all requests;
  ``e2e``: send to last byte; ``tpot``: per request, (e2e - ttft) over its
  generated tokens after the first (vLLM's bench serve TPOT); each as mean,
  p50, p90, p99 in seconds.
* ``hit_rate_usage``: sum of ``usage.prompt_tokens_details.cached_tokens``
  over sum of ``usage.prompt_tokens`` (None where the server leaves it out);
  ``hit_rate_metrics``: the same from the server's Prometheus counters
  ``<ns>:prefix_cache_hits_total`` / ``<ns>:prefix_cache_queries_total``
  (radixkv's and vLLM's names), read before and after the run.

Files: ``results/serve_bench-<timestamp>.jsonl`` (``--out`` without extension
to choose): one row per request (``kind: request``: times, token counts,
errors), one ``kind: summary`` row per run with the full config (the flags,
API key redacted) and environment, and under ``--compare`` a ``kind: ratios``
row; ``.png``: the TTFT distribution (CDF) of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from experiments.common import DEFAULT_TRACE, environment, names_from, parser, run_cli, save_figure, table, write_rows
from experiments.serve_client import ServerError, import_httpx
from experiments.serve_client import metrics_delta as metrics_delta  # re-exported: callers found these here first
from experiments.serve_client import parse_prefix_metrics as parse_prefix_metrics
from experiments.serve_load import WORKLOADS, bench, build_sessions
from radixkv.cache import CACHES

# model name -> (vocabulary size, context length): the defaults of --vocab-size and --max-context
MODELS: dict[str, tuple[int, int]] = {
    "smollm2-135m": (49152, 8192),
    "smollm2-135m-random": (49152, 8192),
    "tiny-random": (512, 2048),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (49152, 8192),
    "HuggingFaceTB/SmolLM2-135M": (49152, 8192),
}
RATIO_KEYS = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "e2e_p50", "e2e_p99", "request_throughput",
              "output_tok_s")


# ---------------------------------------------------------------- reports


def ratios(summaries: list[dict], baseline: str = "none") -> list[dict]:
    """Every run's ``RATIO_KEYS`` over the baseline run's (``none`` if it ran, else the first)."""
    ref = next((s for s in summaries if s["run"] == baseline), summaries[0])
    rows = []
    for s in summaries:
        row = {"run": s["run"], "baseline": ref["run"]}
        for k in RATIO_KEYS:
            row[f"{k}_vs"] = s[k] / ref[k] if s.get(k) is not None and ref.get(k) else None
        rows.append(row)
    return rows


def plot(records: list[dict], runs: list[str]):
    """The TTFT distribution of every run, as CDF lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, run in enumerate(runs):
        ttft = np.sort([r["ttft"] for r in records if r["run"] == run and r["ok"]])
        if ttft.size:
            ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", color=f"C{i}", label=run)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    return fig


# ---------------------------------------------------------------- --compare: a server per cache


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args: argparse.Namespace, cache: str, port: int) -> list[str]:
    """The command that serves ``--model`` with ``cache`` on ``port`` (tests replace it with a stub's)."""
    cmd = [sys.executable, "-m", "radixkv.serve", args.model, "--prefix-cache", cache, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", args.model]
    for flag in ("kv_cache_tokens", "page_size", "block_size", "max_batch_tokens", "chunked_prefill_size", "dtype"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return cmd + shlex.split(args.server_args or "")


def log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log: Path) -> None:
    """Poll ``GET /health`` until it answers 200; a ``ServerError`` if the server exits or ``timeout`` passes."""
    httpx = import_httpx()
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerError(f"the server exited with status {proc.returncode}; {log}:\n{log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise ServerError(f"the server at {base_url} was not healthy after {timeout} s; {log}:\n{log_tail(log)}")


def stop_server(proc: subprocess.Popen, timeout: float) -> None:
    """SIGINT to the server's process group (it was started in its own), SIGKILL if it is still there after
    ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def served(args: argparse.Namespace, cache: str, out: str) -> Iterator[str]:
    """A server with ``cache`` on a free local port while the block runs; yields its base URL."""
    port = free_port()
    log = Path(f"{out}-server-{cache}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        proc = subprocess.Popen(server_command(args, cache, port), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, base_url, args.server_timeout, log)
            yield base_url
        finally:
            stop_server(proc, args.stop_timeout)


# ---------------------------------------------------------------- command line


def is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def root_url(url: str) -> str:
    """The server's root URL: ``http://h:p/v1/`` and ``http://h:p`` both give ``http://h:p``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def add_flags(p: argparse.ArgumentParser) -> None:
    """The server, the load and the request flags."""
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (ignored under --compare)")
    p.add_argument("--model", default="smollm2-135m", help="the served model's name (under --compare: MODEL)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token; redacted in the results")
    p.add_argument("--allow-remote", action="store_true", help="accept a --base-url that is not loopback")
    p.add_argument("--label", default=None, help="the run's name in the table (default: the base URL)")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids lie in [0, N) (default: by --model)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompts are cut from the end so prompt + output fit N tokens (default: by --model)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson starts per second (multi-turn: sessions); default: all at once, a trace's timestamps")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--max-requests", type=int, default=5000, help="refuse a workload of more requests")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass of every request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate max tokens even past EOS (vLLM's extra)")
    p.add_argument("--answer-tokens", choices=("server", "workload"), default="server",
                   help="what a multi-turn prompt contains as the previous answer (see the module docstring)")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests before the run")
    p.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="POST --flush-endpoint before the run (default: on under --compare)")
    p.add_argument("--flush-endpoint", default="/flush_cache", help="vLLM's is /reset_prefix_cache")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar")


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default=None, help="default: trace with --trace, else multi-turn")
    p.add_argument("--sessions", type=int, default=8, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--system-tokens", type=int, default=500, help="multi-turn: shared system prompt length")
    p.add_argument("--user-tokens", type=int, default=150, help="multi-turn: new user tokens per turn")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer tokens per turn")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between an answer and the next turn")
    p.add_argument("--gsp-num-groups", type=int, default=4, help="shared-prefix: groups (one system prompt each)")
    p.add_argument("--gsp-prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group")
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    p.add_argument("--gsp-question-len", type=int, default=128, help="shared-prefix: question tokens per prompt")
    p.add_argument("--gsp-output-len", type=int, default=32, help="shared-prefix: output tokens per prompt")
    p.add_argument("--trace", default=None, help=f"a Mooncake trace (default with --workload trace: {DEFAULT_TRACE})")
    p.add_argument("--num-requests", type=int, default=64, help="trace records replayed")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's gaps (0.1: 10x faster)")
    p.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per 512-token trace block")


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compare", default=None, help=f"start radixkv.serve per cache, e.g. radix,hash,none "
                                                   f"(of {', '.join(CACHES)})")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds after SIGINT before SIGKILL")
    for flag in ("--kv-cache-tokens", "--page-size", "--block-size", "--max-batch-tokens", "--chunked-prefill-size"):
        p.add_argument(flag, type=int, default=None, help="passed to the server where given")
    p.add_argument("--dtype", default=None, help="passed to the server where given")
    p.add_argument("--server-args", default=None, help="more server flags, one shell-quoted string")


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on other flags: the workload, the trace, vocabulary and context, the flush."""
    if args.workload is None:
        args.workload = "trace" if args.trace else "multi-turn"
    if args.workload == "trace" and args.trace is None:
        args.trace = str(DEFAULT_TRACE)
    vocab, context = MODELS.get(args.model, (None, None))
    args.vocab_size = vocab if args.vocab_size is None else args.vocab_size
    args.max_context = context if args.max_context is None else args.max_context
    if args.vocab_size is None:
        p.error(f"--vocab-size: unknown for model {args.model!r}; pass the model's vocabulary size")
    if args.flush_cache is None:
        args.flush_cache = args.compare is not None
    args.base_url = root_url(args.base_url)


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors, before any work."""
    positive = ["sessions", "turns", "user_tokens", "max_new_tokens", "gsp_num_groups", "gsp_prompts_per_group",
                "gsp_question_len", "gsp_output_len", "num_requests", "trace_block_tokens", "vocab_size",
                "max_requests", "max_concurrency", "max_context"]
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    nonneg = ["system_tokens", "gsp_system_prompt_len", "think_time", "time_scale", "warmup_requests", "temperature"]
    for name in nonneg:
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.request_rate is not None and not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if not (args.timeout > 0 and 0 < args.top_p <= 1):
        p.error("--timeout must be > 0 and --top-p in (0, 1]")
    host = urlsplit(args.base_url).hostname
    if urlsplit(args.base_url).scheme not in ("http", "https") or not host:
        p.error(f"--base-url: an http(s) URL, got {args.base_url!r}")
    if not args.allow_remote and not is_loopback(host):
        p.error(f"--base-url {args.base_url} is not a loopback address; --allow-remote to send load there")
    if args.compare is not None:
        try:
            names_from(args.compare, CACHES, "--compare")
        except ValueError as e:
            p.error(str(e))


def check_size(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The workload's bounds: request count and outputs within the context."""
    out = {"multi-turn": args.max_new_tokens, "shared-prefix": args.gsp_output_len}.get(args.workload)
    if args.max_context is not None and out is not None and out >= args.max_context:
        p.error(f"output length {out} leaves no room for a prompt in --max-context {args.max_context}")
    n = {"multi-turn": args.sessions * args.turns,
         "shared-prefix": args.gsp_num_groups * args.gsp_prompts_per_group}.get(args.workload, args.num_requests)
    if n > args.max_requests:
        p.error(f"the workload has {n} requests, more than --max-requests {args.max_requests}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0], "results/serve_bench")
    add_flags(p)
    add_workload_flags(p)
    add_compare_flags(p)
    args = p.parse_args(argv)
    resolve(p, args)
    check(p, args)
    check_size(p, args)
    return args


def config(args: argparse.Namespace) -> dict:
    """The flags as recorded: the API key redacted."""
    return {**vars(args), "api_key": "<redacted>" if args.api_key else None}


COLUMNS = ["run", "ok", "failed", "request_throughput", "output_tok_s", "ttft_mean", "ttft_p50", "ttft_p90",
           "ttft_p99", "tpot_p50", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "hit_rate_usage", "hit_rate_metrics"]


def report(args: argparse.Namespace, out: str, records: list[dict], summaries: list[dict]) -> list[dict]:
    """Print the table (and the ratios under ``--compare``), write the JSONL and the figure."""
    fmt = {c: ".4f" for c in COLUMNS if c not in ("run", "ok", "failed")}
    print(table(summaries, COLUMNS, fmt))
    for s in summaries:
        if s["failed"]:
            print(f"{s['run']}: {s['failed']} of {s['requests']} requests failed; first: {s['first_error']}")
    rows = [*records, *({"kind": "summary", **s, "config": config(args), "env": environment()} for s in summaries)]
    if args.compare is not None:
        rel = ratios(summaries)
        cols = ["run", "baseline", *[f"{k}_vs" for k in RATIO_KEYS]]
        print(table(rel, cols, {c: ".3f" for c in cols[2:]}))
        rows.append({"kind": "ratios", "ratios": rel, "config": config(args)})
    runs = [s["run"] for s in summaries]
    print("wrote", write_rows(out, rows), save_figure(plot(records, runs), out))
    return summaries


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns the summary of every run."""
    args = parse_args(argv)
    out = args.out if args.out != "results/serve_bench" else f"results/serve_bench-{time.strftime('%Y%m%d-%H%M%S')}"
    sessions = build_sessions(args)
    records: list[dict] = []
    summaries: list[dict] = []
    if args.compare is None:
        label = args.label or args.base_url
        recs, summary = asyncio.run(bench(args, args.base_url, label, sessions))
        records, summaries = recs, [summary]
    else:
        for cache in args.compare.split(","):
            with served(args, cache, out) as base_url:
                recs, summary = asyncio.run(bench(args, base_url, cache, sessions))
            records += recs
            summaries.append({**summary, "cache": cache})
    return report(args, out, records, summaries)


if __name__ == "__main__":
    run_cli(main)

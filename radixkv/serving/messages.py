"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a translation onto
the chat path: the same template, tools (``radixkv.serving.tools``), engine and cache as ``/v1/chat/completions``.

* request: ``system`` (a string or text blocks), ``messages`` whose content is a string or ``text``,
  ``tool_use`` and ``tool_result`` blocks, ``tools`` (``name``, ``description``, ``input_schema``),
  ``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``), ``max_tokens``, ``stop_sequences``,
  ``temperature``, ``top_p``, ``top_k`` (recent clients send these in ``extra_body``),
  ``output_config.format`` (a JSON schema the answer follows, by constrained decoding), ``metadata.user_id``
  (the session, as Claude Code fills it), ``session_params`` (radixkv's: a sub-agent's stream and parent),
  ``stream``.
* ``cache_control`` breakpoints (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on system blocks, tools,
  content blocks or the request are retention hints: the longest becomes ``SamplingParams.ttl`` (the cache
  holds what the request leaves at least that long, as a soft hint). More than 4 is a 400, as Anthropic.
* usage, after Anthropic's definition (the total input is ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens``): ``cache_read_input_tokens`` are the prompt tokens found in the prefix
  cache; the engine caches every prompt token it computes (as Anthropic's automatic caching caches up to
  the last block), so those are ``cache_creation_input_tokens``, and ``input_tokens`` (read from and
  written to no cache) is 0, or all the computed tokens under ``--prefix-cache none``.
* ``stop_reason``: ``tool_use`` where the answer called a tool, ``end_turn`` at EOS, ``max_tokens``,
  ``stop_sequence`` (with ``stop_sequence``, which one).

Errors have Anthropic's shape (``radixkv.serving.app``), the field named in the message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from radixkv.config import SamplingParams
from radixkv.serving.async_llm import Delta
from radixkv.serving.protocol import ApiError, CacheControl, SessionParams, session_fields
from radixkv.serving.tools import Answer, ToolPlan, assistant_call, function_tool, plan, tool_result, unique
from radixkv.structured import StructuredOutput
from radixkv.tool_calls import ToolCall

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks in one request
CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: StrictStr | None = Field(default=None, max_length=1024)


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Any  # a string or a list of blocks, read by ``Translation`` (which names a bad block)


class CountTokensRequest(BaseModel):
    """The body of ``/v1/messages/count_tokens``: the prompt's fields. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    cache_control: CacheControl | None = None  # the request-level (automatic) breakpoint
    output_config: dict | None = None  # its ``format`` (a JSON schema) constrains the answer; ``effort`` is ignored


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``."""

    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: StrictBool = False
    session_params: SessionParams | None = None

    def sampling(self, tools: ToolPlan, ttl: float | None) -> SamplingParams:
        session = session_fields(self.session_params, self.metadata and self.metadata.user_id, "metadata.user_id")
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or -1, ttl=ttl,
                              **session, **tools.sampling())


# ----------------------------------------------------------------------------------------------- the request
class TextBlock(BaseModel):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Any = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None


BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


@dataclass
class Translation:
    """A Messages body as the chat path's parts: the conversation ``conv`` (``Prompts.chat_prompt``'s
    messages), the tool plan, and the TTLs of its ``cache_control`` breakpoints."""

    conv: list[dict]
    tools: ToolPlan
    ttls: list[float]

    @property
    def ttl(self) -> float | None:
        """The longest breakpoint's TTL (None: none asked)."""
        return max(self.ttls) if self.ttls else None


def translate(body: CountTokensRequest) -> Translation:
    """``body`` as the chat path's parts; ``ApiError`` naming the field for what it cannot take."""
    ttls = [] if body.cache_control is None else [body.cache_control.ttl]
    conv: list[dict] = []
    system = system_text(body.system, ttls)
    if system is not None:
        conv.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use id -> name, of the assistant turns so far
    for i, message in enumerate(body.messages):
        blocks = content_blocks(message.content, f"messages.{i}.content", ttls)
        if message.role == "assistant":
            conv.append(assistant_turn(blocks, f"messages.{i}.content", calls))
        else:
            conv += user_turns(blocks, f"messages.{i}.content", calls)
    tools = anthropic_tools(body.tools, ttls)
    choice, name = anthropic_choice(body.tool_choice, tools)
    found = plan(tools, choice, name, choice_field="tool_choice", schema_field="tools.{}.input_schema")
    structured = output_format(body.output_config)
    if structured is not None:
        if found.structured is not None:
            raise ApiError(400, f"output_config.format cannot be combined with tool_choice {choice!r}",
                           param="output_config.format")
        found = ToolPlan(found.tools, found.parser, structured)
    if len(ttls) > MAX_BREAKPOINTS:
        raise ApiError(400, f"a request has at most {MAX_BREAKPOINTS} blocks with cache_control, found {len(ttls)}",
                       param="cache_control")
    return Translation(conv, found, ttls)


def output_format(config: dict | None) -> StructuredOutput | None:
    """``output_config.format`` (Anthropic's structured outputs: ``{"type": "json_schema", "schema": ...}``)."""
    spec = (config or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, 'the format is {"type": "json_schema", "schema": {...}}', param="output_config.format")
    try:
        return StructuredOutput(json_schema=json.dumps(spec["schema"]))
    except ValueError as e:
        raise ApiError(400, str(e), param="output_config.format.schema") from None


def checked(model: type[BaseModel], raw: Any, where: str) -> Any:
    """``raw`` as ``model``, or ``ApiError`` naming the first bad field under ``where``."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join([where, *(str(p) for p in first["loc"])])
        raise ApiError(400, first["msg"], param=field) from None


def blocks_of(content: Any, where: str, allowed: tuple[str, ...]) -> list[BaseModel]:
    """A content (a string, or a list of blocks of the ``allowed`` types) as blocks."""
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    if not isinstance(content, list):
        raise ApiError(400, "a string or a list of content blocks", param=where)
    out = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in allowed:
            raise ApiError(400, f"content block type {kind!r} is not supported here (one of {', '.join(allowed)})",
                           param=f"{where}.{j}.type")
        out.append(checked(BLOCKS[kind], raw, f"{where}.{j}"))
    return out


def content_blocks(content: Any, where: str, ttls: list[float]) -> list[BaseModel]:
    blocks = blocks_of(content, where, tuple(BLOCKS))
    ttls += [b.cache_control.ttl for b in blocks if b.cache_control is not None]
    return blocks


def system_text(system: Any, ttls: list[float]) -> str | None:
    """``system`` (a string or text blocks, joined by newlines) as one system turn's text."""
    if system is None:
        return None
    blocks = blocks_of(system, "system", ("text",))
    ttls += [b.cache_control.ttl for b in blocks if b.cache_control is not None]
    return "\n".join(b.text for b in blocks)


def assistant_turn(blocks: list[BaseModel], where: str, calls: dict[str, str]) -> dict:
    """An assistant message: its text blocks as the content, its ``tool_use`` blocks as calls."""
    text, made = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolResultBlock):
            raise ApiError(400, "tool_result blocks belong in user messages", param=f"{where}.{j}.type")
        if isinstance(b, TextBlock):
            text.append(b.text)
        else:
            made.append(assistant_call(b.id, b.name, b.input, f"{where}.{j}"))
            calls[b.id] = b.name
    return {"role": "assistant", "content": "\n".join(text)} | ({"tool_calls": made} if made else {})


def user_turns(blocks: list[BaseModel], where: str, calls: dict[str, str]) -> list[dict]:
    """A user message as turns, in order: each ``tool_result`` a tool message, each run of text one user turn."""
    turns: list[dict] = []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolUseBlock):
            raise ApiError(400, "tool_use blocks belong in assistant messages", param=f"{where}.{j}.type")
        if isinstance(b, ToolResultBlock):
            text = "\n".join(t.text for t in blocks_of(b.content, f"{where}.{j}.content", ("text",)))
            text = f"Error: {text}" if b.is_error else text
            turns.append(tool_result(b.tool_use_id, text, calls, f"{where}.{j}.tool_use_id"))
        elif turns and turns[-1]["role"] == "user":
            turns[-1]["content"] += "\n" + b.text
        else:
            turns.append({"role": "user", "content": b.text})
    return turns or [{"role": "user", "content": ""}]


def anthropic_tools(tools: list[dict] | None, ttls: list[float]) -> list[dict] | None:
    """Anthropic's client tools in OpenAI's function shape (how they are rendered), checked."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise ApiError(400, f"tool type {tool.get('type')!r} is not supported (client tools only)",
                           param=f"tools.{i}.type")
        if tool.get("input_schema") is None:
            raise ApiError(400, "a tool needs its input_schema", param=f"tools.{i}.input_schema")
        if tool.get("cache_control") is not None:
            ttls.append(checked(CacheControl, tool["cache_control"], f"tools.{i}.cache_control").ttl)
        out.append(function_tool(tool.get("name"), tool.get("description"), tool["input_schema"], f"tools.{i}",
                                 f"tools.{i}.input_schema"))
    return unique(out, "tools.{}.name")


def anthropic_choice(choice: dict | None, tools: list[dict] | None) -> tuple[str, str | None]:
    """Anthropic's ``tool_choice`` as (``auto``|``none``|``required``|``named``, the named tool)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice.get("type") not in CHOICES:
        raise ApiError(400, f"one of {', '.join(CHOICES)}", param="tool_choice.type")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise ApiError(400, "the tool to call", param="tool_choice.name")
    return CHOICES[choice["type"]], choice.get("name")


# ------------------------------------------------------------------------------------------------ the answer
@dataclass
class Reply:
    """What a Messages answer needs besides its deltas: its ``head`` (id, model), the stop sequences it was
    given, whether the engine caches prompts (usage), and ``decode`` (token ids to text: which stop sequence)."""

    head: dict
    stops: list[str]
    caching: bool
    decode: Callable[[list[int]], str]

    def usage(self, d: Delta, output_tokens: int) -> dict:
        created = d.num_prompt_tokens - d.num_cached_tokens if self.caching else 0
        return {"input_tokens": d.num_prompt_tokens - d.num_cached_tokens - created, "output_tokens": output_tokens,
                "cache_read_input_tokens": d.num_cached_tokens, "cache_creation_input_tokens": created}

    def stop(self, last: Delta, text: str, token_ids: list[int]) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence`` of an answer whose text is ``text`` (what was kept of its
        tokens ``token_ids``: a stop sequence cuts the text before it)."""
        if last.tool_calls:
            return "tool_use", None
        if last.finish_reason == "length":
            return "max_tokens", None
        if last.finish_reason == "stop" and self.stops:
            full = self.decode(token_ids)
            hits = [(i, s) for s in self.stops if (i := full.find(s, max(0, len(text) - len(s) + 1))) >= 0]
            if hits and min(hits)[0] <= len(text):
                return "stop_sequence", min(hits)[1]
        return "end_turn", None


def tool_use(call: ToolCall) -> dict:
    """A call as Anthropic's ``tool_use`` block (``toolu_`` ids)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments_dict}


def message_body(reply: Reply, deltas: list[Delta]) -> dict:
    """A whole answer as Anthropic's message."""
    last, text = deltas[-1], "".join(d.text for d in deltas)
    content = last.content if last.tool_calls else text
    blocks = ([{"type": "text", "text": content}] if content else []) + [tool_use(c) for c in last.tool_calls]
    reason, sequence = reply.stop(last, text, [t for d in deltas for t in d.token_ids])
    return {**reply.head, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": reply.usage(last, last.num_output_tokens)}


class MessageEvents:
    """One streamed answer as Anthropic's events: ``message_start``, ``ping``, a text block's
    ``content_block_start`` / ``text_delta``s / ``content_block_stop`` (text that may open a tool call held
    back), each call's ``tool_use`` block with its input as one ``input_json_delta``, ``message_delta`` (the
    stop reason, the usage) and ``message_stop``."""

    def __init__(self, reply: Reply, parser: str | None):
        self.reply, self.answer = reply, Answer(parser)
        self.blocks, self.text_open, self.text, self.token_ids = 0, False, "", []

    def start(self, first: Delta) -> list[str]:
        message = {**self.reply.head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": self.reply.usage(first, 0)}
        return [event("message_start", {"message": message}), event("ping", {})]

    def feed(self, delta: Delta) -> list[str]:
        if delta.finish_reason == "error":
            return [event("error", {"error": {"type": "api_error",
                                              "message": f"the request failed in the engine: {delta.error}"}})]
        self.text += delta.text
        self.token_ids += delta.token_ids
        shown, calls = self.answer.add(delta.text), ()
        if delta.finish_reason is not None:
            rest, calls = self.answer.end(delta)
            shown += rest
        out = self.text_delta(shown) if shown else []
        if delta.finish_reason is None:
            return out
        if self.text_open:
            out.append(self.block_stop())
        for call in calls:
            out.append(event("content_block_start", {"index": self.blocks,
                                                     "content_block": tool_use(call) | {"input": {}}}))
            out.append(event("content_block_delta", {"index": self.blocks, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
            out.append(self.block_stop())
        reason, sequence = self.reply.stop(delta, self.text, self.token_ids)
        out.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": self.reply.usage(delta, delta.num_output_tokens)}))
        return [*out, event("message_stop", {})]

    def text_delta(self, text: str) -> list[str]:
        out = []
        if not self.text_open:
            block = {"type": "text", "text": ""}
            out.append(event("content_block_start", {"index": self.blocks, "content_block": block}))
            self.text_open = True
        delta = {"type": "text_delta", "text": text}
        return [*out, event("content_block_delta", {"index": self.blocks, "delta": delta})]

    def block_stop(self) -> str:
        self.text_open, self.blocks = False, self.blocks + 1
        return event("content_block_stop", {"index": self.blocks - 1})


def event(name: str, data: dict) -> str:
    """One Server-Sent Event as Anthropic writes them: its name, and its data with ``type`` the name."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"

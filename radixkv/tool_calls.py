"""Tool calls in a model's output: what an answer that calls a tool looks like, and the parsers that find them.

The engine parses a finished answer once, with the parser its request names (``SamplingParams.tool_parser``),
so the finish kind the session policies see (``Finish.TOOL_CALL`` and the tool's name) is the tool call the
server returns. Parsers (vLLM's ``--tool-call-parser`` names where they match):

* ``hermes``: Hermes / ChatML / Qwen2.5 blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number, text around them is the answer's content. A block that is not a JSON object with a string
  ``name`` and object ``arguments`` (or an unclosed block) makes the whole answer plain text: no calls.
* ``json``: the whole answer is one call object, or a JSON list of them (what constrained decoding for
  ``tool_choice: required`` or a named function produces); anything else is plain text.

A malformed call is never an error: the text comes back as content (OpenAI's ``finish_reason: "stop"``).
O(length of the text) per parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_PARSERS = ("hermes", "json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name``, its ``arguments`` as JSON text (OpenAI's shape), and an ``id``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_dict(self) -> dict:
        """The arguments parsed (Anthropic's ``tool_use.input``)."""
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ParsedOutput:
    """An answer split into its ``content`` (the text outside tool-call blocks) and its ``calls``."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def check_parser(name: str | None) -> None:
    """``ValueError`` unless ``name`` is None or a known parser."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}: one of {', '.join(TOOL_PARSERS)}")


def parse_tool_calls(parser: str, text: str) -> ParsedOutput:
    """The tool calls ``parser`` finds in ``text`` (see the module doc); plain text when it finds none."""
    check_parser(parser)
    if parser == "json":
        calls = _calls(text.strip())
        return ParsedOutput("", calls) if calls else ParsedOutput(text)
    if HERMES_OPEN not in text:
        return ParsedOutput(text)
    calls: list[ToolCall] = []
    for block in _HERMES_BLOCK.findall(text):
        found = _calls(block.strip())
        if len(found) != 1:
            return ParsedOutput(text)
        calls += found
    content = _HERMES_BLOCK.sub("", text)
    if HERMES_OPEN in content or not calls:  # an unclosed block
        return ParsedOutput(text)
    return ParsedOutput(content.strip(), tuple(calls))


def _calls(text: str) -> tuple[ToolCall, ...]:
    """The calls in one JSON text (an object or a list of objects); () where it is anything else."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return ()
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return ()
        if not isinstance(args, dict):
            return ()
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return tuple(calls)


def hermes_block(name: str, arguments: dict | str) -> str:
    """One call written as the ``hermes`` parser reads it (an assistant turn that called a tool, re-rendered)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{HERMES_CLOSE}"

"""What ``experiments.agentic_online`` sends: scaled agent requests (``radixkv.workloads.agentic_scaled``) as
the conversations a coding agent keeps, in OpenAI's or Anthropic's message format.

* **Units are words.** A unit id picks one of 2,048 words that SmolLM2's tokenizer (and most others) keeps
  as one token after a space (``data/replay_words.txt``), so a prompt of N units is about N tokens and two
  prompts that share their first units share their first tokens, whatever server renders them.
* **One conversation per stream.** A request continues the conversation of the request it waits for (its
  stream's previous one; a sub-agent's first, its main agent's) as far as that conversation's messages are a
  prefix of its units: it keeps those messages and the answers between them, up to the last answer, and
  puts the rest of its units into one new message: a tool result where the kept answer called a tool, a
  user turn otherwise (a stream's first: a system turn, then a user turn with the last unit). A prompt that
  is not an extension of its predecessor (the trace's compacted contexts) so keeps what it shares at message
  granularity, the tokens of its new message's shared words included.
* **How answers end.** Every request carries the one tool ``run`` (its only argument an enum of one value,
  so a call is always the same short text). A request whose recorded answer called a tool asks for that
  call (``tool_choice`` naming ``run``); the others forbid tools (``"none"``) and ask for their scaled output
  length with ``ignore_eos`` (the Messages API has no such field; there the model may end early). The next
  request of the stream sends the answer back as the client got it, and a tool result after a call.

``Conversation`` works on OpenAI's messages; ``anthropic_body`` converts them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from radixkv.workloads import Request
from radixkv.workloads.agentic_scaled import UNIT_TAIL

WORDS = tuple(Path(__file__).with_name("data").joinpath("replay_words.txt").read_text().split())
TOOL_NAME = "run"
TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Run a shell command in the repository.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "enum": ["ls"]}},
                   "required": ["command"]}}}
CALL_ARGUMENTS = {"command": "ls"}


def words(units: np.ndarray) -> str:
    """The text of ``units``: one word each, a space before each. O(units)."""
    keys = np.asarray(units, dtype=np.uint64)
    picks = (keys * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(40)) % np.uint64(len(WORDS))  # a fixed mix
    return "".join(" " + WORDS[i] for i in picks.tolist())


def calls_tool(request: Request) -> bool:
    """Whether the request's recorded answer called a tool (so the replay asks for a call)."""
    return request.meta.get("stop") == "tool_use"


@dataclass
class Turn:
    """One message of a conversation and the units its content holds (None for an answer)."""

    message: dict
    units: np.ndarray | None = None


@dataclass
class Conversation:
    """One stream's messages so far (``turns``), continued by ``extend`` for each of its requests."""

    turns: list[Turn] = field(default_factory=list)

    def extend(self, units: np.ndarray) -> Conversation:
        """The conversation a request of these ``units`` sends after this one: see the module doc. A request's
        own last unit (its partial block, ``UNIT_TAIL`` and up) stays in its message but is not looked for in
        later prompts, as the trace's next prompt holds the tokens of that block. O(units)."""
        units = np.asarray(units, dtype=np.int64)
        kept, used, pos, last_answer = [], [], 0, -1  # used[i]: units of ``units`` that kept[i] accounts for
        for turn in self.turns:
            core = None if turn.units is None else turn.units[turn.units < UNIT_TAIL]
            if core is not None and (len(core) > len(units) - 1 - pos
                                     or not np.array_equal(units[pos:pos + len(core)], core)):
                break  # the new message keeps at least one unit (the request's own last one)
            kept.append(turn)
            used.append(0 if core is None else len(core))
            pos += used[-1]
            if core is None:
                last_answer = len(kept) - 1
        if last_answer >= 0:  # end on an answer: a tool result or a user turn follows it
            pos -= sum(used[last_answer + 1:])
            kept = kept[:last_answer + 1]
        elif kept:  # no answer kept: keep the system turn alone
            pos, kept = used[0], kept[:1]
        rest = units[pos:]
        if not kept:
            return Conversation([Turn({"role": "system", "content": words(rest[:-1])}, rest[:-1]),
                                 Turn({"role": "user", "content": words(rest[-1:])}, rest[-1:])])
        answer = kept[-1].message
        if answer.get("tool_calls"):
            message = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": words(rest)}
        else:
            message = {"role": "user", "content": words(rest)}
        return Conversation([*kept, Turn(message, rest)])

    def answered(self, answer: dict) -> Conversation:
        """This conversation with the assistant's ``answer`` (an OpenAI message) after it."""
        return Conversation([*self.turns, Turn(answer)])

    def messages(self) -> list[dict]:
        return [t.message for t in self.turns]


def tool_call_answer(call_id: str) -> dict:
    """The assistant message of a call of ``run`` as an OpenAI client sends it back."""
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": TOOL_NAME, "arguments": json.dumps(CALL_ARGUMENTS)}}]}


def placeholder_answer(request: Request) -> dict:
    """The answer the simulator assumes: the call where one is asked for, else ``output_len`` words of the
    request's own (a unique text, as a generated one is)."""
    if calls_tool(request):
        return tool_call_answer(f"call_{request.rid}")
    seed = int.from_bytes(hashlib.blake2b(str(request.rid).encode(), digest_size=4).digest(), "little")
    return {"role": "assistant", "content": words(np.arange(request.output_len) + (seed << 20)).lstrip()}


def openai_body(conv: Conversation, request: Request, model: str, session_params: dict) -> dict:
    """The streamed ``/v1/chat/completions`` body of one request."""
    body = {"model": model, "messages": conv.messages(), "tools": [TOOL], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0,
            "prompt_cache_key": str(request.session), "session_params": session_params}
    if calls_tool(request):
        body |= {"tool_choice": {"type": "function", "function": {"name": TOOL_NAME}}, "max_tokens": 64}
    else:
        body |= {"tool_choice": "none", "max_tokens": request.output_len, "ignore_eos": True}
    return body


def anthropic_body(conv: Conversation, request: Request, model: str) -> dict:
    """The streamed ``/v1/messages`` body of one request: the same conversation in Anthropic's blocks."""
    system, messages = "", []
    for m in conv.messages():
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "tool":
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            call = m["tool_calls"][0]
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])}]})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    fn = TOOL["function"]
    body = {"model": model, "system": system, "messages": messages, "stream": True, "temperature": 0.0,
            "tools": [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}],
            "metadata": {"user_id": str(request.session)}}
    if calls_tool(request):
        return body | {"tool_choice": {"type": "tool", "name": TOOL_NAME}, "max_tokens": 64}
    return body | {"tool_choice": {"type": "none"}, "max_tokens": request.output_len}

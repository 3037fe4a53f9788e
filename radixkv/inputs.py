"""What an engine accepts as a prompt, in one place: ``LLM``, the Ray ``Cluster``'s driver and the server all
turn text, token ids and chat conversations into checked token ids here.

``Prompts`` holds what the checks need of one engine (its tokenizer, vocabulary, context and KV capacity)
and nothing heavy, so a cluster's driver holds one for its replicas without their weights: it computes the
same ids and refuses the same prompts they would. ``batch_arguments`` is ``generate``'s argument handling.
Bad input is a ``ValueError`` that names what is wrong.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from radixkv.config import SamplingParams
from radixkv.tool_calls import HERMES_CLOSE, HERMES_OPEN, hermes_block

ROLES = ("system", "user", "assistant", "tool")
# Where a chat template has no ``tools`` (SmolLM2's ChatML), the tools go in the system turn as Hermes and
# Qwen2.5 write them, and the model is asked for the ``hermes`` parser's blocks.
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    f"{HERMES_OPEN}{HERMES_CLOSE} XML tags:\n{HERMES_OPEN}\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    f"{HERMES_CLOSE}"
)


@dataclass(frozen=True)
class Prompts:
    """One engine's prompt rules: ``tokenizer`` (None: token ids only), ``vocab_size``, ``context`` (the
    model's positions), ``kv_capacity`` (its KV pool's slots) and ``model`` (its name, for messages)."""

    tokenizer: Any
    vocab_size: int
    context: int
    kv_capacity: int
    model: str

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text through the tokenizer (no special tokens added), or a sequence of integer token ids as ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model!r} has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        try:
            if isinstance(prompt, bytes | bytearray | set | frozenset | dict):  # iterable, but not token ids
                raise TypeError
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)  # numpy arrays and tensors too
        except TypeError:
            raise ValueError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}") from None
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
        if bad:
            raise ValueError(f"token ids must be integers, got {bad[:5]}")
        return [int(t) for t in ids]

    def check(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``ValueError`` if the engine could never serve it with ``params``."""
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        need = len(ids) + params.max_new_tokens
        if need > self.context:
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                             f"context of {self.context} tokens")
        if need - 1 > self.kv_capacity:  # the last generated token's KV is never computed
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) cannot fit in the "
                             f"KV pool of {self.kv_capacity} tokens even alone")
        return ids

    def chat_prompt(self, conv: Sequence[dict], tools: Sequence[dict] | None = None,
                    known: KnownAnswers | None = None) -> list[int]:
        """One conversation's prompt token ids through the chat template (``ValueError`` for bad messages).

        A message is ``{"role", "content"}`` (roles ``ROLES``, content a string); an assistant message may
        add ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
        arguments a JSON object or its text) and a ``tool`` message ``tool_call_id``. ``tools``: OpenAI's
        function tools (``{"type": "function", "function": {"name", "description", "parameters"}}``), rendered
        by the template where it takes ``tools`` and as ``TOOLS_SYSTEM`` where it does not
        (``supports_tools``). ``known``: answers this engine gave, whose own token ids an assistant turn of the
        same text takes (see ``KnownAnswers``)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model!r} has no tokenizer or chat template")
        if isinstance(conv, str | bytes) or not isinstance(conv, Sequence) or not conv:
            raise ValueError("a conversation is a non-empty list of messages")
        for msg in conv:
            calls = isinstance(msg, dict) and bool(msg.get("tool_calls"))
            if not isinstance(msg, dict) or msg.get("role") not in ROLES or not (
                    isinstance(msg.get("content"), str) or (calls and msg.get("content") is None)):
                raise ValueError(f"bad message {msg!r}: role must be one of {ROLES} and content a string")
            if calls and msg["role"] != "assistant":
                raise ValueError(f"bad message {msg!r}: only an assistant message has tool_calls")
        if tools is not None and (isinstance(tools, str | bytes | dict) or not isinstance(tools, Sequence)):
            raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
        conv = [_with_parsed_calls(m) for m in conv]
        if self.supports_tools:
            return self.chat_ids(conv, list(tools) if tools else None, known)
        return self.chat_ids(_plain_tool_turns(conv, tools), known=known)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools``, tool calls and tool results itself."""
        template = getattr(self.tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def chat_ids(self, conv: Sequence[dict], tools: list[dict] | None = None,
                 known: KnownAnswers | None = None) -> list[int]:
        """The template's parts tokenized with their control tokens, each message's content as plain text:
        a content holding ``<|im_start|>`` gets the string's ordinary tokens, so it cannot open a turn.
        The template is rendered with a placeholder per content, split there, and the pieces tokenized
        separately (the same ids as one pass for ordinary text: the template puts a newline or a control
        token at each boundary). An assistant message's empty content beside its ``tool_calls`` is passed
        as is (templates test it), and ``tools`` and call arguments are the template's to write."""
        marks = [f"\x00radixkv-content-{i}\x00" for i in range(len(conv))]
        placeholders, marked = [], []
        for msg, mark in zip(conv, marks, strict=True):
            bare = msg.get("tool_calls") and not msg["content"]
            placeholders.append({**msg, "content": msg["content"] if bare else mark})  # msg: _with_parsed_calls
            if not bare:
                marked.append((mark, msg["content"], msg["role"]))
        text = self.tokenizer.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False,
                                                  **({"tools": tools} if tools else {}))
        ids: list[int] = []
        for mark, content, role in marked:
            before, found, text = text.partition(mark)
            if not found:
                raise ValueError(f"model {self.model!r}'s chat template drops or rewrites message contents")
            ids += self.tokenizer(before, add_special_tokens=False)["input_ids"]
            answer = known.get(content) if known is not None and role == "assistant" else None
            ids += answer if answer is not None else self.tokenizer(content, add_special_tokens=False,
                                                                     split_special_tokens=True)["input_ids"]
        return ids + list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def conversations(self, conversations: Sequence[Sequence[dict]] | Sequence[dict]) -> list[list[int]]:
        """``chat``'s argument, one conversation or a list of them, as each one's prompt ids."""
        if not isinstance(conversations, Sequence) or isinstance(conversations, str | bytes):
            raise ValueError(f"conversations must be a list of messages or of conversations, got "
                             f"{type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return [self.chat_prompt(conv) for conv in conversations]


class KnownAnswers:
    """The token ids of the answers an engine gave lately, by their text (at most ``size``, least recently
    used out first), for the next turn's prompt.

    A client sends an answer back as text in its next turn; the text tokenized again need not be the tokens
    the model sampled (constrained decoding writes ``{"`` as two tokens where the tokenizer makes one), and
    the prompt then leaves the cached context where they differ. An assistant turn whose text is an answer
    given here takes that answer's own ids instead: the next prompt extends the cached context exactly.
    Exact: the same text, and tokens the model produced for it. O(1) per answer and lookup."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def add(self, text: str, ids: Sequence[int]) -> None:
        """An answer's text and its token ids (without the stop token the template writes itself)."""
        if text:
            self._ids[text] = list(ids)
            self._ids.move_to_end(text)
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)

    def get(self, text: str) -> list[int] | None:
        ids = self._ids.get(text)
        if ids is not None:
            self._ids.move_to_end(text)
        return ids

    def __len__(self) -> int:
        return len(self._ids)


def _with_parsed_calls(msg: dict) -> dict:
    """``msg`` as the template is given it: its role, content, and where it has them its tool calls (their
    arguments as objects: templates write them with ``tojson``) and the id of the call a tool message answers.
    ``ValueError`` for a call that is not a function with a name and JSON-object arguments."""
    keep = {"role": msg["role"], "content": msg["content"] or ""}
    if msg["role"] == "tool":
        keep |= {k: msg[k] for k in ("tool_call_id", "name") if msg.get(k) is not None}
    if not msg.get("tool_calls"):
        return keep
    calls = []
    for call in msg["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise ValueError(f"bad tool call {call!r}: a function with a name and arguments as a JSON object")
        calls.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return {**keep, "tool_calls": calls}


def _plain_tool_turns(conv: list[dict], tools: Sequence[dict] | None) -> list[dict]:
    """A tool conversation in the roles a template without tools knows, as Hermes and Qwen2.5 write it:
    the tools in the system turn (``TOOLS_SYSTEM``), a call as its ``hermes`` block after the assistant's
    text, and the results of consecutive tool messages as one user turn of ``<tool_response>`` blocks.
    The tools are written the same way whatever the request's ``tool_choice``, so the turns of one
    conversation share their prefix."""
    out: list[dict] = []
    for msg in conv:
        if msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif msg.get("tool_calls"):
            text = [msg["content"]] if msg["content"] else []
            text += [hermes_block(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(text)})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        text = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def batch_arguments(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """``generate``'s arguments as two lists of the same length: one prompt (text or token ids) or a list of
    them, and one ``SamplingParams`` for all or one each (``ValueError`` otherwise)."""
    if isinstance(prompts, bytes | bytearray | set | frozenset | dict | Integral) or not (
            isinstance(prompts, str | Sequence) or hasattr(prompts, "ndim")):
        raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
    # one prompt of token ids (a list of ints, or a 1-D array or tensor) rather than a list of prompts
    token_ids = prompts.ndim == 1 if hasattr(prompts, "ndim") else bool(prompts) and isinstance(prompts[0], Integral)
    if isinstance(prompts, str) or token_ids:
        prompts = [prompts]
    one = sampling_params is None or isinstance(sampling_params, SamplingParams)
    if not one and (isinstance(sampling_params, str | bytes | dict) or not isinstance(sampling_params, Sequence)):
        raise ValueError("sampling_params must be SamplingParams, None, or a list of them, one per prompt; "
                         f"got {type(sampling_params).__name__}")
    params = [sampling_params] * len(prompts) if one else list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return list(prompts), [sampling_params_of(sp) for sp in params]


def sampling_params_of(params: object) -> SamplingParams:
    """``params``, or the defaults for None; anything else is a ``ValueError``."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams or None, got {type(params).__name__}")
    return params


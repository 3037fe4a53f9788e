"""What an engine accepts as a prompt, in one place: ``LLM``, the Ray ``Cluster``'s driver and the server all
turn text, token ids and chat conversations into checked token ids here.

``Prompts`` holds what the checks need of one engine (its tokenizer, vocabulary, context and KV capacity)
and nothing heavy, so a cluster's driver holds one for its replicas without their weights: it computes the
same ids and refuses the same prompts they would. ``batch_arguments`` is ``generate``'s argument handling.
Bad input is a ``ValueError`` that names what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from radixkv.config import SamplingParams

ROLES = ("system", "user", "assistant")


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

    def chat_prompt(self, conv: Sequence[dict]) -> list[int]:
        """One conversation's prompt token ids through the chat template (``ValueError`` for bad messages)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model!r} has no tokenizer or chat template")
        if isinstance(conv, str | bytes) or not isinstance(conv, Sequence) or not conv:
            raise ValueError("a conversation is a non-empty list of messages")
        for msg in conv:
            if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
                raise ValueError(f"bad message {msg!r}: role must be one of {ROLES} and content a string")
        return self.chat_ids(conv)

    def chat_ids(self, conv: Sequence[dict]) -> list[int]:
        """The template's parts tokenized with their control tokens, each message's content as plain text:
        a content holding ``<|im_start|>`` gets the string's ordinary tokens, so it cannot open a turn.
        The template is rendered with a placeholder per content, split there, and the pieces tokenized
        separately (the same ids as one pass for ordinary text: the template puts a newline or a control
        token at each boundary)."""
        marks = [f"\x00radixkv-content-{i}\x00" for i in range(len(conv))]
        placeholders = [{"role": m["role"], "content": mark} for m, mark in zip(conv, marks, strict=True)]
        text = self.tokenizer.apply_chat_template(placeholders, add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        for msg, mark in zip(conv, marks, strict=True):
            before, found, text = text.partition(mark)
            if not found:
                raise ValueError(f"model {self.model!r}'s chat template drops or rewrites message contents")
            ids += self.tokenizer(before, add_special_tokens=False)["input_ids"]
            ids += self.tokenizer(msg["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def conversations(self, conversations: Sequence[Sequence[dict]] | Sequence[dict]) -> list[list[int]]:
        """``chat``'s argument, one conversation or a list of them, as each one's prompt ids."""
        if not isinstance(conversations, Sequence) or isinstance(conversations, str | bytes):
            raise ValueError(f"conversations must be a list of messages or of conversations, got "
                             f"{type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return [self.chat_prompt(conv) for conv in conversations]


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


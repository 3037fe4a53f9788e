"""The OpenAI request bodies the server takes (pydantic), their sampling parameters, and OpenAI-style errors.

Fields follow the OpenAI API, with vLLM's choices where it is silent: ``top_k``, ``ignore_eos`` and
``min_tokens`` are accepted extras (``min_tokens`` above 0 is refused: not supported), ``n`` must be 1,
``stop`` holds strings. ``priority`` (an integer, vLLM's extra; 0 by default) is the request's priority for
the prefix cache (``SamplingParams.priority``: larger is kept longer by the ``priority`` eviction policy);
anything but an integer is a 400. The session hints follow existing conventions: ``prompt_cache_key`` (OpenAI's
key for requests that share a prefix) names the request's session (``SamplingParams.session``), and
``cache_control`` (Anthropic's ``{"type": "ephemeral", "ttl": "5m"}``; a TTL of ``"5m"``, ``"1h"``, any
``<number>s|m|h`` or seconds as a number) asks the cache to hold what the request leaves that long
(``SamplingParams.ttl``); a malformed one is a 400 naming it. ``session_params`` (SGLang's name) marks a
sub-agent: ``{"id": <session>, "stream": int >= 0, "parent": int >= 0}`` (``SamplingParams.session``,
``stream``, ``parent``). Unknown fields are ignored, as OpenAI does. The chat body's tool fields (``tools``,
``tool_choice``, ``response_format``) are read by ``radixkv.serving.tools``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from radixkv.config import SamplingParams


class ApiError(Exception):
    """A request the server refuses: its HTTP ``status``, a ``message``, the error ``kind`` (OpenAI's
    ``type``) and the field it names (``param``); the app writes it in the endpoint's API's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class CacheControl(BaseModel):
    """Anthropic's retention hint: hold what the request leaves for ``ttl`` (default 5 minutes, theirs)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"] = "ephemeral"
    ttl: StrictStr | StrictInt | StrictFloat = 300.0  # seconds: Anthropic's default, "5m"

    @field_validator("ttl")
    @classmethod
    def _seconds(cls, value: str | float) -> float:
        if isinstance(value, str):
            m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", value.strip())
            if m is None:
                raise ValueError(f"ttl must look like '5m', '1h' or '30s', or be seconds, got {value!r}")
            value = float(m.group(1)) * _UNITS[m.group(2)]
        if isinstance(value, bool) or not 0 <= value <= 1e12:  # NaN fails; so does an int past float's range
            raise ValueError(f"ttl must be a number of seconds from 0 to 1e12, got {str(value)[:40]}")
        return float(value)


class SessionParams(BaseModel):
    """Which session, agent stream and parent stream a request belongs to (SGLang's ``session_params`` name;
    ``stream`` and ``parent`` are radixkv's): stream 0 is the main agent, a sub-agent names its own stream and
    the stream that started it."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = Field(default=None, min_length=1, max_length=1024)
    stream: StrictInt | None = Field(default=None, ge=0)
    parent: StrictInt | None = Field(default=None, ge=0)


def session_fields(params: SessionParams | None, key: str | None, key_field: str) -> dict:
    """``SamplingParams``' session fields from ``session_params`` and the API's own session key (``key``, from
    the field ``key_field``: ``prompt_cache_key``, ``metadata.user_id``); ``ApiError`` naming the field for
    two different ids, a parent without a stream or a stream that is its own parent."""
    params = params or SessionParams()
    if params.id is not None and key is not None and params.id != key:
        raise ApiError(400, f"session_params.id ({params.id!r}) differs from {key_field} ({key!r}): give one, "
                            "or the same in both", param="session_params.id")
    if params.parent is not None and params.stream is None:
        raise ApiError(400, "session_params.parent needs session_params.stream (the sub-agent's own stream)",
                       param="session_params.parent")
    if params.parent is not None and params.parent == params.stream:
        raise ApiError(400, "session_params.parent must be another stream than session_params.stream",
                       param="session_params.parent")
    return {"session": params.id if params.id is not None else key, "stream": params.stream,
            "parent": params.parent}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = -1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    return_token_ids: StrictBool = False  # vLLM's extra: the prompt's and the completion's token ids
    priority: StrictInt = 0  # vLLM's extra: the request's priority for the prefix cache's eviction
    prompt_cache_key: StrictStr | None = Field(default=None, min_length=1, max_length=1024)  # OpenAI's: the session
    cache_control: CacheControl | None = None  # Anthropic's retention hint
    session_params: SessionParams | None = None  # SGLang's name: the session, and a sub-agent's streams

    def sampling(self, default_max_tokens: int, **extra: Any) -> SamplingParams:
        """The engine's parameters, with ``extra`` fields (the tool parser, a constraint); ``ValueError`` for
        what it refuses, ``ApiError`` for a field it names."""
        if self.n != 1:
            raise ValueError("n must be 1: one completion per request")
        if self.min_tokens:
            raise ValueError("min_tokens is not supported (only 0)")
        session = session_fields(self.session_params, self.prompt_cache_key, "prompt_cache_key")
        ttl = None if self.cache_control is None else self.cache_control.ttl
        return SamplingParams(max_new_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos,
                              priority=self.priority, ttl=ttl, **session, **extra)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[list[StrictInt]] | list[str]
    echo: StrictBool = False


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it back


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history (OpenAI's shape)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message. ``content``: a string, a list of text parts, or null beside ``tool_calls``
    (``radixkv.serving.tools`` reads the parts and names a bad one); ``developer`` is OpenAI's newer name
    for ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None  # radixkv.serving.tools checks each and names a bad one
    tool_choice: Any = None
    response_format: Any = None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

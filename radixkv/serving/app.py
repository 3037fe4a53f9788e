"""The OpenAI- and Anthropic-compatible HTTP front (FastAPI): routes, errors, streaming, metrics.

``build_app(engine, ...)`` returns the app; ``radixkv serve`` runs it under uvicorn. The routes only
queue work on the ``AsyncLLM`` and read what it sends back: they never touch the cache or the pool.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as Server-Sent Events,
``stream_options.include_usage``; tools and ``response_format``: ``radixkv.serving.tools``),
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API, errors in its shape:
``radixkv.serving.messages``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus),
``POST /flush_cache`` (SGLang's: empty the prefix cache of what no running request holds), ``GET /v1/cache``
(the cache's stats, sizes, and whether its invariants hold). Every response carries ``usage`` with
``prompt_tokens_details.cached_tokens``. ``return_token_ids: true`` (vLLM's extra) adds the prompt's and
the completion's token ids. Errors have OpenAI's shape: 400 bad input, 401 a missing or wrong API key,
404 an unknown model, 413 a body over ``max_body_bytes``, 500 a request that failed in the engine. The API
key is taken as ``Authorization: Bearer KEY`` or as ``x-api-key: KEY`` (how Anthropic's clients send it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from radixkv.inputs import KnownAnswers
from radixkv.serving import messages as anthropic
from radixkv.serving.async_llm import AsyncLLM, Delta
from radixkv.serving.metrics import ServerMetrics
from radixkv.serving.protocol import ApiError, ChatRequest, CompletionRequest, error_body
from radixkv.serving.tools import Answer, ToolPlan, chat_chunks, chat_message, openai_messages, openai_plan
from radixkv.sessions import Finish

__all__ = ["ApiError", "build_app"]  # ApiError is protocol's (tools and messages raise it too)

MAX_BODY_BYTES = 4 << 20  # a request body over this is refused with 413 (4 MiB: a 500k-token id list)
ANTHROPIC_PATH = "/v1/messages"  # its routes answer errors in Anthropic's shape
ANTHROPIC_KINDS = {"server_error": "api_error"}  # OpenAI's error types that Anthropic names otherwise


def build_app(engine: AsyncLLM, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16) -> FastAPI:
    """The server's app around a (not yet started) engine: an ``AsyncLLM``, or a ``ClusterEngine`` with the
    same interface (its ``replicas`` set: metrics, ``/v1/cache`` and ``/flush_cache`` then report per
    replica); its loop starts with the app."""
    metrics = ServerMetrics(model_name, engine.config.prefix_cache, engine.replicas)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        if isinstance(engine, AsyncLLM):  # tools' constrained decoding ready before the first request comes
            await engine.call(lambda llm: llm.grammars.warm())
        yield
        await engine.shutdown()

    app = FastAPI(title="radixkv", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    _add_guards(app, api_key, max_body_bytes)
    _add_info_routes(app, engine, metrics, model_name)
    serve = _Serving(engine, metrics, model_name, default_max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve.run(request, body, serve.completion_prompt(body), "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        serve.check_model(body.model)
        tools = openai_plan(body)
        ids = serve.chat_ids(openai_messages(body.messages), tools.tools)
        return await serve.run(request, body, ids, "chat.completion", tools)

    @app.post("/v1/messages")
    async def messages(body: anthropic.MessagesRequest, request: Request):
        return await serve.messages(request, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic.CountTokensRequest):
        serve.check_model(body.model)
        found = anthropic.translate(body)
        return {"input_tokens": len(serve.chat_ids(found.conv, found.tools.tools))}

    return app


def _add_guards(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """Body size, API key and OpenAI-shaped errors."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return _error(request, 413, f"request body over {max_body_bytes} bytes", "request_too_large")
        protected = request.url.path.startswith("/v1/") or request.url.path == "/flush_cache"
        sent = (request.headers.get("authorization"), request.headers.get("x-api-key"))
        if api_key is not None and protected and f"Bearer {api_key}" != sent[0] and api_key != sent[1]:
            return _error(request, 401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                          "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(request, 400, f"{first.get('msg', 'invalid request')}" + (f": {param}" if param else ""),
                      param=param)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(request, exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error(request, exc.status_code, str(exc.detail), "invalid_request_error")


def _add_info_routes(app: FastAPI, engine: AsyncLLM, metrics: ServerMetrics, model_name: str) -> None:
    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "radixkv", "max_model_len": engine.prompts.context}]}

    @app.get("/metrics")
    async def prometheus():
        metrics.update(await engine.gauges())  # read from the engine (each replica) when scraped
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache():
        body = await engine.flush_cache()
        return {"message": f"flushed {body['freed_tokens']} cached tokens no running request holds", **body}

    @app.get("/v1/cache")
    async def cache_state():
        return await engine.cache_state()


class _Serving:
    """One request from body to response (streamed or whole), with its metrics."""

    def __init__(self, engine: AsyncLLM, metrics: ServerMetrics, model_name: str, default_max_tokens: int):
        self.engine, self.metrics, self.model_name = engine, metrics, model_name
        self.default_max_tokens = default_max_tokens
        self.answers = KnownAnswers()  # chat answers' own token ids, for the turns that send them back
        tokenizer = engine.prompts.tokenizer
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        self.check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (send each prompt as its own request)", param="prompt")
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return list(prompt)  # token ids are checked with the request (Prompts.check)
        try:
            return self.engine.prompts.encode(prompt)
        except ValueError as e:  # no tokenizer
            raise ApiError(400, str(e), param="prompt") from None

    def chat_ids(self, conv: list[dict], tools: list[dict] | None) -> list[int]:
        """A conversation (``Prompts.chat_prompt``'s messages) and its tools through the chat template."""
        try:
            return self.engine.prompts.chat_prompt(conv, tools, known=self.answers)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    async def run(self, request: Request, body, ids: list[int], kind: str, tools: ToolPlan | None = None):
        """An OpenAI completion or chat completion of the prompt ``ids``."""
        tools = tools or ToolPlan()
        try:
            params = body.sampling(self.default_max_tokens, **tools.sampling())
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        rid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        gen, first, track = await self._start(ids, params, rid, body.stop_strings(), kind == "chat.completion")
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            answer = Answer(tools.parser) if kind == "chat.completion" else None
            events = _ChunkEvents(head, body, answer)
            return StreamingResponse(self._stream(gen, first, track, events), media_type="text/event-stream")
        deltas = await self._collect(request, gen, first, track)
        if deltas is None:
            return Response(status_code=499)
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        tokens = [t for d in deltas for t in d.token_ids]
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if kind == "chat.completion":
            choice["message"], choice["finish_reason"] = chat_message(text, last)
        else:
            choice["text"] = text
        extra = {}
        if getattr(body, "return_token_ids", False):
            choice["token_ids"], extra["prompt_token_ids"] = tokens, ids
        return {**head, "choices": [choice], "usage": _usage(last), **extra}

    async def messages(self, request: Request, body: anthropic.MessagesRequest):
        """An Anthropic Messages answer (``radixkv.serving.messages``)."""
        self.check_model(body.model)
        found = anthropic.translate(body)
        ids = self.chat_ids(found.conv, found.tools.tools)
        try:
            params = body.sampling(found.tools, found.ttl)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        rid = anthropic.message_id()
        gen, first, track = await self._start(ids, params, rid, body.stop_sequences or [], chat=True)
        tokenizer = self.engine.prompts.tokenizer
        reply = anthropic.Reply({"id": rid, "type": "message", "role": "assistant", "model": self.model_name},
                                body.stop_sequences or [], self.engine.config.prefix_cache != "none",
                                lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True))
        if body.stream:
            events = anthropic.MessageEvents(reply, found.tools.parser)
            return StreamingResponse(self._stream(gen, first, track, events), media_type="text/event-stream")
        deltas = await self._collect(request, gen, first, track)
        return Response(status_code=499) if deltas is None else anthropic.message_body(reply, deltas)

    async def _start(self, ids: list[int], params, rid: str, stop: list[str], chat: bool = False):
        """Queue the request; its generator, first delta and metrics (``ApiError`` for a prompt it refuses).
        ``chat``: a chat answer, whose token ids the next turn takes (``KnownAnswers``)."""
        track = _Track(self.metrics, self._remember if chat else None)
        gen = self.engine.generate(ids, params, rid, stop=stop)
        try:
            first = await gen.__anext__()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        track.add(first)
        return gen, first, track

    def _remember(self, text: str, ids: list[int], finish_kind: str | None) -> None:
        """A chat answer the engine finished whole (a stop string cut its text from its tokens: not that one),
        its ids without the stop token the template writes after it."""
        if finish_kind in (Finish.END_TURN, Finish.TOOL_CALL, Finish.LENGTH):
            while ids and ids[-1] in self.special:
                ids = ids[:-1]
            self.answers.add(text, ids)

    async def _collect(self, request: Request, gen, first: Delta, track) -> list[Delta] | None:
        """Every delta of a request answered whole; None where the client went away (the request is aborted)."""
        deltas = [first]

        async def collect():
            async for d in gen:
                track.add(d)
                deltas.append(d)

        task = asyncio.ensure_future(collect()) if first.finish_reason is None else None
        while task is not None and not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the generator: the request is aborted
                return None
        if task is not None:
            task.result()
        if deltas[-1].finish_reason == "error":
            raise ApiError(500, f"the request failed in the engine: {deltas[-1].error}", "server_error")
        return deltas

    async def _stream(self, gen, first: Delta, track, events) -> AsyncIterator[str]:
        """A request's Server-Sent Events: ``events.start(first)``, then ``events.feed(delta)`` for each delta."""
        try:
            for line in events.start(first):
                yield line
            delta = first
            while True:
                for line in events.feed(delta):
                    yield line
                if delta.finish_reason is not None:
                    break
                delta = await gen.__anext__()
                track.add(delta)
        finally:
            await gen.aclose()  # a client gone mid-stream: the request is aborted here


class _ChunkEvents:
    """OpenAI's chunks for one streamed (chat) completion: a chunk per delta (a chat answer's text held back
    and its calls streamed by ``chat_chunks``), the usage chunk if asked, then ``[DONE]``. ``answer``: the
    chat answer's ``Answer`` (None: a text completion)."""

    def __init__(self, head: dict, body, answer: Answer | None):
        self.head, self.body, self.answer = head, body, answer
        self.kind = "text_completion" if answer is None else "chat.completion.chunk"
        self.last: Delta | None = None
        self.role_sent, self.pending = False, []  # token ids not yet sent (return_token_ids)

    def start(self, first: Delta) -> list[str]:
        return []

    def feed(self, delta: Delta) -> list[str]:
        out = []
        if delta.finish_reason == "error":
            out.append(_sse(error_body(f"the request failed in the engine: {delta.error}", "server_error")))
        else:
            out += [_sse({**self.head, "object": self.kind, "choices": [self.choice(piece, finish)]})
                    for piece, finish in self.pieces(delta)]
            self.last = delta
        if delta.finish_reason is not None:
            if self.body.include_usage() and self.last is not None:
                out.append(_sse({**self.head, "object": self.kind, "choices": [], "usage": _usage(self.last)}))
            out.append("data: [DONE]\n\n")
        return out

    def pieces(self, delta: Delta) -> list[tuple[dict, str | None]]:
        self.pending += delta.token_ids
        if self.answer is None:
            return [({"text": delta.text}, delta.finish_reason)]
        pieces = chat_chunks(self.answer, delta)
        if not pieces and not self.role_sent and delta.token_ids:
            # the first token is out, but held back (it may open a tool call): say so now, with the role and
            # no content, as OpenAI's and vLLM's first chunk does, so a client's time to first token is true
            pieces = [({"content": ""}, None)]
        return pieces

    def choice(self, piece: dict, finish: str | None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.answer is None:
            choice["text"] = piece["text"]
        else:
            choice["delta"] = piece | ({} if self.role_sent else {"role": "assistant"})
            self.role_sent = True
        if getattr(self.body, "return_token_ids", False):
            choice["token_ids"], self.pending = self.pending, []
        return choice


class _Track:
    """One request's latency metrics as its deltas arrive at the server, and its answer for ``remember(text,
    ids, finish_kind)`` at the finish (None: not kept)."""

    def __init__(self, metrics: ServerMetrics, remember: Callable[[str, list[int], str | None], None] | None = None):
        self.metrics, self.start, self.last = metrics, time.monotonic(), None
        self.remember, self.text, self.ids = remember, [], []

    def add(self, d: Delta) -> None:
        m, now = self.metrics.replica(d.replica), time.monotonic()
        if self.last is None:
            m.queries.inc(d.num_prompt_tokens)
            m.hits.inc(d.num_cached_tokens)
            m.prompt_tokens.inc(d.num_prompt_tokens)
            if d.token_ids:
                m.ttft.observe(now - self.start)
        elif d.token_ids:
            for _ in d.token_ids:
                m.itl.observe((now - self.last) / len(d.token_ids))
        m.generation_tokens.inc(len(d.token_ids))
        self.last = now
        if self.remember is not None:
            self.text.append(d.text)
            self.ids += d.token_ids
        if d.finish_reason is not None:
            m.e2e.observe(now - self.start)
            m.requests.inc()
            if self.remember is not None:
                self.remember("".join(self.text), self.ids, d.finish_kind)


def _usage(d: Delta) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(request: Request, status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    """An error in the shape of the endpoint's API: Anthropic's on its routes (the field in the message), else
    OpenAI's."""
    if request.url.path.startswith(ANTHROPIC_PATH):
        message = message if param is None or param in message else f"{param}: {message}"
        body = {"type": "error", "error": {"type": ANTHROPIC_KINDS.get(kind, kind), "message": message}}
        return JSONResponse(body, status_code=status)
    return JSONResponse(error_body(message, kind, param, status), status_code=status)

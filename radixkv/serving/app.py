"""The OpenAI-compatible HTTP front (FastAPI): routes, errors, streaming, metrics.

``build_app(engine, ...)`` returns the app; ``radixkv serve`` runs it under uvicorn. The routes only
queue work on the ``AsyncLLM`` and read what it sends back: they never touch the cache or the pool.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as Server-Sent Events,
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus),
``POST /flush_cache`` (SGLang's: empty the prefix cache of what no running request holds), ``GET /v1/cache``
(the cache's stats, sizes, and whether its invariants hold). Every response carries ``usage`` with
``prompt_tokens_details.cached_tokens``. ``return_token_ids: true`` (vLLM's extra) adds the prompt's and
the completion's token ids. Errors have OpenAI's shape: 400 bad input, 401 a missing or wrong API key,
404 an unknown model, 413 a body over ``max_body_bytes``, 500 a request that failed in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from radixkv.serving.async_llm import AsyncLLM, Delta
from radixkv.serving.metrics import ServerMetrics
from radixkv.serving.protocol import ChatRequest, CompletionRequest, error_body

MAX_BODY_BYTES = 4 << 20  # a request body over this is refused with 413 (4 MiB: a 500k-token id list)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def build_app(engine: AsyncLLM, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16) -> FastAPI:
    """The server's app around a (not yet started) engine: an ``AsyncLLM``, or a ``ClusterEngine`` with the
    same interface (its ``replicas`` set: metrics, ``/v1/cache`` and ``/flush_cache`` then report per
    replica); its loop starts with the app."""
    metrics = ServerMetrics(model_name, engine.config.prefix_cache, engine.replicas)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
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
        return await serve.run(request, body, serve.chat_prompt(body), "chat.completion")

    return app


def _add_guards(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """Body size, API key and OpenAI-shaped errors."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return _error(413, f"request body over {max_body_bytes} bytes", "request_too_large")
        protected = request.url.path.startswith("/v1/") or request.url.path == "/flush_cache"
        if api_key is not None and protected and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{first.get('msg', 'invalid request')}" + (f": {param}" if param else ""), param=param)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")


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

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        self._check_model(body.model)
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

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        self._check_model(body.model)
        try:
            return self.engine.prompts.chat_prompt([m.model_dump() for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    async def run(self, request: Request, body, ids: list[int], kind: str):
        try:
            params = body.sampling(self.default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        rid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        track = _Track(self.metrics)
        gen = self.engine.generate(ids, params, rid, stop=body.stop_strings())
        try:
            first = await gen.__anext__()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        track.add(first)
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._events(gen, first, head, body, ids, track), media_type="text/event-stream")
        return await self._whole(request, gen, first, head, body, ids, track)

    async def _whole(self, request: Request, gen, first: Delta, head: dict, body, ids: list[int], track):
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
                return Response(status_code=499)
        if task is not None:
            task.result()
        last = deltas[-1]
        if last.finish_reason == "error":
            raise ApiError(500, f"the request failed in the engine: {last.error}", "server_error")
        text = "".join(d.text for d in deltas)
        tokens = [t for d in deltas for t in d.token_ids]
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if head["object"] == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        extra = {}
        if getattr(body, "return_token_ids", False):
            choice["token_ids"], extra["prompt_token_ids"] = tokens, ids
        return {**head, "choices": [choice], "usage": _usage(last), **extra}

    async def _events(self, gen, first: Delta, head: dict, body, ids: list[int], track) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if head["object"] == "chat.completion" else "text_completion"
        last, role_sent = first, False
        try:
            delta = first
            while True:
                if delta.finish_reason == "error":
                    yield _sse(error_body(f"the request failed in the engine: {delta.error}", "server_error"))
                    break
                choice: dict = {"index": 0, "finish_reason": delta.finish_reason, "logprobs": None}
                if chunk_kind == "text_completion":
                    choice["text"] = delta.text
                else:
                    choice["delta"] = {"content": delta.text} | ({} if role_sent else {"role": "assistant"})
                    role_sent = True
                if getattr(body, "return_token_ids", False):
                    choice["token_ids"] = delta.token_ids
                yield _sse({**head, "object": chunk_kind, "choices": [choice]})
                last = delta
                if delta.finish_reason is not None:
                    break
                delta = await gen.__anext__()
                track.add(delta)
            if body.include_usage():
                yield _sse({**head, "object": chunk_kind, "choices": [], "usage": _usage(last)})
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # a client gone mid-stream: the request is aborted here


class _Track:
    """One request's latency metrics as its deltas arrive at the server."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics, self.start, self.last = metrics, time.monotonic(), None

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
        if d.finish_reason is not None:
            m.e2e.observe(now - self.start)
            m.requests.inc()


def _usage(d: Delta) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status)

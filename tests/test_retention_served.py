"""Session retention end to end, over HTTP: what the session policies keep for an agent, proven on the server.

* An answer that ends in a tool call holds the session's context (``--eviction-policy session``) for the
  learned tool pause while other sessions fill the cache; the tool result then finds all of it cached. Under
  ``--eviction-policy lru`` the same traffic loses it.
* With a host tier and ``--prefetch``, a context demoted after a turn's end is loaded back onto the device
  before the predicted return by the server's loop, with no request in.

SmolLM2-135M (the tools need its tokenizer and chat template); the KV pool is kept small so that a few
requests fill it.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.server_fixture import running_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file and return its contents",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "the file's path"}},
                   "required": ["path"]}}}


def _chat(base: str, messages: list[dict], session: str, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 48, "temperature": 0, "prompt_cache_key": session, **extra}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _fill(base: str, sessions: list[str], tokens: int, first: int = 0) -> None:
    """Other sessions' requests of ``tokens`` prompt tokens each, one after another, no two sharing any
    (``first``: the first one's place among all a test sends)."""
    for k, session in enumerate(sessions, first):
        prompt = list(range(1000 + 2000 * k, 1000 + 2000 * k + tokens))
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_cache_key": session},
                       timeout=120)
        assert r.status_code == 200, r.text


def _tool_round(base: str, eviction: str) -> tuple[int, int]:
    """Session A calls a tool twice (the first pause teaches the hold); during the second tool's run three
    other sessions fill the cache. Returns (the context A left, the cached tokens of A's tool result)."""
    messages = [{"role": "user", "content": "Read the file notes.txt"}]
    forced = {"tools": [READ_FILE], "tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    for turn in range(2):
        answer = _chat(base, messages, "A", **forced)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        call = choice["message"]["tool_calls"][0]
        context = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] - 1
        messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": f"line {turn}"}]
        if turn == 0:
            time.sleep(3.0)  # the tool runs 3 s: the session policies learn a 6 s hold from it
    _fill(base, ["B", "C", "D"], 700)  # 2,100 tokens of other sessions in a 2,048-token pool
    back = _chat(base, messages, "A", **forced)  # the tool result, within the hold
    return context, back["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tool_call_holds_the_session_s_context_where_lru_loses_it():
    common = ("smollm2-135m", "--kv-cache-tokens", "2048", "--schedule-policy", "session", "--default-max-tokens", "48")
    with running_server(*common, "--eviction-policy", "session") as (base, _):
        context, cached = _tool_round(base, "session")
    with running_server(*common, "--eviction-policy", "lru") as (base, _):
        lru_context, lru_cached = _tool_round(base, "lru")
    print(f"session: {cached} of {context} cached; lru: {lru_cached} of {lru_context}")
    assert cached >= context  # the whole context the session left: prompt and answer
    assert lru_cached < lru_context // 4  # evicted while the tool ran


def test_the_idle_server_prefetches_a_demoted_context_before_the_session_returns():
    argv = ("smollm2-135m", "--kv-cache-tokens", "1024", "--host-kv-cache-tokens", "4096", "--prefetch",
            "--write-policy", "write_back", "--eviction-policy", "session", "--default-max-tokens", "48")
    with running_server(*argv) as (base, app):
        engine = app.state.engine
        messages = [{"role": "user", "content": "Say hello."}]
        for turn in range(2):
            answer = _chat(base, messages, "A")
            assert answer["choices"][0]["finish_reason"] == "stop", answer  # the end of a turn (EOS)
            messages += [answer["choices"][0]["message"], {"role": "user", "content": f"And again, {turn}."}]
            if turn == 0:
                time.sleep(4.0)  # the human answers after 4 s: the pause the prefetch predicts next
        finished = time.monotonic()
        context = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] - 1
        _fill(base, ["B"], 900)  # A's context (a turn's end goes first) to the host tier ...
        _fill(base, ["C"], 600, first=1)  # ... and C's evicts B's, leaving room on the device
        llm = engine.llm
        assert llm.stats()["written_tokens"] >= context  # A's context went down to the host tier
        while time.monotonic() < finished + 7.5 and not engine.prefetched:
            time.sleep(0.1)  # no request in: only the server's loop can load it
        assert engine.prefetched >= context - llm.cache.page_size
        before = dict(llm.stats()["hit_tokens_by_tier"])
        back = _chat(base, messages, "A")
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] >= context
        after = llm.stats()["hit_tokens_by_tier"]
        assert after.get("host", 0) == before.get("host", 0)  # found on the device: nothing loaded at admission

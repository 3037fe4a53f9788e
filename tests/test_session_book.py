"""The one home for agent sessions (``radixkv.sessions``): finish kinds, the book of streams awaited keyed by
(session, stream), the pause model (per stream kind, finish and tool; mean, geometric mean, quantile), and
the readers that share it (the ``session`` schedule and eviction policies, the prefetcher, the router)."""

from __future__ import annotations

import json

import pytest

from radixkv import LLM, SamplingParams
from radixkv.cache.base import NO_HINTS, CacheHints
from radixkv.scheduling.session import SessionAware
from radixkv.sessions import AWAITED_MAX, Finish, Pauses, Sessions, finish_of, is_sub_agent, session_hints
from radixkv.stack import check_idle

MAIN_TOOL = (False, Finish.TOOL_CALL, None)


def test_finish_kinds_are_the_trace_s_and_anthropic_s_names():
    assert [f.value for f in Finish] == ["tool_use", "end_turn", "length", "stop_sequence", "abort"]
    assert Finish.TOOL_CALL == "tool_use" and finish_of("end_turn") is Finish.END_TURN
    assert finish_of(None) is None and finish_of("") is None
    with pytest.raises(ValueError, match="unknown finish 'stop'"):
        finish_of("stop")
    assert not is_sub_agent(0) and not is_sub_agent(None) and is_sub_agent(2)


def test_pauses_answer_per_tool_and_fall_back_to_their_kind():
    p = Pauses()
    for seconds in (1.0, 2.0, 4.0):
        p.observe((False, Finish.TOOL_CALL, "Bash"), seconds)
    p.observe((False, Finish.TOOL_CALL, "Read"), 100.0)
    assert p.mean((False, Finish.TOOL_CALL, "Bash")) == pytest.approx(7 / 3)
    assert p.geometric_mean((False, Finish.TOOL_CALL, "Bash")) == pytest.approx(2.0)
    assert p.mean((False, Finish.TOOL_CALL, "Grep")) == pytest.approx(107 / 4)  # unseen tool: every tool's
    assert p.count(MAIN_TOOL) == 4 and p.mean((True, Finish.TOOL_CALL, None)) is None  # sub-agents: none yet
    assert p.quantile((False, Finish.TOOL_CALL, "Bash"), 0.5) == 2.0
    assert p.quantile(MAIN_TOOL, 1.0) == 100.0 and p.quantile(MAIN_TOOL, 0.0) == 1.0
    assert p.expected((False, Finish.END_TURN, None)) is None
    with pytest.raises(ValueError, match="quantile"):
        p.quantile(MAIN_TOOL, 1.5)


def test_a_sub_agent_s_finish_neither_replaces_nor_drops_its_main_agent_s_hold():
    """Regression: the book was keyed by session alone, so a sub-agent ending its turn dropped the main
    agent's tool-call hold, and a sub-agent's tool call replaced it."""
    book = Sessions()
    main = CacheHints(session="S", stream=0, stop=Finish.TOOL_CALL)
    book.finished(main, 0.0, 500)
    book.finished(CacheHints(session="S", stream=1, parent=0, stop=Finish.END_TURN), 1.0, 80)
    assert book.after(Finish.TOOL_CALL)[("S", 0)].length == 500
    book.finished(CacheHints(session="S", stream=2, parent=0, stop=Finish.TOOL_CALL), 2.0, 90)
    assert book.after(Finish.TOOL_CALL)[("S", 0)].length == 500 and len(book.after(Finish.TOOL_CALL)) == 2
    policy = SessionAware(hold=10.0)
    policy.attach(type("S", (), {"clock": lambda self: 3.0, "sessions": book})())
    assert set(policy.held(3.0)) == {("S", 0), ("S", 2)}


def test_a_sub_agent_s_return_teaches_the_sub_agent_pause_not_the_main_agent_s():
    """Regression: the eviction policy kept its pending pause by session, so a sub-agent's return was
    learned as the main agent's tool pause."""
    book = Sessions()
    book.finished(CacheHints(session="S", stream=0, stop=Finish.TOOL_CALL), 0.0)
    book.returned(CacheHints(session="S", stream=1, parent=0), 0.5)  # a sub-agent starts
    assert book.pauses.count(MAIN_TOOL) == 0
    book.returned(CacheHints(session="S", stream=0), 30.0)
    assert book.pauses.mean(MAIN_TOOL) == 30.0 and book.pauses.count((True, Finish.TOOL_CALL, None)) == 0
    book.returned(CacheHints(session="S", stream=0), 40.0)  # learned once per finish
    assert book.pauses.count(MAIN_TOOL) == 1 and book.awaited[("S", 0)].back == 30.0


def test_the_book_forgets_what_ends_without_a_return_and_stays_bounded():
    book = Sessions()
    book.finished(CacheHints(session="S", stream=0, stop=Finish.TOOL_CALL), 0.0)
    for finish in (Finish.LENGTH, Finish.STOP_SEQUENCE, Finish.ABORT, None):
        book.finished(CacheHints(session="S", stream=0, stop=Finish.TOOL_CALL), 0.0)
        book.finished(CacheHints(session="S", stream=0, stop=finish), 1.0)
        assert book.awaited == {} and book.after(Finish.TOOL_CALL) == {}
    book.finished(CacheHints(stop=Finish.TOOL_CALL), 0.0)  # no session: nothing to await
    assert book.awaited == {}
    for k in range(AWAITED_MAX + 10):
        book.finished(CacheHints(session=k, stream=0, stop=Finish.END_TURN), float(k))
    assert len(book.awaited) <= AWAITED_MAX and (AWAITED_MAX + 9, 0) in book.awaited and (0, 0) not in book.awaited
    assert len(book.after(Finish.END_TURN)) == len(book.awaited)


def test_homes_expire_idle_sessions_and_sum_active_contexts():
    book = Sessions(homes_window=10.0)
    homes = book.homes
    homes.place("A", 1, 300, 0.0)
    homes.place("B", 1, 200, 5.0)
    assert homes.home("A", 5.0) == 1 and homes.active[1] == 500
    homes.place("A", 0, 400, 6.0)  # moved
    assert homes.active == [400, 200]
    assert homes.home("B", 16.0) is None and homes.active[1] == 0 and homes.home("A", 16.0) == 0


def test_sampling_params_carry_the_session_hints_one_way():
    p = SamplingParams(session="s", stream=2, parent=0, finish="tool_use")
    assert p.finish is Finish.TOOL_CALL
    assert p.cache_hints == session_hints(CacheHints(), "s", 2, 0, Finish.TOOL_CALL)
    assert p.cache_hints.parent == 0 and p.cache_hints.stop == "tool_use"
    for bad in ({"parent": 0}, {"stream": 1, "parent": 1}, {"stream": 1, "parent": -1}, {"finish": "stop"},
                {"tool_parser": "qwen"}, {"structured": "json"}):
        with pytest.raises(ValueError, match="invalid SamplingParams"):
            SamplingParams(**bad)


def _finishes(llm: LLM) -> list[CacheHints]:
    seen = []
    insert = llm.cache.insert

    def logged(tokens, indices, namespace=None, hints=NO_HINTS):
        if hints.stop is not None:
            seen.append(hints)
        return insert(tokens, indices, namespace, hints)

    llm.cache.insert = logged
    return seen


def test_the_engine_says_how_each_answer_ended():
    """EOS ends the turn, a stop token is a stop sequence, the budget a length, an abort an abort; a caller
    that knows (a trace replay) declares it. Each reaches the finish's hints and the output."""
    llm = LLM("tiny-random", kv_cache_tokens=1024)
    seen = _finishes(llm)
    first = llm.generate([[1, 2, 3]], SamplingParams(8, ignore_eos=True))[0].token_ids[0]
    outs = llm.generate([[1, 2, 3]] * 3, [SamplingParams(8, stop_token_ids=[first]),
                                           SamplingParams(4, ignore_eos=True),
                                           SamplingParams(4, ignore_eos=True, finish="tool_use", session="s")])
    assert [o.finish_kind for o in outs] == [Finish.STOP_SEQUENCE, Finish.LENGTH, Finish.TOOL_CALL]
    rid = llm.add_request([4, 5, 6, 7], SamplingParams(8, session="s", stream=1, parent=0))
    llm.step()
    llm.abort(rid)
    assert [o.finish_kind for o in llm.step()] == [Finish.ABORT]
    assert [h.stop for h in seen[-4:]] == ["stop_sequence", "length", "tool_use", "abort"]
    assert seen[-1].session == "s" and seen[-1].stream == 1 and seen[-1].parent == 0
    assert llm.scheduler.sessions.awaited[("s", None)].hints.stop == Finish.TOOL_CALL
    check_idle(llm.cache, llm.allocator)


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2-135m", kv_cache_tokens=4096)


READ_FILE = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_a_forced_tool_call_parses_and_its_finish_names_the_tool(smol):
    """Constrained decoding (xgrammar) in the Hermes form: the parser finds the call, its arguments follow
    the schema, and the session book learns it was a ``read_file`` call."""
    from radixkv.structured import StructuredOutput

    seen = _finishes(smol)
    schema = {"type": "object", "properties": {"name": {"const": "read_file"}, "arguments": READ_FILE},
              "required": ["name", "arguments"]}
    spec = StructuredOutput(json_schema=json.dumps(schema), begin="<tool_call>\n", end="\n</tool_call>")
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a text file",
                                             "parameters": READ_FILE}}
    system = (f"You are a function calling AI model. Here are the available tools: <tools>\n{json.dumps(tool)}\n"
              "</tools>\nFor each function call return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags.")
    prompt = smol.chat_prompt([{"role": "system", "content": system},
                               {"role": "user", "content": "Read the file notes.txt"}])
    out = smol.generate([prompt], SamplingParams(80, structured=spec, tool_parser="hermes", session="a"))[0]
    assert out.finish_reason == "stop" and out.finish_kind == Finish.TOOL_CALL, out.text
    (call,) = out.tool_calls
    assert call.name == "read_file" and isinstance(json.loads(call.arguments)["path"], str)
    assert seen[-1].stop == Finish.TOOL_CALL and seen[-1].tool == "read_file"
    assert smol.scheduler.sessions.awaited[("a", None)].kind == (False, Finish.TOOL_CALL, "read_file")
    smol.check_idle()


def test_a_constrained_request_recomputed_after_a_preemption_starts_its_grammar_again(smol):
    from radixkv.structured import StructuredOutput

    spec = StructuredOutput(json_object=True)
    prompt = smol.chat_prompt([{"role": "user", "content": "Give me a JSON object with a name."}])
    want = smol.generate([prompt], SamplingParams(24, structured=spec))[0]
    rid = smol.add_request(prompt, SamplingParams(24, structured=spec))
    for _ in range(3):
        smol.step()
    (s,) = [s for s in smol.running if s.rid == rid]
    smol.scheduler.preempt(s)  # its output is recomputed from the start: so is its grammar's state
    outs = []
    while smol.has_unfinished():
        outs += smol.step()
    assert [o.token_ids for o in outs if o.request_id == rid] == [want.token_ids]
    smol.check_idle()


def test_a_schema_the_grammar_library_rejects_is_a_value_error_before_anything_is_queued(smol):
    from radixkv.structured import StructuredOutput, check_schema

    with pytest.raises(ValueError, match="constrained decoding"):
        StructuredOutput(json_schema='{"type": "string", "pattern": "(("}')
    with pytest.raises(ValueError, match="constrained decoding"):
        check_schema({"type": "objectx"})
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    assert not smol.has_unfinished()

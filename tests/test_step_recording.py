"""Steps recorded for the simulator's cost model: the engine's copies between tiers counted and timed per step,
``radixkv serve --record-steps PATH`` writing them as they end, ``CostModel.fit`` turning them into time
constants and bandwidths, ``CostModel.load`` reading presets and files, and ``experiments.cost_fit --steps``."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from radixkv import LLM, SamplingParams
from radixkv.cost import FIT_WEIGHTINGS, TIME_CONSTANTS, CostModel, StepRecord
from radixkv.sessions import Finish
from radixkv.step_file import StepWriter, read_steps

SHORT = SamplingParams(max_new_tokens=2, ignore_eos=True)
FIRST, OTHER = list(range(3, 51)), list(range(100, 148))  # the second pushes the first out of a 64-token pool


def test_a_host_hit_is_loaded_and_timed_in_the_steps_record():
    llm = LLM("tiny-random", kv_cache_tokens=64, host_kv_cache_tokens=512, record_steps=True)
    for prompt in (FIRST, OTHER, FIRST):
        llm.generate([prompt], SHORT)
    stats, log = llm.stats(), llm.step_log
    assert stats["hit_tokens_by_tier"]["host"] == len(FIRST) - 1
    assert sum(r.loaded_tokens for r in log) == stats["loaded_tokens"] >= len(FIRST) - 1
    assert sum(r.written_tokens for r in log) == stats["written_tokens"] > 0
    assert sum(r.load_seconds for r in log) > 0 and sum(r.write_seconds for r in log) > 0
    assert all(r.load_seconds == 0 for r in log if not r.loaded_tokens)
    assert sum(r.storage_loaded_tokens for r in log) == 0 and all(r.computes for r in log)
    cost = CostModel.fit(log, kv_bytes_per_token=llm.pool.bytes_per_slot)
    loaded, seconds = sum(r.loaded_tokens for r in log), sum(r.load_seconds for r in log)
    assert cost.host_bandwidth == pytest.approx(llm.pool.bytes_per_slot * loaded / seconds)
    assert cost.kv_bytes_per_token == llm.pool.bytes_per_slot
    assert cost.storage_bandwidth == CostModel().storage_bandwidth  # nothing loaded from storage
    llm.reset_stats()
    assert llm.step_log == [] and llm.mover.take_times() == {}


def test_an_engine_that_records_nothing_times_no_copy():
    llm = LLM("tiny-random", kv_cache_tokens=64, host_kv_cache_tokens=512)
    for prompt in (FIRST, OTHER, FIRST):
        llm.generate([prompt], SHORT)
    assert llm.stats()["loaded_tokens"] > 0 and not llm.mover.timed and llm.mover.take_times() == {}


def test_a_prefetch_alone_is_a_step_of_loads_the_time_fit_skips():
    llm = LLM("tiny-random", kv_cache_tokens=512, host_kv_cache_tokens=1024, write_policy="write_back",
              prefetch=True, record_steps=True)
    clock = [0.0]
    llm.scheduler.clock = lambda: clock[0]
    tool = SamplingParams(4, session="s", stream=0, finish=Finish.TOOL_CALL)
    prompt = list(range(1, 201))
    first = llm.generate([prompt], tool)[0]
    clock[0] = 10.0
    llm.generate([prompt + first.token_ids + [5, 6]], tool)
    llm.allocator.free(llm.cache.evict(llm.cache.evictable_size))  # written back: the host keeps it
    clock[0] = 20.0
    before = len(llm.step_log)
    loaded = llm.prefetch()
    [record] = llm.step_log[before:]
    assert loaded > 0 and record.loaded_tokens == loaded and record.load_seconds > 0 and not record.computes


def test_step_records_read_old_lines_and_reject_others():
    old = {"prefill_tokens": 3, "attention_pairs": 6.0, "decodes": 1, "seconds": 0.1, "model_seconds": 0.09}
    assert StepRecord.from_dict(old) == StepRecord(3, 6.0, 1, 0.1, 0.09)
    for bad in ({**old, "color": 1}, {"prefill_tokens": 3}, [1, 2]):
        with pytest.raises(ValueError, match="step record"):
            StepRecord.from_dict(bad)
    record = StepRecord.of([0, 8], [8, 1], 0.5, 0.4, [True, False],
                           {("host", "device"): (5, 0.01), ("storage", "device"): (2, 0.02),
                            ("device", "host"): (4, 0.03), ("device", "storage"): (4, 0.04)})
    assert (record.prefill_tokens, record.decodes, record.loaded_tokens, record.storage_loaded_tokens) == (8, 1, 5, 2)
    assert record.written_tokens == 8 and record.write_seconds == pytest.approx(0.07)


def synthetic_steps(true: CostModel, n: int = 80) -> list[StepRecord]:
    """Steps of a replay as ``true`` prices them: prefill chunks and decodes mixed in one step, host loads on
    some, a few prefetches of loads alone."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        tokens = int(rng.integers(1, 600)) if i % 2 else 0
        decodes = int(rng.integers(0 if tokens else 1, 12))
        chunks = int(rng.integers(1, 4)) if tokens else 0
        pairs = tokens * (int(rng.integers(0, 3000)) + (tokens + 1) / 2)
        loaded = int(rng.integers(1, 2000)) if i % 5 == 0 else 0
        if i % 17 == 16:  # a due prefetch while no request was in
            tokens = decodes = pairs = chunks = 0
        load = true.load_time("host", loaded)
        compute = true.step_time(tokens, pairs, decodes, chunks) if tokens or decodes else 0.0
        out.append(StepRecord(tokens, pairs, decodes, compute + load, compute, loaded_tokens=loaded,
                              load_seconds=load, written_tokens=tokens, write_seconds=tokens * 1e-7,
                              prefill_seqs=chunks))
    return out


TRUE = CostModel(prefill_per_token=4e-4, attention_per_pair=3e-8, prefill_per_seq=0.002, decode_step=0.02,
                 decode_per_seq=0.003, step_overhead=0.001, kv_bytes_per_token=512.0, host_bandwidth=3e9)


def test_the_fit_recovers_time_constants_and_host_bandwidth_from_mixed_steps_with_loads():
    fitted = CostModel.fit(synthetic_steps(TRUE), kv_bytes_per_token=512)
    for name in (*TIME_CONSTANTS, "kv_bytes_per_token", "host_bandwidth"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-9)
    assert fitted.storage_bandwidth == CostModel().storage_bandwidth  # nothing loaded from storage
    with pytest.raises(ValueError, match="at least 5"):
        CostModel.fit([r for r in synthetic_steps(TRUE) if not r.computes])


def test_steps_recorded_before_chunks_were_counted_fit_without_the_per_chunk_term():
    """A step file from before ``prefill_seqs`` was recorded (None): the per-chunk constant stays 0, the others
    are fitted as before; ``record_time`` charges such a step one chunk where it prefilled."""
    true = replace(TRUE, prefill_per_seq=0.0)
    old = [replace(r, prefill_seqs=None) for r in synthetic_steps(true)]
    fitted = CostModel.fit(old, kv_bytes_per_token=512)
    assert fitted.prefill_per_seq == 0.0
    assert fitted.prefill_per_token == pytest.approx(true.prefill_per_token, rel=1e-6)
    step = StepRecord(100, 5050.0, 2, 1.0, 1.0, prefill_seqs=None)
    assert TRUE.record_time(step) == pytest.approx(TRUE.step_time(100, 5050.0, 2, 1))
    assert TRUE.record_time(replace(step, prefill_seqs=3)) - TRUE.record_time(step) == pytest.approx(0.004)


def test_a_recorded_step_counts_its_prefill_chunks():
    step = StepRecord.of([0, 10, 5], [7, 3, 1], 0.1, 0.09, [True, True, False])
    assert (step.prefill_seqs, step.prefill_tokens, step.decodes) == (2, 10, 1)
    assert StepRecord.from_dict({**asdict(step), "prefill_seqs": None}).prefill_seqs is None


def test_both_weightings_recover_exact_constants_and_differ_on_noisy_steps():
    exact = synthetic_steps(TRUE)
    for weighting in FIT_WEIGHTINGS:
        fitted = CostModel.fit(exact, kv_bytes_per_token=512, weighting=weighting)
        assert fitted.prefill_per_token == pytest.approx(TRUE.prefill_per_token, rel=1e-6)
    # Long steps 20% slower than the model: an absolute fit follows them, a relative one much less.
    noisy = [replace(r, seconds=r.seconds * (1.2 if r.prefill_tokens > 500 else 1.0)) for r in exact]
    rel = CostModel.fit(noisy, kv_bytes_per_token=512, weighting="relative")
    ab = CostModel.fit(noisy, kv_bytes_per_token=512, weighting="absolute")
    long = max(noisy, key=lambda r: r.seconds)
    def error(c: CostModel) -> float:
        return abs(c.step_time(long.prefill_tokens, long.attention_pairs, long.decodes) + long.load_seconds
                   - long.seconds)
    assert error(ab) < error(rel)
    with pytest.raises(ValueError, match="unknown weighting"):
        CostModel.fit(exact, weighting="squared")


def test_cost_model_load_reads_a_preset_a_dict_file_and_a_fit_file(tmp_path):
    assert CostModel.load("llama3-8b-h100") == CostModel.preset("llama3-8b-h100")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(asdict(TRUE)))
    assert CostModel.load(plain) == TRUE and CostModel.load(str(plain)) == TRUE
    partial = tmp_path / "calibrated.json"  # multiturn --calibrate's: the time constants alone
    partial.write_text(json.dumps({"decode_step": 0.5}))
    assert CostModel.load(partial) == CostModel(decode_step=0.5)
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"config": {}, "cost": asdict(TRUE), "fit_steps": 9}))
    assert CostModel.load(fit) == TRUE
    older = tmp_path / "older.json"  # cost_fit before "cost": the time constants under "fitted"
    older.write_text(json.dumps({"fitted": {"step_overhead": 0.25}, "fit_steps": 9}))
    assert CostModel.load(older) == CostModel(step_overhead=0.25)


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]", '{"decode_step": -1}', '{"color": 1}',
                                     '{"cost": {"color": 1}}'])
def test_cost_model_load_rejects_what_is_neither_a_preset_nor_a_cost_file(tmp_path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="a preset .* a JSON file of CostModel constants"):
        CostModel.load(path if content is not None else "h100-of-the-future")


def test_cost_fit_fits_step_files_into_a_file_the_simulator_reads(tmp_path):
    from experiments import cost_fit

    records = synthetic_steps(TRUE)
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path, part in zip(paths, (records[:40], records[40:]), strict=True):
        writer = StepWriter(path, 512, {"model": "tiny-random"})
        writer.write(part)
        writer.close()
    with paths[1].open("a") as f:
        f.write('{"prefill_tokens": 12, "attention')  # a server killed mid-line: the steps before it stand
    assert read_steps(paths[1]).records == records[40:]
    got = cost_fit.main(["--steps", *map(str, paths), "--out", str(tmp_path / "fit")])
    loaded = CostModel.load(tmp_path / "fit.json")
    assert loaded == CostModel.from_dict(got["cost"]) and got["fit_steps"] == len(records)
    for name in (*TIME_CONSTANTS, "kv_bytes_per_token", "host_bandwidth"):
        assert getattr(loaded, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-9)
    assert got["step_errors"]["max_abs_error"] < 1e-6 and got["copies"]["loaded_tokens"] > 0
    assert [s["steps"] for s in got["sources"]] == [40, len(records) - 40]
    assert set(got["step_errors"]["by_class"]) <= {"decode", "prefill <64", "prefill 64-1023", "prefill 1024+"}
    plain = cost_fit.main(["--steps", *map(str, paths), "--no-per-chunk", "--out", str(tmp_path / "fit0")])
    assert plain["cost"]["prefill_per_seq"] == 0.0 and plain["per_chunk"] is False
    assert plain["step_errors"]["max_abs_error"] > 1e-3  # the chunks' seconds land on the other constants
    other = tmp_path / "c.jsonl"
    StepWriter(other, 1024, {}).close()
    with pytest.raises(ValueError, match="different KV bytes per token"):
        cost_fit.main(["--steps", str(paths[0]), str(other), "--out", str(tmp_path / "x")])
    (tmp_path / "plain.jsonl").write_text(json.dumps(asdict(records[0])) + "\n")
    with pytest.raises(ValueError, match="not a step file"):
        cost_fit.main(["--steps", str(tmp_path / "plain.jsonl"), "--out", str(tmp_path / "x")])


def test_the_server_writes_its_steps_as_they_end(tmp_path):
    import openai
    from server_fixture import running_server

    path = tmp_path / "steps.jsonl"
    with running_server("tiny-random", "--kv-cache-tokens", "64", "--host-kv-cache-tokens", "512",
                        "--record-steps", str(path)) as (base, app):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for prompt in (FIRST, OTHER, FIRST):
            c.completions.create(model="tiny-random", prompt=prompt, max_tokens=2, temperature=0)
        written = read_steps(path).records  # while it serves: flushed as each step ends
        engine = app.state.engine
        assert len(written) >= 6 and engine.llm.step_log == []  # drained into the file
        kv = engine.llm.pool.bytes_per_slot
    steps = read_steps(path)
    assert steps.header["format"] == "radixkv-steps/1" and steps.kv_bytes_per_token == kv
    assert steps.header["config"]["host_capacity_tokens"] == 512 and steps.header["config"]["record_steps"]
    assert steps.records[: len(written)] == written
    assert sum(r.prefill_tokens for r in steps.records) == 3 * len(FIRST) - (len(FIRST) - 1)
    assert sum(r.loaded_tokens for r in steps.records) >= len(FIRST) - 1
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_the_server_records_one_engine_only(capsys, tmp_path):
    from radixkv.serve import build, main, parser
    from radixkv.serving.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="--record-steps records one engine's steps"):
        build(parser().parse_args(["tiny-random", "--replicas", "2", "--record-steps", str(tmp_path / "s")]))
    assert main(["tiny-random", "--replicas", "2", "--record-steps", str(tmp_path / "s")]) == 2
    assert "--replicas 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="record_steps=True"):
        AsyncLLM(LLM("tiny-random", kv_cache_tokens=64), record_steps=tmp_path / "s")

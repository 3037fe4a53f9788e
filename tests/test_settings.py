"""One configuration: every cache and scheduling setting is defined once (``StackConfig``), the engine's config
composes it, and every spelling users know (keyword aliases, vLLM's and SGLang's flags) reaches that one field."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from experiments.common import add_settings
from experiments.common import parser as experiment_parser
from radixkv import EngineConfig, workloads
from radixkv.serve import ENGINE_SKIP, engine_settings
from radixkv.serve import parser as serve_parser
from radixkv.settings import aliases, described
from radixkv.sim import simulate
from radixkv.stack import StackConfig, settings_from

ALIASES = aliases(StackConfig)
VALUE = {"capacity_tokens": 4096, "host_capacity_tokens": 2048}  # a value each aliased field takes


def test_the_engine_config_composes_the_stack_config_and_copies_none_of_its_fields():
    engine_own = {f.name for f in fields(EngineConfig)} - {"stack"}
    assert engine_own.isdisjoint(f.name for f in fields(StackConfig))
    assert EngineConfig().stack == StackConfig()  # one set of defaults
    every = {f.name for f in fields(StackConfig)} | engine_own
    assert {f.name for cls in (StackConfig, EngineConfig) for f in described(cls)} == every - {"model"}


def test_aliases_are_the_ones_users_know():
    assert ALIASES == {"kv_cache_tokens": "capacity_tokens", "host_kv_cache_tokens": "host_capacity_tokens"}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_each_keyword_alias_reaches_its_field(alias):
    name, value = ALIASES[alias], VALUE[ALIASES[alias]]
    assert getattr(EngineConfig(**{alias: value}).stack, name) == value
    assert getattr(EngineConfig(**{alias: value}), alias) == value  # and reads back by either name
    assert getattr(settings_from(StackConfig(), **{alias: value}), name) == value
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(**{alias: value, name: value})


def test_simulate_takes_the_engines_spelling_of_the_capacity():
    reqs = workloads.make("multi_turn", seed=0)
    a = simulate(reqs, "radix", capacity_tokens=30_000).summary()
    b = simulate(reqs, "radix", kv_cache_tokens=30_000).summary()
    assert a == b and a["hit_rate"] > 0


def flag_dests(p: argparse.ArgumentParser) -> dict[str, str]:
    return {option: a.dest for a in p._actions for option in a.option_strings}


@pytest.mark.parametrize("make", [lambda: serve_parser(), lambda: _experiment_with_every_setting()],
                         ids=["serve", "experiment"])
def test_every_flag_spelling_lands_on_its_field(make):
    p = make()
    dests = flag_dests(p)
    for f in described(StackConfig):
        if f.name == "seed" and p.prog != "radixkv serve":
            continue  # an experiment's --seed seeds its workload too (experiments.common.parser)
        if f.name in ENGINE_SKIP and f.name != "prefix_cache":
            assert "--" + f.name.replace("_", "-") not in dests
            continue
        for flag in ("--" + f.name.replace("_", "-"), *f.metadata["flags"]):
            assert dests[flag] == f.name, flag
    args = p.parse_args(["tiny-random"] * (p.prog == "radixkv serve") + ["--max-total-tokens", "512",
                                                                         "--max-num-seqs", "3"])
    assert args.capacity_tokens == args.kv_cache_tokens == 512 and args.max_running == 3
    assert p.parse_args(["tiny-random"] * (p.prog == "radixkv serve") + ["--kv-cache-tokens", "none"]).capacity_tokens \
        is None


def _experiment_with_every_setting() -> argparse.ArgumentParser:
    p = experiment_parser("test", "out")
    add_settings(p, *(f.name for f in described(StackConfig)
                      if f.name != "seed" and (f.name not in ENGINE_SKIP or f.name == "prefix_cache")))
    return p


def test_every_engine_setting_is_a_serve_flag_and_reaches_llm_unchanged():
    args = serve_parser().parse_args(["tiny-random", "--hicache-write-policy", "write_back", "--max-running-requests",
                                      "5", "--max-num-batched-tokens", "777", "--radix-eviction-policy", "lfu",
                                      "--batch-invariant", "--eviction-params", "{}"])
    settings = engine_settings(args)
    expected = {f.name for cls in (StackConfig, EngineConfig) for f in described(cls)} - set(ENGINE_SKIP)
    assert set(settings) == expected
    config = EngineConfig(args.model, prefix_cache=args.prefix_cache, **settings)
    assert (config.write_policy, config.max_running, config.max_batch_tokens, config.eviction_policy,
            config.batch_invariant) == ("write_back", 5, 777, "lfu", True)


def test_unknown_settings_are_clear_errors_and_the_engine_takes_a_storage_tier():
    with pytest.raises(ValueError, match="unknown settings.*kv_cach_tokens"):
        EngineConfig(kv_cach_tokens=4)
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        settings_from(StackConfig(), nope=1)
    assert [t.name for t in EngineConfig(storage_capacity_tokens=4096).stack.tiers] == ["storage"]


def test_each_setting_is_checked_from_its_declaration():
    from radixkv.settings import described

    for f in described(StackConfig):
        if f.metadata["minimum"] is not None:
            with pytest.raises(ValueError, match=f"{f.name} must be an integer >= {f.metadata['minimum']}"):
                StackConfig(**{f.name: f.metadata["minimum"] - 1})
        if f.metadata["choices"] is not None:
            with pytest.raises(ValueError, match=f"{f.name} must be one of"):
                StackConfig(**{f.name: "no-such-name"})
        if "int" in str(f.type):
            with pytest.raises(ValueError, match=f"{f.name} must be an integer"):
                StackConfig(**{f.name: "7"})

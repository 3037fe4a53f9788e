"""experiments.v0_walkthrough: the facts docs/v0_walkthrough.md states, checked in the JSON it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments import v0_walkthrough

pytestmark = pytest.mark.slow  # one walk-through run of about ten seconds, shared by every test here


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The walk-through's JSON, written to a temporary folder."""
    out = tmp_path_factory.mktemp("v0") / "walk"
    v0_walkthrough.main(["--out", str(out)])
    return json.loads(Path(f"{out}.json").read_text())


def test_config_names_the_setup(doc: dict[str, Any]):
    assert doc["config"] | {"block_size": 4, "model": "tiny-random", "kv_cache_tokens": 256} == doc["config"]
    assert "git_commit" in doc["env"]
    assert list(doc["results"]) == list(v0_walkthrough.POINTS)


def test_keys_hash_whole_prefixes_and_form_a_prefix_tree(doc: dict[str, Any]):
    ident, tree = doc["results"]["block_identity"], doc["results"]["prefix_tree"]
    assert [b["hashed_tokens"] for b in ident["blocks"]] == [4, 8, 12]
    assert ident["insert_hashed_tokens"] == 4 + 8 + 12
    base, lora = [b["key"] for b in ident["blocks"]], [b["key_lora-1"] for b in ident["blocks"]]
    assert len(set(base + lora)) == 6  # the adapter changes every key
    keys = tree["keys"]
    assert keys["A"][:2] == keys["B"][:2] and keys["A"][2] != keys["B"][2]  # shared first blocks, same keys
    assert not set(keys["C"]) & set(keys["A"])  # A's blocks 1-2 after another first block: other keys
    assert tree["hits_with_A_cached"] == {"B": 8, "C": 0}
    assert tree["blocks"] == 7


def test_v0_caches_decoded_blocks_at_once_and_v1_at_finish(doc: dict[str, Any]):
    phase = doc["results"]["phase_hashes"]
    assert [c for _, c in phase["hash-v0"]["computed_cached"]] == [8, 8, 12, 12, 12, 12, 16]
    assert [c for _, c in phase["hash"]["computed_cached"]] == [8] * 7
    assert phase["hash-v0"]["cached_at_finish"] == phase["hash"]["cached_at_finish"] == 16
    assert phase["radix"]["cached_at_finish"] == 17  # prompt 10 + answer 8 - the last token's KV
    gen = doc["results"]["generated_kv"]
    assert gen["concurrent_hit"] == {"hash-v0": 12, "hash": 8}
    v0, v1 = gen["twins_before_finish"]["hash-v0"], gen["twins_before_finish"]["hash"]
    assert (v0["shared_slots"], v0["slots_in_use"]) == (16, 16)  # promotion moved the twin onto the cached copy
    assert (v1["shared_slots"], v1["slots_in_use"]) == (8, 24)


def test_multi_turn_and_the_cases_that_hit_nothing(doc: dict[str, Any]):
    turns = doc["results"]["multi_turn"]
    assert {k: v["turn2_hit"] for k, v in turns.items()} == {"hash-v0": 16, "hash": 16, "radix": 17, "none": 0}
    cases = {k: v["hash-v0"] for k, v in doc["results"]["no_hit_cases"].items()}
    assert [cases[k] for k in cases if k.startswith(("prompt shorter", "first token", "another adapter"))] == [0] * 3
    assert [v for k, v in cases.items() if k.startswith("answer fills")] == [8, 12]
    assert [v for k, v in cases.items() if "2 blocks" in k] == [4, 8, 8]  # resent, plus one, raw match


def test_eviction_takes_the_least_recent_and_the_deepest_first(doc: dict[str, Any]):
    ev = doc["results"]["eviction_order"]
    assert ev["order"] == ["X2", "X1", "Y1", "Y0", "X0"]
    stamps = [tuple(ev["last_access_and_hashed_tokens"][b]) for b in ev["order"]]
    assert stamps == sorted(stamps, key=lambda s: (s[0], -s[1]))


def test_prefill_reads_the_cached_prefix_from_the_pool_and_switches(doc: dict[str, Any]):
    pre = doc["results"]["prefix_prefill"]
    assert (pre["hash-v0"]["prefix_len"], pre["hash-v0"]["new_len"]) == (12, 6)
    assert pre["hash-v0"]["prefix_is_request_1s_blocks"]
    assert (pre["none"]["prefix_len"], pre["none"]["new_len"]) == (0, 18)
    assert pre["hash-v0"]["prefill_part"] == pre["none"]["prefill_part"]  # one prefill path for both
    assert pre["outputs_equal"]
    on, off = (doc["results"]["offline_online"][f"enable_prefix_caching={f}"] for f in (True, False))
    assert (on["cache"], on["cached_tokens"], on["prefill_tokens"]) == ("HashV0Cache", 32, 25)
    assert (off["cache"], off["cached_tokens"], off["prefill_tokens"]) == ("NoPrefixCache", 0, 57)
    assert doc["results"]["offline_online"]["outputs_equal"]
    assert "hash-v0" in doc["results"]["offline_online"]["cli_caches"]

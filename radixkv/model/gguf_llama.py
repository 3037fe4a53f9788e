"""A Llama GGUF file as a Hugging Face checkpoint, from one read of the file.

``llama_checkpoint(path)`` reads the file once (``gguf_tensor_table(path, arrays=True)``:
metadata, vocabulary and tensor table) and returns what ``transformers`` would load from
it: the config dict, the float32 state dict (each tensor dequantized by ``gguf``'s own
numpy code, q and k rows put back from llama.cpp's RoPE layout) and the tokenizer (a
byte-level BPE built from the file's tokens and merges, its control tokens special, the
chat template and special tokens the file names). ``tests/test_gguf_cache.py`` checks
every weight bit for bit, the tokenizer's files and the engine's view of the config
against ``transformers``' own load of SmolLM2-135M.

It covers what it can check: architecture ``llama`` with plain RoPE and a ``gpt2``
(byte-level BPE) vocabulary that adds no BOS, EOS or prefix space (SmolLM2, Llama 3 without
RoPE scaling). For anything else it returns None and the caller converts through
``transformers`` (``radixkv.model.gguf``), which parses the file three times.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.model.gguf import GGUFTable, GGUFTensor, gguf_tensor_table

_CONTROL = 3  # llama.cpp's token type of control tokens (<|im_start|>, ...): special in the tokenizer
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def supported(table: GGUFTable) -> bool:
    """Whether ``llama_checkpoint`` converts this file (see the module docstring)."""
    meta = table.metadata
    return (meta.get("general.architecture") == "llama" and meta.get("tokenizer.ggml.model") == "gpt2"
            and "mistral" not in str(meta.get("general.name", "")).lower()  # transformers makes those Mistral
            and not any(meta.get(f"tokenizer.ggml.{k}") for k in ("add_bos_token", "add_eos_token", "add_space_prefix"))
            and not any(k.startswith("llama.rope.scaling") for k in meta)
            and meta.get("tokenizer.ggml.merges") is not None
            and all(_hf_name(t.name) is not None for t in table.tensors))


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _TOP and parts[1] == "weight":
        return f"{_TOP[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    return None


def _dequantized(path: Path, t: GGUFTensor) -> np.ndarray:
    """Tensor ``t`` as float32 ``[rows, cols]`` (``dims`` reversed), as ``gguf.quants.dequantize`` computes it."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(t.kind)
    block, size = GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(t.dims))
    raw = np.memmap(path, np.uint8, "r", t.offset, math.prod(t.dims) // block * size)
    return dequantize(np.asarray(raw).reshape(*shape[:-1], -1), kind).astype(np.float32).reshape(shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows ``[heads * dim, in]`` back from llama.cpp's layout (pairs per head interleaved) to HF's."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _config(meta: dict[str, Any], table: GGUFTable) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    embed = next(t for t in table.tensors if t.name == "token_embd.weight")
    theta = float(meta.get("llama.rope.freq_base", 10000.0))

    def token(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": int(embed.dims[1]),
        "hidden_size": hidden, "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)), "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": all(t.name != "output.weight" for t in table.tensors),
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": token("bos_token_id"), "eos_token_id": token("eos_token_id"),
        "pad_token_id": token("padding_token_id"), "unk_token_id": token("unknown_token_id"),
    }


def _tokenizer(meta: dict[str, Any]) -> Any:
    """The byte-level BPE tokenizer the file describes, as ``transformers``' GGUF conversion builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in np.flatnonzero(np.asarray(kinds) == _CONTROL)])
    named = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"))}
    special = {name: tokens[int(i)] for name, i in named.items() if i is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
                                   **special)


def llama_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any] | None:
    """``(config dict, float32 state dict, tokenizer)`` of a Llama GGUF file from one read, or None where the
    file is not one this module covers (see the module docstring). O(weights)."""
    path = Path(path)
    table = gguf_tensor_table(path, arrays=True)
    if not supported(table):
        return None
    config = _config(table.metadata, table)
    state = {}
    for t in table.tensors:
        name = _hf_name(t.name)
        w = torch.from_numpy(_dequantized(path, t))
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        state[name] = w
    return config, state, _tokenizer(table.metadata)


__all__ = ["llama_checkpoint", "supported"]

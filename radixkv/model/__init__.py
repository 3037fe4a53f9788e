"""Llama-family models on the paged KV pool, loaded from local files only."""

from radixkv.model.llama import LlamaConfig, LlamaForCausalLM
from radixkv.model.loader import BUILTIN, LoadedModel, load_model

__all__ = ["BUILTIN", "LlamaConfig", "LlamaForCausalLM", "LoadedModel", "load_model"]

"""A one-file Llama-family decoder that reads and writes KV through the paged pool.

Covers LlamaForCausalLM checkpoints (SmolLM2 is one), with Qwen2-style q/k/v
biases, Llama's optional attention and MLP biases, and tied embeddings: RoPE
(default and Llama-3 scaling), RMSNorm, SwiGLU, grouped-query attention.
Module names mirror Hugging Face's, except that q/k/v and gate/up
projections are stacked into one matrix each (``qkv_proj``,
``gate_up_proj``: one matmul instead of three and two, which matters at
decode batch sizes); ``load_hf_state_dict`` stacks them.

The forward pass takes a flat batch: the new tokens of every request of the
step, their positions and the KV slots they are written to; attention over
cached prefixes is the backend's job (planned once per step by the caller).
It returns logits only for the rows asked for, by default the last token of
each request. The math is eager PyTorch, as ``transformers`` computes it;
``radixkv.cpu`` serves the same modules through compiled kernels on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from radixkv.attention.base import AttentionBackend
from radixkv.memory.kv_pool import KVPool


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture numbers the model needs, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
    mlp_bias: bool = False
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every end-of-sequence id (Llama 3 has several); eos_token_id is the first

    def __post_init__(self) -> None:
        if not self.eos_token_ids and self.eos_token_id is not None:  # built with a single id
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))

    @classmethod
    def from_hf(cls, hf: Any) -> LlamaConfig:
        """From a ``transformers`` Llama/Qwen2 config (transformers 4.x or 5.x field names)."""
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported RoPE type {kind!r} (radixkv supports default and llama3)")
        heads = hf.num_attention_heads
        eos_ids = tuple(hf.eos_token_id) if isinstance(hf.eos_token_id, (list, tuple)) else (
            () if hf.eos_token_id is None else (hf.eos_token_id,))
        qwen2 = hf.model_type == "qwen2"
        return cls(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta), max_position_embeddings=hf.max_position_embeddings,
            rope_scaling=rope if kind == "llama3" else None,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False) or qwen2),
            o_proj_bias=bool(getattr(hf, "attention_bias", False) and not qwen2),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with Llama-3 scaling when configured."""
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    s = cfg.rope_scaling
    if not s:
        return inv
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)  # long wavelengths: stretched
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; normalized in float32 as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.sizes = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)  # q, k, v rows of qkv_proj
        self.qkv_proj = nn.Linear(h, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
                pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        n, d = x.shape[0], self.cfg.head_dim
        # qkv_proj(x): [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.reshape(n, self.cfg.num_heads, d)  # q: [num_tokens, num_heads, head_dim]
        k = k.reshape(n, self.cfg.num_kv_heads, d)  # k: [num_tokens, num_kv_heads, head_dim]
        q = q * cos + rotate_half(q) * sin  # cos, sin: [num_tokens, 1, head_dim]
        k = k * cos + rotate_half(k) * sin
        pool.store(self.layer, k, v.reshape(n, self.cfg.num_kv_heads, d), out_slots)  # before attention reads it
        o = backend.run(q, self.layer)  # o: [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # gate, then up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [num_tokens, intermediate]
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, out_slots, pool, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, out_slots, pool, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's separate q/k/v and gate/up tensors concatenated along the output rows."""
    out = dict(state)
    for key in list(state):
        for fused, parts in STACKED.items():
            prefix, dot, leaf = key.rpartition(f".{parts[0]}.")
            names = [f"{prefix}.{p}.{leaf}" for p in parts]
            if dot and all(n in out for n in names):
                out[f"{prefix}.{fused}.{leaf}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


_RANDOM_FILLS = {"uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_"}


class _NoRandomFill(TorchFunctionMode):
    """Within it, ``nn.init``'s random fills and the tensor methods behind them (what ``nn.Linear``'s and
    ``nn.Embedding``'s initializers call) fill nothing: weights about to be replaced stay as allocated. A mode
    of this thread only, for the ``with`` block (0.6-0.9 s of random numbers for SmolLM2-135M; the meta
    device would instead import a second's worth of torch)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _RANDOM_FILLS:  # the nn.init function or the tensor method itself
            return args[0] if args else next(iter(kwargs.values()))
        return func(*args, **(kwargs or {}))


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; ``forward`` runs one flat engine step."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gguf_file: str | None = None  # the GGUF file the weights were dequantized from (the loader sets it)

    @classmethod
    def from_hf_state_dict(cls, cfg: LlamaConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                           device: str | torch.device = "cpu") -> LlamaForCausalLM:
        """The model of ``cfg`` holding copies of ``state`` (``transformers`` names) in ``dtype`` on ``device``:
        each weight cast once and taken as it is, where loading and then casting copies it twice, and no random
        initialization of the weights it replaces (``_NoRandomFill``). O(weights)."""
        with _NoRandomFill():
            model = cls(cfg)
        model.load_hf_state_dict({k: v.to(dtype=dtype, device=device, copy=True) for k, v in state.items()},
                                 assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(cfg).to(device=device, dtype=dtype)  # as Module.to(dtype) casts buffers
        return model.eval()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load a ``transformers`` state dict: q/k/v and gate/up are stacked; a tied head may be absent.
        ``assign``: the model takes the given tensors (``nn.Module.load_state_dict``) instead of copying them."""
        state = stack_projections({k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")})
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=assign)
        missing = [m for m in missing if not (self.config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
        """The step's embeddings ``x`` ``[num_tokens, hidden]`` and RoPE tables ``cos``, ``sin``
        ``[num_tokens, 1, head_dim]`` in the model's dtype; ``ValueError`` for ids or positions out of range."""
        cfg = self.config
        # Checks read values back, which a CUDA graph being captured cannot; a replayed decode's ids are sampled
        # and its positions checked with the prompt (radixkv.inputs.Prompts.check).
        checked = not (input_ids.is_cuda and torch.cuda.is_current_stream_capturing())
        if checked and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= cfg.vocab_size)][:5].tolist()
            raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad}")
        if checked and positions.numel() and int(positions.max()) >= cfg.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the model's context length "
                             f"{cfg.max_position_embeddings}")
        x = self.model.embed_tokens(input_ids)  # x: [num_tokens, hidden]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        return x, emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, pool: KVPool,
                backend: AttentionBackend, logits_rows: torch.Tensor | None = None,
                qo_indptr: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step over a flat batch.

        Args:
            input_ids: ``[num_tokens]`` int64, the new tokens of every request, request after request.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            out_slots: ``[num_tokens]`` int64, the KV slot each token's K/V is written to.
            pool, backend: the KV pool and an attention backend already ``plan``-ned for this batch.
            logits_rows: rows whose logits to return; default the last token of each request
                (from ``qo_indptr``, ``[batch + 1]``), or every row when neither is given.

        Returns:
            logits ``[len(logits_rows), vocab_size]`` in the model's dtype.
        """
        x, cos, sin = self.embed(input_ids, positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, out_slots, pool, backend)
        return self.lm_head(self.model.norm(logit_rows(x, logits_rows, qo_indptr)))  # [rows, vocab_size]


def logit_rows(x: torch.Tensor, logits_rows: torch.Tensor | None, qo_indptr: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``x`` ``[num_tokens, hidden]`` to compute logits for (see ``LlamaForCausalLM.forward``)."""
    if logits_rows is None and qo_indptr is not None:
        logits_rows = qo_indptr[1:] - 1
    return x if logits_rows is None else x[logits_rows]

"""A one-file Llama-family decoder that reads and writes KV through the paged pool.

Covers LlamaForCausalLM checkpoints (SmolLM2 is one), with Qwen2-style q/k/v
biases, Llama's optional attention and MLP biases, and tied embeddings: RoPE
(default and Llama-3 scaling), RMSNorm, SwiGLU, grouped-query attention. Module names mirror Hugging Face's, except
that q/k/v and gate/up projections are stacked into one matrix each
(``qkv_proj``, ``gate_up_proj``: one matmul instead of three and two, which
matters at decode batch sizes); ``load_hf_state_dict`` stacks them.

The forward pass takes a flat batch: the new tokens of every request of the
step, their positions and the KV slots they are written to; attention over
cached prefixes is the backend's job (planned once per step by the caller).
It returns logits only for the rows asked for, by default the last token of
each request.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from radixkv import hugepages
from radixkv.attention.base import AttentionBackend
from radixkv.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels
from radixkv.kv_pool import KVPool
from radixkv.model.coded import CodedTiles, q4_rows
from radixkv.model.ops import TorchOps
from radixkv.timing import interleaved


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
            rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            rope_scaling=rope if kind == "llama3" else None,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False) or qwen2),
            o_proj_bias=bool(getattr(hf, "attention_bias", False) and not qwen2),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = TorchOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)  # x: [num_tokens, hidden]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.sizes = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)  # q, k, v rows of qkv_proj
        self.qkv_proj = nn.Linear(h, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_proj_bias)
        self.ops = TorchOps()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
                pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        # cos, sin: [num_tokens, 1, head_dim]; k and v go to the pool, q: [num_tokens, num_heads, head_dim]
        q = self.ops.rope_store(qkv, cos, sin, pool, self.layer, out_slots, self.cfg.num_heads, self.cfg.num_kv_heads)
        o = backend.run(q, self.layer)  # o: [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # gate, then up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = TorchOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))  # SwiGLU; gate_up: [num_tokens, 2 * inter]


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

    def small_linear_weights(self) -> tuple[dict[str, Any], int] | None:
        """The layer's norm weights and its ``PackedLinear``s by name, and the most rows their tiles serve
        (``PackedLinear.small_rows``); None unless every linear layer has tiles (``pack_linears`` on a
        16-bit model on a CPU with AVX2, AVX-512 ones included). For running the layer outside Python
        (``CpuKernelOps.run_layers``)."""
        linears = {"qkv": self.self_attn.qkv_proj, "o": self.self_attn.o_proj,
                   "gate_up": self.mlp.gate_up_proj, "down": self.mlp.down_proj}
        if not all(isinstance(m, PackedLinear) and m.tiles is not None for m in linears.values()):
            return None
        weights = {"input_norm": self.input_layernorm.weight.detach(),
                   "post_norm": self.post_attention_layernorm.weight.detach(), **linears}
        return weights, min(m.small_rows for m in linears.values())


class _Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


SMALL_DTYPES = (torch.bfloat16, torch.float16)  # the weight dtypes small_linear's tiles hold


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered into its blocked CPU layout once, at load time.

    Measured on 2 cores in bfloat16 (AVX-512 BF16): 1.3x faster at 1 token and
    1.5x at 8 (decode batches), equal at 1,200 (prefill), with bit-identical
    outputs. With ``compute_dtype=torch.float32`` a 16-bit layer keeps its
    16-bit interface but multiplies in float32: the weight is upcast once
    (exactly) and each call computes ``round16(float32(x) @ W.T + b)``, the
    arithmetic of a 16-bit GEMM that accumulates in float32, for CPUs without
    16-bit matrix instructions, where oneDNN and MKL emulate 16-bit GEMMs
    about 4x slower than float32 ones (measured on an AVX2-only EPYC: oneDNN
    float32 139 GFLOP/s against 15 for bfloat16 at 150 rows).
    Decode batches (at most ``small_rows`` tokens) of a 16-bit layer go
    through ``small_kernels.small_linear`` instead when given (the compiled
    AVX2 kernel reading the 16-bit weights, repacked into ``tiles``
    ``[out / 8, in, 8]``, accumulating in float32), whichever dtype oneDNN
    multiplies larger batches in: where it upcasts, a float32 copy would
    double what each decode step streams and its float32 GEMM is far from
    peak at 1-8 rows; where it multiplies bfloat16 natively it was slower
    still at decode sizes (a 2-core Zen 4, AVX-512 BF16 without AMX, whole
    decode steps alternating in one process: batch 1 33.0 -> 14.9 ms,
    batch 8 56.5 -> 40.5 ms with ``small_linear``; its bfloat16 blocks of 4
    rows in BF16 dot products there then took batch 8 to 26.1 ms).
    Where the weights were dequantized from a GGUF Q4_1 file, ``coded``
    holds their exact 4-bit codes (``radixkv.model.coded``, set by
    ``pack_linears``), which ``small_kernels.coded_linear`` multiplies for
    batches of at most ``coded_rows`` tokens: the same outputs, bit for bit,
    from 0.625 bytes a weight instead of 2.
    The packed weight is opaque: it cannot be moved, cast or saved, so
    packing is the last step before serving (``pack_linears``).
    """

    # The most rows coded_linear may serve: SmolLM2's 30 layers of linears on a Zen 3, weights from DRAM,
    # alternating with small_linear in one process, took 0.70x small_linear's time at 1 row, 0.81x at 2
    # and 1.05x at 3: rebuilding each weight costs vector ALU throughput that more rows need for their
    # own FMAs (docs/experiments.md, ninth round). On a Zen 1 it took 1.8x at 1 row, so ``pack_linears``
    # measures how many of these rows pay on the CPU at hand (``measure_coded_rows``).
    CODED_ROWS = 2

    def __init__(self, linear: nn.Linear, batch_hint: int = 8, compute_dtype: torch.dtype | None = None,
                 small_kernels: ModuleType | None = None, small_rows: int = 16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.compute_dtype = compute_dtype or self.dtype
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype)
        self.small_kernels, self.small_rows, self.tiles, self.small_bias = None, small_rows, None, None
        self.coded: CodedTiles | None = None
        self.coded_rows = self.CODED_ROWS
        if small_kernels is not None and self.dtype in SMALL_DTYPES and self.out_features % 8 == 0:
            self.small_kernels = small_kernels
            self.small_bias = None if linear.bias is None else linear.bias.detach().float()
            n, k = weight.shape
            self.tiles = weight.view(n // 8, 8, k).transpose(1, 2).contiguous()  # [out / 8, in, 8]

    def weight(self) -> torch.Tensor | None:
        """The 16-bit weight ``[out, in]`` rebuilt from ``tiles`` (None without tiles)."""
        return None if self.tiles is None else self.tiles.transpose(1, 2).reshape(self.out_features, -1)

    def small_linear_args(self) -> dict[str, Any]:
        """Keyword arguments of the kernels' ``TiledLinear`` for this layer (it must have tiles)."""
        c = self.coded
        return {"tiles": self.tiles, "bias": self.small_bias, "codes": c and c.codes, "scale": c and c.scale,
                "offset": c and c.offset, "coded_rows": self.coded_rows}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features], both in the layer's dtype
        if self.small_kernels is not None and x.shape[0] <= self.small_rows:
            if self.coded is not None and x.shape[0] <= self.coded_rows:
                c = self.coded
                return self.small_kernels.coded_linear(x, c.codes, c.scale, c.offset, self.small_bias)
            return self.small_kernels.small_linear(x, self.tiles, self.small_bias)
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype), self.packed, self.bias, "none", [], "")
        return y.to(self.dtype)


def linear_compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``pack_linears`` multiplies ``model``'s weights in on this CPU, or None where it leaves them.

    16-bit weights multiply in their own dtype where oneDNN supports it (AVX-512
    BF16 / FP16, AMX) and in float32 elsewhere; float32 weights are left as
    they are (the exact oracle), as are weights on other devices.
    """
    p = next(model.parameters())
    mkldnn = torch.ops.mkldnn
    if p.device.type != "cpu" or p.dtype == torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_is_mkldnn_bf16_supported")):
        return None
    native = {torch.bfloat16: mkldnn._is_mkldnn_bf16_supported, torch.float16: mkldnn._is_mkldnn_fp16_supported}
    if p.dtype not in native:
        return None
    return p.dtype if native[p.dtype]() else torch.float32


def pack_linears(model: nn.Module, coded_rows: int | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` computing in ``linear_compute_dtype``.

    Where the layers get ``small_linear`` tiles and ``model.gguf_file`` names
    the GGUF file the weights were dequantized from, every layer whose weights
    its Q4_1 codes rebuild exactly also gets them (``PackedLinear.coded``),
    used for batches of at most ``coded_rows`` tokens (0 to
    ``PackedLinear.CODED_ROWS``); None measures that number on this CPU
    (``measure_coded_rows``, a fraction of a second for SmolLM2). Either
    way the outputs are the same bits.
    Returns how many were replaced (0 where that dtype is None).
    """
    if coded_rows is not None and (isinstance(coded_rows, bool) or not isinstance(coded_rows, int)
                                   or not 0 <= coded_rows <= PackedLinear.CODED_ROWS):
        raise ValueError(f"coded_rows must be None or an int in [0, {PackedLinear.CODED_ROWS}], got {coded_rows!r}")
    compute = linear_compute_dtype(model)
    if compute is None:
        return 0
    small = None
    if cpu_kernels_unavailable_reason() is None:
        kernels = load_cpu_kernels()
        small = kernels if kernels.has_avx2() else None
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, compute_dtype=compute, small_kernels=small))
    source = getattr(model, "gguf_file", None)
    if small is not None and source is not None:
        try:
            rows = q4_rows(source, next(model.parameters()).dtype)
        except (OSError, ValueError, KeyError, struct.error):  # the codes only save time: serve without them
            rows = None
        for parent, name, _ in targets if rows is not None else ():
            packed = getattr(parent, name)
            weight = packed.weight()  # None where the layer has no tiles (out_features % 8 != 0)
            packed.coded = None if weight is None else rows.tiles(weight)
    _tiles_to_huge_pages([getattr(parent, name) for parent, name, _ in targets])
    coded = [m for parent, name, _ in targets if (m := getattr(parent, name)).coded is not None]
    chosen = measure_coded_rows(coded) if coded_rows is None else coded_rows
    for m in coded:
        m.coded_rows = chosen
    return len(targets)


def measure_coded_rows(layers: list[PackedLinear], rounds: int = 5) -> int:
    """How many rows (0 to ``PackedLinear.CODED_ROWS``) ``coded_linear`` multiplies faster than ``small_linear``.

    Both give the same bits at these row counts, so only time is at stake,
    and which one wins depends on the CPU (``PackedLinear.CODED_ROWS``). For
    1, 2, ... rows, every layer of ``layers`` (which have codes) is timed
    both ways, in turns, ``rounds`` times each; the first row count at which
    the codes do not win ends the search. Costs ``2 * (rounds + 1)`` passes
    over the layers' weights per row count tried (a warm-up each way).
    """
    if not layers:
        return 0
    kernels = layers[0].small_kernels

    def run(x: dict[int, torch.Tensor], codes: bool) -> None:
        for m in layers:
            c, xm = m.coded, x[m.in_features]
            if codes:
                kernels.coded_linear(xm, c.codes, c.scale, c.offset, m.small_bias)
            else:
                kernels.small_linear(xm, m.tiles, m.small_bias)

    for rows in range(1, PackedLinear.CODED_ROWS + 1):
        x = {m.in_features: torch.ones(rows, m.in_features, dtype=m.dtype) for m in layers}  # values do not matter
        coded, tiles = functools.partial(run, x, True), functools.partial(run, x, False)
        times = interleaved({"coded": coded, "tiles": tiles}, rounds=rounds, per_round=1)
        if times["coded"] >= times["tiles"]:
            return rows - 1
    return PackedLinear.CODED_ROWS


def _tiles_to_huge_pages(layers: list[PackedLinear]) -> None:
    """Move the decode kernels' tiles and codes of ``layers`` into one huge-page buffer (``radixkv.hugepages``).

    A decode step streams all of them; in 4 KiB pages the loads wait on page walks.
    """
    tiled = [m for m in layers if m.tiles is not None]
    coded = [m for m in tiled if m.coded is not None]
    moved = iter(hugepages.pack([m.tiles for m in tiled] +
                                [t for m in coded for t in (m.coded.codes, m.coded.scale, m.coded.offset)]))
    for m in tiled:
        m.tiles = next(moved)
    for m in coded:
        m.coded = CodedTiles(next(moved), next(moved), next(moved))


STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's separate q/k/v and gate/up tensors concatenated along the output rows."""
    out = dict(state)
    for key in list(state):
        for fused, parts in STACKED.items():
            prefix, dot, leaf = key.rpartition(f".{parts[0]}.")
            if not dot:
                continue
            names = [f"{prefix}.{p}.{leaf}" for p in parts]
            if all(n in out for n in names):
                out[f"{prefix}.{fused}.{leaf}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


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
        self.ops = TorchOps()  # runs the layer stack (see set_ops)
        self.gguf_file: str | None = None  # the GGUF file the weights were dequantized from (see pack_linears)

    def set_ops(self, ops: TorchOps) -> None:
        """Run the layers' elementwise steps (RMSNorm, RoPE + KV store, SwiGLU) and the layer loop through ``ops``."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``transformers`` state dict: q/k/v and gate/up are stacked; a tied head may be absent."""
        state = stack_projections({k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")})
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (self.config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

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
        cfg = self.config
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= cfg.vocab_size)][:5].tolist()
            raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad}")
        if positions.numel() and int(positions.max()) >= cfg.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the model's context length "
                             f"{cfg.max_position_embeddings}")
        x = self.model.embed_tokens(input_ids)  # x: [num_tokens, hidden]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x = self.ops.run_layers(self.model.layers, x, cos, sin, out_slots, pool, backend)
        if logits_rows is None and qo_indptr is not None:
            logits_rows = qo_indptr[1:] - 1
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.model.norm(x))  # [rows, vocab_size]

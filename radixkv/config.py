"""Validated configuration: every engine knob, checked once at construction and saved with results."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from radixkv.attention.registry import BACKENDS, FLASHINFER_DTYPE_NAMES
from radixkv.cache.base import CacheHints
from radixkv.cache.factory import CACHES
from radixkv.checks import is_int, is_real
from radixkv.stack import StackConfig, kv_page_size

PREFIX_CACHES = CACHES  # one list of names each: the caches', the policies', the backends' (here, torch-free)
ATTENTION_BACKENDS = BACKENDS  # the registry's names (radixkv.attention.registry, torch-free)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the model's own (radixkv.model.loader.model_dtype)
FLASHINFER_DTYPES = FLASHINFER_DTYPE_NAMES  # FlashInfer has no float32 attention kernels


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings: the cache and scheduling ones (``StackConfig``'s, checked there; ``stack`` gives
    them as one) and the model's. Unknown or out-of-range values raise ``ValueError`` at construction.

    ``kv_cache_tokens=None`` sizes the KV pool from free memory: a quarter of
    the memory available once the weights are loaded (the GPU's on a CUDA
    device, the host's otherwise), at least 1,024 and at most 2**20 tokens
    (``radixkv.engine.default_kv_tokens``).
    ``in_batch_sharing`` is SGLang's in-batch prefix caching threshold: of
    waiting requests sharing an uncached prefix of at least that many tokens,
    one is admitted first and the rest follow once its prefill is cached, or in
    the same step where that step computes it (0 disables it; it never applies
    without a prefix cache).
    ``record_steps`` keeps one ``StepRecord`` per step in ``LLM.step_log``
    (what was computed, the model's seconds): calibration data for the simulator.
    ``host_kv_cache_tokens`` adds a host tier of that many tokens below the device pool (a second KV buffer
    in host memory, pinned beside a CUDA device; None or 0: none), written under ``write_policy`` (SGLang's
    ``write_through``, ``write_through_selective`` after ``write_threshold`` hits, ``write_back``); see
    ``radixkv.cache.tiered``.
    ``eviction_params`` are the eviction policy's parameters (``StackConfig.eviction_params``).
    ``batch_invariant=True`` makes each token's logits the same bits whichever requests share its step
    (SGLang's ``--enable-deterministic-inference``, vLLM's batch invariance), so greedy outputs do not depend
    on the batching a pool size or a host tier leads to: 16-bit models on the CPU kernels path only
    (``ValueError`` at engine start elsewhere); off by default, as there, since the fastest kernel per
    batch size changes the rounding (``radixkv.cpu.linear.PackedLinear``).
    ``dtype="auto"`` serves the model in its own dtype (SmolLM2-135M: bfloat16; ``tiny-random``:
    float32); ``LLM`` resolves it, so ``LLM(...).config.dtype`` is always a concrete name.
    """

    model: str = "smollm2-135m"
    prefix_cache: str = "radix"
    page_size: int = 1
    block_size: int = 16
    kv_cache_tokens: int | None = None
    eviction_policy: str = "lru"
    eviction_params: Mapping[str, Any] = field(default_factory=dict)
    schedule_policy: str = "lpm"
    in_batch_sharing: int = 32
    max_batch_tokens: int | None = 4096
    chunked_prefill_size: int | None = 1024
    max_running: int = 64
    attention_backend: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    record_steps: bool = False
    host_kv_cache_tokens: int | None = None
    write_policy: str = "write_through"
    write_threshold: int = 2
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        # torch.bfloat16 / torch.device("cpu") are accepted and kept as their names (configs are saved as JSON)
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        problems = self._model_problems()
        if self.eviction_policy == "belady":
            problems.append("eviction_policy 'belady' needs the future: the simulator's only")
        if problems:
            raise ValueError(f"invalid EngineConfig: {problems[0]} (got {self})")
        try:
            self.stack  # noqa: B018 - builds (so checks) the cache and scheduling settings
        except ValueError as e:
            raise ValueError(f"invalid EngineConfig: {e}") from None

    def _model_problems(self) -> list[str]:
        types = [
            (isinstance(self.record_steps, bool), "record_steps must be a bool"),
            (isinstance(self.batch_invariant, bool), "batch_invariant must be a bool"),
            (isinstance(self.model, str) and bool(self.model), "model must be a name or a path"),
            (isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
             "device must be 'cpu', 'cuda' or 'cuda:N'"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.attention_backend != "flashinfer" or self.dtype in (*FLASHINFER_DTYPES, "auto"),
             f"attention_backend='flashinfer' needs dtype in {FLASHINFER_DTYPES} (FlashInfer has no float32 kernels); "
             "'auto' falls back to the PyTorch path for float32"),
        ]
        return [message for ok, message in types if not ok]

    @property
    def stack(self) -> StackConfig:
        """The cache and scheduling settings as one ``StackConfig`` (``kv_cache_tokens`` is its capacity,
        ``host_kv_cache_tokens`` its host tier's)."""
        own = ("capacity_tokens", "host_capacity_tokens", "storage_capacity_tokens")  # named for the engine here
        values = {f.name: getattr(self, f.name) for f in fields(StackConfig) if f.name not in own}
        return StackConfig(**values, capacity_tokens=self.kv_cache_tokens,
                           host_capacity_tokens=self.host_kv_cache_tokens)

    @property
    def kv_page_size(self) -> int:
        """Slots per KV page (``StackConfig.kv_page_size``): the hash caches' block, the radix page, 1 for none."""
        return kv_page_size(self.prefix_cache, self.page_size, self.block_size)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's threshold) is greedy:
    dividing logits by a tinier one overflows float32 (inf - inf = NaN) where the limit is the argmax.

    ``priority`` (an int; larger is kept longer by the ``priority`` eviction policy) and ``ttl`` (seconds the
    cache holds the prefix this request leaves once it finishes, under the ``ttl`` policy; None: the
    policy's default) go to the prefix cache with every call made for the request, as its ``CacheHints``
    (``cache_hints``); other eviction policies ignore them."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    ttl: float | None = None

    def __post_init__(self) -> None:
        # Checked here, not where they are used: a value that failed inside a batch would stop the batch.
        stops = self.stop_token_ids
        try:
            stops = () if stops is None else (stops,) if is_int(stops) else tuple(stops)
        except TypeError:
            raise ValueError(f"invalid SamplingParams: stop_token_ids must be integers (got {stops!r})") from None
        checks = [
            (is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens must be an integer >= 1"),
            (is_real(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
            (is_real(self.top_p) and 0 < self.top_p <= 1, "top_p must be a number in (0, 1]"),
            (is_int(self.top_k) and self.top_k >= -1, "top_k must be an integer: -1 or 0 (off), or >= 1"),
            (self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed must be None or "
             "an integer in [-2**63, 2**64), the range torch.Generator takes"),
            (all(map(is_int, stops)), "stop_token_ids must be integers"),
            (isinstance(self.ignore_eos, bool), "ignore_eos must be a bool"),
            (is_int(self.priority), "priority must be an integer"),
            (self.ttl is None or (is_real(self.ttl) and self.ttl >= 0), "ttl must be None or a finite number >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid SamplingParams: {message} (got {self})")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        for name in ("max_new_tokens", "top_k", "seed", "priority"):  # numpy integers pass the checks; torch wants int
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "ttl"):  # a Fraction or a Decimal would fail inside the step's arithmetic
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def cache_hints(self) -> CacheHints:
        """What the prefix cache is told about this request (its ``priority`` and ``ttl``)."""
        return CacheHints(self.priority, self.ttl)

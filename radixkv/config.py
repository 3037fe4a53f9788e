"""Validated configuration: every engine knob, checked once at construction and saved with results."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from radixkv.cache.eviction import POLICIES as EVICTION_POLICIES
from radixkv.scheduling import POLICIES as SCHEDULE_POLICIES

PREFIX_CACHES = ("radix", "hash", "none")
ATTENTION_BACKENDS = ("auto", "torch", "torch-cascade", "cpu", "flashinfer")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings. Unknown or out-of-range values raise ``ValueError`` at construction.

    ``kv_cache_tokens=None`` sizes the KV pool from free memory: a quarter of
    the memory available once the weights are loaded (the GPU's on a CUDA
    device, the host's otherwise), at least 1,024 and at most 2**20 tokens
    (``radixkv.engine.default_kv_tokens``).
    ``in_batch_sharing`` is SGLang's in-batch prefix caching threshold: of
    waiting requests sharing an uncached prefix of at least that many tokens,
    one is admitted first and the rest follow once its prefill is cached
    (0 disables it; it never applies without a prefix cache).
    ``record_steps`` keeps one ``StepRecord`` per step in ``LLM.step_log``
    (what was computed, the model's seconds): calibration data for the simulator.
    """

    model: str = "smollm2-135m"
    prefix_cache: str = "radix"
    page_size: int = 1
    block_size: int = 16
    kv_cache_tokens: int | None = None
    eviction_policy: str = "lru"
    schedule_policy: str = "lpm"
    in_batch_sharing: int = 32
    max_batch_tokens: int = 4096
    chunked_prefill_size: int = 1024
    max_running: int = 64
    attention_backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    record_steps: bool = False

    def __post_init__(self) -> None:
        # torch.bfloat16 / torch.device("cpu") are accepted and kept as their names (configs are saved as JSON)
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))
        checks = [
            (self.prefix_cache in PREFIX_CACHES, f"prefix_cache must be one of {PREFIX_CACHES}"),
            (self.eviction_policy in EVICTION_POLICIES, f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}"),
            (self.schedule_policy in SCHEDULE_POLICIES, f"schedule_policy must be one of {SCHEDULE_POLICIES}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.page_size >= 1 and self.block_size >= 1, "page_size and block_size must be >= 1"),
            (self.kv_cache_tokens is None or self.kv_cache_tokens >= 1, "kv_cache_tokens must be >= 1 or None"),
            (self.max_batch_tokens >= 1 and self.chunked_prefill_size >= 1, "token budgets must be >= 1"),
            (self.max_running >= 1, "max_running must be >= 1"),
            (self.in_batch_sharing >= 0, "in_batch_sharing must be >= 0 (0 disables it)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid EngineConfig: {message} (got {self})")

    @property
    def kv_page_size(self) -> int:
        """Slots per KV page: the hash cache's block, else the radix page."""
        return self.block_size if self.prefix_cache == "hash" else self.page_size

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature=0`` is greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

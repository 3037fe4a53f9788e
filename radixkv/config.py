"""Validated configuration: every engine knob, checked once at construction and saved with results."""

from __future__ import annotations

import os
import re
from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Any

from radixkv.attention.registry import BACKENDS, FLASHINFER_DTYPE_NAMES
from radixkv.cache.base import CacheHints
from radixkv.cache.eviction import needs_future
from radixkv.cache.factory import CACHES
from radixkv.checks import is_int, is_real
from radixkv.sessions import Finish, finish_of, session_hints
from radixkv.settings import aliases, problems, setting
from radixkv.stack import StackConfig, settings_from
from radixkv.structured import StructuredOutput
from radixkv.tool_calls import check_parser

PREFIX_CACHES = CACHES  # one list of names each: the caches', the policies', the backends' (here, torch-free)
ATTENTION_BACKENDS = BACKENDS  # the registry's names (radixkv.attention.registry, torch-free)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the model's own (radixkv.model.loader.model_dtype)
FLASHINFER_DTYPES = FLASHINFER_DTYPE_NAMES  # FlashInfer has no float32 attention kernels


@dataclass(frozen=True, init=False)
class EngineConfig:
    """All engine settings: ``stack``, the cache and scheduling ones (a ``StackConfig``, defined and checked
    there), and the model's, below. Unknown or out-of-range values raise ``ValueError`` at construction.

    ``EngineConfig(model, stack=None, **settings)`` takes the model's settings and any of the stack's by name
    or alias (``kv_cache_tokens`` is ``capacity_tokens``, ``host_kv_cache_tokens`` ``host_capacity_tokens``),
    applied over ``stack`` (default: ``StackConfig()``, the engine's defaults); the stack's settings read
    through by name or alias too (``config.page_size``, ``config.kv_cache_tokens``).

    The stack's ``capacity_tokens=None`` sizes the KV pool from free memory: a quarter of the memory available
    once the weights are loaded (the GPU's on a CUDA device, the host's otherwise), at least 1,024 and at
    most 2**20 tokens (``radixkv.engine.default_kv_tokens``); ``host_capacity_tokens`` adds a host tier below
    the device pool (a second KV buffer in host memory, pinned beside a CUDA device), written under
    ``write_policy`` (``radixkv.cache.tiered``).
    ``record_steps`` keeps one ``StepRecord`` per step in ``LLM.step_log``
    (what was computed, the model's seconds, the copies between tiers and their seconds): calibration data
    for the simulator (``radixkv serve --record-steps PATH`` writes them to a file).
    ``batch_invariant=True`` makes each token's logits the same bits whichever requests share its step
    (SGLang's ``--enable-deterministic-inference``, vLLM's batch invariance), so greedy outputs do not depend
    on the batching a pool size or a host tier leads to: 16-bit models on the CPU kernels path only
    (``ValueError`` at engine start elsewhere); off by default, as there, since the fastest kernel per
    batch size changes the rounding (``radixkv.cpu.linear.PackedLinear``).
    ``dtype="auto"`` serves the model in its own dtype (SmolLM2-135M: bfloat16; ``tiny-random``:
    float32); ``LLM`` resolves it, so ``LLM(...).config.dtype`` is always a concrete name.
    ``cuda_graphs=True`` (the default) captures decode steps in CUDA graphs, one per batch-size bucket, and
    replays them (``radixkv.decode_graphs``): on CUDA with the FlashInfer backend only, keeping one KV page out
    of the allocator for the padding rows; anywhere else it is accepted and decodes run eagerly, as with
    ``cuda_graphs=False`` (vLLM's ``enforce_eager=True``, SGLang's ``--disable-cuda-graph``).
    """

    model: str = "smollm2-135m"
    stack: StackConfig = StackConfig()
    attention_backend: str = setting("auto", "attention kernels: auto picks FlashInfer on a GPU (16-bit), "
                                             "radixkv's compiled CPU kernels on a CPU (16-bit), else PyTorch",
                                     choices=ATTENTION_BACKENDS)
    dtype: str = setting("auto", "weights and KV cache dtype; auto is the model's own (SmolLM2-135M: bfloat16)",
                         choices=DTYPES)
    device: str = setting("cpu", "where the model runs: cpu, cuda or cuda:N")
    record_steps: bool = setting(False, "keep one StepRecord per step in LLM.step_log (simulator calibration)")
    batch_invariant: bool = setting(False, "a token's logits the same bits whichever requests share its step, "
                                           "at some speed (SGLang's --enable-deterministic-inference; 16-bit "
                                           "models on the CPU kernels only)")
    cuda_graphs: bool = setting(True, "replay decode steps from CUDA graphs captured per batch size (FlashInfer on "
                                      "CUDA; elsewhere decodes run eagerly); off: vLLM's --enforce-eager")

    def __init__(self, model: str = "smollm2-135m", stack: StackConfig | None = None, **settings: Any) -> None:
        for f in fields(self):
            if f.name not in ("model", "stack"):
                object.__setattr__(self, f.name, settings.pop(f.name, f.default))
        object.__setattr__(self, "model", os.fspath(model) if isinstance(model, os.PathLike) else model)
        unknown = sorted(set(settings) - STACK_FIELDS - set(STACK_ALIASES))
        if unknown:
            known = sorted({f.name for f in fields(self)} | STACK_FIELDS)
            raise ValueError(f"invalid EngineConfig: unknown settings {unknown}; the settings are {known} and the "
                             f"aliases {sorted(STACK_ALIASES)}")
        try:
            object.__setattr__(self, "stack", settings_from(StackConfig() if stack is None else stack, **settings))
        except ValueError as e:
            raise ValueError(f"invalid EngineConfig: {e}") from None
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        # the stack's settings, by name or alias (only reached where no field of the engine's own answers)
        field_name = STACK_ALIASES.get(name, name)
        if name.startswith("_") or field_name not in STACK_FIELDS or "stack" not in vars(self):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.stack, field_name)

    def __post_init__(self) -> None:
        # torch.bfloat16 / torch.device("cpu") are accepted and kept as their names (configs are saved as JSON)
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))
        checks = [
            (isinstance(self.stack, StackConfig), "stack must be a StackConfig"),
            (isinstance(self.model, str) and bool(self.model), "model must be a name or a path"),
            (isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
             "device must be 'cpu', 'cuda' or 'cuda:N'"),
            (self.attention_backend != "flashinfer" or self.dtype in (*FLASHINFER_DTYPES, "auto"),
             f"attention_backend='flashinfer' needs dtype in {FLASHINFER_DTYPES} (FlashInfer has no float32 kernels); "
             "'auto' falls back to the PyTorch path for float32"),
            (not needs_future(self.stack.eviction_policy),
             f"eviction_policy {self.stack.eviction_policy!r} needs the future: the simulator's only"),
            (self.stack.schedule_policy != "session-oracle", "schedule_policy 'session-oracle' needs the future: "
             "the simulator's only"),
        ]
        wrong = problems(self) + [message for ok, message in checks if not ok]
        if wrong:
            raise ValueError(f"invalid EngineConfig: {wrong[0]} (got {self})")

    @property
    def kv_page_size(self) -> int:
        """Slots per KV page (``StackConfig.kv_page_size``): the hash caches' block, the radix page, 1 for none."""
        return self.stack.kv_page_size

    def to_dict(self) -> dict:
        """Flat, as results files save it: the model's settings and the stack's, by their field names."""
        return {"model": self.model, **self.stack.to_dict(),
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model", "stack")}}


STACK_FIELDS = frozenset(f.name for f in fields(StackConfig))
STACK_ALIASES = aliases(StackConfig)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's threshold) is greedy:
    dividing logits by a tinier one overflows float32 (inf - inf = NaN) where the limit is the argmax.

    ``priority`` (an int; larger is kept longer by the ``priority`` eviction policy) and ``ttl`` (seconds the
    cache holds the prefix this request leaves once it finishes, under the ``ttl`` policy; None: the
    policy's default) go to the prefix cache with every call made for the request, as its ``CacheHints``
    (``cache_hints``); other eviction policies ignore them. So do ``session`` (the conversation or agent
    session the request belongs to, any hashable; None: its own) and ``stream`` (0 its main agent, 1, 2, ...
    its sub-agents; None: unknown), which the ``session`` schedule and eviction policies follow; the engine
    adds how the answer ended (``CacheHints.stop``: its ``finish_reason``) to the hints of the finish."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    ttl: float | None = None
    session: Hashable = None
    stream: int | None = None
    parent: int | None = None
    finish: Finish | None = None
    tool_parser: str | None = None
    structured: StructuredOutput | None = None

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
            (_hashable(self.session), "session must be hashable"),
            (self.stream is None or (is_int(self.stream) and self.stream >= 0),
             "stream must be None or an integer >= 0"),
            (self.parent is None or (is_int(self.parent) and self.parent >= 0 and self.stream is not None
                                     and self.parent != self.stream),
             "parent must be None or the integer >= 0 of another stream, with stream given"),
            (self.structured is None or isinstance(self.structured, StructuredOutput),
             "structured must be None or a StructuredOutput"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid SamplingParams: {message} (got {self})")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        try:
            object.__setattr__(self, "finish", finish_of(self.finish))
            check_parser(self.tool_parser)
        except ValueError as e:
            raise ValueError(f"invalid SamplingParams: {e}") from None
        # numpy integers pass the checks, but torch wants int; a Fraction or a Decimal would fail inside the step's
        # arithmetic
        casts = {"max_new_tokens": int, "top_k": int, "seed": int, "priority": int, "stream": int, "parent": int,
                 "temperature": float, "top_p": float, "ttl": float}
        for name, cast in casts.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, cast(getattr(self, name)))

    @property
    def cache_hints(self) -> CacheHints:
        """What the prefix cache is told about this request: its ``priority``, ``ttl`` and session hints
        (``session_hints``, the simulator's way too; ``finish`` as ``stop`` where the caller declared it)."""
        return session_hints(CacheHints(self.priority, self.ttl), self.session, self.stream, self.parent, self.finish)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True

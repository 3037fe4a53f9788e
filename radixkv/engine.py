"""The engine: continuous batching with chunked prefill on a prefix cache.

``LLM.step()`` schedules one batch (decodes and prefill chunks of running
requests first, then newly admitted ones in policy order, under a token
budget), runs the model once, and post-processes: a finished prefill chunk
is inserted into the cache and the request's lock moves to the new node (its
slots become the cache's canonical ones, so it never points at freed
duplicates); a finished request inserts prompt + output[:-1] and unlocks.
Under memory pressure unlocked cache is evicted first, then the most recently
admitted running request is preempted (its own KV freed, it re-queues and
recomputes what is no longer cached).
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch

from radixkv.attention import AttentionBatch
from radixkv.cache import make_cache
from radixkv.config import EngineConfig, SamplingParams
from radixkv.kv_pool import KVPool
from radixkv.memory import SlotAllocator
from radixkv.model import load_model
from radixkv.model.forward import build_forward
from radixkv.model.sampler import SamplingSpec, sample, seeded_generator
from radixkv.model.step import StepRecord, prepare_step
from radixkv.scheduling import RequestState, Scheduler, make_policy

ROLES = ("system", "user", "assistant")


@dataclass
class RequestOutput:
    """One finished request. Times are seconds since it was added."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft: float
    latency: float
    token_times: list[float] = field(default_factory=list)


@dataclass(eq=False)
class _Seq(RequestState):
    """A request in the engine: the scheduler's record plus what sampling needs."""

    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    generator: torch.Generator | None = None
    device: str = "cpu"
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def reset(self) -> None:
        super().reset()
        self.output, self.token_times = [], []
        self.generator = seeded_generator(self.params.seed, self.device)  # a recomputation samples the same tokens


class LLM:
    """A prefix-caching LLM engine; see the module docstring.

    ``LLM(model, prefix_cache="radix" | "hash" | "hash-v0" | "none", ...)`` takes the fields
    of ``EngineConfig``; ``enable_prefix_caching=False`` is vLLM's spelling of
    ``prefix_cache="none"``.
    """

    def __init__(self, model: str = "smollm2-135m", prefix_cache: str = "radix",
                 enable_prefix_caching: bool | None = None, **settings):
        if enable_prefix_caching is not None and not enable_prefix_caching:
            prefix_cache = "none"
        elif enable_prefix_caching and prefix_cache == "none":
            raise ValueError("enable_prefix_caching=True contradicts prefix_cache='none'")
        self.config = EngineConfig(model=model, prefix_cache=prefix_cache, **settings)
        cfg = self.config
        loaded = load_model(cfg.model, dtype=getattr(torch, cfg.dtype), device=cfg.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        mc = self.model.config
        ps, dtype = cfg.kv_page_size, getattr(torch, cfg.dtype)
        tokens = cfg.kv_cache_tokens or default_kv_tokens(
            KVPool.slot_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype), cfg.device)
        self.pool = KVPool(mc.num_layers, mc.num_kv_heads, mc.head_dim, num_slots=tokens, page_size=ps,
                           dtype=dtype, device=cfg.device)
        self.allocator = SlotAllocator(self.pool.num_slots, ps)
        self.cache = make_cache(cfg.prefix_cache, page_size=cfg.page_size, block_size=cfg.block_size,
                                eviction_policy=cfg.eviction_policy)
        # the model's forward and the attention backend; on a CPU in 16 bits, through radixkv.cpu's speed-ups
        self.forward_fn, self.backend = build_forward(self.model, self.pool, cfg.attention_backend)
        sharing = cfg.in_batch_sharing if cfg.prefix_cache != "none" else 0
        policy = make_policy(cfg.schedule_policy, seed=cfg.seed, in_batch_sharing=sharing, page_size=ps)
        self.scheduler = Scheduler(self.cache, self.allocator, policy, max_running=cfg.max_running,
                                   max_batch_tokens=cfg.max_batch_tokens, chunked_prefill_size=cfg.chunked_prefill_size)
        self._next_id = 0
        self._unclaimed: list[RequestOutput] = []  # finished inside generate() but added with add_request
        self._stats = {"steps": 0, "step_s": 0.0, "model_s": 0.0}  # the scheduler counts tokens
        self.step_log: list[StepRecord] = []  # filled when ``record_steps`` is set (simulator calibration)

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    namespace: Hashable = None) -> int:
        """Queue one request; returns its id. Bad input raises ``ValueError`` and queues nothing."""
        params = _sampling_params(params)
        try:
            hash(namespace)  # the cache keys its trees by it: an unhashable one would fail every later step
        except TypeError:
            raise ValueError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        return self._queue(self._checked(prompt, params), params, namespace)

    def _checked(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``ValueError`` if the engine could never serve it."""
        ids = self._encode(prompt)
        mc = self.model.config
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {mc.vocab_size}): {bad[:5]}")
        need = len(ids) + params.max_new_tokens
        if need > mc.max_position_embeddings:
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                             f"context of {mc.max_position_embeddings} tokens")
        if need - 1 > self.allocator.capacity:  # the last generated token's KV is never computed
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) cannot fit in the "
                             f"KV pool of {self.allocator.capacity} tokens even alone")
        return ids

    def _queue(self, ids: list[int], params: SamplingParams, namespace: Hashable) -> int:
        rid = self._next_id
        self._next_id += 1
        self.scheduler.add(_Seq(rid, ids, namespace, params=params, arrival=time.perf_counter(),
                                generator=seeded_generator(params.seed, self.config.device), device=self.config.device))
        return rid

    @property
    def waiting(self) -> list[_Seq]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[_Seq]:
        return self.scheduler.running

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or finished but not yet returned by ``step()``."""
        return bool(self.waiting or self.running or self._unclaimed)

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run the model once, and return the requests that finished."""
        t0 = time.perf_counter()
        unclaimed, self._unclaimed = self._unclaimed, []
        batch = self.scheduler.schedule()
        if not batch:
            return unclaimed
        prefill_rows = [s.computed < len(s.prompt) for s, _ in batch]
        finished: list[RequestOutput] = []
        try:
            logits, ab, model_s = self._forward(batch)
            self._postprocess(batch, logits, finished)
        except Exception:  # in the model, the cache insertion, sampling or detokenizing
            # the engine goes on without the failed batch; outputs already finished wait for the next step()
            self._unclaimed = unclaimed + finished + self._unclaimed
            self.scheduler.withdraw({s.rid for s, _ in batch})
            raise
        seconds = time.perf_counter() - t0
        self._stats["step_s"] += seconds
        self._stats["model_s"] += model_s
        if self.config.record_steps:
            self.step_log.append(StepRecord.of(ab, seconds, model_s, prefill_rows))
        return unclaimed + finished

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion; one ``RequestOutput`` per prompt, in order.

        Every prompt is checked before any is queued: one bad prompt raises
        ``ValueError`` and leaves the engine as it was. Requests queued
        earlier with ``add_request`` share its batches; those that finish
        meanwhile are returned by the next ``step()``.
        """
        if isinstance(prompts, str) or _is_token_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) and not hasattr(prompts, "ndim"):
            raise ValueError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
        one = sampling_params is None or isinstance(sampling_params, SamplingParams)
        params = [sampling_params] * len(prompts) if one else _as_list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        params = [_sampling_params(sp) for sp in params]
        checked = [self._checked(p, sp) for p, sp in zip(prompts, params, strict=True)]
        rids: list[int] = []
        mine: set[int] = set()
        done: dict[int, RequestOutput] = {}
        try:
            for ids, sp in zip(checked, params, strict=True):
                rids.append(self._queue(ids, sp, None))
                mine.add(rids[-1])
            while len(done) < len(rids):
                for out in self.step():
                    if out.request_id in mine:
                        done[out.request_id] = out
                    else:  # added with add_request: the next step() returns it
                        self._unclaimed.append(out)
        except BaseException:  # a failed step (or Ctrl-C): withdraw this call's requests, keep the others
            self.scheduler.withdraw(mine)
            self._unclaimed = [o for o in self._unclaimed if o.request_id not in mine]
            raise
        self.check_idle()
        return [done[r] for r in rids]

    def chat(self, conversations: Sequence[Sequence[dict]] | Sequence[dict],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Each conversation a list of ``{"role", "content"}`` messages, formatted by the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer or chat template")
        prompts = []
        for conv in conversations:
            if not conv:
                raise ValueError("empty conversation: give at least one message")
            for msg in conv:
                if not isinstance(msg, dict) or msg.get("role") not in ROLES or not isinstance(msg.get("content"), str):
                    raise ValueError(f"bad message {msg!r}: role must be one of {ROLES} and content a string")
            ids = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # a BatchEncoding in transformers 5
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict:
        """Hit rate (cached / prompt tokens at admission), tokens computed, evictions, preemptions, and time.

        ``evictions`` counts the times memory pressure made the cache give up
        slots, ``evicted_tokens`` the slots it gave up.

        ``step_s`` is the time spent in ``step()``, ``model_s`` the part of it in
        the model's forward; ``overhead_share`` = 1 - model_s / step_s is the
        engine's own share (scheduling, cache, metadata, attention planning, sampling).
        """
        s = self.scheduler.stats | self._stats
        s["hit_rate"] = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        s["overhead_share"] = 1 - s["model_s"] / s["step_s"] if s["step_s"] else 0.0
        return s

    def reset_stats(self) -> None:
        """Zero the counters and the step log (the cache keeps its contents): e.g. after a warm-up request."""
        self._stats = {k: type(v)() for k, v in self._stats.items()}
        self.scheduler.stats = dict.fromkeys(self.scheduler.stats, 0)
        self.step_log = []

    def check_idle(self) -> None:
        """At idle no slot is leaked and the cache's invariants hold (AssertionError otherwise)."""
        self.cache.check_invariants()
        held = self.allocator.num_free + self.cache.evictable_size + self.cache.protected_size
        if not (self.waiting or self.running) and held != self.allocator.capacity:
            raise AssertionError(f"slots leaked: free + evictable + protected = {held} != {self.allocator.capacity}")

    # ------------------------------------------------------------------ running
    def _forward(self, batch: list[tuple[_Seq, int]]) -> tuple[torch.Tensor, AttentionBatch, float]:
        """Run the model on the batch: logits of each request's last new token, the batch, the model's seconds."""
        toks = [s.tokens[s.computed : s.computed + n] for s, n in batch]
        ab = AttentionBatch([s.computed for s, _ in batch], [n for _, n in batch],
                            [s.slots[: s.computed + n] for s, n in batch])
        self._stats["steps"] += 1
        x = prepare_step(self.pool, self.backend, toks, ab)
        t0 = time.perf_counter()
        logits = self.forward_fn(x.ids, x.positions, x.out_slots, self.pool, self.backend, qo_indptr=x.qo_indptr)
        return logits, ab, time.perf_counter() - t0

    def _postprocess(self, batch: list[tuple[_Seq, int]], logits: torch.Tensor,
                     finished: list[RequestOutput]) -> None:
        """Commit the step (finished prefill chunks join the cache), sample where a prompt is done, and
        append the outputs of the requests that finished."""
        self.scheduler.commit(batch)
        rows = [i for i, (s, _) in enumerate(batch) if not s.prefilling]
        if not rows:
            return
        sampling = [batch[i][0] for i in rows]
        specs = [SamplingSpec(s.params.temperature, s.params.top_k, s.params.top_p) for s in sampling]
        tokens = sample(logits[rows], specs, [s.generator for s in sampling]).tolist()
        now = time.perf_counter()
        for s, tok in zip(sampling, tokens, strict=True):
            s.output.append(tok)
            s.token_times.append(now - s.arrival)
            if self._done(s, tok):
                finished.append(self._finish(s))

    def _done(self, s: _Seq, tok: int) -> bool:
        return (len(s.output) >= s.params.max_new_tokens or tok in s.params.stop_token_ids
                or (not s.params.ignore_eos and tok in self.model.config.eos_token_ids))

    def _finish(self, s: _Seq) -> RequestOutput:
        self.scheduler.finish(s, s.tokens[:-1])  # the last token's KV was never computed
        text = self.tokenizer.decode(s.output, skip_special_tokens=True) if self.tokenizer is not None else ""
        times = s.token_times
        return RequestOutput(s.rid, s.prompt, s.output, text, len(s.prompt), s.hit, times[0], times[-1], times)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        try:
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)  # numpy arrays and tensors too
        except TypeError:
            raise ValueError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}") from None
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
        if bad:
            raise ValueError(f"token ids must be integers, got {bad[:5]}")
        return [int(t) for t in ids]


def _sampling_params(params: object) -> SamplingParams:
    """``params``, or the defaults for None; anything else is a ``ValueError``."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams or None, got {type(params).__name__}")
    return params


def _as_list(params: object) -> list:
    if isinstance(params, str | bytes | dict) or not isinstance(params, Sequence):
        raise ValueError("sampling_params must be SamplingParams, None, or a list of them, one per prompt; "
                         f"got {type(params).__name__}")
    return list(params)


def _is_token_list(prompts) -> bool:
    """Whether ``generate``'s argument is one prompt of token ids rather than a list of prompts."""
    if hasattr(prompts, "ndim"):  # a numpy array or a tensor: 1-D is one prompt
        return prompts.ndim == 1
    return bool(prompts) and isinstance(prompts[0], Integral)


def default_kv_tokens(bytes_per_slot: int, device: str = "cpu") -> int:
    """KV pool size when none is given: a quarter of the memory available now, at least 1,024 and at
    most 2**20 tokens. Available means the device's free memory on a GPU (after the weights are
    loaded), the host's free pages otherwise."""
    if torch.device(device).type == "cuda":
        avail = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 4 << 30
    return int(max(1024, min(avail // 4 // bytes_per_slot, 1 << 20)))

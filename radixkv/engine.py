"""The engine: continuous batching with chunked prefill on a prefix cache.

``LLM.step()`` schedules one batch (decodes and prefill chunks of running
requests first, then newly admitted ones in policy order, under a token
budget), runs the model once, and post-processes: a finished prefill chunk
is inserted into the cache and the request's lock moves to the new node (its
slots become the cache's canonical ones, so it never points at freed
duplicates); a finished request inserts prompt + output[:-1] and unlocks.
Under memory pressure unlocked cache is evicted first, then the most recently
admitted running request is preempted (its own KV freed, it re-queues and
recomputes what is no longer cached). A step is all or nothing for the
engine's books (``step``; docs/architecture.md, "The step's fault contract").
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from numbers import Integral
from typing import Any

import torch

from radixkv.attention import AttentionBatch
from radixkv.cache.tiers import REPORTED
from radixkv.checks import is_real
from radixkv.config import EngineConfig, SamplingParams
from radixkv.cost import CostModel, StepRecord
from radixkv.forward import build_forward, pool_zeros
from radixkv.inputs import Prompts, batch_arguments, sampling_params_of
from radixkv.interrupts import deferred_interrupts
from radixkv.kv_transfer import TierMemory
from radixkv.memory.kv_pool import KVPool, default_kv_tokens
from radixkv.model import load_model
from radixkv.model.loader import resolve_dtype
from radixkv.model.sampler import SamplingSpec, sample, seeded_generator
from radixkv.model.step import prepare_step
from radixkv.scheduling import RequestState
from radixkv.sessions import Finish, finish_kind
from radixkv.stack import build_stack, check_idle
from radixkv.structured import Grammars
from radixkv.tool_calls import ToolCall, parse_tool_calls


class EngineStalledError(RuntimeError):
    """Requests wait but none can run: without it ``generate`` would spin forever."""


@dataclass
class RequestOutput:
    """One finished request. Times are seconds since it was added (NaN before its first token); each token's
    is when it first came out, also where a preemption made the engine compute it again (``_Seq.emit``).

    ``finish_reason``: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_new_tokens``), ``"abort"``
    (``LLM.abort``) or ``"error"`` (this request alone failed; ``error`` says why, its batch went on).
    ``finish_kind``: how the answer ended for the session policies (``radixkv.sessions.Finish``: a tool call
    where the request's ``tool_parser`` found one, the end of the turn at EOS, ...; None for an error).
    ``tool_calls`` and ``content``: what the request's ``tool_parser`` found in ``text`` (``()`` and None
    without one).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft: float
    latency: float
    token_times: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    error: str | None = None
    finish_kind: Finish | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None


@dataclass(eq=False)
class _Seq(RequestState):
    """A request in the engine: the scheduler's record plus what sampling needs."""

    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    generator: torch.Generator | None = None
    device: str = "cpu"
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    delivered: list[float] = field(default_factory=list)  # times of the tokens produced before a preemption
    matcher: Any = None  # its grammar's state where its output is constrained (``SamplingParams.structured``)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def emit(self, token: int, now: float) -> None:
        """Append a sampled token. One a preemption made it compute again keeps the time it first came out
        (what a streaming client saw: the server does not send it twice), so ``ttft`` is the first token's."""
        i = len(self.token_times)
        self.output.append(token)
        self.token_times.append(self.delivered[i] if i < len(self.delivered) else now - self.arrival)

    def reset(self) -> None:
        super().reset()
        if len(self.token_times) > len(self.delivered):
            self.delivered = self.token_times
        self.output, self.token_times = [], []
        self.generator = seeded_generator(self.params.seed, self.device)  # a recomputation samples the same tokens
        if self.matcher is not None:  # and its grammar starts again with it
            self.matcher.reset()


class LLM:
    """A prefix-caching LLM engine; see the module docstring.

    ``LLM(model, prefix_cache="radix" | "hash" | "hash-v0" | "none", ...)`` takes the fields
    of ``EngineConfig``; ``enable_prefix_caching=False`` is vLLM's spelling of
    ``prefix_cache="none"``; ``hicache_ratio=R`` (SGLang's spelling) sizes the host tier at R x the device
    pool, so ``LLM(...).config.host_kv_cache_tokens`` is always the concrete size.
    """

    def __init__(self, model: str = "smollm2-135m", prefix_cache: str = "radix",
                 enable_prefix_caching: bool | None = None, hicache_ratio: float | None = None, **settings):
        if enable_prefix_caching is not None and not enable_prefix_caching:
            prefix_cache = "none"
        elif enable_prefix_caching and prefix_cache == "none":
            raise ValueError("enable_prefix_caching=True contradicts prefix_cache='none'")
        cfg = EngineConfig(model=model, prefix_cache=prefix_cache, **settings)
        # "auto" becomes the model's own dtype here (one warning where bfloat16 cannot run)
        self.config = cfg = replace(cfg, dtype=resolve_dtype(cfg.dtype, cfg.model, cfg.device))
        loaded = load_model(cfg.model, dtype=getattr(torch, cfg.dtype), device=cfg.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        mc = self.model.config
        dtype = getattr(torch, cfg.dtype)
        tokens = cfg.kv_cache_tokens or default_kv_tokens(
            KVPool.slot_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype), cfg.device)
        # CUDA graphs' padding rows write to a page of their own, the pool's last, which no request is given
        pad = cfg.kv_page_size if cfg.cuda_graphs and torch.device(cfg.device).type == "cuda" else 0
        self.pool = KVPool(mc.num_layers, mc.num_kv_heads, mc.head_dim, num_slots=tokens // cfg.kv_page_size
                           * cfg.kv_page_size + pad, page_size=cfg.kv_page_size, dtype=dtype, device=cfg.device,
                           zeros=pool_zeros(cfg.device, dtype, cfg.attention_backend))
        self.config = cfg = self._host_sized(hicache_ratio)
        # each lower tier's KV buffer, made as build_stack builds the tier; copies timed where steps are recorded
        self.memory = TierMemory(self.pool, timed=cfg.record_steps)
        stack = build_stack(cfg.stack, self.pool.num_slots - pad, memory=self.memory)
        self.mover = self.memory.mover()
        self.cache, self.allocator, self.scheduler = stack.cache, stack.allocator, stack.scheduler
        # the model's forward and the attention backend; on a CPU in 16 bits, through radixkv.cpu's speed-ups
        self.forward_fn, self.backend = build_forward(self.model, self.pool, cfg.attention_backend,
                                                      cfg.batch_invariant)
        self.decode_graphs = None  # decode steps replayed from CUDA graphs (FlashInfer on CUDA only)
        if pad and self.backend.name == "flashinfer":
            from radixkv.decode_graphs import DecodeGraphs  # lazy: it needs flashinfer

            self.decode_graphs = DecodeGraphs(self.model, self.pool, self.backend, cfg.max_running)
        self.prompts = Prompts(self.tokenizer, mc.vocab_size, mc.max_position_embeddings, self.allocator.capacity,
                               cfg.model)
        self._ids = itertools.count()  # request ids
        self._unclaimed: list[RequestOutput] = []  # finished inside generate() but added with add_request
        self._stats = {"steps": 0, "step_s": 0.0, "model_s": 0.0, "saved_prefill_s": 0.0}  # the scheduler: tokens
        self.step_log: list[StepRecord] = []  # filled when ``record_steps`` is set (simulator calibration)
        self._cost = CostModel()  # the CPU calibration preset: what ``saved_prefill_s`` is priced at
        self.grammars = Grammars(self.tokenizer, mc.vocab_size)  # constrained requests' (xgrammar, when first used)
        self.scheduler.on_first_admit = self._count_saved

    def _host_sized(self, ratio: float | None) -> EngineConfig:
        """The config with the host tier at ``ratio`` x the device pool (SGLang's ``--hicache-ratio``), when given
        in place of ``host_kv_cache_tokens``."""
        tokens = self.config.host_kv_cache_tokens
        if ratio is None:
            return self.config
        if tokens or not (is_real(ratio) and ratio > 0):
            raise ValueError(f"hicache_ratio must be a number > 0, and not given with host_kv_cache_tokens "
                             f"(got {ratio!r}, {tokens!r})")
        page = self.pool.page_size  # whole pages, as the tier's allocator holds them
        return replace(self.config, host_kv_cache_tokens=max(int(ratio * self.pool.num_slots) // page * page, page))

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    namespace: Hashable = None) -> int:
        """Queue one request; returns its id. Bad input raises ``ValueError`` and queues nothing."""
        params = sampling_params_of(params)
        try:
            hash(namespace)  # the cache keys its trees by it: an unhashable one would fail every later step
        except TypeError:
            raise ValueError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        return self._queue(self.prompts.check(prompt, params), params, namespace)

    def _queue(self, ids: list[int], params: SamplingParams, namespace: Hashable) -> int:
        matcher = self.grammars.matcher(params.structured) if params.structured is not None else None
        s = _Seq(next(self._ids), ids, namespace, hints=params.cache_hints, params=params, arrival=time.perf_counter(),
                 generator=seeded_generator(params.seed, self.config.device), device=self.config.device,
                 matcher=matcher)
        self.scheduler.add(s)
        return s.rid

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
        """Schedule one batch, run the model once, and return the requests that finished (or failed alone).

        All or nothing for the engine's books: whatever is raised inside (any ``BaseException``, at any
        point), ``Scheduler.recover`` keeps the cache's entries, frees every slot it does not hold and
        queues every unfinished request again to be recomputed (outputs stay exact); outputs that finished
        before the failure come with the next ``step()``; the exception propagates. Raises
        ``EngineStalledError`` when requests wait but none can run (see ``_stalled``).
        """
        t0 = time.perf_counter()
        unclaimed, self._unclaimed = self._unclaimed, []
        finished: list[RequestOutput] = []
        try:
            with deferred_interrupts():  # a Ctrl-C here is raised after the books are whole again
                self.scheduler.prefetch()  # contexts due back from the host tier (``prefetch``), while none waits
                batch = self.scheduler.schedule()
            self.mover.wait()  # loads land before attention reads them
            if not batch:
                if self.waiting or self.running:
                    raise EngineStalledError(self._stalled())
                return unclaimed
            logits, ab, model_s = self._forward(batch)
            with deferred_interrupts():
                self._postprocess(batch, logits, finished)
                self._record(time.perf_counter() - t0, model_s, ab)
                return unclaimed + finished
        except BaseException:
            with deferred_interrupts():  # outputs first: nothing finished is lost, nothing is served twice
                self._unclaimed = unclaimed + finished + self._unclaimed
                self.scheduler.recover(done={o.request_id for o in finished})
            raise

    def prefetch(self) -> int:
        """Load the contexts due back now from the lower tiers (``Scheduler.prefetch``), for an engine with no
        request in (``step`` does it before each batch): a step with nothing to run, all or nothing as one.
        The tokens loaded (with ``record_steps``, a ``StepRecord`` of these loads alone)."""
        before, t0 = sum(self.cache.loaded_tokens.values()), time.perf_counter()
        self._unclaimed += self.step()  # nothing runs: outputs that finished earlier wait for the next step
        loaded = sum(self.cache.loaded_tokens.values()) - before
        if loaded and self.config.record_steps:  # the load bandwidths' data (the fit's time constants skip it)
            self.step_log.append(StepRecord.of([], [], time.perf_counter() - t0, 0.0, [], self.mover.take_times()))
        return loaded

    def _count_saved(self, s: _Seq) -> None:
        """A request's first admission: the prefill time its cached prompt tokens saved (``stats``)."""
        self._stats["saved_prefill_s"] += self._cost.saved_prefill_time(len(s.prompt), s.hit)

    def _record(self, seconds: float, model_s: float, ab: AttentionBatch) -> None:
        self.cache.take_copies()  # done already (the mover ran each); the counters keep the totals
        self._stats["step_s"] += seconds
        self._stats["model_s"] += model_s
        if self.config.record_steps:
            self.step_log.append(StepRecord.of(ab.prefix_lens, ab.new_lens, seconds, model_s, ab.prefilling,
                                               self.mover.take_times()))

    def abort(self, request_ids: int | Iterable[int], finish: Finish = Finish.ABORT) -> None:
        """Stop requests wherever they are (waiting, mid-prefill, decoding); safe between steps.

        Their slots and locks are released and what they computed stays cached where the cache takes it
        (``Scheduler.abort``); each comes back from the next ``step()`` with ``finish_reason="abort"``. Ids
        that are unknown or already finished are ignored. ``finish``: how the answer ended, for the session
        books (``STOP_SEQUENCE`` where the server cut it at a stop string; an abort by default).
        """
        ids = {request_ids} if isinstance(request_ids, Integral) else set(request_ids)
        with deferred_interrupts():
            try:
                for s in [s for s in self.running + self.waiting if s.rid in ids]:
                    out = self._output(s, "abort")  # before its record is reset
                    out.finish_kind = finish
                    self._unclaimed.append(out)
                    s.finished = True
                    s.hints = s.hints._replace(stop=finish)
                    self.scheduler.abort(s)
            except BaseException:  # the books as after a failed step (the fault contract)
                self.scheduler.recover()
                raise

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion; one ``RequestOutput`` per prompt, in order.

        Every prompt is checked before any is queued: one bad prompt raises
        ``ValueError`` and leaves the engine as it was. Requests queued
        earlier with ``add_request`` share its batches; those that finish
        meanwhile are returned by the next ``step()``.
        """
        prompts, params = batch_arguments(prompts, sampling_params)
        checked = [self.prompts.check(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for sp in {sp.structured for sp in params if sp.structured is not None}:
            self.grammars.matcher(sp)  # a schema that cannot compile fails here, before anything is queued
        rids: list[int] = []
        mine: set[int] = set()
        done: dict[int, RequestOutput] = {}
        outs: list[RequestOutput] = []
        try:
            for ids, sp in zip(checked, params, strict=True):
                rids.append(self._queue(ids, sp, None))
                mine.add(rids[-1])
            while len(done) < len(rids):
                outs = self.step()
                with deferred_interrupts():
                    for out in outs:
                        if out.request_id in mine:
                            done[out.request_id] = out
                        else:  # added with add_request: the next step() returns it
                            self._unclaimed.append(out)
                    outs = []
        except BaseException:  # a failed step (or Ctrl-C): withdraw this call's requests, keep the others'
            self.scheduler.withdraw(mine)
            self._unclaimed = [o for o in self._unclaimed + outs if o.request_id not in mine]
            raise
        self.check_idle()
        return [done[r] for r in rids]

    def chat(self, conversations: Sequence[Sequence[dict]] | Sequence[dict],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Each conversation a list of ``{"role", "content"}`` messages, formatted by the chat template."""
        return self.generate(self.prompts.conversations(conversations), sampling_params)

    def chat_prompt(self, conv: Sequence[dict]) -> list[int]:
        """One conversation's prompt token ids through the chat template (``ValueError`` for bad messages)."""
        return self.prompts.chat_prompt(conv)

    @property
    def tier_names(self) -> list[str]:
        """The tiers hits are reported by: the device and the host tier always, then any other lower tier."""
        return list(dict.fromkeys([*REPORTED, *(t.name for t in self.cache.tiers)]))

    def stats(self) -> dict:
        """Hit rate (cached / prompt tokens at admission), tokens computed, evictions, preemptions, and time.

        ``evictions`` counts the times memory pressure made the cache give up
        slots, ``evicted_tokens`` the slots it gave up.

        ``hit_tokens_by_tier`` splits the cached tokens by the tier they came from (``tier_names``);
        ``loaded_tokens`` counts tokens copied from the lower tiers into the device, ``written_tokens`` down.

        ``step_s`` is the time spent in ``step()``, ``model_s`` the part of it in
        the model's forward; ``overhead_share`` = 1 - model_s / step_s is the
        engine's own share (scheduling, cache, metadata, attention planning, sampling).

        ``saved_prefill_s`` is the prefill time the cache saved, priced by ``CostModel()`` (the CPU
        calibration preset, not measured): for each admitted request of n prompt tokens of which h were
        cached (every tier), ``prefill_time(n, 0) - prefill_time(n - h, h)``, as the simulator's.
        """
        s = self.scheduler.stats | self._stats
        s["hit_rate"] = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        s["hit_tokens_by_tier"] = {name: self.scheduler.hit_by_tier.get(name, 0) for name in self.tier_names}
        s["loaded_tokens"] = sum(self.cache.loaded_tokens.values())
        s["written_tokens"] = sum(self.cache.written_tokens.values())
        s["overhead_share"] = 1 - s["model_s"] / s["step_s"] if s["step_s"] else 0.0
        return s

    def flush_cache(self) -> int:
        """Evict every cached token no running request holds, the host tier's copies too, writing nothing down
        (SGLang's ``/flush_cache``): how many device slots were freed. Safe between steps.

        All or nothing for the books, as ``step()``: a fault part way (a KV-event listener raising, say) is
        recovered as a failed step's (``Scheduler.recover``: every slot the caches do not hold is free again,
        running requests are queued again to be recomputed, outputs stay exact) and propagates.
        """
        with deferred_interrupts():  # a Ctrl-C here is raised after the books are whole again
            try:
                return self.scheduler.flush()
            except BaseException:
                self.scheduler.recover()
                raise

    def cache_state(self) -> dict:
        """The prefix cache as the server's ``/v1/cache`` shows it: its stats, sizes, the allocator's free and
        total slots, and whether its invariants hold (with the problem where they do not)."""
        try:
            self.cache.check_invariants()
            ok, problem = True, None
        except AssertionError as e:
            ok, problem = False, str(e)
        c = self.cache
        return {"prefix_cache": self.config.prefix_cache, "stats": c.stats(), "total_size": c.total_size,
                "evictable_size": c.evictable_size, "protected_size": c.protected_size,
                "free_slots": self.allocator.num_free, "capacity": self.allocator.capacity,
                "tiers": {t.name: {"total_size": t.cache.total_size, "capacity": t.allocator.capacity}
                          for t in c.tiers},
                "invariants_hold": ok, "problem": problem}

    def reset_stats(self) -> None:
        """Zero the counters and the step log (the cache keeps its contents): e.g. after a warm-up request."""
        self._stats = {k: type(v)() for k, v in self._stats.items()}
        self.scheduler.stats = dict.fromkeys(self.scheduler.stats, 0)
        self.scheduler.hit_by_tier = {}
        self.cache.reset_transfer_counts()
        self.step_log = []
        self.mover.take_times()  # the copies timed so far belong to no later step

    def check_idle(self) -> None:
        """The cache's and the allocator's invariants hold; when nothing waits or runs, nothing is protected
        and every slot is free or evictable (``AssertionError`` otherwise)."""
        if self.waiting or self.running:
            self.cache.check_invariants()
            self.allocator.check_invariants()
        else:
            check_idle(self.cache, self.allocator)

    # ------------------------------------------------------------------ running
    def _forward(self, batch: list[tuple[_Seq, int]]) -> tuple[torch.Tensor, AttentionBatch, float]:
        """Run the model on the batch: logits of each request's last new token, the batch, the model's seconds."""
        toks = [s.tokens[s.computed : s.computed + n] for s, n in batch]
        ab = AttentionBatch([s.computed for s, _ in batch], [n for _, n in batch],
                            [s.slots[: s.computed + n] for s, n in batch], [s.prefilling for s, _ in batch])
        self._stats["steps"] += 1
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(ab):  # decodes alone: replayed from their bucket's graph
            graphs.prepare([t[0] for t in toks], ab)
            run = graphs.replay
        else:
            x = prepare_step(self.pool, self.backend, toks, ab)
            run = partial(self.forward_fn, x.ids, x.positions, x.out_slots, self.pool, self.backend,
                          qo_indptr=x.qo_indptr)
        t0 = time.perf_counter()
        logits = run()
        return logits, ab, time.perf_counter() - t0

    def _postprocess(self, batch: list[tuple[_Seq, int]], logits: torch.Tensor,
                     finished: list[RequestOutput]) -> None:
        """Commit the step (finished prefill chunks join the cache), sample where a prompt is done, and
        append the outputs of the requests that finished. A request whose sampling fails finishes alone
        with ``finish_reason="error"``."""
        self.scheduler.commit(batch)
        rows = [i for i, (s, _) in enumerate(batch) if not s.prefilling]
        if not rows:
            return
        sampling = [batch[i][0] for i in rows]
        specs = [SamplingSpec(s.params.temperature, s.params.top_k, s.params.top_p) for s in sampling]
        errors: list[Exception | None] = [None] * len(rows)
        rows_logits = logits[rows]
        self.grammars.mask(rows_logits, [s.matcher for s in sampling])  # constrained rows: what the grammar allows
        tokens = sample(rows_logits, specs, [s.generator for s in sampling], errors).tolist()  # one sync
        now = time.perf_counter()
        for s, tok, err in zip(sampling, tokens, errors, strict=True):
            if err is not None:  # this request's own failure: the rest of the batch goes on
                self._finish(s, "error", finished, error=f"sampling failed: {type(err).__name__}: {err}")
                continue
            s.emit(tok, now)
            if reason := self._done(s, tok):
                self._finish(s, reason, finished)

    def _done(self, s: _Seq, tok: int) -> str | None:
        if tok in s.params.stop_token_ids or (not s.params.ignore_eos and tok in self.model.config.eos_token_ids):
            return "stop"
        if s.matcher is not None and (not s.matcher.accept_token(tok) or s.matcher.is_terminated()):
            return "stop"  # the grammar is complete (a masked sample is always accepted)
        return "length" if len(s.output) >= s.params.max_new_tokens else None

    def _finish(self, s: _Seq, reason: str, finished: list[RequestOutput], error: str | None = None) -> None:
        """Deliver the output first, then release: a failure in between never loses the request (``recover``
        drops a finished one) and at worst leaves its KV uncached."""
        out = self._output(s, reason, error)
        finished.append(out)
        s.finished = True
        if reason == "error":
            self.scheduler.abort(s)  # what it computed stays cached; its last token may have no KV yet
        else:  # how the answer ended (the tool it called), for the session books
            s.hints = s.hints._replace(stop=out.finish_kind, tool=out.tool_calls[0].name if out.tool_calls else None)
            self.scheduler.finish(s, s.tokens[:-1])  # the last token's KV was never computed

    def _output(self, s: _Seq, reason: str, error: str | None = None) -> RequestOutput:
        try:
            text = self.tokenizer.decode(s.output, skip_special_tokens=True) if self.tokenizer is not None else ""
        except Exception as e:  # a tokenizer failing on one output fails that request only
            text, reason, error = "", "error", error or f"detokenizing failed: {type(e).__name__}: {e}"
        times = s.token_times or [math.nan]
        calls, content = (), None
        if s.params.tool_parser is not None and reason in ("stop", "length"):
            parsed = parse_tool_calls(s.params.tool_parser, text)
            calls, content = parsed.calls, parsed.content
        return RequestOutput(s.rid, s.prompt, s.output, text, len(s.prompt), max(s.hit, 0), times[0], times[-1],
                             s.token_times, reason, error, finish_kind(reason, s.params.finish, bool(calls), bool(
                                 s.output) and s.output[-1] in s.params.stop_token_ids), calls, content)

    def _stalled(self) -> str:
        """Why nothing could be scheduled: what the first waiting request needs against what memory has."""
        head = self.waiting[0] if self.waiting else self.running[0]
        need = len(head.prompt) + head.params.max_new_tokens - 1
        return (f"no progress possible: request {head.rid} needs up to {need} KV slots; free "
                f"{self.allocator.num_free}, evictable {self.cache.evictable_size}, protected (locked) "
                f"{self.cache.protected_size} of {self.allocator.capacity}; {len(self.running)} running, "
                f"{len(self.waiting)} waiting")


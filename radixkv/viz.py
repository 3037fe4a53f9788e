"""Drawings of prefix-cache trees for notebooks and docs.

Everything works from ``cache.to_dict()`` snapshots (``RadixCache`` and
``HashBlockCache`` share the format: nested ``{"tokens", "lock_count",
"last_access", "children", ...}`` dicts). A node is identified by its *path*,
the tuple of every token from the root to the end of its edge, which survives
splits and is what ``diff_trees`` compares between two snapshots.
matplotlib is imported only inside the drawing functions, which never open a
window, so this module is safe on a headless machine.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Path = tuple[int, ...]
Decode = Callable[[Sequence[int]], str]

#: Face and edge colours per node status (SGLang's Figure 3 uses green / blue / red).
FACE = {"new": "#c7e9c0", "hit": "#c6dbef", "evicted": "#fde0dd", "cached": "#f7f7f7"}
EDGE = {"new": "#238b45", "hit": "#2171b5", "evicted": "#cb181d", "cached": "#737373"}
LEGEND = {"new": "new", "hit": "hit (matched / touched)", "evicted": "evicted", "cached": "cached"}


def snapshot(cache_or_tree: Any) -> dict[str, Any]:
    """``cache.to_dict()`` for a cache, the dict itself for a snapshot."""
    return cache_or_tree if isinstance(cache_or_tree, dict) else cache_or_tree.to_dict()


def iter_nodes(tree: dict[str, Any]) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """``(path, parent_path, node)`` for every non-root node, parents before children."""
    stack = [((), child) for child in reversed(tree["children"])]
    while stack:
        parent, node = stack.pop()
        path = parent + tuple(node["tokens"])
        yield path, parent, node
        stack.extend((path, child) for child in reversed(node["children"]))


def cached_length(tree: dict[str, Any], tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` the snapshot holds (walking edges; may end inside one)."""
    tokens, node, off = tuple(tokens), tree, 0
    while off < len(tokens) and node["children"]:
        shared = [_common_length(child["tokens"], tokens[off:]) for child in node["children"]]
        common = max(shared)
        off += common
        node = node["children"][shared.index(common)]  # the first child sharing the most
        if not 0 < common == len(node["tokens"]):  # ends inside the edge (or shares nothing)
            break
    return off


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class TreeDiff:
    """What changed between two snapshots; every set holds node paths.

    ``new``: nodes whose tokens were not cached before. ``hit``: nodes whose
    tokens were cached and that were matched or touched in between (their
    ``last_access`` moved). ``split``: node boundaries that did not exist
    before although the tokens did (the upper half of a split edge; also in
    ``hit`` when touched). ``evicted``: nodes of the first snapshot whose
    tokens are gone.
    """

    new: set[Path] = field(default_factory=set)
    hit: set[Path] = field(default_factory=set)
    split: set[Path] = field(default_factory=set)
    evicted: set[Path] = field(default_factory=set)
    new_tokens: int = 0
    evicted_tokens: int = 0

    def counts(self) -> dict[str, int]:
        """Node counts per category plus the token counts (for tables and JSON rows)."""
        return {"new_nodes": len(self.new), "hit_nodes": len(self.hit), "split_nodes": len(self.split),
                "evicted_nodes": len(self.evicted), "new_tokens": self.new_tokens,
                "evicted_tokens": self.evicted_tokens}


def diff_trees(before: Any, after: Any) -> TreeDiff:
    """Compare two snapshots (or caches, snapshotted now) node by node; see ``TreeDiff``."""
    before, after = snapshot(before), snapshot(after)
    old = {path: (parent, node) for path, parent, node in iter_nodes(before)}
    clock = max((node["last_access"] for _, node in old.values()), default=0)
    diff = TreeDiff()
    for path, parent, node in iter_nodes(after):
        held = cached_length(before, path)
        if held < len(path):
            diff.new.add(path)
            diff.new_tokens += len(path) - max(held, len(parent))
            continue
        if path not in old:
            diff.split.add(path)
        if node["last_access"] > clock:  # the clock only grows: touched after the first snapshot
            diff.hit.add(path)
    for path, (parent, _) in old.items():
        held = cached_length(after, path)
        if held < len(path):
            diff.evicted.add(path)
            diff.evicted_tokens += len(path) - max(held, len(parent))
    return diff


class TreeRecorder:
    """Snapshots a cache between operations: ``tree, diff = rec.step()`` after each one."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.last = snapshot(cache)

    def step(self) -> tuple[dict[str, Any], TreeDiff]:
        """The cache's tree now and its diff against the previous call (or construction)."""
        before, self.last = self.last, snapshot(self.cache)
        return self.last, diff_trees(before, self.last)


def edge_label(tokens: Sequence[int], decode: Decode | None = None, max_label: int = 36, wrap: int = 14) -> str:
    """An edge's text (decoded, or token ids), newlines as ``⏎``, its middle cut to fit ``max_label`` chars, wrapped."""
    text = decode(list(tokens)) if decode else " ".join(map(str, tokens))
    text = text.replace("\n", "⏎ ").replace("$", r"\$")
    if len(text) > max_label:  # keep both ends: where an edge ends is where the tree splits
        head = (max_label * 3) // 5
        text = text[:head] + "…" + text[len(text) - (max_label - head - 1):]
    return "\n".join(textwrap.wrap(text, wrap, break_long_words=True, replace_whitespace=False)) or "·"


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is None:
        import matplotlib.pyplot as plt  # Agg on a headless machine, inline in a notebook

        ax = plt.subplots(figsize=size)[1]
    ax.set_axis_off()
    return ax


def legend_handles(statuses: Iterable[str] = ("new", "hit", "evicted", "cached")) -> list[Any]:
    """Patches for a legend of the node colours (e.g. one legend for a whole grid of trees)."""
    from matplotlib.patches import Patch

    return [Patch(facecolor=FACE[s], edgecolor=EDGE[s], linestyle="--" if s == "evicted" else "-", label=LEGEND[s])
            for s in statuses]


def _drawn_items(tree: dict[str, Any], new: set[Path], hit: set[Path], evicted: set[Path]) -> dict[Path, dict]:
    """The drawn tree by path: every node of the snapshot, then the ghosts, each under its deepest drawn prefix."""
    drawn: dict[Path, dict] = {(): {"path": (), "kids": [], "node": None}}

    def add(path: Path, parent: Path, node: dict[str, Any] | None, status: str) -> None:
        drawn[path] = {"path": path, "kids": [], "node": node, "edge": path[len(parent):], "status": status}
        drawn[parent]["kids"].append(drawn[path])

    for path, parent, node in iter_nodes(tree):
        add(path, parent, node, "new" if path in new else "hit" if path in hit else "cached")
    for path in sorted(evicted - drawn.keys(), key=len):
        add(path, max((p for p in drawn if len(p) < len(path) and path[: len(p)] == p), key=len), None, "evicted")
    return drawn


def _place(root: dict[str, Any]) -> int:
    """Tidy layout: leaves on consecutive columns in depth-first order, parents centred over their children.

    Sets every item's ``x`` and ``y``; returns the number of leaves. O(items).
    """
    leaves = 0

    def place(item: dict[str, Any], depth: int) -> float:
        nonlocal leaves
        item["y"] = -depth
        if item["kids"]:
            xs = [place(kid, depth + 1) for kid in item["kids"]]
            item["x"] = (xs[0] + xs[-1]) / 2
        else:
            item["x"], leaves = float(leaves), leaves + 1
        return item["x"]

    place(root, 0)
    return leaves


def _stats_line(item: dict[str, Any]) -> str:
    """A box's second line: the edge's length, its ``lock_count`` when positive, and ``last_access``."""
    node, info = item["node"], f"\n{len(item['edge'])} tok"
    if node is not None:
        lock = f" · lock {node['lock_count']}" if node["lock_count"] else ""
        info += f"{lock} · t={node['last_access']}"
    return info


def draw_tree(tree: Any, ax: Any = None, *, diff: TreeDiff | None = None, new: Iterable[Path] = (),
              hit: Iterable[Path] = (), evicted: Iterable[Path] = (), decode: Decode | None = None,
              title: str | None = None, max_label: int = 36, wrap: int = 14, fontsize: float = 7,
              stats: bool = True, legend: bool = True) -> Any:
    """Draw a cache's tree (root on top) and return the matplotlib Axes.

    Each node is a box holding its edge (decoded with ``decode``, e.g. a
    tokenizer's ``decode``, else token ids), its length, lock count when
    positive and ``last_access`` (``stats``). Nodes in ``new`` / ``hit`` are
    coloured (``diff`` supplies all three sets at once); ``evicted`` paths,
    which the tree no longer holds, are drawn as dashed ghosts where they hung.
    Every box's text artist has its status as ``gid`` (``new``, ``hit``,
    ``evicted`` or ``cached``) for tests and post-processing.
    """
    new, hit, evicted = set(new), set(hit), set(evicted)
    if diff is not None:
        new, hit, evicted = new | diff.new, hit | diff.hit, evicted | diff.evicted
    drawn = _drawn_items(snapshot(tree), new, hit, evicted)
    root = drawn[()]
    leaves = _place(root)
    depth = -min(item["y"] for item in drawn.values())
    ax = _axes(ax, (max(4.0, 1.5 * leaves), max(2.5, 1.3 * (depth + 1))))
    ax.text(root["x"], 0, "root", ha="center", va="center", fontsize=fontsize, zorder=3,
            bbox=dict(boxstyle="circle,pad=0.3", fc="white", ec="black"))
    for item in drawn.values():
        for kid in item["kids"]:
            ghost = kid["status"] == "evicted"
            ax.plot([item["x"], kid["x"]], [item["y"], kid["y"]], color="#cb181d" if ghost else "#969696",
                    ls="--" if ghost else "-", lw=1, zorder=1)
        if not item["path"]:
            continue
        status = item["status"]
        label = edge_label(item["edge"], decode, max_label, wrap) + (_stats_line(item) if stats else "")
        ghost = status == "evicted"
        ax.text(item["x"], item["y"], label, ha="center", va="center", fontsize=fontsize, zorder=3,
                alpha=0.8 if ghost else 1.0, linespacing=1.1, gid=status,
                bbox=dict(boxstyle="round,pad=0.35", fc=FACE[status], ec=EDGE[status],
                          ls="--" if ghost else "-", lw=1.6 if status != "cached" else 0.8))
    ax.set_xlim(-0.7, max(leaves, 1) - 0.3)
    ax.set_ylim(-depth - 0.6, 0.5)
    if title:
        ax.set_title(title, fontsize=fontsize + 2, loc="left")
    if legend:
        present = [s for s in ("new", "hit", "evicted", "cached") if any(i.get("status") == s for i in drawn.values())]
        if present:
            ax.legend(handles=legend_handles(present), loc="upper left", bbox_to_anchor=(1.0, 1.0),
                      fontsize=fontsize, frameon=False)
    return ax


def draw_blocks(tree: Any, ax: Any = None, *, decode: Decode | None = None, title: str | None = None,
                max_label: int = 12, wrap: int = 6, fontsize: float = 6) -> Any:
    """Draw a block cache (``HashBlockCache.to_dict()``) as one row of blocks per chain and return the Axes.

    Row r is the r-th root-to-leaf chain; a block already drawn in an earlier
    row (a shared prefix) is a dotted empty outline in later rows, so sharing
    reads as columns. Locked blocks (``lock_count`` > 0) have a thick edge.
    """
    from matplotlib.patches import Rectangle

    chains, seen = [], set()
    chain_to: dict[Path, list[tuple[Path, dict[str, Any]]]] = {(): []}  # each node's chain, root side first
    for path, parent, node in iter_nodes(snapshot(tree)):
        chain_to[path] = [*chain_to[parent], (path, node)]
        if not node["children"]:
            chains.append(chain_to[path])
    width = max((len(c) for c in chains), default=1)
    ax = _axes(ax, (max(4.0, (0.3 + 0.07 * wrap) * width), max(1.5, 0.8 * len(chains) + 0.6)))
    for row, chain in enumerate(chains):
        for col, (path, block) in enumerate(chain):
            shared = path in seen
            seen.add(path)
            ax.add_patch(Rectangle((col, -row - 0.9), 0.92, 0.8, fc="none" if shared else FACE["cached"],
                                   ec=EDGE["cached"], ls=":" if shared else "-",
                                   lw=2.0 if block["lock_count"] else 0.8))
            if not shared:
                ax.text(col + 0.46, -row - 0.5, edge_label(block["tokens"], decode, max_label, wrap),
                        ha="center", va="center", fontsize=fontsize)
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-max(len(chains), 1) - 0.1, 0.1)
    if title:
        ax.set_title(title, fontsize=fontsize + 3, loc="left")
    return ax

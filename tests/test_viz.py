"""radixkv.viz: snapshot diffs and headless drawings (tiny hand-made trees, integer tokens, no model)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from radixkv import HashBlockCache, RadixCache  # noqa: E402
from radixkv.viz import (  # noqa: E402
    EDGE,
    FACE,
    TreeRecorder,
    cached_length,
    diff_trees,
    draw_blocks,
    draw_tree,
    edge_label,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def insert(cache: RadixCache, tokens: list[int]) -> None:
    """Insert with fresh slot indices (the tree checks they are unique)."""
    start = insert.next
    insert.next += len(tokens)
    cache.insert(tokens, np.arange(start, start + len(tokens)))


insert.next = 0


def boxes(ax) -> dict[str, list]:
    """The node boxes of a drawing by status (their text artists carry it as gid)."""
    out: dict[str, list] = {}
    for text in ax.texts:
        if text.get_gid():
            out.setdefault(text.get_gid(), []).append(text)
    return out


def test_diff_finds_new_split_hit_and_evicted():
    cache = RadixCache()
    insert(cache, [1, 2, 3, 4, 5])
    before = cache.to_dict()
    insert(cache, [1, 2, 3, 9, 9])
    diff = diff_trees(before, cache)
    assert diff.new == {(1, 2, 3, 9, 9)}
    assert diff.split == {(1, 2, 3)}  # the upper half of the split edge: its tokens were cached
    assert diff.hit == {(1, 2, 3)}  # the insert walked through it; the lower half [4, 5] was not touched
    assert (diff.evicted, diff.new_tokens, diff.evicted_tokens) == (set(), 2, 0)

    mid = cache.to_dict()
    freed = cache.evict(1)  # LRU leaf: [4, 5]
    assert len(freed) == 2
    diff = diff_trees(mid, cache)
    assert diff.evicted == {(1, 2, 3, 4, 5)}
    assert (diff.new, diff.hit, diff.evicted_tokens) == (set(), set(), 2)
    assert diff.counts()["evicted_nodes"] == 1


def test_diff_of_a_match_that_splits_marks_both_halves_hit():
    cache = RadixCache()
    insert(cache, [1, 2, 3, 4])
    before = cache.to_dict()
    cache.match_prefix([1, 2, 7])
    diff = diff_trees(before, cache)
    assert diff.split == {(1, 2)} and diff.hit == {(1, 2)} and not diff.new and not diff.evicted


def test_diff_evicted_chain_counts_each_node_once():
    cache = RadixCache()
    insert(cache, [1, 2])
    insert(cache, [1, 2, 3, 4])
    insert(cache, [5, 6])
    before = cache.to_dict()
    cache.match_prefix([5, 6])  # make [1 2] -> [3 4] the least recently used chain
    cache.evict(4)
    diff = diff_trees(before, cache)
    assert diff.evicted == {(1, 2), (1, 2, 3, 4)} and diff.evicted_tokens == 4


def test_cached_length_picks_the_longest_matching_child():
    cache = RadixCache(page_size=2)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 7, 3, 4])  # same first token, different first page: two children of the root
    tree = cache.to_dict()
    assert cached_length(tree, [1, 7, 3, 4, 9]) == 4
    assert cached_length(tree, [1, 2, 3]) == 3
    assert cached_length(tree, [8]) == 0
    assert cached_length(tree, []) == 0


def test_recorder_diffs_consecutive_operations():
    cache = RadixCache()
    rec = TreeRecorder(cache)
    insert(cache, [1, 2, 3])
    tree, diff = rec.step()
    assert diff.new == {(1, 2, 3)} and tree["children"][0]["tokens"] == [1, 2, 3]
    cache.match_prefix([1, 2, 3])
    _, diff = rec.step()
    assert diff.hit == {(1, 2, 3)} and not diff.new


def test_draw_tree_colours_new_hit_and_evicted_nodes():
    cache = RadixCache()
    insert(cache, [1, 2, 3, 4, 5])
    insert(cache, [1, 2, 3, 6])
    cache.match_prefix([1, 2, 3, 6])
    before = cache.to_dict()
    cache.evict(1)  # [4, 5], the least recently used leaf
    m = cache.match_prefix([1, 2, 3, 6])
    cache.lock(m.node)
    insert(cache, [7, 8])
    diff = diff_trees(before, cache)
    ax = draw_tree(cache, diff=diff, title="step")
    assert isinstance(ax, matplotlib.axes.Axes)
    drawn = boxes(ax)
    assert {k: len(v) for k, v in drawn.items()} == {"new": 1, "hit": 2, "evicted": 1}
    for status, texts in drawn.items():
        for text in texts:
            patch = text.get_bbox_patch()
            assert patch.get_facecolor() == to_rgba(FACE[status])
            assert patch.get_edgecolor() == to_rgba(EDGE[status])
    ghost = drawn["evicted"][0]
    assert ghost.get_text().startswith("4 5") and ghost.get_bbox_patch().get_linestyle() == "--"
    assert "lock 1" in next(t.get_text() for t in drawn["hit"] if t.get_text().startswith("6"))
    assert [t.get_text() for t in ax.get_legend().get_texts()][0] == "new"
    ax.figure.canvas.draw()  # renders headless


def test_draw_tree_explicit_sets_decode_and_an_empty_tree():
    cache = RadixCache()
    insert(cache, [72, 105])
    ax = draw_tree(cache.to_dict(), new=[(72, 105)], decode=lambda ids: "".join(map(chr, ids)), stats=False,
                   legend=False)
    (text,) = boxes(ax)["new"]
    assert text.get_text() == "Hi" and ax.get_legend() is None
    assert boxes(draw_tree(RadixCache())) == {}


def test_ghosts_hang_under_their_deepest_remaining_prefix():
    cache = RadixCache()
    insert(cache, [1, 2, 3])
    ax = draw_tree(cache, evicted=[(1, 2, 3, 4, 5), (1, 2, 3, 4, 5, 6)], stats=False, legend=False)
    ghosts = sorted(t.get_text() for t in boxes(ax)["evicted"])
    assert ghosts == ["4 5", "6"]


def test_edge_label_keeps_both_ends_and_escapes():
    label = edge_label(list(range(40)), max_label=20, wrap=100)
    assert len(label) == 20 and label.startswith("0 1 2") and label.endswith("39") and "…" in label
    assert edge_label([1], decode=lambda ids: "a\nb $5") == r"a⏎ b \$5"


def test_draw_blocks_shows_shared_blocks_once():
    cache = HashBlockCache(block_size=2)
    cache.insert(list(range(6)), list(range(6)))
    cache.insert([0, 1, 2, 3, 9, 9, 5], list(range(10, 17)))  # shares two blocks, adds one; the tail is not cached
    ax = draw_blocks(cache, title="blocks")
    assert len(ax.patches) == 6  # 2 chains x 3 blocks
    assert sum(p.get_linestyle() == ":" for p in ax.patches) == 2  # the shared blocks, in the second row
    assert sorted(t.get_text() for t in ax.texts) == ["0 1", "2 3", "4 5", "9 9"]


def _fig3():
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("experiments.fig3_tree_steps")


def test_fig3_replay_with_a_word_tokenizer():
    fig3 = _fig3()
    vocab: dict[str, int] = {}

    def tokenize(text: str) -> list[int]:
        return [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\s*\S+|\s+", text)]

    steps = fig3.fig3_steps(tokenize)  # asserts invariants and the figure's evictions per step
    assert [len(s.diff.evicted) for s in steps] == [0, 0, 0, 0, 1, 0, 0, 2, 3]
    assert [s.diff.counts()["new_nodes"] > 0 for s in steps] == [False] + [True] * 8
    assert steps[3].diff.split  # chat 2 splits chat 1's first edge
    assert steps[-1].free_slots == steps[-1].config["capacity_tokens"] - steps[-1].total_tokens
    row = steps[4].row(decode=lambda ids: " ".join(map(str, ids)))
    assert row["evicted_nodes"] == 1 and "text" in row["tree"]["children"][0]
    for page in (4, 16):
        assert len(fig3.fig3_steps(tokenize, page_size=page)) == 9

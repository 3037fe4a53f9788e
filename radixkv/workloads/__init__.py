"""Seeded token-level request streams named after real use.

``make(name, seed=0, **sizes)`` builds a synthetic workload whose shape
follows a published benchmark (sizes are keyword arguments; the defaults are
the published shapes); ``mooncake(path)`` replays Mooncake's public trace, ``agentic(path)`` real
coding-agent sessions (prompts kept as block runs, ``BlockPrompt``, built into tokens when sent);
``split_of(session)`` is the project's one tune/test split of agent sessions.
Every generator is deterministic for a given seed, and tokens are int64 ids
drawn so that two independently drawn spans never share a prefix by accident.
"""

from __future__ import annotations

from collections.abc import Callable

from radixkv.workloads.agentic import agentic
from radixkv.workloads.mooncake import mooncake
from radixkv.workloads.request import BlockPrompt, Request, TokenSource
from radixkv.workloads.split import SPLITS, split_of
from radixkv.workloads.synthetic import (
    few_shot,
    multi_turn,
    no_sharing,
    self_consistency,
    shared_prefix,
    tree_of_thought,
)

WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    f.__name__: f for f in (multi_turn, shared_prefix, few_shot, tree_of_thought, self_consistency, no_sharing)}


def make(name: str, seed: int = 0, **sizes) -> list[Request]:
    """A synthetic workload by name; ``sizes`` override its published shape.

    >>> reqs = make("shared_prefix", groups=2, prompts_per_group=3, system_tokens=8, question_tokens=2)
    >>> len(reqs), len(reqs[0].prompt)
    (6, 10)
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)} (or use mooncake())")
    return WORKLOADS[name](seed=seed, **sizes)


__all__ = ["BlockPrompt", "Request", "SPLITS", "TokenSource", "WORKLOADS", "agentic", "make", "mooncake", "split_of"]

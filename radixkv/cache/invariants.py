"""How the caches' invariant checks fail: one ``AssertionError`` naming the cache and the broken invariant.

Each cache checks its own structure in its ``check_invariants`` method (the randomized tests call it after
every operation), next to the state it checks. This module knows no cache: the cache modules import it,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable

Require = Callable[..., None]


def requirer(kind: str) -> Require:
    """``require(ok, name, detail="")``: raise ``AssertionError`` naming ``kind``'s invariant ``name`` unless ok."""

    def require(ok: bool, name: str, detail: object = "") -> None:
        if not ok:  # the detail (often a node or block) is formatted only on failure: this runs per entry
            raise AssertionError(f"{kind} invariant '{name}' broken: {detail!r}")

    return require

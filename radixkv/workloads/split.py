"""The project's one split of agent sessions into ``tune`` and ``test``.

Every agent experiment chooses its parameters on ``tune`` and reports on ``test``. A session's side is a
function of its id alone: the first 8 bytes of the SHA-256 of the id, read as an unsigned integer, below
``TEST_SHARE`` of 2^64 put it in ``test``. So the split needs no file of its own, holds for any subset or
order of the sessions, and never moves when sessions are added. On ``shared/traces/agentic`` it puts 285
of the 563 sessions (2.12 of the 4.30 billion prompt tokens) in ``test``.

>>> split_of("trace_0001") in SPLITS
True
"""

from __future__ import annotations

import hashlib

SPLITS = ("tune", "test")
TEST_SHARE = 0.5  # half the sessions: both sides keep enough sessions for intervals


def split_of(session: str) -> str:
    """``"test"`` or ``"tune"``: the side of the split the session with this id is on. O(len(id))."""
    if not isinstance(session, str) or not session:
        raise ValueError(f"a session id is a non-empty string, got {session!r}")
    head = int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big")
    return "test" if head < TEST_SHARE * 2**64 else "tune"


def check_split(split: str | None) -> None:
    """``ValueError`` unless ``split`` is None (every session) or one of ``SPLITS``."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS} (or None: every session)")

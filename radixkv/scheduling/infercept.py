"""``infercept``: InferCept's choice at each interception (Abhyankar et al., "InferCept: Efficient Intercept
Support for Augmented Large Language Model Inference", ICML 2024), as itself, on agent sessions.

The paper's rule: when a request is intercepted (here: its answer called a tool, and the agent waits for the
result), its context's KV is **preserved** on the device, **discarded** (recomputed when the request resumes)
or **swapped** to host memory (and back), whichever wastes least. Waste is memory held idle times the
seconds it is held so:

* preserve: the context's ``C`` tokens for the interception, ``T_int x C``;
* discard: the recompute of ``C`` when the request resumes, during which the batch's memory waits with it,
  ``T_fwd(C) x (C + M)``, ``M`` the tokens of the other requests running;
* swap: the copy out and back, ``2 T_swap(C) x (C + M)`` (the paper overlaps much of it with compute; it is
  charged whole here).

``T_int`` is the interception's expected duration: the pauses seen after the same tool from the same kind of
stream (``radixkv.sessions.Pauses.expected``, learned online), ``hold`` seconds before any was seen;
``T_fwd(C) = reload_per_token x C`` and ``T_swap(C) = swap_per_token x C`` (defaults: the llama3-70b-8xh100
preset's prefill per token and its KV per token over one GPU's 64 GB/s PCIe link). Swap is a choice only over
a host tier; on the device alone the choice is preserve or discard.

The schedule is first-come-first-served, as InferCept's (vLLM's); the decision goes on the sessions book's
entry for the finish (``Awaited.pin``: the expected duration to preserve, -1 to discard or swap), which the
``infercept`` eviction policy (``radixkv.cache.eviction.infercept``) holds the path for or evicts first (over
a host tier, demoting it: the swap). O(running) per finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.scheduling.continuum import RELOAD_PER_TOKEN
from radixkv.sessions import Finish, Sessions, stream_key

SWAP_PER_TOKEN = 327_680 / 64e9  # seconds to copy a token's KV one way: Llama-3-70B bf16 over PCIe Gen5 x16
ACTIONS = ("preserve", "discard", "swap")


def min_waste(context: int, interception: float, others: int, reload_per_token: float, swap_per_token: float | None
              ) -> tuple[str, dict[str, float]]:
    """The action that wastes least for a context of ``context`` tokens intercepted ``interception`` seconds
    while ``others`` tokens of other requests run, and each action's waste (token-seconds); ``swap_per_token``
    None: no host tier to swap to. Ties go to the first of ``ACTIONS``.

    >>> min_waste(1000, 0.5, 0, reload_per_token=1e-3, swap_per_token=None)[0]  # a short call: keep it
    'preserve'
    >>> min_waste(1000, 600.0, 0, reload_per_token=1e-3, swap_per_token=None)[0]  # ten minutes: recompute
    'discard'
    >>> min_waste(1000, 600.0, 0, reload_per_token=1e-3, swap_per_token=1e-5)[0]  # cheaper to copy back
    'swap'
    """
    held = context + others
    waste = {"preserve": interception * context, "discard": reload_per_token * context * held}
    if swap_per_token is not None:
        waste["swap"] = 2 * swap_per_token * context * held
    return min(waste, key=lambda a: (waste[a], ACTIONS.index(a))), waste


class InferCept:
    """See the module doc. ``reload_per_token`` and ``swap_per_token``: seconds a token (> 0); ``hold``: the
    expected interception before any was seen (> 0, default 10 s)."""

    name, needs_match, sees_in_flight, follows_sessions = "infercept", False, False, True

    def __init__(self, reload_per_token: float = RELOAD_PER_TOKEN, swap_per_token: float = SWAP_PER_TOKEN,
                 hold: float = 10.0):
        for key, value in (("reload_per_token", reload_per_token), ("swap_per_token", swap_per_token),
                           ("hold", hold)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"infercept policy: {key} must be a number > 0, got {value!r}")
        self.reload_per_token, self.swap_per_token, self.hold = float(reload_per_token), float(swap_per_token), hold
        self.scheduler: Any = None
        self.sessions = Sessions()
        self.chosen = dict.fromkeys(ACTIONS, 0)  # how often each action was taken

    def attach(self, scheduler: Any) -> None:
        self.scheduler, self.sessions = scheduler, scheduler.sessions

    def added(self, state: Any) -> None:
        """Nothing to learn at arrival (the book learns the pause)."""

    def finished(self, state: Any, length: int) -> None:
        """At a tool call: the least wasteful action for the context it leaves, on the book's entry."""
        key = stream_key(state.hints)
        entry = self.sessions.awaited.get(key) if key is not None else None
        if entry is None or state.hints.stop != Finish.TOOL_CALL:
            return
        expected = self.sessions.pauses.expected(entry.kind)
        interception = self.hold if expected is None else expected
        others = sum(len(s.slots) for s in self.scheduler.running if s is not state)
        swap = self.swap_per_token if self.scheduler.cache.tiers else None
        action, _ = min_waste(length, interception, others, self.reload_per_token, swap)
        self.chosen[action] += 1
        entry.pin = interception if action == "preserve" else -1.0

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        """Arrival order (FCFS). O(n log n)."""
        return sorted(waiting, key=lambda c: c.order)

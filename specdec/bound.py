"""The most any n-gram chain policy could gain on a finished greedy run.

Greedy output is fixed, and so is what the n-gram lookup proposes at each point of it: the
draft of length k after ``t`` committed tokens depends only on the prompt and those tokens.
So the fastest schedule of draft lengths (k = 0..k_max at every step) that any policy, the
cost model included, could pick is found exactly by dynamic programming over ``t``, with
each step priced by the measured forward costs. It knows the future, so no real policy
reaches it; it tells whether a goal is in reach of the drafter at all, and how far the
planner is from it. Draft time is left out (the lookup is free next to a forward) and so is
bookkeeping: only target forwards are counted, as in the cost model.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost import ForwardCosts
from .drafters.ngram import lookup


@dataclass(frozen=True)
class ChainBound:
    """``seconds``: target forward time of the best schedule after the first token (which
    the prefill commits); ``plain_seconds``: one forward per token instead; ``ks``: the
    draft length of each of the best schedule's steps."""

    seconds: float
    plain_seconds: float
    ks: tuple[int, ...]

    @property
    def speedup(self) -> float:
        """Decode speed-up over plain decoding (1.0 when nothing is left to decode)."""
        return self.plain_seconds / self.seconds if self.seconds > 0 else 1.0


def ngram_chain_bound(prompt: list[int], output: list[int], costs: ForwardCosts, k_max: int,
                      n_max: int = 3, n_min: int = 1) -> ChainBound:
    """The fastest schedule for decoding ``output`` (greedy, after ``prompt``) with chains of
    at most ``k_max`` drafts from ``lookup(ids, k, n_max, n_min)``."""
    ids = list(prompt) + list(output)
    T, P = len(output), len(prompt)
    best = [0.0] * (T + 1)  # best[t]: seconds to commit output[t:] once output[:t] is committed
    plain = 0.0  # the same for plain decoding, summed in the same order (so best[1] <= plain)
    step = [(0, t + 1) for t in range(T + 1)]  # step[t]: (k, t after the step) of the best schedule
    for t in range(T - 1, 0, -1):
        context = ids[: P + t]
        best[t], plain = costs(1) + best[t + 1], costs(1) + plain
        for k in range(1, min(k_max, T - t) + 1):
            draft = lookup(context, k, n_max, n_min)
            if not draft:
                break  # no match: no k drafts anything
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[t + accepted]:
                accepted += 1
            after = min(t + accepted + 1, T)
            seconds = costs(len(draft) + 1) + best[after]
            if seconds < best[t]:
                best[t], step[t] = seconds, (k, after)
    ks, t = [], 1
    while t < T:
        ks.append(step[t][0])
        t = step[t][1]
    return ChainBound(best[1] if T > 1 else 0.0, plain, tuple(ks))

"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens."""
from __future__ import annotations

from ..sequence import Sequence
from .base import Draft


def lookup(ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Continuation (<= k tokens) of the latest earlier match of ``ids``' last n tokens, trying
    n from ``n_max`` down to ``n_min``; among matches of the same n the most recent one with a
    full k-token continuation wins, else the most recent with the longest one."""
    L = len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n:]
        best: list[int] = []
        for start in range(L - n - 1, -1, -1):  # most recent first, excluding the suffix itself
            if ids[start:start + n] == suffix:
                cont = ids[start + n:start + n + k]
                if len(cont) > len(best):
                    best = cont
                if len(best) == k:
                    break
        if best:
            return best
    return []


class NgramDrafter:
    def __init__(self, n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs, ks) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens = lookup(seq.ids, k, self.n_max, self.n_min) if k > 0 else []
            for i, t in enumerate(tokens):  # stop drafting after an EOS draft
                if t in seq.eos_ids:
                    tokens = tokens[:i + 1]
                    break
            drafts.append(Draft(tokens))
        return drafts

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

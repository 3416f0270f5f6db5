"""Prompt lookup: propose what followed an earlier occurrence of the text's last n tokens
(the longest n first; see ``lookup``)."""
from __future__ import annotations

import numpy as np

from ..sequence import Sequence, cut_after_eos
from ..tree import DraftTree
from .base import Draft


def match_starts(a: np.ndarray, n: int) -> np.ndarray:
    """Ascending starts of the earlier occurrences of ``a``'s last n tokens (windows that
    begin before the suffix itself; they may overlap it). Vectorized: a long context costs
    microseconds, not a Python loop over every position."""
    L = len(a)
    starts = np.nonzero(a[: L - n] == a[L - n])[0]  # [matches]
    for j in range(1, n):
        starts = starts[a[starts + j] == a[L - n + j]]
    return starts


def lookup(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Continuation (<= k tokens) of an earlier match of ``ids``' last n tokens, trying
    n from ``n_max`` down to ``n_min``; among matches of the same n the most recent one with a
    full k-token continuation wins, else the one with the longest (the oldest)."""
    a, L = np.asarray(ids), len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = match_starts(a, n)
        if len(starts):
            full = starts[starts <= L - n - k]  # continuations of k tokens
            start = int(full[-1] if len(full) else starts[0])
            return a[start + n: start + n + k].tolist()
    return []


MATCH_CAP = 32


def longest_match(ids: list[int] | np.ndarray, cap: int = MATCH_CAP) -> int:
    """The largest m <= cap such that ``ids``' last m tokens also occur earlier (0: the last
    token never occurred before)."""
    a = np.asarray(ids)  # [L]
    L = len(a)
    if L < 2:
        return 0
    cand = np.nonzero(a[:-1] == a[-1])[0]  # ends of earlier occurrences of the last token
    m = 0
    while len(cand) and m < cap:
        m += 1
        cand = cand[cand >= m]
        cand = cand[a[cand - m] == a[L - 1 - m]] if m < L else cand[:0]
    return m


def lookup_branches(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int, branches: int) -> list[list[int]]:
    """Up to ``branches`` distinct continuations (<= k tokens) of earlier matches of the last
    n tokens: longest n first, most recent match first within an n."""
    a, L, found = np.asarray(ids), len(ids), []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in match_starts(a, n)[::-1].tolist():
            cont = a[start + n:start + n + k].tolist()
            if cont not in found:
                found.append(cont)
                if len(found) == branches:
                    return found
    return found


class NgramDrafter:
    """Chains, or with ``branches > 1`` a tree of several matches' continuations (a trie of at
    most ``max_nodes`` nodes)."""

    def __init__(self, n_max: int = 3, n_min: int = 1, branches: int = 1, max_nodes: int | None = None):
        self.n_max, self.n_min, self.branches, self.max_nodes = n_max, n_min, branches, max_nodes

    def context(self, seq: Sequence) -> int | None:
        """None when the lookup finds no match for ``seq``, or none whose first draft the
        request's grammar allows (then ``hybrid`` drafts with the model); else the cost
        model's context: the length of the longest earlier match of the text's end
        (``cost.MatchAcceptance``). A long match means a copy in progress, and its drafts are
        accepted far more often than those of a 1-token match."""
        m = longest_match(seq.id_array(), max(MATCH_CAP, self.n_min))  # >= n_min: the lookup matches
        if m < self.n_min:
            return None
        if seq.grammar is not None:  # a first draft the grammar forbids: as no match
            firsts = [lookup(seq.id_array(), 1, self.n_max, self.n_min)] if self.branches == 1 else \
                lookup_branches(seq.id_array(), 1, self.n_max, self.n_min, self.branches)
            if not any(f and seq.grammar.valid_prefix(f) for f in firsts):
                return None
        return m

    def propose(self, seqs, ks) -> list[Draft]:
        return [self._draft(seq, k) if k > 0 else Draft([]) for seq, k in zip(seqs, ks)]

    def _draft(self, seq: Sequence, k: int) -> Draft:
        if self.branches == 1:  # stop drafting after an EOS draft
            return Draft(cut_after_eos(lookup(seq.id_array(), k, self.n_max, self.n_min), seq.eos_ids))
        paths = [cut_after_eos(p, seq.eos_ids)
                 for p in lookup_branches(seq.id_array(), k, self.n_max, self.n_min, self.branches)]
        if seq.grammar is not None:  # each branch stops before its first draft the grammar forbids
            paths = [p[:seq.grammar.valid_prefix(p)] for p in paths]
            paths = [p for p in paths if p]
        if not paths:
            return Draft([])
        tree = DraftTree.from_paths(seq.ids[-1], paths)
        if self.max_nodes is not None and tree.num_drafts > self.max_nodes:  # rows are topological
            tree = DraftTree(tree.tokens[: self.max_nodes + 1], tree.parents[: self.max_nodes + 1])
        if all(p == r - 1 for r, p in enumerate(tree.parents)):  # one branch: a plain chain
            return Draft(tree.tokens[1:])
        return Draft(tree.tokens[1:], tree=tree)

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

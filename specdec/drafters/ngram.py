"""Prompt lookup: propose what followed an earlier occurrence of the text's last n tokens
(the longest n first; see ``lookup``), in the request's own text and, with an
``NgramCorpus``, in the other requests' texts: those running beside it and those that
finished before it."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..sequence import Sequence, cut_after_eos
from ..tree import DraftTree
from .base import Draft


def match_starts(a: np.ndarray, n: int) -> np.ndarray:
    """Ascending starts of the earlier occurrences of ``a``'s last n tokens (windows that
    begin before the suffix itself; they may overlap it)."""
    return occurrences(a, a[len(a) - n:], len(a) - n)


class NgramCorpus:
    """The texts (prompt and output ids) of other requests, for lookups across requests:
    SGLang's n-gram cache is shared so, where vLLM's prompt lookup reads the request alone.
    ``live``: the running requests by slot, read as their ids are so far (the other
    completions of a prompt drawn with ``n > 1`` run beside each other); ``texts``: those
    that finished, joined in one array, each followed by a separator (-1) that no token
    equals, so that a match never spans two texts and a continuation stops at its text's end;
    the oldest are dropped once the tokens pass ``capacity``. A lookup scans the array
    (vectorized: a lookup over a million tokens takes about 1 ms on a 2-core CPU)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.live: dict[int, Sequence] = {}
        self.texts: deque[np.ndarray] = deque()
        self.size = 0  # tokens held, separators included
        self._joined: np.ndarray | None = None  # [size] the texts and separators, joined on demand
        self._ends: np.ndarray | None = None  # [texts] the separators' indices

    def others(self, seq: Sequence | None = None) -> "OtherTexts":
        """What ``seq``'s lookup reads beside its own text."""
        return OtherTexts([s.id_array() for s in reversed(self.live.values()) if s is not seq], self)

    def __len__(self) -> int:
        return len(self.texts)

    def add(self, ids) -> None:
        """A finished request's ids (a text longer than the capacity keeps its end)."""
        text = np.append(np.asarray(ids, dtype=np.int64)[max(0, len(ids) - (self.capacity - 1)):], -1)
        self.texts.append(text)
        self.size += len(text)
        while self.size > self.capacity:
            self.size -= len(self.texts.popleft())
        self._joined = None

    def joined(self) -> np.ndarray:
        if self._joined is None:
            self._joined = np.concatenate(self.texts) if self.texts else np.full(1, -1)
            self._ends = np.nonzero(self._joined < 0)[0]
        return self._joined

    def find(self, pattern: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``: the continuations (1..k tokens, within their text) that
        follow the occurrences of ``pattern``, oldest first."""
        hay = self.joined()
        after = occurrences(hay, pattern, len(hay) - len(pattern)) + len(pattern)
        lengths = np.minimum(self._ends[np.searchsorted(self._ends, after)] - after, k)
        return after[lengths > 0], lengths[lengths > 0]


@dataclass
class OtherTexts:
    """The texts a lookup reads beside the request's own: ``live``, the other running
    requests' ids so far (the latest admitted first), then ``corpus``'s finished texts."""

    live: list[np.ndarray]
    corpus: NgramCorpus

    def __bool__(self) -> bool:
        return bool(self.live) or bool(self.corpus)

    def places(self, pattern: np.ndarray, k: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(array, starts, lengths)`` per text (the finished ones as one array): the
        continuations (1..k tokens) after the occurrences of ``pattern``, most recent first."""
        n, out = len(pattern), []
        for text in self.live:
            after = occurrences(text, pattern, len(text) - n)[::-1] + n
            out.append((text, after, np.minimum(k, len(text) - after)))
        if self.corpus:
            after, lengths = self.corpus.find(pattern, k)
            out.append((self.corpus.joined(), after[::-1], lengths[::-1]))
        return out

    def longest_match(self, a: np.ndarray, cap: int) -> int:
        """The longest m <= cap such that ``a``'s last m tokens occur in one of the texts."""
        hays = self.live + ([self.corpus.joined()] if self.corpus else [])
        return max((longest_match(a, cap, hay) for hay in hays), default=0)


def occurrences(hay: np.ndarray, pattern: np.ndarray, before: int) -> np.ndarray:
    """Ascending starts ``i < before`` of ``pattern`` in ``hay``. Vectorized: a long context
    costs microseconds, not a Python loop over every position."""
    starts = np.nonzero(hay[:max(before, 0)] == pattern[0])[0]  # [matches]
    for j in range(1, len(pattern)):
        starts = starts[hay[starts + j] == pattern[j]]
    return starts


def matches(a: np.ndarray, n: int, k: int, others: OtherTexts | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The continuations (<= k tokens) of the earlier occurrences of ``a``'s last n tokens, as
    ``(array, starts, lengths)`` per place, most recent first within each: ``a`` itself, then
    the ``others``. Only places with a match."""
    L, out = len(a), []
    if n < L:
        after = match_starts(a, n)[::-1] + n
        out.append((a, after, np.minimum(k, L - after)))
    if others:
        out += others.places(a[L - n:], k)
    return [m for m in out if len(m[1])]


def sizes(a: np.ndarray, n_max: int, n_min: int, others: OtherTexts | None) -> list[int]:
    """The n-gram sizes a lookup tries, longest first: ``n_max`` down to ``n_min``, after the
    length of the longest match in the ``others`` where that is longer than ``n_max`` and than
    any in the text itself (the text continues another request's for that long: a request
    asked again, a document quoted again)."""
    out = list(range(min(n_max, len(a)), n_min - 1, -1))
    if others:
        m = others.longest_match(a, MATCH_CAP)
        if m > n_max and m > longest_match(a, MATCH_CAP):
            out.insert(0, m)
    return out


def lookup(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int, others: OtherTexts | None = None) -> list[int]:
    """Continuation (<= k tokens) of an earlier match of ``ids``' last n tokens, trying
    the n of ``sizes`` in turn; among matches of the same n the most recent one with a
    full k-token continuation wins (the text's own before the ``others``'), else the one with
    the longest (in the text itself: the oldest)."""
    a = np.asarray(ids)
    for n in sizes(a, n_max, n_min, others):
        found = matches(a, n, k, others)
        for hay, after, lengths in found:
            full = np.flatnonzero(lengths == k)
            if len(full):
                return hay[after[full[0]]: after[full[0]] + k].tolist()
        if found:
            hay, after, lengths = max(found, key=lambda m: m[2].max())  # the first place among ties
            i = int(lengths.argmax())
            return hay[after[i]: after[i] + lengths[i]].tolist()
    return []


MATCH_CAP = 32


def longest_match(ids: list[int] | np.ndarray, cap: int = MATCH_CAP, hay: np.ndarray | None = None) -> int:
    """The largest m <= cap such that ``ids``' last m tokens also occur earlier in ``ids``, or
    with ``hay`` anywhere in it (0: the last token never occurred before)."""
    a = np.asarray(ids)  # [L]
    L = len(a)
    if hay is None:
        if L < 2:
            return 0
        hay = a[:-1]  # an earlier occurrence ends before the last token
    cand = np.nonzero(hay == a[-1])[0]  # ends of the occurrences of the last token
    m = 0
    while len(cand) and m < cap:
        m += 1
        cand = cand[cand >= m]
        cand = cand[hay[cand - m] == a[L - 1 - m]] if m < L else cand[:0]
    return m


BRANCH_SCAN = 64  # matches read per place and n for distinct branches (a frequent n-gram has thousands)


def lookup_branches(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int, branches: int,
                    others: OtherTexts | None = None) -> list[list[int]]:
    """Up to ``branches`` distinct continuations (<= k tokens) of earlier matches of the last
    n tokens: n in the order of ``sizes``, within an n the text's own matches before the
    ``others``', most recent first."""
    a, found = np.asarray(ids), []
    for n in sizes(a, n_max, n_min, others):
        for hay, after, lengths in matches(a, n, k, others):
            for start, length in zip(after[:BRANCH_SCAN].tolist(), lengths[:BRANCH_SCAN].tolist()):
                cont = hay[start:start + length].tolist()
                if cont not in found:
                    found.append(cont)
                    if len(found) == branches:
                        return found
    return found


class NgramDrafter:
    """Chains, or with ``branches > 1`` a tree of several matches' continuations (a trie of at
    most ``max_nodes`` nodes). With ``corpus`` it also looks up the texts of the other
    requests: those running (each registered at its first step) and those that finished
    before (each request's text joins them when it leaves the batch)."""

    def __init__(self, n_max: int = 3, n_min: int = 1, branches: int = 1, max_nodes: int | None = None,
                 corpus: NgramCorpus | None = None):
        self.n_max, self.n_min, self.branches, self.max_nodes = n_max, n_min, branches, max_nodes
        self.corpus = corpus

    def context(self, seq: Sequence) -> int | None:
        """None when the lookup finds no match for ``seq``, or none whose first draft the
        request's grammar allows (then ``hybrid`` drafts with the model); else the cost
        model's context: the length of the longest earlier match of the text's end
        (``cost.MatchAcceptance``), in the text or the others'. A long match means a copy in
        progress, and its drafts are accepted far more often than those of a 1-token match."""
        ids, cap = seq.id_array(), max(MATCH_CAP, self.n_min)  # >= n_min: the lookup matches
        m = longest_match(ids, cap)
        others = self._others(seq)
        if others and m < cap:
            m = max(m, others.longest_match(ids, cap))
        if m < self.n_min:
            return None
        if seq.grammar is not None:  # a first draft the grammar forbids: as no match
            firsts = self._paths(seq, 1)
            if not any(f and seq.grammar.valid_prefix(f) for f in firsts):
                return None
        return m

    def _others(self, seq: Sequence) -> OtherTexts | None:
        if self.corpus is None:
            return None
        self.corpus.live[seq.slot] = seq
        return self.corpus.others(seq)

    def _paths(self, seq: Sequence, k: int) -> list[list[int]]:
        """The continuations drafted for ``seq``: one, or up to ``branches``."""
        if self.branches == 1:
            return [lookup(seq.id_array(), k, self.n_max, self.n_min, self._others(seq))]
        return lookup_branches(seq.id_array(), k, self.n_max, self.n_min, self.branches, self._others(seq))

    def propose(self, seqs, ks) -> list[Draft]:
        if self.corpus is not None:  # the batch's texts, for each other's lookups
            self.corpus.live.update((s.slot, s) for s in seqs)
        return [self._draft(seq, k) if k > 0 else Draft([]) for seq, k in zip(seqs, ks)]

    def _draft(self, seq: Sequence, k: int) -> Draft:
        paths = [cut_after_eos(p, seq.eos_ids) for p in self._paths(seq, k)]  # stop after an EOS draft
        if self.branches == 1:
            return Draft(paths[0])
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
        if self.corpus is not None:  # its text is read by the others' lookups from now on
            self.corpus.live[seq.slot] = seq

    def release(self, seq: Sequence) -> None:
        if self.corpus is not None:
            self.corpus.live.pop(seq.slot, None)
            if seq.finish_reason != "error":
                self.corpus.add(seq.id_array())

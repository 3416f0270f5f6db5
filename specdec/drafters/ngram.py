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


class NgramCorpus:
    """The texts (prompt and output ids) of other requests, for lookups across requests:
    SGLang's n-gram cache is shared so, where vLLM's prompt lookup reads the request alone.
    ``live``: the running requests by slot, read as their ids are so far (the other
    completions of a prompt drawn with ``n > 1`` run beside each other); ``texts``: those
    that finished, joined in one array, each followed by a separator (-1) that no token
    equals, so that a match never spans two texts and a continuation stops at its text's end;
    the oldest are dropped once the tokens pass ``capacity``. A lookup scans the array
    once (``suffix_matches``: about 0.3 ms for a million tokens on a 2-core CPU)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.live: dict[int, Sequence] = {}
        self.texts: deque[np.ndarray] = deque()
        self.size = 0  # tokens held, separators included
        self._joined: np.ndarray | None = None  # [size] the texts and separators, joined on demand
        self.separators: np.ndarray | None = None  # [texts] the separators' indices in ``joined()``

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
            self.separators = np.nonzero(self._joined < 0)[0]
        return self._joined


@dataclass
class OtherTexts:
    """The texts a lookup reads beside the request's own: ``live``, the other running
    requests' ids so far (the latest admitted first), then ``corpus``'s finished texts."""

    live: list[np.ndarray]
    corpus: NgramCorpus

    def __bool__(self) -> bool:
        return bool(self.live) or bool(self.corpus)

    def places(self, a: np.ndarray, cap: int) -> list["Place"]:
        """Each running text, then the finished ones (one array), with the matches of ``a``'s
        last tokens in it."""
        out = [Place(text, suffix_matches(text, a, cap)) for text in self.live]
        if self.corpus:
            hay = self.corpus.joined()
            out.append(Place(hay, suffix_matches(hay, a, cap), stops=self.corpus.separators))
        return out


MATCH_CAP = 32  # the longest match a lookup measures (beyond ngram_max: the cost model's context)


def suffix_matches(hay: np.ndarray, a: np.ndarray, cap: int) -> list[np.ndarray]:
    """``ends[m - 1]``: the ascending indices in ``hay`` where an occurrence of ``a``'s last m
    tokens ends, for m = 1 up to the longest such match (at most ``cap``). One vectorized scan
    of ``hay`` for the last token, then each longer match filters the ones before it: a
    lookup reads every n it tries from one pass over each text."""
    L, m = len(a), 1
    ends, out = np.nonzero(hay == a[-1])[0], []
    while len(ends):
        out.append(ends)
        if m >= cap or m >= L:
            break
        ends = ends[ends >= m]
        ends = ends[hay[ends - m] == a[L - 1 - m]]
        m += 1
    return out


def longest_match(ids: list[int] | np.ndarray, cap: int = MATCH_CAP) -> int:
    """The largest m <= cap such that ``ids``' last m tokens also occur earlier in ``ids`` (0:
    the last token never occurred before)."""
    a = np.asarray(ids)  # [L]
    return len(suffix_matches(a[:-1], a, cap)) if len(a) > 1 else 0  # an earlier one ends before the last token


@dataclass
class Place:
    """A text a lookup reads, with the matches of the request's last tokens in it: ``text``,
    whose continuations are drafted; ``ends`` (``suffix_matches``); ``stops``, the indices a
    continuation stops at (a finished text's separators; None: the text's end)."""

    text: np.ndarray
    ends: list[np.ndarray]
    stops: np.ndarray | None = None

    def continuations(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)`` of the continuations (1..k tokens) after the occurrences of
        the last n tokens, most recent first."""
        if n > len(self.ends):
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        after = self.ends[n - 1][::-1] + 1
        stop = len(self.text) if self.stops is None else self.stops[np.searchsorted(self.stops, after)]
        lengths = np.minimum(stop - after, k)
        return after[lengths > 0], lengths[lengths > 0]


def places(a: np.ndarray, cap: int, others: OtherTexts | None = None) -> list[Place]:
    """The texts a lookup of ``a``'s end reads, in their order: ``a`` itself (its earlier
    occurrences), then the ``others``'."""
    own = Place(a, suffix_matches(a[:-1], a, cap) if len(a) > 1 else [])
    return [own] + (others.places(a, cap) if others else [])


def sizes(ps: list[Place], n_max: int, n_min: int, length: int) -> list[int]:
    """The n-gram sizes a lookup tries, longest first: ``n_max`` down to ``n_min`` (at most
    the text's ``length``), after the length of the longest match in the other texts where
    that is longer than ``n_max`` and than any in the text itself (the text continues another
    request's for that long: a request asked again, a document quoted again)."""
    out = list(range(min(n_max, length), n_min - 1, -1))
    m = max((len(p.ends) for p in ps[1:]), default=0)
    if m > n_max and m > len(ps[0].ends):
        out.insert(0, m)
    return out


def lookup(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int, others: OtherTexts | None = None) -> list[int]:
    """Continuation (<= k tokens) of an earlier match of ``ids``' last n tokens, trying
    the n of ``sizes`` in turn; among matches of the same n the most recent one with a
    full k-token continuation wins (the text's own before the ``others``'), else the one with
    the longest (in the text itself: the oldest)."""
    a = np.asarray(ids)
    return first_continuation(places(a, max(MATCH_CAP, n_max), others), len(a), k, n_max, n_min)


def first_continuation(ps: list[Place], length: int, k: int, n_max: int, n_min: int) -> list[int]:
    """``lookup`` over its ``places``."""
    for n in sizes(ps, n_max, n_min, length):
        found = [(p.text, *p.continuations(n, k)) for p in ps]
        found = [f for f in found if len(f[1])]
        for text, after, lengths in found:
            full = np.flatnonzero(lengths == k)
            if len(full):
                return text[after[full[0]]: after[full[0]] + k].tolist()
        if found:
            text, after, lengths = max(found, key=lambda f: f[2].max())  # the first place among ties
            i = int(lengths.argmax())
            return text[after[i]: after[i] + lengths[i]].tolist()
    return []


BRANCH_SCAN = 64  # matches read per place and n for distinct branches (a frequent n-gram has thousands)


def lookup_branches(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int, branches: int,
                    others: OtherTexts | None = None) -> list[list[int]]:
    """Up to ``branches`` distinct continuations (<= k tokens) of earlier matches of the last
    n tokens: n in the order of ``sizes``, within an n the text's own matches before the
    ``others``', most recent first."""
    a = np.asarray(ids)
    return distinct_continuations(places(a, max(MATCH_CAP, n_max), others), len(a), k, n_max, n_min, branches)


def distinct_continuations(ps: list[Place], length: int, k: int, n_max: int, n_min: int,
                           branches: int) -> list[list[int]]:
    """``lookup_branches`` over its ``places``."""
    found = []
    for n in sizes(ps, n_max, n_min, length):
        for p in ps:
            after, lengths = p.continuations(n, k)
            for start, size in zip(after[:BRANCH_SCAN].tolist(), lengths[:BRANCH_SCAN].tolist()):
                cont = p.text[start:start + size].tolist()
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
        # ``_places`` this step, by sequence: (the sequence, its length then, its places)
        self._found: dict[int, tuple[Sequence, int, list[Place]]] = {}

    def context(self, seq: Sequence) -> int | None:
        """None when the lookup finds no match for ``seq``, or none whose first draft the
        request's grammar allows (then ``hybrid`` drafts with the model); else the cost
        model's context: the length of the longest earlier match of the text's end
        (``cost.MatchAcceptance``), in the text or the others', at most ``MATCH_CAP`` (or
        ``n_min``). A long match means a copy in progress, and its drafts are accepted far
        more often than those of a 1-token match."""
        m = min(max(len(p.ends) for p in self._places(seq)), max(MATCH_CAP, self.n_min))
        if m < self.n_min:
            return None
        if seq.grammar is not None:  # a first draft the grammar forbids: as no match
            firsts = self._paths(seq, 1)
            if not any(f and seq.grammar.valid_prefix(f) for f in firsts):
                return None
        return m

    def _places(self, seq: Sequence) -> list[Place]:
        """What ``seq``'s lookups read this step (``places``), found once: the planner's
        ``context`` and ``propose`` read the same."""
        found = self._found.get(id(seq))
        if found is None or found[0] is not seq or found[1] != len(seq.ids):
            others = None if self.corpus is None else self.corpus.others(seq)
            found = seq, len(seq.ids), places(seq.id_array(), max(MATCH_CAP, self.n_max, self.n_min), others)
            self._found[id(seq)] = found
        return found[2]

    def _paths(self, seq: Sequence, k: int) -> list[list[int]]:
        """The continuations drafted for ``seq``: one, or up to ``branches``."""
        ps, n = self._places(seq), len(seq.ids)
        if self.branches == 1:
            return [first_continuation(ps, n, k, self.n_max, self.n_min)]
        return distinct_continuations(ps, n, k, self.n_max, self.n_min, self.branches)

    def propose(self, seqs, ks) -> list[Draft]:
        if self.corpus is not None:  # the batch's texts, for each other's lookups (found before: again)
            if any(self.corpus.live.get(s.slot) is not s for s in seqs):
                self.corpus.live.update((s.slot, s) for s in seqs)
                self._found.clear()
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
        self._found.clear()  # the texts have grown
        if self.corpus is not None:  # its text is read by the others' lookups from now on
            self.corpus.live[seq.slot] = seq

    def release(self, seq: Sequence) -> None:
        if self.corpus is not None:
            self.corpus.live.pop(seq.slot, None)
            if seq.finish_reason != "error":
                self.corpus.add(seq.id_array())

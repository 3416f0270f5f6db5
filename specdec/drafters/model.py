"""A draft model (or the target itself, for ``self``) with its own KV cache.

Each round the drafter first catches up on committed tokens its cache has not seen (the
recovered token, or the last draft and the bonus; on the first rounds the prompt: at most
``max_catch_up`` tokens per round, as the target's chunked prefill, drafting nothing until
it has them all), then drafts for the whole batch, one forward per depth:

* **chain** (``topk == 1``): the draft's own choice at each depth (argmax, or a draw from
  q when sampling);
* **tree** (``topk > 1``, EAGLE-2 style): each depth expands the ``topk`` best frontier
  nodes into ``topk`` children each: the draft's most likely ones for greedy requests,
  ``topk`` drawn from q without replacement for sampled ones (accepted by the overlap of p
  and q, as a chain's drafts, where top-k children are accepted only with p's own mass);
  the tree keeps the ``max_nodes`` best nodes overall. The frontier of each depth is fed as
  one chunk per sequence, positioned at its depth and masked to see only its ancestors
  among the earlier depths' rows (the runtime's tail mask).

``observe`` keeps the accepted path's KV (a gather for trees) and rewinds the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..runtime.base import NO_TREES
from ..sampling import probs_from_logits, sample, sequence_logits
from ..sequence import Sequence, common_prefix
from ..tree import DraftTree
from .base import Draft


@dataclass
class _Growth:
    """One sequence's tree while it grows. Node 0 is the root (the last committed id)."""

    tokens: list[int]
    parents: list[int]
    # a node's rank: for top-k children (greedy requests) the path's draft log-probability
    # (EAGLE-2's). For children drawn from q (sampled requests): the parent's rank plus
    # log(q_j / q_1) for the parent's j-th draw, q_j the j-th largest draft probability
    # there. That does not depend on the tokens drawn, so that which draws the tree keeps
    # (a prefix of each parent's) does not either, as the verifier's rule for draws without
    # replacement needs; and the path of first draws ranks 0: the tree holds the chain the
    # same draft would sample (each draft accepted by the overlap of p and q), then the
    # most likely branches off it.
    ranks: list[float]
    depths: list[int]
    fed: list[int] = field(default_factory=list)  # nodes fed to the draft cache, in cache order
    drawn: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> q its children were drawn from

    def path(self, node: int) -> list[int]:
        """The tokens from the root (excluded) down to ``node``."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def add(self, parent: int, token: int, rank_logq: float) -> int:
        """Add ``token`` under ``parent`` as the child whose rank adds ``rank_logq``."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.ranks.append(self.ranks[parent] + rank_logq)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def feed_mask(self, frontier: list[int]) -> torch.Tensor:
        """``[n, fed + n]``: each frontier node sees its fed ancestors and itself."""
        cols = {node: j for j, node in enumerate(self.fed + frontier)}
        m = torch.zeros(len(frontier), len(cols), dtype=torch.bool)
        for i, node in enumerate(frontier):
            while node > 0:
                m[i, cols[node]] = True
                node = self.parents[node]
        return m

    def best(self, nodes: list[int], n: int) -> list[int]:
        """The ``n`` best of ``nodes`` by rank (a parent never ranks below its child, nor a
        child below a later sibling, and each sorts first on ties)."""
        return sorted(nodes, key=lambda r: (-self.ranks[r], self.depths[r], r))[:n]

    def best_tree(self, max_nodes: int) -> DraftTree:
        """The ``max_nodes`` best nodes, in topological order; with the q of drawn children
        (zeros for rows that drew none) if any were drawn."""
        keep = sorted(self.best(range(1, len(self.tokens)), max_nodes), key=lambda r: (self.depths[r], r))
        row = {0: 0} | {node: i + 1 for i, node in enumerate(keep)}
        q = None
        if self.drawn:
            none = torch.zeros_like(next(iter(self.drawn.values())))
            q = torch.stack([self.drawn.get(node, none) for node in row])  # [n+1, target_vocab]
        return DraftTree([self.tokens[0]] + [self.tokens[r] for r in keep],
                         [-1] + [row[self.parents[r]] for r in keep], q=q)


class ModelDrafter:
    def __init__(self, runtime, num_slots: int, target_vocab: int, topk: int = 1,
                 max_nodes: int | None = None, max_catch_up: int = 0, max_rows: int | None = None,
                 prefix_caching: bool = True):
        if topk > 1 and not runtime.masks_reach_cache:  # (its tree grows a depth a forward)
            raise ValueError("draft-model " + NO_TREES)
        self.runtime = runtime
        # positions the draft may feed: its own context (a draft model's may be shorter than
        # the target's; the engine drafts with it only while a round fits, ``room``)
        self.max_context = min(runtime.max_context, max_rows or runtime.max_context)
        self.cache = runtime.new_cache(num_slots, self.max_context)
        # rows kept for the slot's next request, and copied between slots (not on llama.cpp)
        self.reuses_prefixes = prefix_caching and getattr(runtime, "reuses_prefixes", False)
        self.can_copy = self.reuses_prefixes and callable(getattr(self.cache, "copy", None))
        self.cached_ids: list[list[int]] = [[] for _ in range(num_slots)]  # ids behind each slot's KV
        self.target_vocab = target_vocab
        self.draft_vocab = runtime.vocab_size  # a narrower draft may lack the target's last ids
        self.topk, self.max_nodes = topk, max_nodes
        self.max_catch_up = max_catch_up  # tokens fed per sequence and round before drafting; 0 = all
        # per slot, the ids a draft cache without reused rows would hold now: drafting starts
        # when it would have them all, so that rows kept from earlier requests (prefix reuse)
        # save work but change neither the rounds nor a seeded request's draws
        self.fresh = [0] * num_slots
        self.drafted: set[int] = set()  # slots that drafted this round
        # per slot, the fed tree nodes after the committed ids: (parent fed index, token) -> index
        self.tail: dict[int, dict[tuple[int, int], int]] = {}
        self.owner: dict[int, int] = {}  # slot -> the request its cached ids belong to

    def _cached(self, seq: Sequence) -> list[int]:
        """The ids behind ``seq``'s slot's KV. A request new to the slot keeps the part its
        predecessor left that its own ids start with, in whole catch-up chunks (prefix reuse:
        ``release`` leaves the prompt, where the runtime allows), so that its later feeds cut
        the ids where a fresh draft's would; the last id is always fed again."""
        cached = self.cached_ids[seq.slot]
        if self.owner.get(seq.slot) != seq.request_id:
            self.owner[seq.slot] = seq.request_id
            self.fresh[seq.slot] = 0
            n = common_prefix(cached, seq.ids[:-1])
            n = n // self.max_catch_up * self.max_catch_up if self.max_catch_up else 0
            del cached[n:]
            self.cache.rewind(seq.slot, n)
        return cached

    def room(self, seq: Sequence) -> int:
        """Drafts the draft's context leaves ``seq`` a round: as the target's, the draft's
        rows of a round of k stay below position ``len(seq.ids) + k``. Past its context the
        target decodes alone (vLLM's Top1Proposer skips such sequences too)."""
        return self.max_context - len(seq.ids)

    def behind(self, seq: Sequence) -> int:
        """Tokens the next ``propose`` for ``seq`` feeds before its first depth (at least the
        last committed one) without reused rows: the cost model prices that catch-up."""
        self._cached(seq)
        return len(seq.ids) - min(self.fresh[seq.slot], len(seq.ids) - 1)

    def propose(self, seqs, ks) -> list[Draft]:
        fed = [i for i, k in enumerate(ks) if k > 0 and self._due(seqs[i])]
        logits, took = self._catch_up([seqs[i] for i in fed])  # [B, vocab_d]; forwards per sequence
        caught = [b for b, i in enumerate(fed)  # the rest draft nothing this round
                  if self.fresh[seqs[i].slot] == len(seqs[i].ids)]
        self.drafted |= {seqs[fed[b]].slot for b in caught}
        active = fed
        if len(caught) < len(fed):
            active, logits = [fed[b] for b in caught], logits[caught] if caught else None
        if self.topk == 1:
            drafts = self._chains(seqs, ks, active, logits)
        else:
            drafts = self._trees(seqs, ks, active, logits)
        for i, n in zip(fed, took):
            drafts[i].forwards += n
        return drafts

    def _due(self, seq: Sequence) -> bool:
        """Advance ``seq``'s fresh count by what a draft without reused rows would feed this
        round; whether the slot lacks some of it (else it holds those rows already, and
        feeds nothing before the round a fresh draft would feed past them)."""
        have = min(len(self._cached(seq)), len(seq.ids) - 1)  # the last id is always fed again
        fresh = min(self.fresh[seq.slot], len(seq.ids) - 1)
        self.fresh[seq.slot] = fresh + min(self.max_catch_up or len(seq.ids), len(seq.ids) - fresh)
        return self.fresh[seq.slot] > have

    def _catch_up(self, seqs: list[Sequence]) -> tuple[torch.Tensor | None, list[int]]:
        """Feed each sequence's committed ids the cache lacks (at most ``max_catch_up``);
        logits at the last one fed, and the forwards each sequence took part in."""
        if not seqs:
            return None, []
        for s in seqs:  # the last committed id is always fed: its logits start the draft
            cached = self._cached(s)
            if len(cached) >= len(s.ids):
                del cached[len(s.ids) - 1:]
                self.cache.rewind(s.slot, len(cached))
        pre = set()  # slots fed their prompt first, whole (one more forward each)
        if getattr(self.runtime, "whole_prompts", False):  # longrope: as its own plain decoding takes a prompt
            todo = [s for s in seqs if len(self.cached_ids[s.slot]) < s.prompt_len]
            if todo:
                head = [s.ids[len(self.cached_ids[s.slot]):s.prompt_len] for s in todo]
                self.runtime.forward(self.cache, [s.slot for s in todo], [self._known(h) for h in head],
                                     last_only=True, prefill=True)
                for s, h in zip(todo, head):
                    self.cached_ids[s.slot].extend(h)
                    pre.add(s.slot)
        if self.can_copy:
            for s in seqs:
                self._copy_longest(s)
        feed = [s.ids[len(self.cached_ids[s.slot]):][: self.max_catch_up or None] for s in seqs]
        lead, shared = self._leaders(seqs, feed)
        first = [i for i, j in enumerate(lead) if j == i]
        took = [int(j == i) + (seqs[i].slot in pre) for i, j in enumerate(lead)]
        logits: list = [None] * len(seqs)
        out = self.runtime.forward(self.cache, [seqs[i].slot for i in first], [self._known(feed[i]) for i in first],
                                   last_only=True)  # [len(first), vocab_d]
        for b, i in enumerate(first):
            logits[i] = out[b]
        rest = []
        for i, s in enumerate(seqs):  # the others copy the shared rows, then feed what follows
            if lead[i] != i:
                self.cache.copy(seqs[lead[i]].slot, s.slot, len(self.cached_ids[s.slot]) + shared[i])
                if len(feed[i]) > shared[i]:
                    rest.append(i)
                else:
                    logits[i] = logits[lead[i]]
        if rest:
            out = self.runtime.forward(self.cache, [seqs[i].slot for i in rest],
                                       [self._known(feed[i][shared[i]:]) for i in rest], last_only=True)
            for b, i in enumerate(rest):
                logits[i] = out[b]
                took[i] += 1
        for s, toks in zip(seqs, feed):
            self.cached_ids[s.slot].extend(toks)
        return torch.stack(logits), took  # [B, vocab_d]

    def _known(self, ids: list[int]) -> list[int]:
        """Committed ``ids`` as the draft's input: an id past the draft's embedding (a
        narrower draft: the target's added tokens or padded rows) is fed as id 0. It sways
        only the proposals, which the target checks."""
        return ids if self.draft_vocab >= self.target_vocab else [t if t < self.draft_vocab else 0 for t in ids]

    def _copy_longest(self, seq: Sequence) -> None:
        """Where ``seq`` is catching up (more than a round's 1-2 ids behind) and another slot
        holds more of its ids (a sibling completion a step ahead, or a free slot keeping a
        prompt that starts the same), copy those rows instead of computing them."""
        cached = self.cached_ids[seq.slot]
        if len(seq.ids) - len(cached) <= 2:
            return
        best, n = None, len(cached)
        for slot, ids in enumerate(self.cached_ids):
            if slot != seq.slot and len(ids) > n:
                m = common_prefix(ids, seq.ids[:-1])  # the last id is fed: its logits start the draft
                if m > n:
                    best, n = slot, m
        if best is not None:
            self.cache.copy(best, seq.slot, n)
            cached[:] = seq.ids[:n]

    def _leaders(self, seqs: list[Sequence], feed: list[list[int]]) -> tuple[list[int], list[int]]:
        """Per sequence, which one computes the prompt part of its ``feed`` and how long that
        part is: ``n`` completions of one prompt catch up on it once (the first computes it,
        the others copy its rows and feed only their own tokens after it), where the cache can
        copy rows between slots and the part is longer than a round's 1-2 ids; else itself."""
        lead, shared = list(range(len(seqs))), [0] * len(seqs)
        if len(seqs) < 2 or not self.can_copy:
            return lead, shared
        first: dict[tuple, int] = {}
        for i, (s, toks) in enumerate(zip(seqs, feed)):
            done = len(self.cached_ids[s.slot])
            part = min(len(toks), s.prompt_len - done)  # the feed's prompt tokens
            if part > 2:
                lead[i], shared[i] = first.setdefault((done, tuple(s.ids[:done + part])), i), part
        return lead, shared

    def _chains(self, seqs, ks, active, logits) -> list[Draft]:
        drafts = [Draft([], [] if not s.sampling.greedy else None) for s in seqs]
        while active:
            still = []
            for row, i in zip(logits, active):
                seq, d = seqs[i], drafts[i]
                token, q = self._pick(row, seq, d.tokens)
                if token is None:
                    continue
                d.tokens.append(token)
                if q is not None:
                    d.q.append(q)
                if len(d.tokens) < ks[i] and token not in seq.eos_ids:
                    still.append(i)
            active = still
            if active:
                slots = [seqs[i].slot for i in active]
                feed = [[drafts[i].tokens[-1]] for i in active]
                logits = self.runtime.forward(self.cache, slots, feed, last_only=True)
                for slot, toks, i in zip(slots, feed, active):
                    self.cached_ids[slot].extend(toks)
                    drafts[i].forwards += 1
        for d in drafts:
            d.q = torch.stack(d.q) if d.q else None  # [k, target_vocab]
        return drafts

    def _pick(self, logits: torch.Tensor, seq: Sequence, drafted: list[int]):
        """Draft token from one logits row ``[vocab_d]`` after the drafts ``drafted``; q over
        the target's vocab when sampling."""
        # on the target's device (the request's generator's): a draft may run elsewhere (llama.cpp on the CPU)
        logits = logits[None, : self.target_vocab].to(seq.generator.device)
        logits = sequence_logits(logits, seq, [drafted])[0]  # no id the target cannot emit
        if seq.sampling.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits[None], seq.sampling)[0]  # [vocab_d]
        if not bool(torch.isfinite(q).all()):  # nan logits (an fp16 draft overflowing): no draft
            return None, None
        token = int(sample(q[None], seq.generator))
        return token, F.pad(q, (0, self.target_vocab - q.shape[0]))

    def _trees(self, seqs, ks, active, logits) -> list[Draft]:
        """EAGLE-2 expansion, one draft forward per depth for the whole batch."""
        drafts = [Draft([]) for _ in seqs]
        grow = {i: _Growth([seqs[i].ids[-1]], [-1], [0.0], [0]) for i in active}
        frontier = {i: [0] for i in active}  # nodes whose children the logits rows predict
        rows = {i: [logits[b]] for b, i in enumerate(active)}  # [vocab_d] per frontier node
        while active:
            nxt = []
            for i in active:
                seq, g = seqs[i], grow[i]
                children = [c for node, row in zip(frontier[i], rows[i]) for c in self._children(g, node, row, seq)]
                frontier[i] = [c for c in g.best(children, self.topk) if g.tokens[c] not in seq.eos_ids]
                if frontier[i] and g.depths[frontier[i][0]] < ks[i]:
                    nxt.append(i)
            active = nxt
            if active:  # one forward for every sequence's next depth
                root_pos = [len(seqs[i].ids) - 1 for i in active]
                out = self.runtime.forward(
                    self.cache, [seqs[i].slot for i in active],
                    [[grow[i].tokens[n] for n in frontier[i]] for i in active],
                    positions=[[p + grow[i].depths[n] for n in frontier[i]] for i, p in zip(active, root_pos)],
                    chunk_masks=[grow[i].feed_mask(frontier[i]) for i in active])  # [B, topk, vocab_d]
                for b, i in enumerate(active):
                    drafts[i].forwards += 1
                    grow[i].fed += frontier[i]
                    rows[i] = list(out[b, : len(frontier[i])])
        for i, g in grow.items():
            tree = g.best_tree(self.max_nodes or len(g.tokens) - 1)
            drafts[i].tokens, drafts[i].tree = tree.tokens[1:], tree
            row_of = {n: j for j, n in enumerate(g.fed)}
            self.tail[seqs[i].slot] = {(row_of.get(g.parents[n], -1), g.tokens[n]): j
                                       for j, n in enumerate(g.fed)}
        return drafts

    def _children(self, g: _Growth, node: int, logits: torch.Tensor, seq: Sequence) -> list[int]:
        """Add ``topk`` children under ``node`` from the draft's logits row there ``[vocab_d]``:
        its most likely tokens for a greedy request (deterministic: the verifier treats
        them as one-hot proposals); for a sampled one, tokens drawn from q without
        replacement (an exponential race), keeping q for the verifier."""
        q = self._q(logits, seq, g.path(node))  # [vocab_d]
        top = torch.topk(q, min(self.topk, q.shape[0]))
        picks, rank_logq = top.indices, top.values.log()  # [topk]
        if not seq.sampling.greedy:
            race = torch.empty_like(q).exponential_(generator=seq.generator)  # [vocab_d]
            picks = torch.topk(q / race, top.indices.shape[0]).indices  # an ordered draw without replacement
            rank_logq = rank_logq - rank_logq[0]
            g.drawn[node] = F.pad(q, (0, self.target_vocab - q.shape[0]))  # [target_vocab], as a chain's q
        return [g.add(node, t, r) for t, p_t, r in zip(picks.tolist(), q[picks].tolist(), rank_logq.tolist())
                if p_t > 0]

    def _q(self, logits: torch.Tensor, seq: Sequence, path: list[int]) -> torch.Tensor:
        """Draft probabilities over the target's vocab (narrower for a narrower draft), after
        the drafts ``path`` (after the request's grammar and logits processing,
        ``sequence_logits``, then temperature, top-k, top-p and min-p when sampling; plain
        softmax of those logits for greedy requests), on the request's generator's device."""
        logits = logits[None, : self.target_vocab].float().to(seq.generator.device)
        logits = sequence_logits(logits, seq, [path])[0]
        if seq.sampling.greedy:
            return logits.softmax(-1)
        return probs_from_logits(logits[None], seq.sampling)[0]

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        cached = self._cached(seq)
        tail = self.tail.pop(seq.slot, None)
        if tail is not None:  # keep the fed nodes on the committed path, in path order
            base, path, parent = len(cached), [], -1
            for token in seq.ids[base:]:
                if (parent, token) not in tail:
                    break
                parent = tail[parent, token]
                path.append(parent)
            if path:
                self.cache.keep(seq.slot, base, path)
            else:
                self.cache.rewind(seq.slot, base)
            cached.extend(seq.ids[base: base + len(path)])
        n = min(len(cached), len(seq.ids))
        keep = common_prefix(cached, seq.ids, seq.prompt_len if n >= seq.prompt_len else 0)
        del cached[keep:]
        self.cache.rewind(seq.slot, keep)
        # a slot that drafted held all ids, as a fresh one would: both keep the same
        self.fresh[seq.slot] = keep if seq.slot in self.drafted else min(self.fresh[seq.slot], keep)
        self.drafted.discard(seq.slot)

    def release(self, seq: Sequence) -> None:
        """Forget ``seq``'s drafts and output; its prompt's KV stays for the slot's next
        request where the runtime keeps rows over a rewind (``Runtime.reuses_prefixes``) and
        prefix caching is on."""
        cached = self.cached_ids[seq.slot]
        keep = min(len(cached), seq.prompt_len) if self.reuses_prefixes and seq.finish_reason != "error" else 0
        del cached[keep:]
        self.tail.pop(seq.slot, None)
        self.drafted.discard(seq.slot)  # a request that failed between propose and observe
        self.cache.rewind(seq.slot, keep)


class EagleDrafter(ModelDrafter):
    """``ModelDrafter`` over an EAGLE head (``runtime.eagle.EagleHead``): chains and EAGLE-2
    trees alike, each row's feature coming with it (the target's for committed tokens, which
    the engine hands over with ``features``; the head's own for drafts). ``observe`` keeps
    only the rows fed with the target's features: accepted drafts were fed the head's own, so
    the next round feeds them again with the target's, as SGLang's draft extend and vLLM's
    proposer do (the head was trained on such rows). With prefix reuse the head's cache keeps
    a prompt's rows as a draft model's does, and the target's features stay by position
    beside them (``share``: those of rows the target copied between slots), so that a reused
    prompt's next rows find the features before them."""

    def __init__(self, head, num_slots: int, target_vocab: int, **kwargs):
        super().__init__(head, num_slots, target_vocab, **kwargs)
        self.taps = head.reads
        self.targeted = [0] * num_slots  # per slot, the leading rows fed with the target's features

    def _catch_up(self, seqs: list[Sequence]):
        out = super()._catch_up(seqs)
        for s in seqs:  # every committed id fed so far came with the target's feature
            self.targeted[s.slot] = len(self.cached_ids[s.slot])
        return out

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        super().observe(seq, num_accepted)
        cached = self.cached_ids[seq.slot]
        keep = self.targeted[seq.slot] = min(self.targeted[seq.slot], len(cached))
        if len(cached) > keep:
            del cached[keep:]
            self.cache.rewind(seq.slot, keep)
            self.fresh[seq.slot] = min(self.fresh[seq.slot], keep)

    def features(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """The target's tapped hidden states ``[n, len(taps) * hidden]`` of ``seq``'s
        committed tokens at positions ``start`` to ``start + n - 1``."""
        self.cache.store(seq.slot, start, self.runtime.fuse(rows))

    def share(self, src: int, dst: int, start: int, end: int) -> None:
        """The target copied slot ``src``'s KV rows ``start`` to ``end - 1`` to slot ``dst``:
        their features too."""
        self.cache.share(src, dst, start, end)

    def attach(self, cache) -> None:
        """The target's KV cache: a Gemma 4 assistant's layers attend over its rows
        (``runtime.eagle.AssistantCache.target``); an EAGLE head's, over their own."""
        if hasattr(self.cache, "target"):
            self.cache.target = cache

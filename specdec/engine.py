"""The engine: batches of sequences going through draft -> verify -> commit rounds.

Cache invariant (target and ``self``/``draft`` drafters alike): between steps a sequence's
target cache holds KV for all its committed ids but the last one; that last token (the
recovered or bonus token of the previous round, or the first token after prefill) gets its
KV as row 0 of the next verify forward, in front of the new drafts.
"""
from __future__ import annotations

import time
from collections import deque

from .config import SpecConfig
from .drafters import Draft, Drafter
from .sampling import probs_from_logits, sample
from .sequence import Sequence, cut_after_eos
from .tree import verify_tree
from .verify import Verdict, verify


def tree_inputs(seqs: list[Sequence], drafts: list[Draft]) -> dict:
    """Positions and masks for the verify forward when any draft is a tree (else none)."""
    if all(d.tree is None for d in drafts):
        return {}
    return {"positions": [d.tree.positions(len(s.ids) - 1) if d.tree else None for s, d in zip(seqs, drafts)],
            "chunk_masks": [d.tree.mask() if d.tree else None for d in drafts]}


def truncate(tokens: list[int], budget: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """The part of a round's verified ``tokens`` that may be committed: at most ``budget``
    tokens, ending at the first EOS. Returns ``(kept, hit_eos)``."""
    kept = cut_after_eos(tokens[:budget], eos_ids)
    return kept, bool(kept) and kept[-1] in eos_ids


class Engine:
    def __init__(self, target, drafter: Drafter | None, spec: SpecConfig, max_batch_size: int):
        self.target = target  # LoadedModel
        self.runtime = target.runtime
        self.drafter = drafter
        self.k = spec.depth if drafter is not None else 0
        self.cache = self.runtime.new_cache(max_batch_size)
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """Admit waiting sequences (prefill), run one round for the batch; return finished ones."""
        self._admit()
        seqs = [s for s in self.running if not s.finished]
        if seqs:
            self._round(seqs)
        return self._retire()

    def _round(self, seqs: list[Sequence]) -> None:
        ks = [min(self.k, s.remaining - 1) for s in seqs]
        drafts = self.drafter.propose(seqs, ks) if self.drafter else [Draft([]) for _ in seqs]  # 1. propose
        chunks = [[s.ids[-1]] + d.tokens for s, d in zip(seqs, drafts)]
        logits = self.runtime.forward(self.cache, [s.slot for s in seqs], chunks,
                                      **tree_inputs(seqs, drafts))  # 2. verify [B, 1+k, vocab]
        for s, d, rows in zip(seqs, drafts, logits):
            v = self._verify(s, d, rows[: len(d.tokens) + 1])  # rejected drafts' KV dropped
            committed = self._commit(s, v.tokens)  # 3. commit, stop checks
            s.metrics.record_verify(len(d.tokens), v.num_accepted, committed)
            s.metrics.target_forwards += 1
            s.metrics.draft_forwards += d.forwards
            if self.drafter:
                self.drafter.observe(s, v.num_accepted)  # 4. observe

    def _verify(self, s: Sequence, d: Draft, rows) -> Verdict:
        """Verify one sequence's draft (chain or tree) and keep only the accepted path's KV."""
        if d.tree is None:
            v = verify(d.tokens, d.q, rows, s.sampling, s.generator)
            self.cache.rewind(s.slot, len(s.ids) + v.num_accepted)
        else:
            v = verify_tree(d.tree, rows, s.sampling, s.generator)
            self.cache.keep(s.slot, len(s.ids) - 1, v.rows)  # path rows -> consecutive slots
        return v

    def _admit(self) -> None:
        new = []
        while self.waiting and self.free_slots:
            s = self.waiting.popleft()
            s.slot = self.free_slots.pop()
            s.started_at = time.perf_counter()
            new.append(s)
        if not new:
            return
        logits = self.runtime.forward(self.cache, [s.slot for s in new], [s.ids for s in new],
                                      last_only=True)  # [B, vocab]
        for s, row in zip(new, logits):
            if s.sampling.greedy:
                token = int(row.argmax())
            else:
                token = int(sample(probs_from_logits(row[None], s.sampling), s.generator))
            s.metrics.target_forwards += 1
            self._commit(s, [token])
            self.running.append(s)

    def _commit(self, s: Sequence, tokens: list[int]) -> int:
        kept, hit_eos = truncate(tokens, s.remaining, s.eos_ids)
        s.ids.extend(kept)
        if hit_eos or self._hit_stop_string(s, len(kept)):
            s.finish_reason = "stop"
        elif s.remaining == 0:
            s.finish_reason = "length"
        return len(kept)

    def _hit_stop_string(self, s: Sequence, num_new: int) -> bool:
        """Cut ``s`` after the token that completes a stop string; the text ends before it."""
        if not s.sampling.stop or num_new == 0:
            return False
        decode = self.target.tokenizer.decode
        out = s.output_ids
        text = decode(out, skip_special_tokens=True)
        hits = [i for i in (text.find(stop) for stop in s.sampling.stop) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        for m in range(len(out) - num_new + 1, len(out) + 1):  # fewest tokens that reach the stop
            if any(stop in decode(out[:m], skip_special_tokens=True) for stop in s.sampling.stop):
                del s.ids[s.prompt_len + m:]
                break
        s.text = text[:cut]
        return True

    def _retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if not done:
            return []
        now = time.perf_counter()
        for s in done:
            self.cache.rewind(s.slot, 0)
            if self.drafter:
                self.drafter.release(s)
            self.free_slots.append(s.slot)
            s.metrics.wall_s = now - s.started_at
            s.metrics.generated_tokens = s.num_output
        self.running = [s for s in self.running if not s.finished]
        return done

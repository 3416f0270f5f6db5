"""A draft model (or the target itself, for ``self``) with its own KV cache.

Each round the drafter first catches up on committed tokens its cache has not seen (the
recovered/bonus token, and on the first round the whole prompt), then drafts one token per
forward for the whole batch. ``observe`` rewinds its cache to the longest prefix that
still matches the committed ids.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sampling import probs_from_logits, sample
from ..sequence import Sequence
from .base import Draft


class ModelDrafter:
    def __init__(self, runtime, num_slots: int, target_vocab: int):
        self.runtime = runtime
        self.cache = runtime.new_cache(num_slots)
        self.cached_ids: list[list[int]] = [[] for _ in range(num_slots)]  # ids behind each slot's KV
        self.target_vocab = target_vocab

    def propose(self, seqs, ks) -> list[Draft]:
        drafts = [Draft([], [] if not s.sampling.greedy else None) for s in seqs]
        # first forward: catch up on committed ids not yet in the cache
        active = [i for i, k in enumerate(ks) if k > 0]
        feed = [seqs[i].ids[len(self.cached_ids[seqs[i].slot]):] for i in active]
        while active:
            slots = [seqs[i].slot for i in active]
            logits = self.runtime.forward(self.cache, slots, feed, last_only=True)  # [B, vocab_d]
            for slot, toks in zip(slots, feed):
                self.cached_ids[slot].extend(toks)
            still, feed = [], []
            for row, i in zip(logits, active):
                seq, d = seqs[i], drafts[i]
                d.forwards += 1
                token, q = self._pick(row, seq)
                d.tokens.append(token)
                if q is not None:
                    d.q.append(q)
                if len(d.tokens) < ks[i] and token not in seq.eos_ids:
                    still.append(i)
                    feed.append([token])
            active = still
        for d in drafts:
            d.q = torch.stack(d.q) if d.q else None  # [k, target_vocab]
        return drafts

    def _pick(self, logits: torch.Tensor, seq: Sequence):
        """Draft token from one logits row ``[vocab_d]``; q over the target's vocab when sampling."""
        logits = logits[: self.target_vocab]  # never propose an id the target cannot emit
        if seq.sampling.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits[None], seq.sampling)[0]  # [vocab_d]
        token = int(sample(q[None], seq.generator))
        return token, F.pad(q, (0, self.target_vocab - q.shape[0]))

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        cached = self.cached_ids[seq.slot]
        n = min(len(cached), len(seq.ids))
        keep = seq.prompt_len if n >= seq.prompt_len else 0
        while keep < n and cached[keep] == seq.ids[keep]:
            keep += 1
        del cached[keep:]
        self.cache.rewind(seq.slot, keep)

    def release(self, seq: Sequence) -> None:
        self.cached_ids[seq.slot].clear()
        self.cache.rewind(seq.slot, 0)

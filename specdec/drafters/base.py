"""The drafter protocol: propose draft tokens for a batch, observe how many were accepted."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import torch

from ..sequence import Sequence
from ..tree import DraftTree


@dataclass
class Draft:
    tokens: list[int]  # [k] draft ids, k may be 0
    q: torch.Tensor | None = None  # [k, target_vocab] draft probs; None = one-hot (no model, or greedy)
    forwards: int = 0  # draft-model forwards spent on this draft
    tree: DraftTree | None = None  # several candidates per depth; ``tokens`` = its rows 1..n


class Drafter(Protocol):
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Draft]:
        """For ``seqs[i]``, a chain of at most ``ks[i]`` drafts, or a tree at most ``ks[i]``
        deep; a chain stops after an EOS draft."""

    def observe(self, seq: Sequence, num_accepted: int) -> None:
        """Called after ``seq`` committed its verified tokens (``seq.ids`` is updated)."""

    def release(self, seq: Sequence) -> None:
        """``seq`` left the batch: free what the drafter holds for it."""

    # Optional (EAGLE): ``taps``, the target's hidden states the drafter reads
    # (``TorchLlama.capture``), and ``features(seq, start, rows)``, which the engine calls
    # after each target forward with the rows ``[n, features]`` of ``seq``'s committed
    # tokens at positions ``start`` on, and ``share(src, dst, start, end)``, after it copies
    # the target's KV rows ``start`` to ``end - 1`` from slot ``src`` to slot ``dst``; and
    # ``attach(cache)``, which the engine calls with the target's KV cache (a Gemma 4
    # assistant's layers attend over it).

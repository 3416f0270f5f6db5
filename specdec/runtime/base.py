"""The runtime interface: what the engine and drafters may ask of a loaded model.

A runtime owns weights; a cache owns per-sequence KV state in *slots*. ``forward`` appends
a chunk of new tokens to each listed slot and returns logits; ``cache.rewind`` drops the
tokens past a length (O(1) for the torch runtime: it resets a length counter), and
``cache.keep`` the rows of a tree off its accepted path.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch


NO_TREES = ("token trees need tree attention masks: the torch and llama.cpp runtimes draw them (a draft model with "
            "recurrent layers drafts chains), the transformers fallback runs chains only")


class Cache(Protocol):
    lengths: list[int]  # tokens with valid KV, per slot

    def rewind(self, slot: int, length: int, idle: bool = False) -> None:
        """Forget everything at or after ``length`` in ``slot``. ``idle``: its request
        finished, and the rows kept wait for a prompt that starts the same (prefix reuse)."""

    def copy(self, src: int, dst: int, length: int) -> None:
        """Optional (torch, hf): ``dst``, whose rows are the same as ``src``'s first ones,
        takes ``src``'s rows up to ``length`` (running requests share prompt chunks)."""

    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Trees only (``Runtime.supports_masks``): keep rows ``start + rows[i]`` at ``start + i``."""


class Runtime(Protocol):
    device: torch.device
    vocab_size: int  # width of the logits
    max_context: int  # positions the model supports
    supports_masks: bool  # custom chunk masks and positions (trees; ``NO_TREES``)
    # a chunk mask may see rows of earlier forwards too (a draft model's tree, fed depth by depth), not only the chunk's
    masks_reach_cache: bool
    # how ``forward`` runs a batch's chunks (``cost.BATCH_LAYOUTS``): "padded" (one forward,
    # each chunk padded to the longest), "packed" (one forward over their rows), "serial"
    batch_layout: str
    # a rewound slot keeps its rows before the cut valid, so the engine may leave a finished
    # prompt's KV in its slot for a new prompt that starts the same (prefix reuse); where only
    # at some of its prompt chunks' ends (the torch runtime's recurrent states), it is False, an
    # optional ``reuses_prompt_chunks`` is True, and the cache's ``holds(slot, length)`` says where
    reuses_prefixes: bool
    # a prompt must go in one forward (no chunked prefill) for the logits to be the model's
    # (transformers' longrope picks its frequencies from a forward's last position)
    whole_prompts: bool
    # the cache goes back to an earlier length (not transformers' recurrent states): drafts
    # can be rejected (the torch runtime's recurrent states go back ``state_depth - 1`` tokens)
    rewinds: bool

    @property
    def speed_key(self) -> str:
        """What besides the weights file and the thread count sets this runtime's forward
        times (part of the key of the measured cost curves, ``cost.cost_key``)."""
        ...

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> Cache:
        """A cache of ``num_slots`` sequences; ``max_rows``: the longest a sequence gets (the
        context window), a hint for how far the cache grows beyond what a forward needs."""
        ...

    def forward(
        self,
        cache: Cache,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        *,
        positions: Sequence[Sequence[int]] | None = None,
        chunk_masks: Sequence[torch.Tensor] | None = None,
        last_only: bool = False,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Append ``tokens[b]`` (ragged) to ``slots[b]`` and return their logits.

        ``positions[b]`` default to consecutive positions after the slot's length;
        ``chunk_masks[b]`` ``[n_b, m_b]`` (bool, ``m_b >= n_b``) says which of the slot's
        last ``m_b`` keys each new token sees: the ``m_b - n_b`` cached keys just before the
        chunk (e.g. a draft tree's earlier depths), then the chunk itself. Default causal over
        the chunk; a ``None`` entry in either list means the default. Every key before those
        ``m_b`` (the committed prefix) is always seen.
        Returns ``[batch, max_n, vocab]`` (rows past ``n_b`` are padding), or
        ``[batch, vocab]`` for each slot's last new token when ``last_only``. ``prefill``:
        the chunks are prompt chunks (llama.cpp decodes each whole and alone, as it does
        every ``last_only`` forward; the transformers runtime does not cut them at a longrope
        switch; the torch runtime need not care).
        """
        ...

"""Fallback runtime: any ``AutoModelForCausalLM`` on transformers' own model and cache.

Each slot holds a ``DynamicCache``; a batch runs slot by slot (transformers caches cannot
rewind sequences independently), and rollback crops the cache. Chain drafts only: no
custom masks or positions.
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch


class HFCache:
    """A ``DynamicCache`` per slot. Sliding-window layers (Mistral, Gemma 2/3...) keep their
    whole past (``activate_past_recording``; they attend over the window's rows alone), so
    that any rewind finds the rows before it: transformers' own ``crop`` of such a layer
    keeps only the window, after which an earlier length cannot be restored."""

    def __init__(self, num_slots: int, config):
        self.config = config
        self.caches = [self._make() for _ in range(num_slots)]
        self.lengths = [0] * num_slots

    def _make(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        return cache

    def rewind(self, slot: int, length: int, idle: bool = False) -> None:
        from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        n = self.lengths[slot] - length
        if length == 0:
            self.caches[slot] = self._make()
        elif n:
            for layer in self.caches[slot].layers:
                if isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
                    if layer.is_initialized:  # drop n rows, keep the rest
                        layer.keys, layer.values = layer.keys[..., :-n, :], layer.values[..., :-n, :]
                        layer.cumulative_length -= n
                else:
                    layer.crop(-n)  # transformers 5: negative = drop n
        self.lengths[slot] = length

    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` rows (and nothing after them)."""
        self.caches[dst] = copy.deepcopy(self.caches[src])
        self.lengths[dst] = self.lengths[src]
        self.rewind(dst, length)


class HFRuntime:
    supports_masks = False
    batch_layout = "serial"
    reuses_prefixes = True  # a cropped DynamicCache keeps the rows before the cut

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, load_format: str = "auto"):
        from .loading import load_hf_model

        self.model = load_hf_model(path, device, dtype, load_format)
        self.device, self.dtype = device, dtype
        cfg = self.model.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        # transformers computes the output layer for the last row only when asked (a prompt's
        # other rows would cost a [prompt, vocab] product for nothing)
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters \
            else {}

    @property
    def speed_key(self) -> str:
        return f"{self.dtype},{self.device}"

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> HFCache:
        return HFCache(num_slots, self.model.config)

    @torch.inference_mode()
    def forward(self, cache: HFCache, slots, tokens, *, positions=None, chunk_masks=None,
                last_only: bool = False, prefill: bool = False) -> torch.Tensor:
        if positions is not None or chunk_masks is not None:
            raise ValueError("the transformers fallback runtime supports chain drafts only (no trees)")
        T = max(len(t) for t in tokens)
        out = torch.zeros(len(slots), 1 if last_only else T, self.vocab_size, device=self.device)
        for b, (slot, toks) in enumerate(zip(slots, tokens)):
            ids = torch.tensor([toks], device=self.device)  # [1, n]
            keep = self.keep_last if last_only else {}
            logits = self.model(input_ids=ids, cache=cache.caches[slot], use_cache=True, **keep).logits[0]
            cache.lengths[slot] += len(toks)
            if last_only:
                out[b, 0] = logits[-1]
            else:
                out[b, : len(toks)] = logits
        return out[:, 0] if last_only else out

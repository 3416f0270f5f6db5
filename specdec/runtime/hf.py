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

from .torch_llama import ARCHS, RECOMPUTES_PAST_SWITCH, longrope_switch


class HFCache:
    """A ``DynamicCache`` per slot. Sliding-window layers (Mistral, Gemma 2/3...) keep their
    whole past (``activate_past_recording``; they attend over the window's rows alone), so
    that any rewind finds the rows before it: transformers' own ``crop`` of such a layer
    keeps only the window, after which an earlier length cannot be restored."""

    def __init__(self, num_slots: int, config):
        self.config = config
        self.caches = [self._make() for _ in range(num_slots)]
        self.lengths = [0] * num_slots
        # for a model that recomputes its cache past its longrope switch (``HFRuntime.recompute_at``):
        # each slot's tokens, and whether its rows were computed with the long factors
        self.ids: list[list[int]] = [[] for _ in range(num_slots)]
        self.long = [False] * num_slots

    def _make(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        return cache

    def rewind(self, slot: int, length: int, idle: bool = False) -> None:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        n = self.lengths[slot] - length
        del self.ids[slot][length:]
        if length == 0:
            self.caches[slot] = self._make()
            self.long[slot] = False
        elif n:
            for layer in self.caches[slot].layers:
                if any(getattr(layer, "is_recurrent_states_initialized", {}).values()):
                    # a recurrent state holds the dropped tokens (HFRuntime.rewinds)
                    raise RuntimeError(f"cannot rewind a {type(layer).__name__} by {n} tokens")
                conv = isinstance(layer, LinearAttentionCacheLayerMixin)
                if conv:  # conv states (LFM2...), recorded whole since the first token: drop n columns, keep the rest
                    for i, done in layer.is_conv_states_initialized.items():
                        if done:
                            layer.conv_states[i] = layer.conv_states[i][..., :-n]
                if isinstance(layer, DynamicSlidingWindowLayer):  # alone or beside conv states: keep the whole past
                    if layer.is_initialized:
                        layer.keys, layer.values = layer.keys[..., :-n, :], layer.values[..., :-n, :]
                        layer.cumulative_length -= n
                elif conv:
                    if isinstance(layer, DynamicLayer):  # LinearAttentionAndFullAttentionLayer's attention rows
                        DynamicLayer.crop(layer, -n)
                else:
                    layer.crop(-n)  # transformers 5: negative = drop n
        self.lengths[slot] = length

    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` rows (and nothing after them)."""
        self.caches[dst] = copy.deepcopy(self.caches[src])
        self.lengths[dst] = self.lengths[src]
        self.ids[dst], self.long[dst] = list(self.ids[src]), self.long[src]
        self.rewind(dst, length)


def context_window(config) -> int:
    """The tokens a model's positions reach: its text model's ``max_position_embeddings``
    (a multimodal config keeps it in ``text_config``), else an older name (MPT's
    ``max_seq_len``, Whisper's decoder's ``max_target_positions``); 2^20 where none is named."""
    text = config.get_text_config(decoder=True)
    for cfg in (text, config):
        for name in ("max_position_embeddings", "max_seq_len", "max_target_positions"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 1 << 20


# models that keep their state in their own modules, shared by all sequences (transformers'
# cache holds none of it)
OWN_STATE = ("recurrent_gemma", "minimax")  # minimax: its own MiniMaxCache, refused at the first forward


class HFRuntime:
    supports_masks = masks_reach_cache = False
    batch_layout = "serial"

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, load_format: str = "auto",
                 trust_remote_code: bool = False):
        from .loading import load_hf_model

        self.model = load_hf_model(path, device, dtype, load_format, trust_remote_code)
        self.device, self.dtype = device, dtype
        cfg = self.model.config
        takes = inspect.signature(self.model.forward).parameters
        # transformers 5 names the cache ``cache``; a model's own code may use the older name.
        # (Not one that takes neither by name: GPT-1, RWKV, XLNet pass on **kwargs, and would
        # drop a cache given so, each forward then seeing none of the tokens before it)
        self.cache_name = next((n for n in ("cache", "past_key_values") if n in takes), None)
        # transformers' own list of models whose state a DynamicCache cannot hold (xLSTM's
        # rnn_state, Reformer's...): they take a cache argument and fail at the first forward
        own_state = not getattr(type(self.model), "_supports_default_dynamic_cache", lambda: True)()
        if self.cache_name is None or own_state or cfg.model_type in OWN_STATE:
            why = "its forward takes no cache / past_key_values argument" if self.cache_name is None else \
                "transformers' DynamicCache cannot hold it"
            torch_runs = " (the torch runtime runs it: backend 'torch' or 'auto')" if cfg.model_type in ARCHS else ""
            raise ValueError(f"{cfg.model_type!r} keeps its state outside transformers' cache, where specdec "
                             f"holds each sequence's ({why}); it cannot run here{torch_runs}")
        # a recurrent state (Mamba, Qwen3-Next...) cannot go back to an earlier length:
        # nothing drafts against it, and no finished prompt is reused (transformers refuses
        # assisted generation for such models too)
        self.rewinds = not getattr(self.model, "_is_stateful", False)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = context_window(cfg)
        # the positions of a forward's tokens, given: a model that works them out itself may
        # count from 0 every forward (Bamba's); not for rope over several axes (mrope's 3-D
        # positions, which the model derives itself)
        rope = getattr(cfg.get_text_config(decoder=True), "rope_parameters", None) or {}
        self.give_positions = "position_ids" in takes and "mrope_section" not in rope
        # longrope: plain decoding takes the short factors for a token before the switch and
        # the long ones after it, and a whole prompt's forward takes one set for all of it; so
        # a decoding forward is cut at the switch, a prompt goes whole, and no prompt's rows
        # are reused for another (whose forward would have taken the other set). A recurrent
        # state takes a prompt whole too: transformers' Mamba reads a many-token forward after
        # the first as a new prompt
        self.switch = longrope_switch(cfg)
        longrope = self.switch is not None and self.switch < self.max_context
        # Phi-3's family (its prepare_inputs_for_generation) drops the cache when a sequence first
        # passes original_max_position_embeddings and computes it all again, with the long factors
        self.recompute_at = cfg.original_max_position_embeddings if longrope and \
            cfg.model_type in RECOMPUTES_PAST_SWITCH and hasattr(cfg, "original_max_position_embeddings") else None
        self.whole_prompts = longrope or not self.rewinds
        self.reuses_prefixes = not self.whole_prompts  # a cropped DynamicCache keeps the rows before the cut
        # transformers computes the output layer for the last row only when asked (a prompt's
        # other rows would cost a [prompt, vocab] product for nothing)
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}

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
            keep = self.keep_last if last_only else {}
            cut = self.switch - cache.lengths[slot] if self.switch and not prefill else 0
            pieces = [toks[:cut], toks[cut:]] if 0 < cut < len(toks) else [toks]
            rows = []
            for piece in pieces:
                rows.append(self._forward(cache, slot, piece, keep))
                cache.ids[slot] += piece
                cache.lengths[slot] += len(piece)
            logits = torch.cat(rows)  # [n, vocab], or the last pieces' last rows
            if last_only:
                out[b, 0] = logits[-1]
            else:
                out[b, : len(toks)] = logits
        return out[:, 0] if last_only else out

    def _forward(self, cache: HFCache, slot: int, piece: list[int], keep: dict) -> torch.Tensor:
        """Logits ``[len(piece), vocab]`` (or the last row's, by ``keep``) of ``piece`` after
        ``slot``'s rows. Past ``recompute_at`` as transformers' Phi-3 decodes: the piece that
        first goes past it is computed with every token before it, afresh (the long factors
        for all); a slot rewound back to it or before gets its rows again with the short ones."""
        start, prefix = cache.lengths[slot], []
        if self.recompute_at is not None:
            long = start + len(piece) > self.recompute_at  # the factors this forward takes
            if start and long != cache.long[slot]:  # the slot's rows have the other set
                prefix, start, cache.caches[slot] = cache.ids[slot][:start], 0, cache._make()
            cache.long[slot] = long
        ids = torch.tensor([prefix + piece], device=self.device)  # [1, n]
        given = {self.cache_name: cache.caches[slot]}
        if self.give_positions:
            given["position_ids"] = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        logits = self.model(input_ids=ids, use_cache=True, **given, **keep).logits[0]
        return logits if keep else logits[len(prefix):]

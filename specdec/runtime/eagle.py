"""EAGLE heads and multi-token prediction layers: one decoder layer that drafts from the
target's own hidden states.

An EAGLE drafter (Li et al.: EAGLE, whose checkpoints EAGLE-2 drafts trees with, and EAGLE-3)
is no language model of its own: it reads the *features* the target computed for the
committed tokens and predicts the next token from the feature of the token before and the
token itself. The checkpoints, as SGLang and vLLM load them:

* **EAGLE** (``yuhuili/EAGLE-*``): ``fc`` maps ``[embedding; feature]`` (2 x hidden) to the
  hidden size, then one Llama decoder layer without its input norm; its output goes through
  the target's ``lm_head`` (no norm) and is the next step's feature. The feature is the
  target's last hidden state after its final norm (tap ``num_layers``).
* **EAGLE-3** (``LlamaForCausalLMEagle3``; weights ``midlayer.*``, ``fc``, ``norm``,
  ``lm_head``, ``d2t``): the target's feature is three of its hidden states side by side
  (``eagle_aux_hidden_state_layer_ids``, the outputs of those layers as SGLang reads them;
  default the inputs of layers 2, L/2 and L-3), which ``fc`` maps to the hidden size. The
  layer's attention reads ``[input_norm(embedding); hidden_norm(feature)]`` (2 x hidden), the
  residual stream starts at the feature (after its norm with ``norm_before_residual``); its
  output before the final ``norm`` is the next step's feature, after it the ``lm_head``'s
  input: a smaller draft vocabulary whose id ``i`` is the target's ``i + d2t[i]``.

* **MTP** (multi-token prediction, DeepSeek-V3's and GLM-4.5's ``num_nextn_predict_layers``:
  ``MtpHead``): a layer the model was trained with, stored in its own checkpoint after its
  last layer (``model.layers.{L}.``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer of the
  model's own kind, ``shared_head.norm`` / ``.head``). ``eh_proj`` maps ``[enorm(embedding);
  hnorm(feature)]`` to the hidden size; the decoder layer (its input norm included) runs on
  that; its output is the next step's feature, and through ``shared_head`` the logits. The
  feature is EAGLE's, the target's last hidden state after its final norm, as vLLM and SGLang
  hand it over. Drafting k > 1 tokens runs the layer again on its own output (vLLM's way with
  one layer; further MTP layers of a checkpoint are not read). Qwen3-Next's and Qwen3.5's
  (``mtp_num_hidden_layers``) are the same in other names (``mtp.``: ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``fc``, ``layers.0``, ``norm``; the model's embedding and head), but
  for the feature: the layer's output after ``mtp.norm``, as vLLM hands it to the next step.
  MiMo-V2-Flash's (``model.mtp.layers.{0,1,2}.``; its config declares none) are DeepSeek's in
  names but for ``pre_mlp_layernorm`` and ``final_layernorm``, which gives the feature as
  Qwen's ``mtp.norm`` does; the model's embedding and head; the decoder layer is one of its
  windowed layers (their key/value heads, window, sinks and rope) with a dense MLP. The first
  of them drafts every step (vLLM and SGLang read all three into one module, whichever comes last).
* **Gemma 4's assistant** (``gemma4_assistant``, vLLM's ``mtp`` method with it as the draft:
  ``Gemma4Assistant``): a few Gemma 4 layers with queries alone, attending over the target's
  own keys and values (``AssistantCache.target``), fed EAGLE's pair through ``pre_projection``.

Rows: the head's cache row of the token at position ``p`` holds the pair (feature of
position ``p - 1``, token ``p``): the target's feature while ``p`` is committed (``store``),
else the head's own output at the row that drafted the token (its parent). SGLang and vLLM
put that pair at position ``p - 1``; rotary attention depends only on the difference of two
positions, so the scores are the same. Position 0 has no feature: its row is written but no
other token sees it (EAGLE's first pair is (feature 0, token 1)).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from .cuda_graphs import CudaGraphs
from .linear import pick_linear
from .ops import norm, rms_norm
from .torch_llama import (GEMMA4, CheckpointReader, Family, KVCache, TorchLlama, decoder_layer, index_weights,
                          slot_runs, text_model)

EAGLE_KINDS = ("eagle", "eagle3")
# whose checkpoints may hold MTP layers (Qwen3.5's also as the multimodal checkpoints they are released as)
MTP_ARCHS = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5",
             "qwen3_5_moe", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa")


def eagle_kind(path: Path, names: Sequence[str] | None = None) -> str | None:
    """``"eagle3"``, ``"eagle"``, ``"mtp"`` (a Gemma 4 assistant, ``Gemma4Assistant``) or None:
    what the checkpoint in ``path`` is, by its config's model type and architectures (EAGLE-3's
    name one with ``Eagle3``) or its weights' names (``names``; EAGLE-3's ``midlayer.``, EAGLE's
    ``fc`` beside ``layers.0`` without a model's embedding)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    fields = json.loads(config.read_text())
    archs = fields.get("architectures") or []
    if fields.get("model_type") in ("gemma4_assistant", "gemma4_unified_assistant"):  # Gemma 4's assistants, as
        # vLLM's method mtp takes them
        return "mtp"
    if any("eagle3" in a.lower() for a in archs):
        return "eagle3"
    if names is None:
        return None
    names = {n.removeprefix("model.") for n in names}
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names) and "norm.weight" not in names:
        return "eagle"
    return None


def eagle_name(stored: str) -> str:
    """An EAGLE checkpoint's name as ``decoder_layer`` reads it: its layer (``midlayer.`` or
    ``layers.0.``, with or without ``model.``) as ``model.layers.0.``, the rest (``fc``,
    ``norm``, ``lm_head``, ``d2t``, ``embed_tokens``) without ``model.``."""
    name = stored.removeprefix("model.")
    for old in ("midlayer.", "layers.0."):
        if name.startswith(old):
            name = "model.layers.0." + name[len(old):]
    return name


class HeadWeights:
    """A head's tensors under the names ``decoder_layer`` reads, each stored name renamed by
    ``rename`` (an EAGLE checkpoint's: ``eagle_name``)."""

    def __init__(self, weights, rename=eagle_name):
        self.weights = weights
        self.names = {rename(stored): stored for stored in weights}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.names[name]]


def feature_taps(kind: str, config, target_layers: int) -> tuple[int, ...]:
    """The target hidden states (``TorchLlama.capture``'s taps) an EAGLE head reads: EAGLE's
    last one after the final norm; EAGLE-3's three (``eagle_aux_hidden_state_layer_ids``, at
    the top of its config or in its ``eagle_config``, name layers whose outputs it reads, as
    SGLang takes them: tap ``i + 1``; default the inputs of layers 2, L/2 and L-3, vLLM's and
    SGLang's)."""
    if kind == "eagle":
        return (target_layers,)
    eagle = getattr(config, "eagle_config", None) or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("this EAGLE-3 head reads the target's last hidden state alone (use_aux_hidden_state "
                         "false), which specdec does not support")
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(i + 1 for i in ids)
    return (2, target_layers // 2, target_layers - 3)


class EagleCache(KVCache):
    """The head's KV, plus per row its output hidden state (``hidden [slots, capacity,
    hidden]``: the feature its children read), moved with the row by ``keep`` and ``copy``;
    and per slot the target's features of the committed positions (``targets``, after
    ``fc``), valid below ``known[slot]``."""

    def __init__(self, head: "EagleHead", num_slots: int, max_rows: int | None = None):
        super().__init__(1, num_slots, head.kv_heads, head.head_dim, head.device, head.dtype, max_rows=max_rows,
                         keys_only=head.latent is not None, v_dim=head.v_dim,
                         index=head.sparse_index and (1, head.sparse_index.dim))
        self.hidden = torch.zeros(1, self.capacity, head.hidden_size, device=head.device, dtype=head.dtype)
        self.targets = torch.zeros(1, self.capacity, head.hidden_size, device=head.device, dtype=head.dtype)
        self.known = [0] * num_slots

    def ensure(self, capacity: int, slots: int = 1) -> None:
        super().ensure(capacity, slots)
        # as K's shape: a new buffer exactly when K's is new, where CUDA graphs are captured again
        self.hidden = grown(self.hidden, self.k.shape[1], self.capacity)

    @torch.inference_mode()
    def copy(self, src: int, dst: int, length: int) -> None:
        start = self.lengths[dst]
        super().copy(src, dst, length)
        self.hidden[dst, start:length] = self.hidden[src, start:length]

    @torch.inference_mode()
    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        src = torch.tensor([start + r for r in rows], device=self.hidden.device)
        self.hidden[slot, start:start + len(rows)] = self.hidden[slot, src]
        super().keep(slot, start, rows)

    @torch.inference_mode()
    def store(self, slot: int, start: int, features: torch.Tensor) -> None:
        """The target's (fused) features ``[n, hidden]`` of positions ``start`` on."""
        end = start + features.shape[0]
        self._room(slot + 1, end)
        self.targets[slot, start:end] = features
        self.known[slot] = end

    @torch.inference_mode()
    def share(self, src: int, dst: int, start: int, end: int) -> None:
        """Slot ``src``'s target features of positions ``start`` to ``end - 1`` as ``dst``'s."""
        self._room(max(src, dst) + 1, end)
        self.targets[dst, start:end] = self.targets[src, start:end]
        self.known[dst] = end

    def _room(self, slots: int, end: int) -> None:
        """``targets`` with room for ``slots`` slots and ``end`` rows (its rows doubling)."""
        rows = self.targets.shape[1]
        self.targets = grown(self.targets, slots, rows if end <= rows else max(end, 2 * rows))


def grown(t: torch.Tensor, slots: int, rows: int) -> torch.Tensor:
    """``t [slots, rows, width]``, or a copy with room for at least ``slots`` and ``rows``."""
    if slots <= t.shape[0] and rows <= t.shape[1]:
        return t
    out = t.new_zeros(max(slots, t.shape[0]), max(rows, t.shape[1]), t.shape[2])
    out[: t.shape[0], : t.shape[1]] = t
    return out


class EagleHead(TorchLlama):
    """An EAGLE or EAGLE-3 head (``kind``) as a runtime (``forward``, ``new_cache``), drafting
    for ``target`` (a ``TorchLlama``, whose embedding it shares, and for EAGLE its
    ``lm_head``): ``TorchLlama``'s attention, MLP, masks, trees and CUDA graphs over one layer
    whose inputs are the token's embedding and a feature (see the module's docstring).
    ``reads``: the target's hidden states it reads (its taps); ``fuse`` turns them into
    features."""

    def __init__(self, kind: str, config, weights, target: TorchLlama, linear: str, cuda_graphs: bool | None = None):
        if config.num_hidden_layers != 1:
            raise ValueError(f"this {kind.upper()} head has {config.num_hidden_layers} layers; specdec runs heads "
                             "of one layer (as published)")
        w = HeadWeights(weights)
        self.kind, self.target = kind, target
        self.device, self.dtype = target.device, target.dtype
        self.num_layers, self.num_heads = 1, config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.num_heads
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_context = target.max_context
        self.family, self.window, self.latent = Family(activation=getattr(config, "hidden_act", "silu")), None, None
        self._init_rope(config)
        self.multi_row = self.one_row_packed = False
        self.taps, self.features = (), None
        r = CheckpointReader(w, self.device, self.dtype, self.family, linear, multi_row=False)
        self.layers = [decoder_layer(r, config, "model.layers.0.")]
        self.embed = r.get("embed_tokens.weight") if "embed_tokens.weight" in w else target.embed
        self.vocab_size = target.vocab_size
        self.reads = feature_taps(kind, config, target.num_layers)  # the target's taps
        fc = r.get("fc.weight")
        width = (len(self.reads) if kind == "eagle3" else 2) * target.embed.shape[1]
        if fc.shape != (self.hidden_size, width):
            raise ValueError(f"this {kind.upper()} head's fc is {tuple(fc.shape)}, not {(self.hidden_size, width)}: "
                             "it was not trained for this target")
        self.fc = r.linear(fc, r.opt("fc.bias"))
        self.to_target = None  # [draft vocab] the target id of each draft id (EAGLE-3's d2t)
        if kind == "eagle3":
            self.hidden_norm = r.norm("model.layers.0.hidden_norm.weight")
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
            self.norm = r.norm("norm.weight")
            self.lm_head = r.linear(r.get("lm_head.weight"), None)
            if "d2t" in w:
                d2t = w["d2t"].to(self.device, torch.long)
                self.to_target = torch.arange(d2t.shape[0], device=self.device) + d2t
                if int(self.to_target.max()) >= self.vocab_size:
                    raise ValueError("this EAGLE-3 head's d2t maps past the target's vocabulary")
        else:
            self.norm, self.lm_head = None, target.lm_head  # the target's own
        self.logit_scale = float(getattr(config, "logit_scale", 1.0) or 1.0)
        self.normed_feature = False  # the next step's feature: the layer's output (True: after ``norm``)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = CudaGraphs(self) if use_graphs else None

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> EagleCache:
        return EagleCache(self, num_slots, max_rows)

    @torch.inference_mode()
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's tapped hidden states ``[n, len(taps) * hidden]`` as this head's
        features ``[n, hidden]`` (EAGLE-3: through ``fc``; EAGLE: as they are)."""
        features = features.to(self.device, self.dtype)
        return self.fc(features) if self.kind == "eagle3" else features

    def _batch(self, cache: EagleCache, starts, slots, tokens, positions, chunk_masks, T, keys, long=None):
        """``TorchLlama._batch``'s inputs, with each row's feature (``hidden``): the target's
        for a committed token, else its parent row's output; and position 0's key hidden."""
        x = super()._batch(cache, starts, slots, tokens, positions, chunk_masks, T, keys, long)
        B = len(slots)
        source = torch.zeros(B, T, dtype=torch.long)  # 0: none, 1: the target's feature, 2: a row's output
        index = torch.zeros(B, T, dtype=torch.long)
        for b, (slot, toks) in enumerate(zip(slots, tokens)):
            mask = None if chunk_masks is None else chunk_masks[b]
            if mask is not None:  # a tree's nodes: each one's parent is its last ancestor, else the row before the tree
                tail = mask.shape[1] - mask.shape[0]
                for i in range(len(toks)):
                    seen = mask[i, : tail + i].nonzero()
                    source[b, i], index[b, i] = 2, starts[b] - tail + (int(seen[-1]) if len(seen) else -1)
                continue
            row = torch.arange(starts[b], starts[b] + len(toks))  # a chain: the target's feature where it has one
            given = positions is not None and positions[b] is not None
            pos = torch.tensor(positions[b]) if given else row
            known = (pos > 0) & (pos <= cache.known[slot])
            source[b, : len(toks)] = torch.where(known, 1, 2 * (row > 0))
            index[b, : len(toks)] = torch.where(known, pos - 1, row - 1).clamp(min=0)
        source, index = source.to(self.device), index.to(self.device)
        rows = x.slots[:, None].expand(B, T)
        target = cache.targets[rows.clamp(max=cache.targets.shape[0] - 1), index.clamp(max=cache.targets.shape[1] - 1)]
        own = cache.hidden[rows, index.clamp(max=cache.hidden.shape[1] - 1)]
        x.hidden = torch.where((source == 1)[..., None], target, own) * (source > 0)[..., None]  # [B, T, hidden]
        x.mask[:, 0, :, 0] &= x.write == 0  # no token sees position 0 but itself
        return x

    def _inputs(self, L: dict, e: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's residual stream ``[B, T, hidden]`` and attention's input, from the
        tokens' embeddings ``e`` and their features (``[B, T, hidden]`` each)."""
        if self.kind == "eagle3":
            normed = rms_norm(feature, self.hidden_norm, self.eps)
            residual = normed if self.norm_before_residual else feature
            return residual, torch.cat([rms_norm(e, L["attn_norm"], self.eps), normed], dim=-1)  # [B, T, 2 hidden]
        a = self.fc(torch.cat([e, feature], dim=-1))  # EAGLE: fc over both, then the layer without its input norm
        return a, a

    def _layers(self, cache: EagleCache, x, last: torch.Tensor | None = None, to_float: bool = True):
        B, T = x.ids.shape
        L = self.layers[0]
        residual, a = self._inputs(L, self.embedding(x.ids), x.hidden)
        attend = self._attend_latent if self.latent else self._attend
        h = residual + self._residual(attend(cache, x, L, a, self._rope(x.pos)), L["post_attn_norm"])
        h = h + self._residual(self._mlp(L, rms_norm(h, L["mlp_norm"], self.eps)), L["post_mlp_norm"])
        if self.normed_feature:
            h = rms_norm(h, self.norm, self.eps)
        cache.hidden[x.slots[:, None], x.write] = h  # the next step's feature
        if last is not None:
            h = h[torch.arange(B, device=h.device), last]  # [B, hidden]
        logits = self.lm_head(h if self.norm is None or self.normed_feature else rms_norm(h, self.norm, self.eps))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.to_target is not None:  # [..., draft vocab] -> [..., vocab]; ids it never drafts: -inf
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            logits = full.index_copy(-1, self.to_target, logits)
        return (logits.float() if to_float else logits), None


class MtpHead(EagleHead):
    """A checkpoint's own multi-token prediction layer (see the module's docstring) as an
    ``EagleHead`` of kind ``"mtp"``, drafting for ``target``: its layer is the target's kind
    (latent attention, experts, gated attention), with the target's rope tables and family."""

    def __init__(self, config, weights, target: TorchLlama, linear: str, cuda_graphs: bool | None = None):
        kind, (config, _) = config.model_type, text_model(config)
        qwen = "mtp.fc.weight" in weights  # Qwen3-Next's, Qwen3.5's names
        mimo = kind == "mimo_v2_flash"  # (its first MTP layer's norm before the MLP: ``pre_mlp_layernorm``)
        pre = "mtp.layers.0." if qwen else "model.mtp.layers.0." if mimo else \
            f"model.layers.{config.num_hidden_layers}."
        if kind not in MTP_ARCHS or not (qwen or pre + "eh_proj.weight" in weights):
            raise ValueError(f"this {kind} checkpoint has no multi-token prediction layer ({pre}eh_proj.weight, "
                             "mtp.fc.weight): method 'mtp' needs one (DeepSeek-V3's, GLM-4.5's, Qwen3.5's)")
        if mimo:
            weights = HeadWeights(weights, lambda n: n.replace(".pre_mlp_layernorm.", ".post_attention_layernorm."))
        self.kind, self.target = "mtp", target
        self.device, self.dtype = target.device, target.dtype
        self.num_layers, self.num_heads, self.kv_heads = 1, target.num_heads, target.kv_heads
        self.head_dim, self.latent, self.eps = target.head_dim, target.latent, target.eps
        self.hidden_size, self.max_context = config.hidden_size, target.max_context
        self.family, self.window, self.rope = target.family, None, target.rope
        self.multi_row = self.one_row_packed = False
        self.taps, self.features = (), None
        r = CheckpointReader(weights, self.device, self.dtype, self.family, linear, multi_row=False)
        if mimo:  # a windowed layer of the target's: its key/value heads and window, sinks, its rope
            place = next(layer["kv"] for layer in target.layers if layer["sliding"])
            self.kv_heads, self.head_dim, self.v_dim, self.window = place.heads, place.dim, target.v_dim, target.window
            self.layers = [decoder_layer(r, config, pre, sliding=True, rope="sliding_attention")]
        else:  # (experts where the checkpoint's layer has a router: DeepSeek-V3's, GLM-4.5's, Qwen3-Next's)
            self.layers = [decoder_layer(r, config, pre, pre + "mlp.gate.weight" in weights, latent=self.latent)]
        if target.sparse_index is not None and pre + "self_attn.indexer.wk.weight" in weights:  # (DeepSeek-V3.2's,
            # GLM-5's: sparse attention, an indexer of its own)
            self.sparse_index = replace(target.sparse_index, owns=(True,))
            self.layers[0]["indexer"] = index_weights(r, pre + "self_attn.indexer.", 0)
        if self.layers[0]["rope"] not in self.rope:
            raise ValueError("this MTP layer's rope table is not the target's")
        self.to_target, self.logit_scale, self.normed_feature = None, 1.0, qwen or mimo
        self.vocab_size = target.vocab_size
        self.reads = (target.num_layers,)  # the last hidden state, after the final norm
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = CudaGraphs(self) if use_graphs else None
        if qwen:
            self.enorm, self.hnorm = r.norm("mtp.pre_fc_norm_embedding.weight"), r.norm("mtp.pre_fc_norm_hidden.weight")
            self.fc, self.norm = r.linear(r.get("mtp.fc.weight"), None), r.norm("mtp.norm.weight")
            self.embed, self.lm_head = target.embed, target.lm_head
            return
        self.enorm, self.hnorm = r.norm(pre + "enorm.weight"), r.norm(pre + "hnorm.weight")
        self.fc = r.linear(r.get(pre + "eh_proj.weight"), None)
        if mimo:  # the model's embedding and head
            self.norm, self.embed, self.lm_head = r.norm(pre + "final_layernorm.weight"), target.embed, target.lm_head
            return
        self.norm = r.norm(pre + "shared_head.norm.weight")
        # the embedding and head the layer was trained with: the checkpoint's copies where it has
        # them and they differ from the model's (DeepSeek-V3's are equal: the model's serve), else the model's
        def differs(own: str, model: str) -> bool:
            return own in weights and not torch.equal(weights[own], weights[model])

        embed, head = pre + "embed_tokens.weight", pre + "shared_head.head.weight"
        model_head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # tied
        self.embed = r.get(embed) if differs(embed, "model.embed_tokens.weight") else target.embed
        self.lm_head = r.linear(r.get(head), None) if differs(head, model_head) else target.lm_head

    def _inputs(self, L: dict, e: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(torch.cat([rms_norm(e, self.enorm, self.eps), rms_norm(feature, self.hnorm, self.eps)], dim=-1))
        return h, rms_norm(h, L["attn_norm"], self.eps)


class AssistantCache(EagleCache):
    """A Gemma 4 assistant's rows: its output hidden state per row and the target's features
    (``EagleCache``; its own keys and values: none, one-wide placeholders), and ``target``, the
    target's ``KVCache`` its layers attend over (the engine's, ``attach``; else a scratch one of
    zeros, for timing its forwards alone)."""

    def __init__(self, head: "Gemma4Assistant", num_slots: int, max_rows: int | None = None):
        super().__init__(head, num_slots, max_rows)
        self.target: KVCache | None = None


class Gemma4Assistant(EagleHead):
    """Gemma 4's assistant (``gemma4_assistant``: the ``google/gemma-4-*-it-assistant``
    checkpoints; ``gemma4_unified_assistant``: 12B's, for its unified model), drafting for its
    Gemma 4 ``target`` as transformers' ``Gemma4AssistantForCausalLM`` with its candidate
    generator does, and vLLM's ``mtp`` method with such a checkpoint:

    * its input is the pair (feature, token) of ``EagleHead``: ``pre_projection`` maps ``[the
      target's embedding of the token, scaled as the target scales it; the feature]`` (2 x the
      target's width) to its own width; the feature is the target's last hidden state (after the
      final norm), or for a draft the assistant's previous output through ``post_projection``
      (back to the target's width);
    * its layers are Gemma 4's with queries alone: each attends over the keys and values of the
      target's last layer of its type with keys of its own (full attention: all rows before the
      pair's token; sliding: the last ``window + 1`` of them, transformers' bidirectional window),
      at one position for a whole draft (the last committed token's: ``anchor``), so that it has
      no cache of its own and its rows of one forward are independent of each other;
    * its logits (no softcap, as transformers') are its tied head's, or with
      ``use_ordered_embeddings`` (E2B's, E4B's) those of the tokens of the ``centroid_intermediate_top_k``
      best of ``num_centroids`` clusters, the others the least of them less 1.

    Rows: a committed token's anchor is its own position, a draft's the last committed one's
    (``EagleCache.known``): the target's cache holds exactly the rows before it when the engine
    drafts. No CUDA graphs: it attends over the target's buffers, which grow."""

    def __init__(self, config, weights, target: TorchLlama, linear: str):
        text = text_model(config.text_config)[0]
        stores = {layer["sliding"]: layer["kv"] for layer in target.layers if layer.get("kv") and not layer["kv"].reuse}
        if target.family.embed_scale is None or not stores or text.model_type not in GEMMA4:
            raise ValueError("a Gemma 4 assistant drafts for a Gemma 4 target (its layers attend over the target's "
                             "keys and values)")
        if config.backbone_hidden_size != target.embed.shape[1] or text.vocab_size != target.vocab_size:
            raise ValueError(f"this Gemma 4 assistant was trained for a target {config.backbone_hidden_size} wide with "
                             f"{text.vocab_size} tokens, not {target.embed.shape[1]} with {target.vocab_size}")
        self.kind, self.target = "mtp", target
        self.device, self.dtype = target.device, target.dtype
        self.num_layers, self.num_heads = text.num_hidden_layers, text.num_attention_heads
        self.kv_heads = self.head_dim = 1  # (its own cache's placeholders: it has none)
        self.hidden_size = target.embed.shape[1]  # its features': the target's width
        self.eps, self.max_context = text.rms_norm_eps, target.max_context
        self.family, self.window, self.latent = Family.of(text, self.dtype), None, None
        self.reach = target.window  # the target's sliding window (its sliding layers': ``window + 1`` rows)
        self._init_rope(text)
        self.multi_row = self.one_row_packed = False
        self.taps, self.features, self.graphs = (), None, None
        r = CheckpointReader(weights, self.device, self.dtype, self.family, linear, multi_row=False)
        self.layers = []
        for i, kind in enumerate(text.layer_types):
            place = stores.get(kind == "sliding_attention")
            if place is None or text.layer_heads[i][1] != place.dim or self.num_heads % place.heads:
                raise ValueError(f"this Gemma 4 assistant's layer {i} ({kind}) has no layer of its kind and head "
                                 "width in the target to attend over")
            self.layers.append(decoder_layer(r, text, f"model.layers.{i}.", sliding=kind == "sliding_attention",
                                             rope=kind if kind in self.rope else None, kv=replace(place, reuse=True)))
        self.norm = r.norm("model.norm.weight")
        self.pre_projection = r.linear(r.get("pre_projection.weight"), None)
        self.post_projection = r.linear(r.get("post_projection.weight"), None)
        head = r.get("lm_head.weight" if "lm_head.weight" in r else "model.embed_tokens.weight")  # [vocab, width]
        self.embed, self.vocab_size = target.embed, target.vocab_size
        self.reads = (target.num_layers,)  # the last hidden state, after the final norm
        self.to_target, self.logit_scale, self.normed_feature = None, 1.0, False
        self.clusters = None  # [clusters, tokens per cluster] its ordered tokens, and how many clusters it keeps
        if getattr(config, "use_ordered_embeddings", False):  # (its head's rows gathered: ``_clustered``)
            self.head, self.lm_head = head, None
            self.centroids = r.linear(r.get("masked_embedding.centroids.weight"), None)
            order = weights["masked_embedding.token_ordering"].to(self.device, torch.long)
            self.clusters = order.view(config.num_centroids, -1)
            self.keep = config.centroid_intermediate_top_k
        else:
            self.lm_head = r.linear(head, None)

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> AssistantCache:
        return AssistantCache(self, num_slots, max_rows)

    def _batch(self, cache: AssistantCache, starts, slots, tokens, positions, chunk_masks, T, keys, long=None):
        """``EagleHead._batch``'s inputs, but each row's position its anchor, and its masks over
        the target's rows before it (``[B, 1, T, S]``, S: the greatest anchor; at least row 0)."""
        x = super()._batch(cache, starts, slots, tokens, positions, chunk_masks, T, keys, long)
        anchor = torch.zeros(len(slots), T, dtype=torch.long)  # [B, T]
        for b, (slot, toks) in enumerate(zip(slots, tokens)):
            given = positions is not None and positions[b] is not None
            pos = torch.tensor(positions[b] if given else range(starts[b], starts[b] + len(toks)))
            anchor[b, : len(toks)] = pos.clamp(max=cache.known[slot])
        S = max(1, int(anchor.max()))
        if cache.target is None:  # timed alone: attend over zeros
            cache.target = self.target.new_cache(len(cache.lengths))
        cache.target.ensure(S, max(slots) + 1)
        key = torch.arange(S)
        seen = key < anchor.clamp(min=1)[..., None]  # [B, T, S]
        near = seen & (key >= anchor[..., None] - (self.reach or S) - 1)
        x.pos, x.mask, x.sliding = (t.to(self.device) for t in (anchor, seen[:, None], near[:, None]))
        x.runs = slot_runs(list(slots), S)
        return x

    def _mask(self, starts, S, T, chunk_masks, dev, pos):
        """A placeholder ``[B, 1, T, 1]``: its layers attend over the target's rows alone (``_batch``'s masks),
        none of its own."""
        return torch.ones(len(starts), 1, T, 1, dtype=torch.bool, device=dev), None

    def _layers(self, cache: AssistantCache, x, last: torch.Tensor | None = None, to_float: bool = True):
        if last is not None:  # its rows are independent: the last of each alone
            B = x.ids.shape[0]
            rows = torch.arange(B, device=x.ids.device)
            x = replace(x, ids=x.ids[rows, last][:, None], pos=x.pos[rows, last][:, None],
                        write=x.write[rows, last][:, None], hidden=x.hidden[rows, last][:, None],
                        mask=x.mask[rows, :, last][:, :, None], sliding=x.sliding[rows, :, last][:, :, None])
        e = self.embedding(x.ids) * self.target.family.embed_scale  # [B, T, target width]
        h = self.pre_projection(torch.cat([e, x.hidden], dim=-1))  # [B, T, width]
        rope = self._rope(x.pos)
        for L in self.layers:  # Gemma 4's layer, its queries over the target's rows
            h = h + self._residual(self._attend(cache.target, x, L, norm(h, L["attn_norm"], self.eps), rope),
                                   L["post_attn_norm"])
            h = h + self._residual(self._mlp(L, norm(h, L["mlp_norm"], self.eps)), L["post_mlp_norm"])
            h = h * L["scalar"] if L["scalar"] is not None else h
        h = norm(h, self.norm, self.eps)
        cache.hidden[x.slots[:, None], x.write] = self.post_projection(h)  # the next draft's feature
        logits = self.lm_head(h) if self.clusters is None else self._clustered(h)  # [B, T, vocab]
        logits = logits[:, 0] if last is not None else logits
        return (logits.float() if to_float else logits), None

    def _clustered(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the tokens of the ``keep`` best clusters for ``h [B, T,
        width]``; every other token's: the least of those less 1."""
        tokens = self.clusters[self.centroids(h).topk(self.keep, dim=-1).indices].flatten(-2)  # [B, T, n]
        chosen = (self.head[tokens] @ h[..., None])[..., 0]  # [B, T, n]
        out = (chosen.amin(-1, keepdim=True) - 1).expand(*h.shape[:-1], self.vocab_size)
        return out.scatter(-1, tokens, chosen)


def head_linear(rt: TorchLlama, quantize: str) -> str:
    """A head's linears' kind beside the target runtime ``rt``: ``quantize`` is
    ``draft_quantization`` (auto: int8 on a CPU in float32)."""
    int8 = quantize == "int8" or (quantize == "auto" and rt.device.type == "cpu" and rt.dtype == torch.float32)
    return pick_linear(rt.device, rt.dtype, int8)


def load_mtp(target, quantize: str = "auto"):
    """``target``'s own multi-token prediction layer (an ``MtpHead`` over the weights in its
    checkpoint) as a ``LoadedModel`` beside it; ``quantize``: ``draft_quantization``."""
    from .loading import LoadedModel, Weights

    rt = target.runtime
    if type(rt) is not TorchLlama:
        raise ValueError("method 'mtp' reads the target's hidden states, which only specdec's torch runtime gives: "
                         "run the target with backend 'torch' (or 'auto', for an architecture it runs)")
    try:
        weights = Weights(target.path)
    except ValueError:  # a GGUF's directory, or no weights at all
        raise ValueError(f"method 'mtp' reads the MTP layer from the checkpoint's safetensors files; {target.path} "
                         "has none") from None
    head = MtpHead(target.config, weights, rt, head_linear(rt, quantize), cuda_graphs=rt.graphs is not None)
    return LoadedModel(f"{target.name} (MTP)", target.path, head, target.tokenizer, target.eos_ids, target.config)


def eagle_checkpoint(draft: str, revision: str | None = None) -> str | None:
    """The EAGLE kind of the checkpoint ``draft`` names (a directory or a hub id; None for
    anything else, a ``.gguf`` included): a hub id by its config's architectures alone."""
    from .loading import Weights, resolve

    path = Path(draft).expanduser()
    if path.is_file() or (path.is_dir() and not (path / "config.json").is_file()):
        return None
    if path.is_dir():
        try:
            return eagle_kind(path, list(Weights(path)))
        except ValueError:  # no weights
            return None
    return eagle_kind(resolve(draft, weights=False, revision=revision))


def load_eagle(draft: str, kind: str, target, quantize: str = "auto", revision: str | None = None):
    """The EAGLE head or Gemma 4 assistant ``draft`` (a directory or hub id; ``kind`` as
    ``eagle_checkpoint`` found it) on ``target``'s device and dtype, as a ``LoadedModel`` with the target's tokenizer;
    ``quantize``: ``draft_quantization`` (auto: int8 linears on a CPU in float32)."""
    from transformers import AutoConfig

    from .loading import LoadedModel, Weights, resolve

    rt = target.runtime
    if type(rt) is not TorchLlama:
        raise ValueError(f"an {kind.upper()} head reads the target's hidden states, which only specdec's torch runtime "
                         "gives: run the target with backend 'torch' (or 'auto', for an architecture it runs)")
    path = resolve(draft, weights=True, revision=revision)
    config = AutoConfig.from_pretrained(path)
    if kind == "mtp":
        head = Gemma4Assistant(config, Weights(path), rt, head_linear(rt, quantize))
    else:
        head = EagleHead(kind, config, Weights(path), rt, head_linear(rt, quantize), cuda_graphs=rt.graphs is not None)
    return LoadedModel(str(draft), path, head, target.tokenizer, target.eos_ids, config)

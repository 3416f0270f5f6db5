"""A compact PyTorch forward pass for the Llama family (Llama, Mistral, Ministral, Qwen2, Qwen3, Phi-3, Granite,
SmolLM3, GLM-4, OLMo 2 and 3, EXAONE 4, ERNIE 4.5, Arcee, Seed-OSS, HunYuan, Cohere, Command R7B, StarCoder2,
Apertus, and older kin: Phi, GPT-NeoX, StableLM, GPT-J, Falcon, GPT-2, GPT-BigCode, OPT, BLOOM and MPT, these two
and Falcon-RW with ALiBi's biases: ``Alibi``), its mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
dots.llm1, ERNIE 4.5, GPT-OSS, GLM-4.5, Granite's, Llama 4's: ``Experts``), the mixtures with multi-head latent
attention (DeepSeek-V2 and V3, GLM-4.7-Flash, Mistral 4: ``Latent``), Gemma's (Gemma, Gemma 2, Gemma 3, and the text
model of Gemma 3's multimodal checkpoints: ``text_model``), whose layers differ from Llama's only in small ways
(``Family``), Gemma 4 (heads of two widths and layers reading earlier layers' keys: ``KVPlace``; per-layer inputs;
its experts beside the MLP), Gemma 3n (Gemma 4's shared keys and per-layer inputs under alternating updates:
``ops.AltUp``, ``TorchLlama._altup_layer``), Hy4's hyper-connections (``ops.HyperConnections``), Phi-3's longrope
(``TorchLlama.switch``), and the hybrids of recurrent layers and
attention (``recurrent``, whose states rewind with the cache):
Gated DeltaNet layers beside gated attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), OLMo 3's (OLMo-Hybrid) or latent
attention (Kimi Delta Attention, a decay per key channel: Kimi Linear's, Ling 3's), Mamba-2
layers beside attention
(Granite 4.0's hybrids, Bamba, Nemotron-H: ``RenamedWeights``; Falcon-H1's side by side in each layer:
``ScaledWeights``; Zamba2's after shared attention blocks: ``zamba_shared_blocks``), Mamba layers beside attention
(Jamba), RecurrentGemma's RG-LRU blocks beside windowed attention, MiniMax's lightning attention beside full
attention (``_normed_residual_layer``), LFM2's and LFM3's short convolutions beside attention, and Mamba,
Falcon-Mamba and Mamba-2 (recurrent layers alone).

Weights use Hugging Face names and conventions (rotate-half RoPE), so safetensors from an
HF directory and GGUF tensors dequantized by transformers load the same way. The KV cache
is position-indexed per slot: token ``j`` of a sequence lives at index ``j`` of its slot,
and a rollback only rewinds the slot's length.

Beside it: ``moe`` (the experts), ``recurrent`` (DeltaNet, Mamba-2 and Mamba layers, their states),
``linear`` (``Linear``'s kinds), ``ops`` (norms, attention, rotary embeddings) and
``cuda_graphs`` (``CudaGraphs``).
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import disk_cache
from .cuda_graphs import GRAPH_MAX_TOKENS, CudaGraphs, graph_tokens
from .linear import (LINEAR_KINDS, PACKED_ONE_ROW_SLACK, Linear, Ternary, TernaryWeight, expert_bytes, linear_bytes,
                     mem_available, pick_linear)
from .lora import LoRALayers
from .moe import MOE_ARCHS, Experts, MixtureOfAttention, grouped_mm_graphable, moe_layers
from .ops import (ACTIVATIONS, TRAINED_ACTIVATIONS, AltUp, GatedNorm, HyperConnections, LayerNorm, attention,
                  cat_or_none, norm, norm_width, rms_norm, rotate, softcap, xielu)
from .recurrent import (DEFAULT_DEPTH, LINEAR_ATTENTION, PURE_RECURRENT, RECURRENT_TYPES, DeltaNet, Mamba1, Mamba2,
                        RecurrentStates, ShortConv, StatePlan, layer_number, recurrent_mixer)

log = logging.getLogger(__name__)

# Qwen2 and Qwen3 on text alone (text_model; Qwen3-VL-MoE's: Qwen3-MoE's experts)
QWEN_VL_TEXT = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text")
# GLM-4.1V's / GLM-4.6V-Flash's text model: GLM-4's layers (GLM-4.5V's and GLM-4.6V's: GLM-4.5's, ``moe``), its
# multimodal rope on text alone the text model's
GLM_VL_TEXT = ("glm4v_text",)
# DeltaNet layers beside gated attention (``recurrent``): Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's (text
# models: the "qwen3_5" and "qwen3_5_moe" checkpoints hold them)
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Granite's multipliers; Granite 4.0's hybrids (granitemoehybrid, with or without experts) have Mamba-2 layers
# beside attention without rope, as Bamba's beside attention with rope on half of each head
GRANITES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
            "granitemoe_swa", "hyperclovax")  # (Granite-SWA's and its MoE's: windows on the layers layer_types names,
# a sink per head, a rope base per layer, layer_rope_theta, 0 for none; HyperCLOVA X's: Granite's, norms after too)
GEMMA4 = ("gemma4_text", "gemma4_unified_text")  # Gemma 4's text models (the unified one, 12B's: no per-layer inputs)
# Gemma 3n's and 4's: keys shared by the last layers (``KVPlace``), values normed without a weight, per-layer inputs
GEMMA_N = ("gemma3n_text", *GEMMA4)
ARCHS = tuple(dict.fromkeys((
    "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3", "smollm3", "glm4", *GLM_VL_TEXT, "gemma",
    "gemma2", "gemma3_text", "olmo2", "olmo3", "exaone4", "ernie4_5", "arcee", "seed_oss", "hunyuan_v1_dense", "cohere",
    "cohere2", "starcoder2", "apertus", "apertus1p5_text", "bamba", "nemotron_h", "lfm2", "lfm3", "olmo_hybrid",
    "falcon_h1", "jamba", "zamba2", "recurrent_gemma", "minimax", "jetmoe",
    "gpt_neox", "phi", "stablelm",
    "olmo", "gptj", "falcon", "gpt2", "opt", "gpt_bigcode", "nemotron", "internlm3", "iquestcoder", "exaone", "helium",
    "llama4_text", "bloom", "mpt", "glm", "vaultgemma", "jais2", "nanochat", "afmoe", "gpt_neo",
    "cwm", "youtu", "axk1", "codegen", "persimmon", "dbrx", "kolibri1", "flint", "minicpm3", *GEMMA_N, "kimi_linear",
    "bailing_hybrid", "hy_v4", "lara_mini", "cohere_compass_text", "bitnet", "mllama_text_model")
    + GRANITES + MOE_ARCHS + QWEN_VL_TEXT + HYBRID_ARCHS + PURE_RECURRENT))  # HF
# model_type; biases, q/k norms, Phi-3's fused projections and Gemma 2/3's norms after attention and MLP come from the
# weights
GEMMAS = ("gemma", "gemma2", "gemma3_text", "vaultgemma")  # (VaultGemma's: Gemma 2's without norms after)
# whose transformers model rotates a part of each head where the config says
PARTIAL_ROTARY = ("phi3", "glm", "glm4", "glm4_moe", "bamba", "glm4v_moe_text", "gpt_neox", "phi", "stablelm", "gptj",
                  "codegen", "persimmon", "nemotron", "mistral4", "minimax_m2", "mimo_v2_flash", "laguna",
                  "sarvam_moe", "recurrent_gemma", "minimax") + GLM_VL_TEXT + HYBRID_ARCHS  # (Mistral 4's: its latent's
# rotated part; MiniMax-Text-01's: its rotary_dim, ``text_model``)
# multimodal checkpoints whose text model may be one of ARCHS (Gemma 3's, Mistral 3's: Mistral
# Small 3.1 and up, LLaVA's): its weights' prefixes (as saved and on the hub; transformers' own
# module names)
MULTIMODAL = dict.fromkeys(("gemma3", "mistral3", "llava", "aria"), ("language_model.model.", "model.language_model."))
# Qwen2.5-VL's and Qwen3-VL's (their multimodal rope, on text alone, is the text model's: its three
# position streams are equal); Qwen2.5-VL's released checkpoints keep the text model under "model."
MULTIMODAL.update(dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"),
                                ("model.language_model.", "language_model.model.", "model.")))
# more that hold a text model the torch runtime runs: LLaVA-NeXT's and LLaVA-OneVision's, InternVL's (the "-hf"
# checkpoints: Qwen2 / Qwen3 text), LFM2-VL's (LFM2's), LFM3-VL's, EXAONE 4.5's (EXAONE 4's); SmolVLM's and Idefics3's
# (Llama). (Not Aya Vision's: its transformers model leaves out its Command R7B text model's logit scale, where vLLM's
# keeps it.)
MULTIMODAL.update(dict.fromkeys(("llava_next", "llava_onevision", "internvl", "lfm2_vl", "lfm3_vl", "exaone4_5"),
                                ("model.language_model.", "language_model.model.")))
MULTIMODAL.update(dict.fromkeys(("smolvlm", "idefics3"), ("model.text_model.",)))
MULTIMODAL["apertus1p5"] = ("model.language_model.",)  # (Apertus 1.5's: its images and audio as tokens)
MULTIMODAL["cohere_compass"] = ("model.language_model.",)  # (North's: Qwen3-VL's layout around Command R7B's layers)
# (Llama 3.2 Vision's: ``text_model``; under "model." as transformers' causal LM of its config names them: dummy weights)
MULTIMODAL["mllama"] = ("model.language_model.", "language_model.model.", "model.")
# (Qwen3.5's under "model." too: transformers' causal LM of its config, dummy weights' names)
MULTIMODAL.update(dict.fromkeys(("qwen3_5", "qwen3_5_moe"), ("model.language_model.", "language_model.model.", "model.")))
# GLM-4.1V's and up
MULTIMODAL.update(dict.fromkeys(("glm4v", "glm4v_moe", "glm46v"),  # (GLM-4.6V's: GLM-4.1V's text model)
                                ("model.language_model.", "language_model.model.")))
# Llama 4's (Scout's, Maverick's; "model.": transformers' causal LM of its config, dummy weights' names)
MULTIMODAL["llama4"] = ("language_model.model.", "model.language_model.", "model.")
MULTIMODAL.update(dict.fromkeys(("gemma4", "gemma4_unified"),
                                ("model.language_model.", "language_model.model.", "model.")))  # (Gemma 4's)
MULTIMODAL["gemma3n"] = ("model.language_model.",)  # (Gemma 3n's: E2B's, E4B's, as released)


class TextWeights:
    """A multimodal checkpoint's text model's weights under a text model's names (``model.*``,
    ``lm_head.weight``); the vision tower's are never read. ``layers``: the checkpoint's layer of each
    of the text model's (Llama 3.2 Vision's self-attention layers, between its cross-attention ones)."""

    def __init__(self, weights, prefix: str, head: str, layers: list[int] | None = None):
        self.weights, self.prefix, self.head, self.layers = weights, prefix, head, layers

    def _name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        if self.layers is not None and name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            name = f"model.layers.{self.layers[int(i)]}.{rest}"
        return self.prefix + name.removeprefix("model.")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self._name(name)]

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.weights


class RenamedWeights:
    """A checkpoint's weights under Llama's names (``model.layers.{i}.self_attn.q_proj.weight``...),
    each name's parts replaced in turn by ``renames[model_type]`` (``(old, new)``), then its
    ``model.`` by ``prefix``: HunYuan's q/k norms are ``query_layernorm`` / ``key_layernorm``,
    StarCoder2's MLP ``c_fc`` / ``c_proj``, Apertus's norms ``attention_layernorm`` /
    ``feedforward_layernorm``, Phi's output ``dense``, MLP ``fc1`` / ``fc2`` and final norm
    ``final_layernorm``; GPT-NeoX's (Pythia's) ``gpt_neox.`` for ``model.``, and its fused
    ``query_key_value`` holds each head's query, key and value side by side (``[heads, 3,
    head_dim]``), read as Phi-3's ``qkv_proj`` (every query, then every key, then every value);
    StableLM's q/k norms are one per head (``q_layernorm.norms.{h}``), read stacked ``[heads,
    head_dim]``; GPT-2's products' weights transposed (its ``Conv1D``), its original checkpoints'
    names bare (``h.{i}.``, ``wte``); GPT-BigCode's (StarCoder's) as GPT-2's, not transposed, its
    fused projection multi-query (in order) or per head; OPT's under ``model.decoder.`` (its
    original checkpoints': ``decoder.``); EXAONE 3's GPT-2-like (``transformer.h.{i}.attn.attention.``,
    ``c_fc_0``...); GPT-J's, Falcon's and BLOOM's layers ``transformer.h.{i}.`` (BLOOM's also bare,
    its embeddings' norm ``word_embeddings_layernorm``), BLOOM's and Falcon's fused projection per
    head as GPT-NeoX's, or (Falcon's new decoder architecture's) per
    group of heads sharing a key and value (``[groups, heads / groups + 2, head_dim]``), or
    (multi-query) already in order; MPT's blocks ``transformer.blocks.{i}.`` (``norm_1``, ``attn.Wqkv``
    in order, ``ffn.``); Nemotron-H's blocks hold one mixer each (``mixer.``: attention,
    Mamba-2, an MLP or experts) after one norm, under ``backbone.`` as saved (``model.`` as
    transformers names it), as Mamba's, Falcon-Mamba's and Mamba-2's blocks (a Mamba layer
    each); LFM2's (and LFM2-MoE's) norms, attention and MLP go by their own names."""

    RENAMES = {
        "nemotron_h": [(".input_layernorm.", ".norm."), (".post_attention_layernorm.", ".norm."),
                       (".self_attn.", ".mixer."), (".mamba.", ".mixer."), (".mlp.", ".mixer."),
                       ("model.embed_tokens.", "model.embeddings."), ("model.norm.", "model.norm_f.")],
        "lfm2": [(".input_layernorm.", ".operator_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                 (".q_norm.", ".q_layernorm."), (".k_norm.", ".k_layernorm."), (".o_proj.", ".out_proj."),
                 (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.up_proj.", ".feed_forward.w3."),
                 (".mlp.down_proj.", ".feed_forward.w2."), ("model.norm.", "model.embedding_norm.")],
    }
    RENAMES["lfm2_moe"] = RENAMES["lfm2"] + [(".mlp.", ".feed_forward.")]  # (its experts, router, expert_bias)
    # LFM3's: Qwen3's attention names, LFM2's norms and MLP, norms after the mixer and the MLP too (use_sandwich_norm)
    LFM3_MLP = [(".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.up_proj.", ".feed_forward.w3."),
                (".mlp.down_proj.", ".feed_forward.w2."), ("model.norm.", "model.embedding_norm."),
                (".input_layernorm.", ".operator_norm.")]
    RENAMES["lfm3"] = LFM3_MLP + [(".post_attention_layernorm.", ".post_operator_norm."),
                                  (".pre_feedforward_layernorm.", ".ffn_norm."),
                                  (".post_feedforward_layernorm.", ".post_ffn_norm.")]
    RENAMES.update(dict.fromkeys(PURE_RECURRENT, RENAMES["nemotron_h"]))
    RENAMES["nanochat"] = [(".mlp.up_proj.", ".mlp.fc1."), (".mlp.down_proj.", ".mlp.fc2.")]
    # OLMo-Hybrid's as released (its DeltaNet layers' convolutions apart: ``recurrent.DeltaNet.weights``)
    RENAMES["olmo_hybrid"] = [(".input_layernorm.", ".attention_layer_norm."),
                              (".post_attention_layernorm.", ".feedforward_layer_norm.")]
    RENAMES["hunyuan_v1_dense"] = RENAMES["hunyuan_v1_moe"] = [(".q_norm.", ".query_layernorm."),
                                                               (".k_norm.", ".key_layernorm.")]
    RENAMES["sarvam_moe"] = [("model.embed_tokens.", "model.word_embeddings."), (".self_attn.", ".attention."),
                             (".attention.qkv_proj.", ".attention.query_key_value."),
                             (".attention.o_proj.", ".attention.dense."),
                             (".q_norm.", ".query_layernorm."), (".k_norm.", ".key_layernorm."),
                             (".gate.e_score_correction_bias", ".gate.expert_bias")]
    RENAMES["jetmoe"] = [(".self_attn.", ".self_attention.")]  # (its attention experts: ``MixtureOfAttention``)
    # RecurrentGemma's (its recurrent blocks' own names: ``recurrent.RGLRU.weights``)
    RENAMES["recurrent_gemma"] = [(".input_layernorm.", ".temporal_pre_norm."), (".post_attention_layernorm.",
                                                                                ".channel_pre_norm."),
                                  (".self_attn.", ".temporal_block."), (".mlp.", ".mlp_block."),
                                  ("model.norm.", "model.final_norm.")]
    # Kimi Linear's experts, router and shared experts as released (``block_sparse_moe.``; its dense MLP ``mlp.``)
    RENAMES["kimi_linear"] = [(f".mlp.{n}.", f".block_sparse_moe.{n}.") for n in ("experts", "gate", "shared_experts")]
    # Ling's hybrids (bailing_hybrid) as saved: attention (either kind) under ``attention.``, its output ``dense``
    RENAMES["bailing_hybrid"] = [("model.embed_tokens.", "model.word_embeddings."),
                                 (".self_attn.o_proj.", ".attention.dense."), (".self_attn.", ".attention."),
                                 (".gate.e_score_correction_bias", ".gate.expert_bias")]
    # Hy4's as saved: its gates (attention's output, the MLPs') ``linear_gate``, sinks ``learnable_sink_param``, its
    # hyper-connections' under ``hc_pre.``
    RENAMES["hy_v4"] = [(".gate_proj.", ".linear_gate."), (".self_attn.sinks", ".self_attn.learnable_sink_param"),
                        (".attn_hc.", ".hc_pre.hc_attn_layer.hc_"), (".ffn_hc.", ".hc_pre.hc_mlp_layer.hc_"),
                        ("model.hc_head.", "model.hc_pre.hc_head.hc_head_")]
    RENAMES["starcoder2"] = [(".mlp.up_proj.", ".mlp.c_fc."), (".mlp.down_proj.", ".mlp.c_proj.")]
    RENAMES["apertus"] = RENAMES["apertus1p5_text"] = [(".input_layernorm.", ".attention_layernorm."),
                                                       (".post_attention_layernorm.", ".feedforward_layernorm.")]
    RENAMES["phi"] = [(".self_attn.o_proj.", ".self_attn.dense."), (".mlp.up_proj.", ".mlp.fc1."),
                      (".mlp.down_proj.", ".mlp.fc2."), ("model.norm.", "model.final_layernorm."),
                      (".q_norm.", ".q_layernorm."), (".k_norm.", ".k_layernorm.")]
    RENAMES["gpt_neox"] = [(".self_attn.qkv_proj.", ".attention.query_key_value."),
                           (".self_attn.o_proj.", ".attention.dense."), (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                           (".mlp.down_proj.", ".mlp.dense_4h_to_h."), ("model.embed_tokens.", "model.embed_in."),
                           ("model.norm.", "model.final_layer_norm."), ("lm_head.", "embed_out.")]
    RENAMES["dbrx"] = [("model.embed_tokens.", "model.wte."), (".layers.", ".blocks."),
                       (".input_layernorm.", ".norm_attn_norm.norm_1."),
                       (".post_attention_layernorm.", ".norm_attn_norm.norm_2."),
                       (".self_attn.qkv_proj.", ".norm_attn_norm.attn.Wqkv."),
                       (".self_attn.o_proj.", ".norm_attn_norm.attn.out_proj."), (".mlp.experts.", ".ffn.experts."),
                       (".mlp.router.", ".ffn.router."), ("model.norm.", "model.norm_f.")]
    RENAMES["flint"] = [(".self_attn.sinks", ".self_attn.softmax_offset")]  # (as saved)
    RENAMES["kolibri1"] = [(".post_self_attn_layernorm.", ".post_attn_norm."),  # (as saved)
                           (".post_mlp_layernorm.", ".post_ffn_norm."),
                           (".mlp.gate.e_score_correction_bias", ".moe.router.expert_bias")]
    RENAMES["persimmon"] = [(".self_attn.qkv_proj.", ".self_attn.query_key_value."),
                            (".self_attn.o_proj.", ".self_attn.dense."), (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                            (".mlp.down_proj.", ".mlp.dense_4h_to_h."), (".q_norm.", ".q_layernorm."),
                            (".k_norm.", ".k_layernorm."), ("model.norm.", "model.final_layernorm.")]
    RENAMES["stablelm"] = [(".q_norm.", ".q_layernorm.norms."), (".k_norm.", ".k_layernorm.norms.")]
    RENAMES["gptj"] = [("model.embed_tokens.", "model.wte."), (".layers.", ".h."), (".input_layernorm.", ".ln_1."),
                       (".self_attn.o_proj.", ".attn.out_proj."), (".self_attn.", ".attn."),
                       (".mlp.up_proj.", ".mlp.fc_in."), (".mlp.down_proj.", ".mlp.fc_out."),
                       ("model.norm.", "model.ln_f.")]
    RENAMES["codegen"] = RENAMES["gptj"]  # (its fused projection in 4 blocks, each of queries, values, keys)
    RENAMES["gpt2"] = [("model.embed_tokens.", "model.wte."), ("model.embed_positions.", "model.wpe."),
                       (".layers.", ".h."), (".input_layernorm.", ".ln_1."), (".post_attention_layernorm.", ".ln_2."),
                       (".self_attn.qkv_proj.", ".attn.c_attn."), (".self_attn.o_proj.", ".attn.c_proj."),
                       (".mlp.up_proj.", ".mlp.c_fc."), (".mlp.down_proj.", ".mlp.c_proj."),
                       ("model.norm.", "model.ln_f.")]
    RENAMES["gpt_bigcode"] = RENAMES["gpt2"]  # (its products nn.Linear's: not transposed)
    RENAMES["gpt_neo"] = [(".self_attn.o_proj.", ".attn.attention.out_proj."), (".self_attn.", ".attn.attention.")] \
        + RENAMES["gpt2"]  # (q, k and v apart)
    # EXAONE 3's, as saved (transformers renames them at load)
    RENAMES["exaone"] = [("model.embed_tokens.", "model.wte."), (".layers.", ".h."), ("model.norm.", "model.ln_f."),
                         (".self_attn.o_proj.", ".attn.attention.out_proj."), (".self_attn.", ".attn.attention."),
                         (".input_layernorm.", ".ln_1."), (".post_attention_layernorm.", ".ln_2."),
                         (".mlp.gate_proj.", ".mlp.c_fc_0."), (".mlp.up_proj.", ".mlp.c_fc_1."),
                         (".mlp.down_proj.", ".mlp.c_proj.")]
    RENAMES["opt"] = [(".input_layernorm.", ".self_attn_layer_norm."),
                      (".post_attention_layernorm.", ".final_layer_norm."), (".self_attn.o_proj.", ".self_attn.out_proj."),
                      (".mlp.up_proj.", ".fc1."), (".mlp.down_proj.", ".fc2."), ("model.norm.", "model.final_layer_norm.")]
    RENAMES["falcon"] = [("model.embed_tokens.", "model.word_embeddings."), (".layers.", ".h."),
                         (".self_attn.qkv_proj.", ".self_attention.query_key_value."),
                         (".self_attn.o_proj.", ".self_attention.dense."), (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                         (".mlp.down_proj.", ".mlp.dense_4h_to_h."), ("model.norm.", "model.ln_f.")]
    RENAMES["bloom"] = [("model.embed_tokens.", "model.word_embeddings."),
                        ("model.embed_norm.", "model.word_embeddings_layernorm."), (".layers.", ".h."),
                        (".self_attn.qkv_proj.", ".self_attention.query_key_value."),
                        (".self_attn.o_proj.", ".self_attention.dense."), (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
                        (".mlp.down_proj.", ".mlp.dense_4h_to_h."), ("model.norm.", "model.ln_f.")]
    RENAMES["mpt"] = [("model.embed_tokens.", "model.wte."), (".layers.", ".blocks."),
                      (".input_layernorm.", ".norm_1."), (".post_attention_layernorm.", ".norm_2."),
                      (".self_attn.qkv_proj.", ".attn.Wqkv."), (".self_attn.o_proj.", ".attn.out_proj."),
                      (".mlp.", ".ffn."), ("model.norm.", "model.norm_f.")]
    # a checkpoint's prefix for ``model.``, by its embeddings' name (as saved; else ``model.``)
    PREFIXES = [("backbone.", "embeddings"), ("backbone.", "embedding"), ("gpt_neox.", "embed_in"),
                ("transformer.", "wte"), ("transformer.", "word_embeddings"), ("", "wte"), ("", "word_embeddings"),
                ("model.decoder.", "embed_tokens"), ("decoder.", "embed_tokens")]

    def __init__(self, weights, config):
        self.weights, self.renames = weights, self.RENAMES[config.model_type]
        if config.model_type == "lfm3" and not config.use_sandwich_norm:  # its norm before the MLP alone
            self.renames = self.LFM3_MLP + [(".post_attention_layernorm.", ".ffn_norm.")]
        if config.model_type == "olmo_hybrid" and not any(".feedforward_layer_norm." in n for n in weights):
            self.renames = []  # (under transformers' names: dummy weights')
        if config.model_type == "kimi_linear" and any(n.endswith(".block_sparse_moe.down_proj.weight") for n in weights):
            self.renames = [(".mlp.", ".block_sparse_moe.")]  # (transformers saves its dense MLPs so too)
        self.heads = getattr(config, "num_attention_heads", None)
        if "backbone.embedding.weight" in weights:  # (Mamba-2's original checkpoints; transformers renames it at load)
            self.renames = self.renames + [("model.embeddings.", "model.embedding.")]
        self.prefix = next((p for p, e in self.PREFIXES if f"{p}{e}.weight" in weights), "model.")
        if self.prefix == "model." and config.model_type == "exaone":  # (saved under Llama's names already)
            self.renames = []
        self.conv1d = config.model_type == "gpt2"  # its products' weights [in, out] (transformers' Conv1D)
        self.codegen = config.model_type == "codegen"
        new = config.model_type == "falcon" and config.new_decoder_architecture
        self.per_head = config.model_type in ("gpt_neox", "bloom", "persimmon") or \
            config.model_type in ("falcon", "gpt_bigcode") and not new and not config.multi_query  # fused per head
        # [heads, 3, head_dim]
        self.groups = config.num_kv_heads if new else None  # Falcon's [groups, heads / groups + 2, head_dim]
        if new and (config.num_ln_in_parallel_attn or 2) == 2:  # a norm before attention, another before the MLP
            self.renames = self.renames + [(".input_layernorm.", ".ln_attn."), (".post_attention_layernorm.", ".ln_mlp.")]

    def _name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def __getitem__(self, name: str) -> torch.Tensor:
        name = self._name(name)
        if ".norms." in name and name not in self.weights:  # one norm per head: stacked [heads, head_dim]
            heads = [name.replace(".norms.", f".norms.{h}.") for h in range(self.heads)]  # (keys': fewer)
            return torch.stack([self.weights[n] for n in heads if n in self.weights])
        t = self.weights[name]
        if self.conv1d and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            return t.t()
        if self.codegen and name.endswith(".attn.qkv_proj.weight"):  # [4, (q, v, k), hidden / 4, in] -> q, k, v
            blocks = t.view(4, 3, -1, t.shape[1])
            return torch.cat([blocks[:, 0], blocks[:, 2], blocks[:, 1]]).reshape(t.shape)
        if (".query_key_value." in name or ".c_attn." in name) and self.per_head:  # [heads, 3, head_dim, ...] ->
            # [3, heads, head_dim, ...]
            return t.view(self.heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        if ".query_key_value." in name and self.groups:  # queries, keys, values of each group -> all queries...
            g = t.view(self.groups, self.heads // self.groups + 2, -1, *t.shape[1:])
            return torch.cat([g[:, :-2].flatten(0, 1), g[:, -2], g[:, -1]]).reshape(t.shape)
        return t

    def __contains__(self, name: str) -> bool:
        name = self._name(name)
        return name in self.weights or ".norms." in name and name.replace(".norms.", ".norms.0.") in self.weights


class ScaledWeights:
    """Falcon-H1's weights with its muP multipliers folded in (each scales a product's input or
    output, so its weight, and its bias where it scales the output): attention's input
    (``attention_in_multiplier``), keys (``key_multiplier``) and output; the Mamba-2 layer's
    input (``ssm_in_multiplier``), its input products' five parts (``ssm_multipliers``: z, x,
    B, C, dt; transformers' ``compute_mup_vector``) and output; the MLP's gate (inside the
    activation) and down products (``mlp_multipliers``)."""

    def __init__(self, weights, config):
        from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

        self.weights = weights
        mup = compute_mup_vector(config).flatten()  # [in_proj rows]
        attn_in, key, attn_out = config.attention_in_multiplier, config.key_multiplier, config.attention_out_multiplier
        gate, down = config.mlp_multipliers
        self.scales = {  # name's end -> (weight's factor, bias's)
            "self_attn.q_proj": (attn_in, 1.0), "self_attn.k_proj": (attn_in * key, key),
            "self_attn.v_proj": (attn_in, 1.0), "self_attn.o_proj": (attn_out, attn_out),
            "mamba.in_proj": (config.ssm_in_multiplier * mup[:, None], mup),
            "mamba.out_proj": (config.ssm_out_multiplier, config.ssm_out_multiplier),
            "feed_forward.gate_proj": (gate, gate), "feed_forward.down_proj": (down, down),
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.weights[name]
        module, _, kind = name.rpartition(".")
        scale = next((s for end, s in self.scales.items() if module.endswith(end)), None)
        if scale is None or kind not in ("weight", "bias"):
            return t
        return (t.float() * scale[kind == "bias"]).to(t.dtype)

    def __contains__(self, name: str) -> bool:
        return name in self.weights


def text_model(config, weights=None):
    """``(config, weights)`` of the text model the torch runtime runs, under Llama's names: a
    multimodal checkpoint's (``MULTIMODAL``: Gemma 3 4B and up, Mistral 3, LLaVA and its kin, Qwen2-VL to Qwen3-VL,
    GLM-4.1V+, InternVL, SmolVLM, LFM2-VL; ``text_config``, ``TextWeights``; text prompts only), then
    Nemotron-H's, LFM2's... (``RenamedWeights``), Falcon-H1's (``ScaledWeights``), else as given."""
    if config.model_type in MULTIMODAL:
        text = config.get_text_config(decoder=True)
        if weights is not None:
            prefix = next((p for p in MULTIMODAL[config.model_type] if p + "embed_tokens.weight" in weights),
                          MULTIMODAL[config.model_type][0])
            head = next((h for h in ("language_model.lm_head.weight", "lm_head.weight") if h in weights), "")
            cross = getattr(text, "cross_attention_layers", None) or ()
            weights = TextWeights(weights, prefix, head, [i for i in range(text.num_hidden_layers) if i not in cross]
                                  if cross else None)
        config = text
    if config.model_type == "mllama_text_model" and config.cross_attention_layers:
        # Llama 3.2 Vision's text model on text alone: its self-attention layers, the cross-attention layers between
        # them skipped (as transformers' model skips them without an image); its embedding 8 rows wider than its head
        config = copy.deepcopy(config)
        config.num_hidden_layers -= len(config.cross_attention_layers)
        config.cross_attention_layers = []
    if config.model_type in LLAMA_FIELDS:
        config = llama_fields(config)
    if config.model_type in GEMMA_N:
        config = per_layer_fields(config)
    if config.model_type == "mimo_v2_flash" and not hasattr(config, "layer_heads"):  # (its windowed layers' twice as
        # many key/value heads: ``kv_places``)
        config = copy.deepcopy(config)
        kv = config.num_key_value_heads
        config.layer_heads = [(2 * kv if t == "sliding_attention" else kv, config.head_dim) for t in config.layer_types]
    if config.model_type == "minimax" and getattr(config, "rotary_dim", None) and \
            "partial_rotary_factor" not in (config.rope_parameters or {}):
        # MiniMax-Text-01's and MiniMax-M1's rope on the first rotary_dim of each head (64 of 128), as their own code
        # and vLLM's apply it; transformers 5.24's MiniMax leaves the field out and rotates whole heads (its fix for
        # MiniMax-M2, which names the same field, maps it to partial_rotary_factor, as here)
        config = copy.deepcopy(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        config.rope_parameters = dict(config.rope_parameters or {}, partial_rotary_factor=config.rotary_dim / head_dim)
    if config.model_type in RenamedWeights.RENAMES and weights is not None:
        return config, RenamedWeights(weights, config)
    if config.model_type == "falcon_h1" and weights is not None:
        return config, ScaledWeights(weights, config)
    return config, weights


def per_layer_fields(config):
    """Gemma 4's config, whose fields per layer (``per_layer_config``: its full-attention layers'
    wider heads, fewer key/value heads) its global fields refuse to give: a copy whose global
    fields are its sliding layers' (the first layer's), with ``layer_heads``, each layer's
    ``(key/value heads, head dim)`` (idempotent); Gemma 3n's (one shape), the same field for ``kv_places``."""
    if hasattr(config, "layer_heads"):
        return config
    n = config.num_hidden_layers
    heads = [(c.num_key_value_heads, c.head_dim) for c in (config.per_layer_config[i] for i in range(n))] \
        if hasattr(config, "per_layer_config") else [(config.num_key_value_heads, config.head_dim)] * n
    config = copy.deepcopy(config)
    config.__dict__.pop("_heterogeneity_spec", None)  # (a plain config: its global fields readable)
    config.num_key_value_heads, config.head_dim = heads[0]
    config.layer_heads = heads
    return config


LLAMA_FIELDS = ("gptj", "falcon", "gpt2", "opt", "gpt_bigcode", "bloom", "mpt", "gpt_neo", "codegen",
                "dbrx")  # (``llama_fields``)


def llama_fields(config):
    """A copy of GPT-J's (CodeGen's), GPT-2's, GPT-Neo's, GPT-BigCode's, OPT's, Falcon's, BLOOM's, MPT's or DBRX's
    config with the fields the runtime reads under Llama's names: the MLP's width (``n_inner`` or 4 x hidden,
    ``ffn_dim``, ``ffn_hidden_size``, BLOOM's 4 x hidden, MPT's ``expansion_ratio`` x hidden) and
    activation, the key and value heads (Falcon's: ``num_kv_heads`` in its new decoder
    architecture; 1 multi-query, Falcon's and GPT-BigCode's; else every head's), GPT-J's
    ``rotary_dim`` as a partial rotary factor, MPT's ``max_seq_len`` as its context; DBRX's from its
    ``attn_config`` and ``ffn_config``."""
    config = copy.deepcopy(config)
    if config.model_type in ("bloom", "mpt"):
        config.intermediate_size = config.hidden_size * (config.expansion_ratio if config.model_type == "mpt" else 4)
        config.hidden_act = "bloom_gelu" if config.model_type == "bloom" else "gelu"
        config.num_key_value_heads = config.num_attention_heads
        if config.model_type == "mpt":
            config.max_position_embeddings = config.max_seq_len
    if config.model_type in ("gptj", "gpt2", "opt", "gpt_bigcode", "gpt_neo", "codegen"):
        config.intermediate_size = config.ffn_dim if config.model_type == "opt" else \
            (config.intermediate_size if config.model_type == "gpt_neo" else config.n_inner) or 4 * config.hidden_size
        config.hidden_act = config.activation_function
        config.num_key_value_heads = 1 if getattr(config, "multi_query", False) else config.num_attention_heads
    if config.model_type in ("gptj", "codegen"):
        head_dim = config.hidden_size // config.num_attention_heads
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": (config.rotary_dim or head_dim) / head_dim}
    if config.model_type == "dbrx":  # (its attention's and experts' fields in their own configs)
        ffn = config.ffn_config
        config.num_key_value_heads, config.clip_qkv = config.attn_config.kv_n_heads, config.attn_config.clip_qkv
        config.intermediate_size, config.hidden_act = ffn.ffn_hidden_size, ffn.ffn_act_fn.get("name", "silu")
        config.num_local_experts, config.num_experts_per_tok = ffn.moe_num_experts, ffn.moe_top_k
        config.moe_normalize_expert_weights = ffn.moe_normalize_expert_weights
        theta = getattr(config.attn_config, "rope_theta", None)  # (its checkpoints' rope base, 500000, which
        if theta:  # transformers 5.24's model leaves for rope_parameters' default; vLLM's reads it)
            config.rope_parameters = dict(rope_types(config)[None], rope_theta=theta)
    if config.model_type == "falcon":
        config.intermediate_size = config.ffn_hidden_size
        config.hidden_act = config.activation
        config.num_key_value_heads = config.num_kv_heads if config.new_decoder_architecture else \
            1 if config.multi_query else config.num_attention_heads
    return config


@dataclass(frozen=True)
class Temperature:
    """Llama 4's query temperature: queries scaled by ``1 + beta log(1 + floor((position +
    offset) / span))``, 1 within the first span. Llama 4's own (``attn_temperature_tuning``:
    ``attn_scale``, ``floor_scale``, offset 1) on its layers without rope alone (``nope_only``),
    the product in float32 then cast (``in_float``); Ministral 3's and Mistral 4's
    (``llama_4_scaling_beta``, ``original_max_position_embeddings``) on every layer, the factor
    cast to the model's dtype first."""

    beta: float
    span: int
    offset: int = 0
    nope_only: bool = False
    in_float: bool = False

    def factor(self, pos: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, 1]`` float32 at positions ``pos [B, T]``."""
        return (1 + self.beta * torch.log1p(torch.floor((pos + self.offset) / self.span)))[:, None, :, None]

    def scale(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Queries ``q [B, H, T, D]`` at positions ``pos [B, T]``, scaled."""
        return (q * self.factor(pos)).to(q.dtype) if self.in_float else q * self.factor(pos).to(q.dtype)


@dataclass(frozen=True)
class Alibi:
    """ALiBi's position biases, in place of rope (BLOOM's, MPT's, Falcon-RW's): head h's score of
    a key gains ``scale * slopes[h] * (the key's position)``. MPT's transformers model adds
    ``slope * (position - the last key's)`` instead: a shift along each query's row, which its
    softmax does not see. ``scale``: Falcon's scores and biases are scaled together (``head_dim
    ** -0.5``), BLOOM's and MPT's biases are not."""

    slopes: tuple[float, ...]
    scale: float = 1.0

    @classmethod
    def of(cls, config) -> "Alibi | None":
        heads = config.num_attention_heads
        if config.model_type == "mpt":  # its own slopes (``alibi_bias_max`` 8, as transformers' model builds them)
            n = 2 ** math.ceil(math.log2(heads))
            slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1).float() * (8 / n))
            if n != heads:
                slopes = torch.cat([slopes[1::2], slopes[::2]])[:heads]
            return cls(tuple(slopes.tolist()))
        if config.model_type == "bloom" or config.model_type == "falcon" and config.alibi:
            n = 2 ** math.floor(math.log2(heads))  # powers of the base, then odd powers of the next one's
            slopes = torch.pow(torch.tensor(2 ** -(2 ** -(math.log2(n) - 3))), torch.arange(1, n + 1))
            if n != heads:
                extra = torch.pow(torch.tensor(2 ** -(2 ** -(math.log2(2 * n) - 3))),
                                  torch.arange(1, 1 + 2 * min(n, heads - n), 2))
                slopes = torch.cat([slopes, extra])
            if config.model_type == "bloom":
                return cls(tuple(slopes.tolist()))
            head_dim = config.hidden_size // heads  # (Falcon's slopes rounded to bfloat16, as its model has them)
            return cls(tuple(slopes.bfloat16().float().tolist()), scale=head_dim ** -0.5)
        return None

    def bias(self, mask: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The attention bias ``[B, heads, T, S]`` in ``dtype`` of ``mask [B, T, S]`` (bool) and
        the keys' positions ``key_pos [B, T, S]``: -inf where a key is not seen."""
        slopes = torch.tensor(self.slopes, device=mask.device)[None, :, None, None]  # [1, heads, 1, 1]
        bias = self.scale * slopes * key_pos[:, None].float()
        return bias.masked_fill(~mask[:, None], float("-inf")).to(dtype)


def query_temperature(config) -> Temperature | None:
    """Ministral 3's and Mistral 4's query temperature (from their rope parameters), Llama 4's
    (from its own fields); None without one."""
    if config.model_type == "llama4_text":
        return Temperature(config.attn_scale, config.floor_scale, offset=1, nope_only=True, in_float=True) \
            if config.attn_temperature_tuning else None
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    return Temperature(beta, params["original_max_position_embeddings"]) if beta else None


@dataclass(frozen=True)
class Family:
    """Where a model's layers depart from Llama's (all as transformers computes them).
    ``offset_norms``: norms scale by ``1 + weight``, in float32 (the weights are kept so; Gemma's,
    and Qwen3-Next's and Qwen3.5's but for the DeltaNet output's norm; a layer norm's in the model's
    dtype: Nemotron's);
    ``embed_scale``: the embeddings' factor (Gemma's sqrt(hidden size) rounded to the model's
    dtype, Granite's ``embedding_multiplier``); ``attn_scale``: queries' scale (Gemma's
    ``query_pre_attn_scalar ** -0.5``, Granite's ``attention_multiplier``; None:
    ``head_dim ** -0.5``); ``residual_scale``: what attention's and the MLP's outputs are
    scaled by before the residual sum (Granite's, MiniCPM3's); ``logits_divisor``: Granite's
    ``logits_scaling``; ``hidden_divisor``: the last hidden state's, before the output layer
    (MiniCPM3's ``hidden_size / dim_model_base``); ``logits_scale``: the logits' factor (Cohere's ``logit_scale``, Falcon-H1's
    ``lm_head_multiplier``); ``attn_softcap`` / ``final_softcap``: ``cap * tanh(x / cap)`` on
    attention scores (Gemma 2's) / the logits (Gemma 2's, Gemma 3's where set);
    ``activation``: the MLP's gate (``ACTIVATIONS``); ``interleaved_rope``: rotary pairs are
    neighbouring dimensions, not halves (GLM-4's; DeepSeek-V2's, and V3's and GLM-4.7-Flash's
    where ``rope_interleave``: transformers moves their rotated halves apart afterwards, the
    same move in queries and keys, so the scores are the same); ``float_norms``: the norm's product in
    float32, then cast (GPT-OSS's, OLMo 2's, as Gemma's without the 1 +; its weights as the model's
    dtype holds them, but for a float16 model, which transformers keeps them float32 for);
    ``rope_math``: queries and keys rotated in the model's dtype ("model"), in float32 then cast
    ("float": OLMo 2's, ERNIE 4.5's), or so by a table rounded to the model's dtype ("float_math":
    Cohere's); ``layer_norm``: the norms are layer norms (``ops.LayerNorm``), in the model's
    dtype ("model": StarCoder2's, Phi's, GPT-NeoX's, StableLM's), float32 ("float": Cohere's) or float32
    without weights ("plain": OLMo's, whose checkpoints hold none); ``parallel``: attention and the
    MLP read the layer's input, normed once (Cohere's, Phi's) or each by its own norm (GPT-NeoX's),
    and both outputs join the residual: ``(h + attention) + mlp`` ("residual": Cohere's, StableLM's)
    or ``h + (attention + mlp)`` ("outputs": Phi's, GPT-NeoX's), as each transformers model sums
    them (None: the MLP after attention); ``clip_qkv``: queries, keys and values clamped to
    ``[-clip, clip]`` after the q/k norms (OLMo's, OLMoE's);
    ``norm_after_rope``: the q/k norms after the rotation (HunYuan's), not before;
    ``query_temperature``: queries scaled by a factor of their position after the rotation
    (``Temperature``: Ministral 3's, Mistral 4's, Llama 4's); ``l2_qk_norm``: queries and keys
    normed without weights after the rotation, on the layers that rotate (Llama 4's ``use_qk_norm``);
    ``gated_mlp``: the MLP is ``down(act(gate) * up)`` (else ``down(act(up))``: Nemotron-H's, Arcee's);
    ``learned_positions``: positions are a learned table's rows added to the embeddings, no rope
    (GPT-2's; the offset of a position's row: 0; OPT's: 2); ``scale_queries``: the queries
    scaled by ``head_dim ** -0.5`` as they come out of their product, the scores then not
    (OPT's); ``alibi``: position biases on the scores, no rope (``Alibi``: BLOOM's, MPT's, Falcon-RW's);
    ``weightless_norms``: RMS norms without weights, the embeddings normed too (NanoChat's);
    ``rope_reversed``: rotary pairs turned the other way (NanoChat's ``cat(x2, -x1)``: sin negated);
    ``experts_mean``: the routed experts' output and the shared ones' averaged, not summed (Cohere2-MoE's
    ``shared_expert_combination_strategy`` "average"); ``value_scale``: the values' factor as they come
    out of their product (MiMo-V2-Flash's ``attention_value_scale``)."""

    offset_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    residual_scale: float | None = None
    logits_divisor: float | None = None
    hidden_divisor: float | None = None
    logits_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    activation: str = "silu"
    interleaved_rope: bool = False
    float_norms: bool = False
    rope_math: str = "model"
    layer_norm: str | None = None
    parallel: str | None = None
    clip_qkv: float | None = None
    norm_after_rope: bool = False
    query_temperature: Temperature | None = None
    l2_qk_norm: bool = False
    gated_mlp: bool = True
    learned_positions: int | None = None
    scale_queries: bool = False
    alibi: Alibi | None = None
    weightless_norms: bool = False
    rope_reversed: bool = False
    experts_mean: bool = False
    value_scale: float | None = None

    @classmethod
    def of(cls, config, dtype: torch.dtype = torch.float32) -> "Family":
        gemma23 = config.model_type in ("gemma2", "gemma3_text", "vaultgemma")  # the fields only their models read
        act = (config.hidden_activation if gemma23 else None) or getattr(config, "hidden_act", "silu")
        if config.model_type in GRANITES:  # (HyperCLOVA X's logits times logits_scaling, not over it)
            clova = config.model_type == "hyperclovax"
            return cls(embed_scale=config.embedding_multiplier, attn_scale=config.attention_multiplier,
                       residual_scale=config.residual_multiplier, activation=act,
                       **{"logits_scale" if clova else "logits_divisor": config.logits_scaling})
        latent = Latent.of(config)
        if latent is not None and config.model_type == "minicpm3":  # muP's multipliers, as Granite's
            return cls(activation=act, attn_scale=latent.scale(config), embed_scale=config.scale_emb,
                       residual_scale=config.scale_depth / math.sqrt(config.num_hidden_layers),
                       hidden_divisor=config.logits_scaling)
        if latent is not None:  # (Mistral 4's queries scaled past its original context, as Ministral 3's)
            return cls(activation=act, attn_scale=latent.scale(config),
                       interleaved_rope=config.model_type == "deepseek_v2" or config.model_type != "hy_v4" and
                       bool(getattr(config, "rope_interleave", True)),  # (DeepSeek-V3.2's, GLM-5's: no field, always;
                       # Hy4's: halves)
                       query_temperature=query_temperature(config) if config.model_type == "mistral4" else None)
        if config.model_type in HYBRID_ARCHS:
            return cls(activation=act, offset_norms=True)
        if config.model_type == "nemotron_h":
            return cls(activation=config.mlp_hidden_act, gated_mlp=False)
        if config.model_type == "phimoe":  # layer norms (with biases) at rms_norm_eps
            return cls(activation=act, layer_norm="model")
        if config.model_type in ("arcee", "apertus", "apertus1p5_text"):  # their MLPs not gated: relu2(up), xielu(up)
            return cls(activation=act, gated_mlp=False)
        if config.model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
            return cls(activation=act, norm_after_rope=True)
        if config.model_type == "afmoe":  # norms' products in float32; muP: the embeddings times sqrt(hidden)
            return cls(activation=act, float_norms=True,
                       embed_scale=config.hidden_size ** 0.5 if config.mup_enabled else None)
        if config.model_type == "nanochat":  # relu2(up) not gated, q/k norms after the rotation, the logits capped
            return cls(activation=act, gated_mlp=False, l2_qk_norm=True, weightless_norms=True, rope_reversed=True,
                       final_softcap=config.final_logit_softcapping)
        if config.model_type == "dbrx":  # layer norms without biases, queries, keys and values clamped
            return cls(activation=act, layer_norm="model", clip_qkv=config.clip_qkv)
        if config.model_type in ("jais2", "persimmon"):  # layer norms (Persimmon's q/k ones too), relu2(up) not gated
            return cls(activation=act, layer_norm="model", gated_mlp=False)
        if config.model_type in ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"):  # (Cohere2-MoE's: RMS
            # norms where rms_norm_eps; Cohere Compass's rope by halves, as Llama's)
            rms = config.model_type == "cohere2_moe" and config.rms_norm_eps is not None
            compass = config.model_type == "cohere_compass_text"
            return cls(activation=act, interleaved_rope=not compass, rope_math="model" if compass else "float_math",
                       layer_norm=None if rms else "float",
                       parallel="residual", logits_scale=config.logit_scale,
                       experts_mean=getattr(config, "num_shared_experts", 0) > 0
                       and config.shared_expert_combination_strategy == "average")
        if config.model_type in ("phi", "gpt_neox", "stablelm", "gptj", "falcon", "codegen"):
            parallel = getattr(config, "use_parallel_residual", True)  # (GPT-NeoX's, StableLM's where they say so)
            if config.model_type == "falcon":
                parallel = config.parallel_attn or config.new_decoder_architecture
            return cls(activation=act, gated_mlp=config.model_type == "stablelm", layer_norm="model",
                       interleaved_rope=config.model_type in ("gptj", "codegen"), alibi=Alibi.of(config),
                       rope_math="float" if config.model_type == "codegen" else "model",
                       parallel=("residual" if config.model_type == "stablelm" else "outputs") if parallel else None)
        if config.model_type in ("bloom", "mpt"):  # layer norms (MPT's without biases), MLPs not gated
            clip = config.attn_config.clip_qkv if config.model_type == "mpt" else None
            scale = config.attn_config.softmax_scale if config.model_type == "mpt" else None
            return cls(activation=act, gated_mlp=False, layer_norm="model", alibi=Alibi.of(config), clip_qkv=clip,
                       attn_scale=scale)
        if config.model_type in ("gpt2", "gpt_bigcode", "gpt_neo"):  # (scale_attn_weights False: scores not scaled;
            # GPT-Neo's never are)
            return cls(activation=act, gated_mlp=False, layer_norm="model", learned_positions=0,
                       attn_scale=None if getattr(config, "scale_attn_weights", False) else 1.0)
        if config.model_type == "nemotron":  # layer norms of 1 + weight, relu2(up) not gated
            return cls(activation=act, gated_mlp=False, layer_norm="model", offset_norms=True)
        if config.model_type == "opt":
            return cls(activation=act, gated_mlp=False, layer_norm="model", learned_positions=2, scale_queries=True,
                       attn_scale=1.0)
        if config.model_type == "olmo":
            return cls(activation=act, layer_norm="plain", clip_qkv=config.clip_qkv, rope_math="float")
        if config.model_type == "starcoder2":
            return cls(activation=act, gated_mlp=False, layer_norm="model")
        if config.model_type == "ministral3" and query_temperature(config):
            return cls(activation=act, query_temperature=query_temperature(config))
        if config.model_type == "llama4_text":  # rotary pairs interleaved, rotated in float32
            return cls(activation=act, interleaved_rope=True, rope_math="float", l2_qk_norm=config.use_qk_norm,
                       query_temperature=query_temperature(config))
        if config.model_type in GEMMA_N:  # Gemma's embeddings; norms of the weight (not 1 +) in float32;
            # scores not scaled (q/k norms instead)
            return cls(float_norms=True, embed_scale=torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item(),
                       attn_scale=1.0, final_softcap=config.final_logit_softcapping,
                       activation=config.hidden_activation)
        if config.model_type == "mimo_v2_flash":
            return cls(activation=act, value_scale=config.attention_value_scale)
        if config.model_type == "recurrent_gemma":  # Gemma's norms; its embeddings scaled by sqrt(hidden) as bfloat16
            # holds it, whatever the dtype; logits capped
            return cls(offset_norms=True, embed_scale=torch.tensor(config.hidden_size ** 0.5, dtype=torch.bfloat16).item(),
                       final_softcap=config.logits_soft_cap, activation=config.hidden_activation)
        if config.model_type == "zamba2":  # its shared blocks' scores scaled by (head_dim / 2) ** -0.5
            return cls(activation=act, attn_scale=(config.attention_head_dim / 2) ** -0.5)
        if config.model_type == "falcon_h1":  # (its other multipliers: in the weights, ``ScaledWeights``)
            return cls(activation=act, embed_scale=config.embedding_multiplier,
                       logits_scale=config.lm_head_multiplier)
        if config.model_type not in GEMMAS:
            return cls(activation=act,
                       float_norms=config.model_type in ("gpt_oss", "olmo2", "olmo3", "helium", "flex_olmo", "flint",
                                                         "olmo_hybrid", "lara_mini"),
                       clip_qkv=getattr(config, "clip_qkv", None) if config.model_type == "olmoe" else None,
                       interleaved_rope=config.model_type in ("glm", "glm4", "ernie4_5", "ernie4_5_moe", "helium")
                       + GLM_VL_TEXT,
                       rope_math="float" if config.model_type in ("olmo2", "olmo3", "ernie4_5", "ernie4_5_moe",
                                                                   "flex_olmo", "lfm3", "olmo_hybrid")
                       else "model")
        return cls(offset_norms=True, embed_scale=torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item(),
                   attn_scale=config.query_pre_attn_scalar ** -0.5 if config.model_type != "gemma" else None,
                   # Gemma 3's config has the field too, but transformers' model never reads it
                   attn_softcap=config.attn_logit_softcapping if config.model_type in ("gemma2", "vaultgemma")
                   else None,
                   final_softcap=config.final_logit_softcapping if gemma23 else None, activation=act)


LATENT_NORM_EPS = 1e-6  # the latents' norms (q_a_layernorm, kv_a_layernorm), built without the config's eps


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's widths (DeepSeek-V2 and V3's, GLM-4.7-Flash's). A token's
    keys and values are, per head h, ``K_h = W_UK[h] c`` beside the rotated ``k_rope`` that all
    heads share, and ``V_h = W_UV[h] c``, from one normed latent ``c`` (``rank`` wide). The
    cache keeps that row alone, ``[c, k_rope]``: one "head" of ``rank + rope``. Attention runs
    on it as multi-query attention (every head's queries side by side as one head's, so that
    the rows are read once, not copied per head) with the weights absorbed (SGLang's and vLLM's MLA
    decoding): a head's query becomes ``[W_UK[h]^T q_nope, q_rope]``, so that its dot product
    with a row is the score of the full key; the rows' latents are the values; and the
    attended latent goes through ``W_UV[h]``. A long chunk of new tokens instead expands the
    rows to every head's keys and values and attends as multi-head attention (``expands``:
    SGLang's prefill). ``nope``: a head's query width that meets the latent; ``value``: a
    head's value width; ``q_rank``: the query's own low-rank step (None: one projection)."""

    rank: int
    rope: int
    nope: int
    value: int
    q_rank: int | None

    @classmethod
    def of(cls, config) -> "Latent | None":
        if getattr(config, "kv_lora_rank", None) is None:
            return None
        return cls(config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim,
                   config.q_lora_rank)

    def expands(self, tokens: int) -> bool:
        """Whether ``tokens`` new tokens per row attend through expanded keys and values: the
        expansion costs ``rank (nope + value)`` per key and head, the absorbed form ``2 rank -
        nope - value`` more than the expanded per key, head and token (171 tokens for
        DeepSeek's widths)."""
        return tokens * (2 * self.rank - self.nope - self.value) > self.rank * (self.nope + self.value)

    def scale(self, config) -> float:
        """The scores' scale, as transformers': the full key's width ``** -0.5``, under yarn
        times its ``mscale_all_dim`` factor squared."""
        scale = (self.nope + self.rope) ** -0.5
        params = rope_types(config)[None]
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            factor = params["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale


# latent attention under DeepSeek Sparse Attention (``SparseIndex``)
DSA_ARCHS = ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4")
INDEX_NORM_EPS = 1e-6  # the indexer's key norm (a layer norm, built without the config's eps)


@dataclass(frozen=True)
class SparseIndex:
    """DeepSeek Sparse Attention (DeepSeek-V3.2's, GLM-5's, A.X K2's): beside latent attention, an indexer
    of ``heads`` small heads ``dim`` wide keeps for each new token the ``topk`` keys it scores
    best, and attention sees those alone. A token's index key is ``LayerNorm(wk(x))`` (one per
    token, kept in the cache's ``index`` rows); a query's heads ``wq_b(q_low)`` (the query's normed
    low-rank step); the first ``rope`` of each one's dimensions rotated (rotary pairs neighbours
    with ``interleaved``: GLM-5's; halves: DeepSeek-V3.2's). A key's score is ``sum_h w_h
    relu(q_h . k / sqrt(dim))`` in float32, ``w = weights_proj(x) / sqrt(heads)``; with no more
    keys than ``topk`` it keeps them all. ``owns``: the layers with an indexer of their own; the
    others (GLM-5's "shared") keep the last such layer's choice. As transformers' models compute
    it (the released kernels' FP8 scores and Hadamard rotation left out, as there). Hy4's
    (``layout`` "last") rotates the last ``rope`` dimensions by halves, its key's norm (at
    ``norm_eps``) and heads' weights in float32 (``in_float``)."""

    heads: int
    dim: int
    topk: int
    rope: int
    layout: str  # the rotated dimensions: "halves" (the first, DeepSeek-V3.2's), "pairs" (GLM-5's), "last" (Hy4's)
    owns: tuple[bool, ...]
    norm_eps: float = 1e-6  # (transformers' layer norm's default; Hy4's rms_norm_eps)
    in_float: bool = False

    @classmethod
    def of(cls, config) -> "SparseIndex | None":
        if config.model_type not in DSA_ARCHS:
            return None
        types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        hy = config.model_type == "hy_v4"
        return cls(config.index_n_heads, config.index_head_dim, config.index_topk, config.qk_rope_head_dim,
                   "pairs" if config.model_type == "glm_moe_dsa" else "last" if hy else "halves",
                   tuple(t == "full" for t in types), config.rms_norm_eps if hy else INDEX_NORM_EPS, in_float=hy)


class KVCache:
    """Per-layer K/V ``[slots, kv_heads, capacity, head_dim]``, grown on demand: rows doubling,
    but past ``max_rows`` (the context window) plus a forward's padding only as far as a
    forward needs (a verify forward at the window's end: its drafts, a tree's nodes); slots
    only up to the highest one used (the engine takes a freed slot that keeps no prompt
    before an untouched one, and untouched ones lowest first), so one long request holds one
    slot's rows, not ``num_slots``' (8x the memory). A slot that keeps a finished prompt for
    prefix reuse is taken only for a matching prefix or once no other is free, so requests
    with distinct prompts one after another do grow the slots up to ``num_slots``.
    ``keys_only``: V is None, the values are the keys' first dimensions (``Latent``'s rows).
    ``states``: the recurrent layers' (``recurrent.RecurrentStates``), which rewind with it.
    ``tracks_ids``: a model whose rows change with the sequence's length (``TorchLlama.switch``):
    each slot's token ids (``ids``), which factors its rows took (``long``) and the length its
    prompt reaches (``reach``, ``expect``), so that its rows can be computed again.
    ``second``: ``(layers, kv_heads, head_dim)`` of layers whose K/V have another shape, kept in
    ``k2`` / ``v2`` (Gemma 4's full-attention layers: wider heads, fewer of them); ``v_dim``: the
    values' width where it is not the keys' (MiMo-V2-Flash's); ``index``: ``(layers, dim)`` of
    DeepSeek Sparse Attention's index keys (``SparseIndex``), one row per token in ``index``."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, capacity: int = 256, max_rows: int | None = None,
                 keys_only: bool = False, states: RecurrentStates | None = None, tracks_ids: bool = False,
                 second: tuple[int, int, int] | None = None, v_dim: int | None = None,
                 index: tuple[int, int] | None = None):
        self.limit = None if max_rows is None else max_rows + GRAPH_MAX_TOKENS
        capacity = min(capacity, self.limit or capacity)
        self.k = torch.zeros(num_layers, 1, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = None if keys_only else \
            torch.zeros(num_layers, 1, kv_heads, capacity, v_dim or head_dim, device=device, dtype=dtype)
        self.k2 = self.v2 = None
        if second is not None:
            layers, heads, dim = second
            self.k2, self.v2 = (torch.zeros(layers, 1, heads, capacity, width, device=device, dtype=dtype)
                                for width in (dim, v_dim or dim))
        self.index = None if index is None else torch.zeros(index[0], 1, 1, capacity, index[1], device=device,
                                                            dtype=dtype)
        self.lengths = [0] * num_slots
        self.adapters = [0] * num_slots  # each slot's LoRA adapter's id (0: none; ``TorchLlama.lora``)
        self.states = states
        self.ids: list[list[int]] | None = [[] for _ in range(num_slots)] if tracks_ids else None
        self.long, self.reach = [False] * num_slots, [0] * num_slots

    @property
    def buffers(self) -> tuple[str, ...]:
        return tuple(n for n in ("k", "v", "k2", "v2", "index") if getattr(self, n) is not None)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, capacity: int, slots: int = 1) -> None:
        """Room for ``capacity`` rows in each of the first ``slots`` slots."""
        have_slots, have = self.k.shape[1], self.capacity
        if capacity <= have and slots <= have_slots:
            return
        new_cap = have if capacity <= have else max(capacity, min(2 * have, self.limit or 2 * have))
        for name in self.buffers:
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], max(slots, have_slots), old.shape[2], new_cap, old.shape[4])
            new[:, :have_slots, :, :have] = old
            setattr(self, name, new)

    def save_prefix(self, slot: int) -> None:
        """Keep what going back to ``slot``'s length later needs (a prompt chunk's end, for
        prefix reuse): its recurrent states (KV rows stay valid anyway)."""
        if self.states is not None:
            self.states.save(slot, self.lengths[slot])

    def holds(self, slot: int, length: int) -> bool:
        """Whether ``slot`` can go back to (or be copied at) ``length``: always, but for recurrent
        states, kept for the last tokens and a few prompt chunks' ends."""
        return self.states is None or self.states.holds(slot, length, self.lengths[slot])

    def rewind(self, slot: int, length: int, idle: bool = False) -> None:
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        if self.states is not None:
            self.states.rewind(slot, length, self.lengths[slot])
        if self.ids is not None:
            del self.ids[slot][length:]
        self.lengths[slot] = length

    def expect(self, slot: int, length: int) -> None:
        """``slot``'s sequence (a new request's) will reach ``length`` tokens: its prompt's
        rows take the factors of that length from the start (``TorchLlama.switch``), not the
        short ones until a chunk passes the switch and all of them again."""
        self.reach[slot] = length

    @torch.inference_mode()
    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` rows (and nothing after them); the rows
        ``dst`` has are the same as ``src``'s, so only the ones after them are copied (recurrent
        states: ``src``'s at ``length``, which it must hold, ``holds``)."""
        assert self.lengths[dst] <= length <= self.lengths[src], (self.lengths[dst], length, self.lengths[src])
        if self.states is not None:
            self.states.copy(src, dst, length, self.lengths[src])
        self.ensure(length, dst + 1)
        start = self.lengths[dst]
        if self.ids is not None:  # rows of the other factors differ: all of them
            start = 0 if self.long[dst] != self.long[src] else start
            self.ids[dst], self.long[dst] = self.ids[src][:length], self.long[src]
        for name in self.buffers:
            t = getattr(self, name)
            t[:, dst, :, start:length] = t[:, src, :, start:length]
        self.lengths[dst] = length

    @torch.inference_mode()  # the buffers are inference tensors once ensure() ran in a forward
    def keep(self, slot: int, start: int, rows: Sequence[int]) -> None:
        """Keep only KV rows ``start + rows[i]`` (increasing), moved to ``start + i``: the
        accepted path of a token tree becomes consecutive, the rest is rewound."""
        assert list(rows) == sorted(rows) and start + rows[-1] < self.lengths[slot]
        if self.states is not None:
            self.states.keep(slot, start, list(rows))
        if self.ids is not None:
            self.ids[slot][start:] = [self.ids[slot][start + r] for r in rows]
        src = torch.tensor([start + r for r in rows], device=self.k.device)
        dst = torch.arange(start, start + len(rows), device=self.k.device)
        for name in self.buffers:
            t = getattr(self, name)
            t[:, slot, :, dst] = t[:, slot, :, src]
        self.lengths[slot] = start + len(rows)


@dataclass
class Batch:
    """One forward's inputs on the device (a CUDA graph's are fixed buffers of these shapes)."""

    ids: torch.Tensor  # [B, T] token ids (padding rows: 0)
    pos: torch.Tensor  # [B, T] rotary positions
    write: torch.Tensor  # [B, T] cache index of each new token
    slots: torch.Tensor  # [B] cache slot of each row
    mask: torch.Tensor  # [B, 1, T, S] bool: new token i sees key j
    sliding: torch.Tensor | None = None  # [B, 1, T, S] the mask within the sliding window (its layers')
    # an eager forward's rows as runs of consecutive slots, ``(first row, end row, first slot)``
    # (a graph's slots vary between replays): each layer then attends over views of the
    # cache, one per run, not over a gathered copy of it
    runs: tuple[tuple[int, int, int], ...] | None = None
    hidden: torch.Tensor | None = None  # [B, T, hidden] an EAGLE head's hidden inputs (``eagle.EagleHead``)
    long: torch.Tensor | None = None  # [B] bool: rows whose rope takes its long factors (``TorchLlama.switch``)
    states: StatePlan | None = None  # where the recurrent layers' states go (``recurrent``)
    selected: torch.Tensor | None = None  # [B, 1, T, S] ``mask`` less the keys DeepSeek Sparse Attention's last
    # indexer dropped (``TorchLlama._select``; None: none dropped)


RECOMPUTE_CHUNK = 512  # rows per forward where a slot's rows are computed again (``TorchLlama.switch``)
RUNS_FROM_KEYS = 256  # a batch in several runs of slots attends run by run from this many keys


def slot_runs(slots: list[int], keys: int) -> tuple[tuple[int, int, int], ...] | None:
    """``slots`` as runs of consecutive slots ``(first row, end row, first slot)``, for
    attending over views of the cache: one run, or several once the keys are many enough
    that copying them costs more than an attention call per run; else None (a gather)."""
    runs, b0 = [], 0
    for b in range(1, len(slots) + 1):
        if b == len(slots) or slots[b] != slots[b - 1] + 1:
            runs.append((b0, b, slots[b0]))
            b0 = b
    return tuple(runs) if len(runs) == 1 or keys >= RUNS_FROM_KEYS else None



# tables that depend on the position alone (proportional: Gemma 4's, a part of each head's frequencies, the rest 0)
POSITIONAL_ROPE = ("default", "linear", "yarn", "llama3", "proportional")


def ntk_alpha(params: dict) -> float | None:
    """HunYuan's rope: "dynamic" with a fixed ``alpha``, which only stretches the base (``base
    alpha ** (d / (d - 2))``: a table of the position alone, as transformers computes it)."""
    return params.get("alpha") if params.get("rope_type") == "dynamic" else None


def rope_types(config) -> dict[str | None, dict]:
    """The rope parameters per layer type (Gemma 3's ``full_attention`` / ``sliding_attention``; a
    type whose are None has no rope: Cohere Compass's full layers), or ``{None: ...}`` for one set
    on every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()) and any(params.values()):
        return {t: p for t, p in params.items() if p is not None}
    return {None: params}


def longrope_switch(config) -> int | None:
    """Where transformers' longrope (Phi-3.5, Phi-4-mini) switches from its short factors to its
    long ones: it picks them for a whole forward, long when the forward goes past
    ``original_max_position_embeddings`` (per layer type too); None without longrope."""
    at = [p["original_max_position_embeddings"] for p in rope_types(config).values()
          if p.get("rope_type") == "longrope" and p.get("original_max_position_embeddings")]
    return min(at) if at else None


# models whose transformers model drops its cache where a sequence first goes past its longrope
# switch and computes it all again with the long factors (their ``prepare_inputs_for_generation``):
# every row's rope then follows the sequence's length, as ``TorchLlama.switch`` and ``HFRuntime.recompute_at`` run it
RECOMPUTES_PAST_SWITCH = ("phi3", "phimoe", "phi4_multimodal")


def quant_config(config) -> dict:
    """``config``'s (a config object, or a ``config.json``'s dict) ``quantization_config`` as a
    dict (a multimodal checkpoint's, else its text config's; transformers' object's fields; its
    ``quant_method`` a string), {} without one."""
    def field(c, name: str):
        return c.get(name) if isinstance(c, dict) else getattr(c, name, None)

    qc = field(config, "quantization_config") or field(field(config, "text_config") or {}, "quantization_config")
    qc = {} if qc is None else dict(qc) if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") is not None:
        qc["quant_method"] = str(getattr(qc["quant_method"], "value", qc["quant_method"]))
    return qc


def quant_method(config) -> str | None:
    """The ``quant_method`` of ``config``'s ``quantization_config``, None without one."""
    return quant_config(config).get("quant_method")


def fp8_block(qc: dict | None) -> tuple[int, int] | None | bool:
    """Of a ``quantization_config`` (a dict): False where its weights are not FP8 the torch runtime
    dequantizes at load (``loading.dequantize_fp8``), else the blocks one scale covers (None: the
    scales' grid divides the weights exactly, one per row or one for the whole tensor):
    transformers' fine-grained ``fp8`` (``weight_block_size``), or ``compressed-tensors``' 8-bit
    float weights (``float-quantized``: vLLM's FP8-dynamic checkpoints; per tensor, channel or
    ``block_structure``)."""
    qc = qc or {}
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
        return tuple(block) if block else None
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") not in ("float-quantized", None):
        return False
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    if not weights or any((w.get("type"), w.get("num_bits")) != ("float", 8) for w in weights):
        return False
    blocks = {tuple(w["block_structure"]) for w in weights if w.get("strategy") == "block" and w.get("block_structure")}
    return blocks.pop() if len(blocks) == 1 else None if not blocks else False


def bitnet_form(qc: dict | None) -> str | None:
    """Of a ``quantization_config`` (a dict): how the torch runtime reads BitNet's ternary weights
    (``CheckpointReader``): ``"offline"``, packed four to a byte beside a ``weight_scale`` each
    (transformers' ``bitlinear``, as microsoft/bitnet-b1.58-2B-4T is released); ``"online"``, bf16
    masters quantized at load (``autobitlinear`` online, as its -bf16 release); None for any other
    (a norm inside each product, ``use_rms_norm``, or ``autobitlinear``'s offline form, which
    multiplies by its scale)."""
    qc = qc or {}
    if qc.get("quant_method") != "bitnet" or qc.get("use_rms_norm"):
        return None
    form = (qc.get("linear_class", "bitlinear"), qc.get("quantization_mode", "offline"))
    return {("bitlinear", "offline"): "offline", ("autobitlinear", "online"): "online"}.get(form)


def bitnet_projection(name: str) -> bool:
    """Whether ``name`` is the weight of one of a BitNet decoder layer's projections, which its quantization makes
    ternary (``CheckpointReader``, ``loading.DummyWeights``)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def unsupported(config) -> str | None:
    """Why the torch runtime cannot run ``config`` as transformers does (None: it can)."""
    qc = quant_config(config)
    method = qc.get("quant_method")
    config, _ = text_model(config)
    if config.model_type not in ARCHS:
        return f"the torch runtime supports {', '.join(ARCHS)}, not {config.model_type!r}"
    if method == "bitnet" and (config.model_type != "bitnet" or bitnet_form(qc) is None):
        return ("the torch runtime reads BitNet's ternary weights packed (bitlinear, offline) or as bf16 masters "
                "(autobitlinear, online), without use_rms_norm, in a BitNet model")
    if method is not None and fp8_block(qc) is False and (config.model_type, method) not in (
            ("gpt_oss", "mxfp4"), ("bitnet", "bitnet")):
        # GPTQ, AWQ, bitsandbytes, int4 compressed-tensors...: packed weights transformers' quantizers unpack (GPT-OSS's
        # MXFP4 experts and FP8 weights are dequantized at load: ``mxfp4``, ``loading.dequantize_fp8``)
        return f"the torch runtime reads unquantized, FP8, BitNet's and GPT-OSS's MXFP4 checkpoints, not {method!r} ones"
    act = Family.of(config).activation
    if act not in ACTIVATIONS and act not in TRAINED_ACTIVATIONS:
        known = ", ".join([*ACTIVATIONS, *TRAINED_ACTIVATIONS])
        return f"the torch runtime supports the {known} activations, not {act!r}"
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):  # (GPT-2's option; no released checkpoint sets it)
        return "the torch runtime does not scale attention by the inverse layer index"
    if config.model_type == "opt" and not (config.do_layer_norm_before and config.layer_norm_elementwise_affine
                                           and config.word_embed_proj_dim == config.hidden_size):  # (OPT-350M's)
        return ("the torch runtime runs OPT's norms before attention and the MLP, with weights, and no projections "
                "in and out")
    if config.model_type == "bloom" and config.apply_residual_connection_post_layernorm:  # (no released checkpoint's)
        return "the torch runtime adds BLOOM's residual before its norms, not after"
    if config.model_type == "dbrx" and config.moe_normalize_expert_weights not in (None, 1):
        return "the torch runtime renormalises DBRX's expert weights by their sum (moe_normalize_expert_weights 1)"
    if config.model_type == "hunyuan_v1_moe" and len({*(config.moe_topk if isinstance(config.moe_topk, list)
                                                        else [config.moe_topk])}) > 1:
        return "the torch runtime routes every layer to as many experts (one moe_topk)"
    if config.model_type in GEMMA_N and (len(set(config.layer_heads)) > 2 or
                                               (config.num_kv_shared_layers or 0) >= config.num_hidden_layers):
        return "the torch runtime runs Gemma 3n and 4 with heads of at most two shapes, and layers with keys of their own"
    if config.model_type == "mpt" and config.attn_config.qk_ln:  # (transformers' MPT leaves it out)
        return "the torch runtime does not run MPT's qk_ln"
    if getattr(config, "moe_latent_size", None):  # Nemotron-H's experts in a latent width
        return "the torch runtime runs experts in the model's width, not through moe_latent_size projections"
    if getattr(config, "use_bidirectional_attention", False) not in (False, None, "vision"):  # EmbeddingGemma's
        # encoder (Gemma 4's "vision": among image tokens alone, none in a text prompt)
        return "the torch runtime runs causal attention, not bidirectional"
    for params in rope_types(config).values():
        rope = params.get("rope_type", "default")
        if rope == "longrope" and config.model_type not in RECOMPUTES_PAST_SWITCH and \
                (longrope_switch(config) or 0) < (getattr(config, "max_position_embeddings", None) or 1 << 20):
            # its keys keep the factors of the forward that computed them, a prompt's whole: a chunked prompt differs
            return (f"the torch runtime runs longrope's switch where the model computes its cache again past it "
                    f"({', '.join(RECOMPUTES_PAST_SWITCH)}), not on {config.model_type!r}, whose keys keep the factors "
                    "of the forward that computed them (backend 'hf' runs transformers' own model)")
        if rope not in (*POSITIONAL_ROPE, "longrope") and not ntk_alpha(params):  # dynamic: rescaled by the length
            return (f"the torch runtime supports rope types {', '.join(POSITIONAL_ROPE)} and longrope, not {rope!r} "
                    "(backend 'hf' runs transformers' own model)")
        if params.get("partial_rotary_factor", 1.0) != 1.0 and config.model_type not in PARTIAL_ROTARY \
                and rope != "proportional":
            return f"the torch runtime rotates a part of each head for {', '.join(PARTIAL_ROTARY)} only"
    return None


def sliding_layers(config) -> tuple[int | None, list[bool]]:
    """``(window, which layers attend through it)``, as each architecture's transformers
    model reads its config: a query at position p sees keys past p - window. Mistral, Phi-3,
    Mixtral, Qwen3-MoE: every layer when ``sliding_window`` is set (Qwen3-MoE's config drops it
    unless ``use_sliding_window``); Qwen2 / Qwen3 / Qwen2-MoE: the layers ``layer_types``
    names ``sliding_attention``, none unless ``use_sliding_window``; Gemma 2 / 3, SmolLM3, GPT-OSS:
    those ``layer_types`` names (whatever ``use_sliding_window`` says); GPT-Neo: its "local" layers
    (``window_size``); MiniMax: its full-attention layers, where ``sliding_window`` is set; Llama, Gemma,
    Granite, GLM-4: none."""
    n, kind = config.num_hidden_layers, config.model_type
    if kind == "gpt_neo":  # its "local" layers
        return config.window_size, [t == "local" for t in config.attention_layers]
    window = getattr(config, "sliding_window", None)
    if kind in ("llama", "gemma", "granite", "glm", "glm4", *GLM_VL_TEXT) or not window or \
            (kind in ("qwen2", "qwen3", "qwen2_moe", *QWEN_VL_TEXT) and not getattr(config, "use_sliding_window", False)):
        return None, [False] * n
    types = None if kind in ("mistral", "phi3", "mixtral", "qwen3_moe") else getattr(config, "layer_types", None)
    sliding = [t == "sliding_attention" for t in types] if types else [True] * n
    if kind == "minimax":  # (its attention layers, where it has a window)
        sliding = [t == "full_attention" for t in types]
    return (window if any(sliding) else None), sliding


class CheckpointReader:
    """A checkpoint's tensors as the runtime holds them: copies on its device in its dtype
    (nothing may pin a memory-mapped file), norms as its ``Family`` keeps them, projections
    as ``Linear`` of its kind; BitNet's ternary projections (``ternary``: ``bitnet_form``) as
    ``TernaryWeight`` and ``Ternary``."""

    def __init__(self, weights, device: torch.device, dtype: torch.dtype, family: Family, linear: str,
                 multi_row: bool, quantization: dict | None = None):
        self.weights, self.device, self.dtype, self.family = weights, device, dtype, family
        self.kind, self.multi_row = linear, multi_row
        self.ternary = bitnet_form(quantization)
        self.unconverted = (quantization or {}).get("modules_to_not_convert")  # (masters left as they are)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str) -> torch.Tensor | TernaryWeight:
        if self.ternary is not None and self._is_ternary(name):
            return self._ternary_weight(name)
        return self.weights[name].to(device=self.device, dtype=self.dtype, copy=True)

    def _is_ternary(self, name: str) -> bool:
        """Whether ``name`` is a BitNet projection's weights: packed beside a scale (``offline``), or a
        decoder layer's projection of bf16 masters (``online``) that ``modules_to_not_convert`` does not
        name (as transformers' quantizer matches its patterns)."""
        from transformers.quantizers.quantizers_utils import should_convert_module

        if self.ternary == "offline":
            return name.endswith(".weight") and name + "_scale" in self.weights
        return bitnet_projection(name) and should_convert_module(name.removesuffix(".weight"), self.unconverted)

    def _ternary_weight(self, name: str) -> TernaryWeight:
        """Packed weights (unpacked by ``loading.Weights``) and their ``weight_scale``, which the product
        divides by; or masters quantized as transformers' ``AutoBitLinear`` does online: each weight
        times ``1 / mean |w|``, rounded and clamped to -1..1, that scale the divisor."""
        w = self.weights[name]  # [out, in]
        if self.ternary == "offline":
            return TernaryWeight(w.to(torch.int8), self.weights[name + "_scale"].float().reshape(-1).expand(w.shape[0]))
        w = w.float()
        scale = 1.0 / w.abs().mean().clamp(min=1e-5)
        return TernaryWeight((w * scale).round().clamp(-1, 1).to(torch.int8), scale.expand(w.shape[0]))

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.weights else None

    def table(self, name: str) -> torch.Tensor:
        """A table whose rows the runtime gathers (an embedding, unless a tied head shares its tensor;
        Gemma 3n's and 4's per-layer table), kept in the checkpoint's float dtype where that is narrower
        than the runtime's: its rows, cast on use, are the values ``get`` gives (bfloat16 and float16
        widen to float32 exactly), in half the memory (Gemma 3n E2B's per-layer table: 4 GB, not 8, in
        a float32 model)."""
        t = self.weights[name]
        if t.is_floating_point() and t.element_size() < torch.finfo(self.dtype).bits // 8:
            return t.to(device=self.device, copy=True)
        return self.get(name)

    def raw(self, name: str) -> torch.Tensor:
        """A tensor the model keeps in float32 whatever its dtype (Hy4's hyper-connections, its head...)."""
        return self.weights[name].to(device=self.device, dtype=torch.float32, copy=True)

    def norm(self, name: str) -> torch.Tensor | LayerNorm | None:
        """A norm's weight: Gemma's, Qwen3-Next's and Qwen3.5's as 1 + weight in float32, GPT-OSS's
        in float32 (both as the model's dtype holds them, as transformers; GPT-OSS's exact for a
        float16 model, which transformers keeps them float32 for); a layer norm's weight and bias
        (``Family.layer_norm``; OLMo's hold none: "plain"); NanoChat's none either: a weight of 1
        (``weightless_norms``)."""
        gated = name.removesuffix("weight") + "norm.weight"  # (A.X K2's: ``GatedNorm``, its gate's products beside,
        if name.endswith("layernorm.weight") and gated in self.weights:  # as released or under transformers' names)
            down, up = (name.removesuffix("weight") + n + ".weight" for n in ("W_down", "W_up"))
            if down not in self.weights:
                down, up = (name.removesuffix("weight") + f"mlp.{n}.weight" for n in ("fc1", "fc2"))
            return GatedNorm(self.get(gated), self.linear(self.get(down), None), self.linear(self.get(up), None))
        plain = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")
        if self.family.layer_norm == "plain" and name.endswith(plain):
            return LayerNorm(None, None, in_float=True)
        if self.family.weightless_norms and name.endswith(plain + ("model.embed_norm.weight",)):
            return torch.ones((), device=self.device, dtype=self.dtype)  # (a weight of 1 for every channel)
        if self.family.layer_norm and name in self.weights:  # (Nemotron's: of 1 + weight, in the model's dtype)
            return LayerNorm(self.get(name) + self.family.offset_norms, self.opt(name.removesuffix("weight") + "bias"),
                             self.family.layer_norm == "float")
        if name not in self.weights or not (self.family.offset_norms or self.family.float_norms):
            return self.opt(name)
        if self.family.float_norms:
            exact = self.dtype == torch.float16
            return (self.weights[name] if exact else self.get(name)).to(device=self.device, dtype=torch.float32)
        return 1.0 + self.get(name).float()

    def fused(self, name: str, parts: list[str]) -> torch.Tensor | TernaryWeight:
        """Phi-3's (GPT-NeoX's) fused projection, else its parts' weights one after another."""
        if name in self.weights:
            return self.get(name)
        weights = [self.get(p) for p in parts]
        ternary = [isinstance(w, TernaryWeight) for w in weights]
        if any(ternary) and not all(ternary):
            raise ValueError(f"{', '.join(parts)}: modules_to_not_convert leaves some of these BitNet projections "
                             "unquantized, and specdec computes them as one product")
        return TernaryWeight.cat(weights) if all(ternary) else torch.cat(weights)

    def linear(self, weight: torch.Tensor | TernaryWeight, bias: torch.Tensor | None) -> Linear | Ternary:
        if isinstance(weight, TernaryWeight):
            return Ternary(weight, bias, self.device, self.dtype, self.multi_row)
        return Linear(weight, bias, self.kind, self.multi_row)

    def mlp(self, prefix: str, optional: bool = False) -> tuple[Linear | None, Linear | None]:
        """``(gate_up, down)`` of the gated MLP under ``prefix`` (``None, None`` where it is
        ``optional`` and absent: a mixture's layer without shared experts); Granite's gate and up
        fused as ``input_linear``, its down ``output_linear``."""
        if prefix + "output_linear.weight" in self.weights:
            return self.linear(self.get(prefix + "input_linear.weight"), None), \
                self.linear(self.get(prefix + "output_linear.weight"), None)
        if optional and prefix + "down_proj.weight" not in self.weights:
            return None, None
        if not self.family.gated_mlp:  # Nemotron-H's: up alone
            return self.linear(self.get(prefix + "up_proj.weight"), self.opt(prefix + "up_proj.bias")), \
                self.linear(self.get(prefix + "down_proj.weight"), self.opt(prefix + "down_proj.bias"))
        gate_up = self.fused(prefix + "gate_up_proj.weight", [prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        biases = cat_or_none([self.opt(prefix + "gate_proj.bias"), self.opt(prefix + "up_proj.bias")])
        return self.linear(gate_up, biases), self.linear(self.get(prefix + "down_proj.weight"), self.opt(prefix + "down_proj.bias"))


def latent_attention(r: CheckpointReader, a: str, latent: Latent) -> dict:
    """A latent attention's weights under ``a`` (``...self_attn.``): ``qkv`` the products of
    the layer's input fused (the query's low-rank step or the query itself, then the latent
    and the shared rotated key), ``q_norm`` / ``q_b`` the query's second step (None without
    one), ``kv_norm`` the latent's norm, ``uk [heads, nope, rank]`` and ``uv [heads, rank,
    value]`` the per-head up-projections of keys and values, absorbed (``Latent``), ``out_gate``
    a gate on the output per head (Ling's ``g_proj``) or per element (Hy4's ``gate_proj``; None
    without), ``sinks`` a logit per head beside the keys' (Hy4's, float32). The two
    norms' epsilon is transformers' (its modules' default, 1e-6, not ``rms_norm_eps``)."""
    names = [a + ("q_a_proj" if latent.q_rank is not None else "q_proj"), a + "kv_a_proj_with_mqa"]
    up = r.get(a + "kv_b_proj.weight")  # [heads (nope + value), rank]
    up = up.view(-1, latent.nope + latent.value, latent.rank)
    weights, biases = [r.get(n + ".weight") for n in names], [r.opt(n + ".bias") for n in names]
    if any(b is not None for b in biases):  # attention_bias: q_proj has none beside the latent's
        biases = [w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)]
    # (A.X K2's second query product gives each head's query and its output's gates, from the normed low-rank step
    # beside the raw one: q_b_proj as released, twice as wide in; q_gate_proj under transformers' names)
    q_b = None if latent.q_rank is None else r.get(a + "q_gate_proj.weight") if a + "q_gate_proj.weight" in r else \
        r.get(a + "q_b_proj.weight")
    return {
        "qkv": r.linear(torch.cat(weights), cat_or_none(biases)),
        "q_norm": r.norm(a + "q_a_layernorm.weight"),
        "q_b": None if q_b is None else r.linear(q_b, None),
        "q_gated": q_b is not None and q_b.shape[1] == 2 * latent.q_rank,
        "kv_norm": r.norm(a + "kv_a_layernorm.weight"),
        # a gate on the output per head (Ling's g_proj) or per element (Hy4's gate_proj); a sink per head (Hy4's)
        "out_gate": next((r.linear(r.get(a + n), None) for n in ("g_proj.weight", "gate_proj.weight") if a + n in r),
                         None),
        "sinks": r.raw(a + "sinks") if a + "sinks" in r else None,
        "uk": up[:, :latent.nope].contiguous(),
        "uv": up[:, latent.nope:].transpose(1, 2).contiguous(),
        "indexer": None,  # DeepSeek Sparse Attention's (``index_weights``, on the layers with one)
    }


def index_weights(r: CheckpointReader, a: str, slot: int, in_float: bool = False) -> dict:
    """A layer's DeepSeek Sparse Attention indexer under ``a`` (``...self_attn.indexer.``,
    ``SparseIndex``): its query and key products, the key's layer norm, the heads' weights (the
    norm and these in float32 where ``in_float``: Hy4's), and ``slot``, its rows' place in the
    cache's ``index``."""
    get = r.raw if in_float else r.get
    return {"wq_b": r.linear(r.get(a + "wq_b.weight"), None), "wk": r.linear(r.get(a + "wk.weight"), None),
            "k_norm": LayerNorm(get(a + "k_norm.weight"), get(a + "k_norm.bias"), in_float=in_float),
            "weights": r.linear(get(a + "weights_proj.weight"), None), "slot": slot}


def gated_attention(r: CheckpointReader, a: str, config) -> dict:
    """An attention under ``a`` whose output a gate scales (``sigmoid(gate) * output``, before
    ``o_proj``): Qwen3-Next's and Qwen3.5's ``q_proj`` gives each head's query and then its
    gate, AFMoE's ``gate_proj`` the gates (LFM3's: one per head), Laguna's ``g_proj`` (one per
    head or per element, through a softplus in float32: ``softplus_gate``); the queries, keys,
    values and gates fused in that order (a gate without a bias beside biased queries: zeros);
    ``gated``: the gates' width."""
    H, hidden = config.num_attention_heads, config.hidden_size
    softplus = a + "g_proj.weight" in r
    if softplus or a + "gate_proj.weight" in r:  # (Laguna's, AFMoE's)
        gate = r.get(a + ("g_proj" if softplus else "gate_proj") + ".weight")
        q, qb, gate_b = r.get(a + "q_proj.weight"), r.opt(a + "q_proj.bias"), None
    else:
        q, gate = (t.reshape(-1, hidden) for t in r.get(a + "q_proj.weight").view(H, 2, -1, hidden).unbind(1))
        bias = r.opt(a + "q_proj.bias")
        qb, gate_b = (None, None) if bias is None else (b.flatten() for b in bias.view(H, 2, -1).unbind(1))
    if qb is not None and gate_b is None:
        gate_b = qb.new_zeros(gate.shape[0])
    return {"qkv": r.linear(torch.cat([q, r.get(a + "k_proj.weight"), r.get(a + "v_proj.weight"), gate]),
                            cat_or_none([qb, r.opt(a + "k_proj.bias"), r.opt(a + "v_proj.bias"), gate_b])),
            "gated": gate.shape[0], "softplus_gate": softplus}


@dataclass(frozen=True)
class KVPlace:
    """A layer's keys and values where layers differ (Gemma 4's): ``heads`` key/value heads of
    ``dim``; ``second``: kept in the cache's second group (``KVCache``'s ``k2`` / ``v2``);
    ``index``: its place in that group, or (``reuse``) the earlier layer's whose rows it attends
    over, writing none (Gemma 4's last ``num_kv_shared_layers``)."""

    heads: int
    dim: int
    second: bool
    index: int
    reuse: bool = False


def kv_places(config, kv_heads: int, head_dim: int) -> list[KVPlace] | None:
    """Each layer's ``KVPlace`` for Gemma 4 (``per_layer_fields``' ``layer_heads``; a shared layer
    reads the last layer of its type before the shared ones) and MiMo-V2-Flash (``text_model``'s), else None."""
    heads = getattr(config, "layer_heads", None)
    if heads is None:
        return None
    n, shared, types = config.num_hidden_layers, getattr(config, "num_kv_shared_layers", 0) or 0, config.layer_types
    places: list[KVPlace] = []
    counts = [0, 0]
    for i, (kv, dim) in enumerate(heads):
        if i >= n - shared:
            source = max(j for j in range(n - shared) if types[j] == types[i])
            places.append(replace(places[source], reuse=True))
            continue
        second = (kv, dim) != (kv_heads, head_dim)
        places.append(KVPlace(kv, dim, second, counts[second]))
        counts[second] += 1
    return places


def decoder_layer(r: CheckpointReader, config, pre: str, moe: bool = False, sliding: bool = False,
                  rope: str | None = None, rotates: bool = True, latent: Latent | None = None,
                  recurrent: DeltaNet | Mamba2 | Mamba1 | ShortConv | None = None, index: int = 0,
                  block: str | None = None, kv: "KVPlace | None" = None) -> dict:
    """The weights of the decoder layer under ``pre`` (``model.layers.{i}.``) as
    ``TorchLlama._layers`` reads them: ``moe``: its MLP is experts (with shared ones where the
    checkpoint has them); ``sliding``: it attends within the window (Llama 4's: its chunk); ``rope``: its rope
    table's key (a layer type, or None); ``rotates``: it applies rope at all (SmolLM3's);
    ``latent``: its attention is latent (``latent_attention``'s weights); ``recurrent``: it is
    a recurrent layer of that kind, no attention (``recurrent``); ``index``: its KV's (or
    states') index in the cache, among the layers of its kind; ``block``: Nemotron-H's block
    type, a mixer alone or an MLP ("mlp", "moe") alone, or Falcon-H1's "hybrid" (attention and
    the recurrent layer side by side, their outputs summed; None: a mixer and an MLP); ``kv``:
    its attention's shape and place in the cache where layers differ (Gemma 4's, ``KVPlace``:
    then ``index`` is ``kv.index``), and whether it reads an earlier layer's keys and values
    (queries alone then: no k/v projections of its own)."""
    a = pre + "self_attn."
    if kv is not None:
        index = kv.index
    own = ["k", "v"]  # its own projections beside the queries'
    if kv is not None:  # (Gemma 4's attention_k_eq_v: the keys, before their norm, are the values)
        own = [] if kv.reuse else ["k", "v"] if a + "v_proj.weight" in r else ["k"]
    mixes, mlps = block not in ("mlp", "moe"), block in (None, "mlp", "moe", "hybrid")
    if not mixes:
        mixer = {}
    elif recurrent is not None and block != "hybrid":
        mixer = recurrent.weights(r, pre)
    elif a + "kv_proj.weight" in r:  # JetMoE's: keys and values of one product, the queries' and output's experts
        mixer = {"qkv": r.linear(r.get(a + "kv_proj.weight"), None), "o": None, "sinks": None, "q_norm": None,
                 "k_norm": None, "moa": MixtureOfAttention.load(config, r, a + "experts.")}
    else:
        mixer = {
            **(latent_attention(r, a, latent) if latent else gated_attention(r, a, config)
               if config.model_type in HYBRID_ARCHS or a + "gate_proj.weight" in r or a + "g_proj.weight" in r else {
                "qkv": r.linear(r.fused(a + "qkv_proj.weight", [a + f"{n}_proj.weight" for n in ["q", *own]]),
                                r.opt(a + "qkv_proj.bias") if a + "qkv_proj.weight" in r else
                                cat_or_none([r.opt(a + f"{n}_proj.bias") for n in ["q", *own]]))}),
            "o": r.linear(r.get(a + "o_proj.weight"), r.opt(a + "o_proj.bias")),
            "o_norm": r.norm(a + "attn_sub_norm.weight"),  # BitNet's: attention's output normed before its product
            **({} if latent else {  # (latent attention's sinks: ``latent_attention``'s)
                "sinks": r.opt(a + "sinks") if a + "sinks" in r else r.opt(a + "attention_sink_bias"),  # [H] GPT-OSS's
                # (MiMo-V2-Flash's as released)
                "q_norm": r.norm(a + "q_norm.weight"), "k_norm": r.norm(a + "k_norm.weight") if own else None}),
            **(recurrent.weights(r, pre) if block == "hybrid" else {}),
        }
    shared = ("shared_experts." if pre + "mlp.shared_experts.down_proj.weight" in r else "shared_expert.") \
        if moe else ""  # GLM-4.5's, Qwen2-MoE's
    mlp = next((pre + m for m, down in (("shared_mlp.", "output_linear"), ("feed_forward.", "down_proj"),
                                        ("feed_forward.shared_expert.", "down_proj"), ("mlp.shared_mlp.", "down_proj"))
                if pre + m + down + ".weight" in r), pre + "mlp." + shared)  # Granite's, Bamba's, Llama 4's, HunYuan's
    gate_up, down = r.mlp(mlp, optional=moe) if mlps else (None, None)
    sandwich = pre + "pre_feedforward_layernorm.weight" in r  # Gemma 2/3: norms after, too
    glm4 = pre + "post_self_attn_layernorm.weight" in r  # GLM-4's norms after, named its way
    afmoe = pre + "pre_mlp_layernorm.weight" in r  # AFMoE's: norms after, too, named its way
    # A.X K1's experts' output (with the shared ones') normed, inside its MoE block; its checkpoints keep the norm
    # beside the layer's, for its dense layers too, which do not use it
    inner = next((n for n in ("mlp.post_mlp_layernorm", "post_mlp_layernorm") if pre + n + ".weight" in r), None) \
        if config.model_type == "axk1" and moe else None
    after = pre + "input_layernorm.weight" not in r and pre + "post_feedforward_layernorm.weight" in r  # OLMo 2's,
    # Exaone 4's: norms after alone
    peri = pre + "post_norm1.weight" in r  # HyperCLOVA X's: norms after too (Peri-LN), named so
    return {
        "attn_norm": r.norm(pre + "input_layernorm.weight") if mixes else None,
        **mixer,
        "post_attn_norm": r.norm(pre + "post_attention_layernorm.weight") if sandwich or after or afmoe else
        r.norm(pre + "post_self_attn_layernorm.weight") if glm4 else r.norm(pre + "post_norm1.weight") if peri else None,
        "mlp_norm": r.norm(pre + ("pre_feedforward_layernorm" if sandwich else "pre_mlp_layernorm" if afmoe else
                                  "pre_ff_layernorm" if pre + "pre_ff_layernorm.weight" in r else
                                  "post_attention_layernorm") + ".weight")
        if mlps and not after else None,
        "post_mlp_norm": r.norm(pre + (inner or ("post_mlp_layernorm" if glm4 or afmoe else "post_norm2" if peri else
                                                 "post_feedforward_layernorm")) + ".weight")
        if sandwich or glm4 or after or afmoe or inner or peri else None,
        "gate_up": gate_up,  # the dense MLP, or beside the experts their shared ones (Qwen2-MoE's, GLM-4.5's)
        "xielu": xielu_weights(r, mlp) if r.family.activation == "xielu" and gate_up is not None else None,
        "down": down,
        "down_norm": r.norm(mlp + "ffn_sub_norm.weight") if mlps else None,  # (BitNet's, before the MLP's down product)
        "shared_gate": r.opt(pre + "mlp.shared_expert_gate.weight") if moe else None,  # [1, hidden]
        "experts": Experts.load(config, r.weights, pre, r.device, r.dtype) if moe else None,
        "experts_bias": r.opt(pre + "mlp.bias") if moe else None,  # [hidden] after their sum (JetMoE's)
        "sliding": sliding,
        "rope": rope,  # its rope table's key
        "rotates": rotates,
        "index": index,
        "kv": kv,
        "v_from_k": own == ["k"],
        "v_norm": kv is not None and config.model_type in GEMMA_N,  # (values normed, without a weight)
        # Gemma 4's per-layer input (``TorchLlama._per_layer_inputs``): its gate and projection and their norm
        "per_layer": (r.linear(r.get(pre + "per_layer_input_gate.weight"), None),
                      r.linear(r.get(pre + "per_layer_projection.weight"), None),
                      r.norm(pre + "post_per_layer_input_norm.weight"))
        if pre + "per_layer_input_gate.weight" in r else None,
        "scalar": r.opt(pre + "layer_scalar"),  # [1] Gemma 4's: the layer's output scaled
        # MiniMax's residual factors (``TorchLlama._normed_residual_layer``): the mixer's kind's, then the MLP's
        "factors": (*((config.linear_attn_alpha_factor, config.linear_attn_beta_factor) if recurrent is not None else
                      (config.full_attn_alpha_factor, config.full_attn_beta_factor)),
                    config.mlp_alpha_factor, config.mlp_beta_factor) if config.model_type == "minimax" else None,
        # Gemma 3n's (``TorchLlama._altup_layer``): its streams' router and coefficients (``ops.AltUp``), its
        # low-rank residual (LAuReL), the gate's sparsity (``gaussian_top_k``)
        "altup": {"router_norm": r.norm(pre + "altup.router_norm.weight"),
                  "router": r.get(pre + "altup.modality_router.weight"),  # [streams, hidden]
                  "predict": r.get(pre + "altup.prediction_coefs.weight"),  # [streams ** 2, streams]
                  "correct": r.get(pre + "altup.correction_coefs.weight"),  # [streams, streams]
                  "scale": r.get(pre + "altup.correct_output_scale") if config.altup_correct_scale else None}
        if pre + "altup.modality_router.weight" in r else None,
        "laurel": (r.linear(r.get(pre + "laurel.linear_left.weight"), None),
                   r.linear(r.get(pre + "laurel.linear_right.weight"), None), r.norm(pre + "laurel.post_laurel_norm.weight"))
        if pre + "laurel.linear_left.weight" in r else None,
        "sparsity": top_k_cutoff(config.activation_sparsity_pattern[layer_number(pre)], r.device, r.dtype)
        if getattr(config, "activation_sparsity_pattern", None) else None,
        # Hy4's hyper-connections (``ops.HyperConnections``) into attention and into the MLP
        "hc": tuple({n: r.raw(f"{pre}{hc}.{n}") for n in ("fn", "base", "scale")} for hc in ("attn_hc", "ffn_hc"))
        if pre + "attn_hc.fn" in r else None,
        # Gemma 4's experts beside its dense MLP (``TorchLlama._experts_beside``)
        "moe_block": {"experts": Experts.load(config, r.weights, pre, r.device, r.dtype),
                      "router_scale": r.get(pre + "router.scale"),
                      "pre_norm": r.norm(pre + "pre_feedforward_layernorm_2.weight"),
                      "dense_norm": r.norm(pre + "post_feedforward_layernorm_1.weight"),
                      "experts_norm": r.norm(pre + "post_feedforward_layernorm_2.weight")}
        if pre + "router.proj.weight" in r else None,
    }


def zamba_shared_blocks(r: CheckpointReader, config, layers: list[dict], rotates: bool) -> int:
    """Zamba2's shared blocks into its hybrid layers' ``layers[i]["shared"]`` (and each one's
    ``linear``; None on the others): hybrid layer ``j`` runs block ``j % num_mem_blocks`` (its
    weights read once, under the first hybrid layer that runs it) with its own low-rank adapters
    (``qkv_adapters``: the query's, key's and value's, where ``use_shared_attention_adapter``;
    ``gate_up_adapter``: the MLP's) and keys (cache index ``j``). Returns the number of hybrid
    layers (their keys')."""
    hybrid, blocks = config.hybrid_layer_ids, {}
    for j, i in enumerate(hybrid):
        b = j % config.num_mem_blocks
        pre = f"model.layers.{hybrid[b]}.shared_transformer."
        if b not in blocks:
            blocks[b] = decoder_layer(r, config, pre, rotates=rotates)
        pair = [(r.linear(r.get(f"{n}.{j}.0.weight"), None), r.linear(r.get(f"{n}.{j}.1.weight"), None))
                for n in (pre + "feed_forward.gate_up_proj_adapter_list",
                          *(pre + f"self_attn.linear_{p}_adapter_list" for p in "qkv"))
                if f"{n}.{j}.0.weight" in r]
        layers[i]["shared"] = dict(blocks[b], index=j, gate_up_adapter=pair[0], qkv_adapters=pair[1:])
        layers[i]["linear"] = r.linear(r.get(f"model.layers.{i}.linear.weight"), None)
    for L in layers:
        L.setdefault("shared", None)
        L.setdefault("linear", None)
    return len(hybrid)


def top_k_cutoff(sparsity: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Gemma 3n's gate sparsity (``gaussian_top_k``): the standard normal's quantile at ``sparsity``, in
    the model's dtype (None: a dense gate)."""
    if not sparsity:
        return None
    quantile = torch.distributions.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))
    return quantile.to(device=device, dtype=dtype)


def gaussian_top_k(gate: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Gemma 3n's sparse gate: what of each row exceeds its mean plus ``cutoff`` standard deviations
    (about the largest ``1 - sparsity`` of a normal row), less that much; the rest 0."""
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    return F.relu(gate - (torch.mean(gate, dim=-1, keepdim=True) + std * cutoff))


def xielu_weights(r: CheckpointReader, mlp: str) -> list[torch.Tensor]:
    """The MLP under ``mlp``'s xIELU parameters (Apertus's, each layer's own: ``ops.xielu``):
    its trained ``alpha_p`` and ``alpha_n``, and its ``beta`` and ``eps`` (transformers' 0.5 and
    -1e-6 where the checkpoint leaves them out)."""
    fixed = [r.get(mlp + "act_fn." + n) if mlp + "act_fn." + n in r else torch.tensor(v, device=r.device, dtype=r.dtype)
             for n, v in (("beta", 0.5), ("eps", -1e-6))]
    return [r.get(mlp + "act_fn.alpha_p"), r.get(mlp + "act_fn.alpha_n"), *fixed]


class TorchLlama:
    """Runtime for Llama- and Gemma-family checkpoints, mixtures of experts and hybrids with
    recurrent layers (see ``ARCHS``, ``Family``, ``Experts``, ``recurrent``).
    ``cuda_graphs`` (default: on a CUDA device; for experts, where ``grouped_mm_graphable``;
    not with recurrent layers) replays small forwards as CUDA graphs (``CudaGraphs``). With recurrent layers a
    slot rewinds by up to ``state_depth - 1`` tokens (``recurrent.RecurrentStates``), another
    request's prompt reuses its rows only at a kept prompt chunk's end (``reuses_prompt_chunks``),
    a token tree is verified in one forward (its scans along each node's path), and a draft model on
    it drafts chains.

    ``switch``: where the rope of Phi-3's longrope (Phi-3.5-mini, Phi-4-mini) goes from its short
    factors to its long ones, as transformers' model decodes: a row whose forward goes past it
    takes the long ones, and the slot's rows are computed again with them, since Phi-3's model
    drops its cache there and computes it all again (and again with the short ones for a slot
    rewound back before it: prefix reuse of a shorter prompt). A prompt takes the factors of its
    whole length (``KVCache.expect``), chunked or not; the engine keeps a round's rows on one
    side of the switch (``Engine._plan``)."""

    supports_masks = masks_reach_cache = True
    chunk: int | None = None  # Llama 4's attention_chunk_size: its chunked layers' (``_mask``)
    switch: int | None = None  # Phi-3's longrope switch, where it falls inside the context
    second_kv: tuple[int, int, int] | None = None  # (Gemma 4's: ``KVCache``'s second group)
    v_dim: int | None = None  # the values' width where it is not the keys' (MiMo-V2-Flash's)
    sparse_index: SparseIndex | None = None  # DeepSeek Sparse Attention's indexer (DeepSeek-V3.2's, GLM-5's)
    per_layer: tuple | None = None  # (Gemma 3n's and 4's per-layer inputs: ``_per_layer_inputs``)
    altup: AltUp | None = None  # (Gemma 3n's streams: ``_altup_layer``)
    lora: LoRALayers | None = None  # requests' LoRA adapters (``enable_lora``)
    batch_layout = "padded"
    reuses_prefixes = True  # a slot's KV rows stay valid after a rewind (Engine's prefix reuse)
    whole_prompts = False
    rewinds = True

    def __init__(self, config, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, linear: str | None = None, multi_row: bool | None = None,
                 cuda_graphs: bool | None = None):
        reason = unsupported(config)
        if reason:
            raise ValueError(reason)
        config, weights = text_model(config, weights)
        self.device, self.dtype = device, dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = getattr(config, "num_attention_heads", None) or 1  # (1: none, Mamba's)
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.latent, self.sparse_index = Latent.of(config), SparseIndex.of(config)
        if self.latent is not None:  # the cache's one row per token (``Latent``)
            self.kv_heads, self.head_dim = 1, self.latent.rank + self.latent.rope
        self.eps = next((getattr(config, n) for n in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps", "layer_norm_eps",
                                                      "norm_epsilon") if getattr(config, n, None)),
                        1e-5)  # (Nemotron-H's name, LFM2's, Cohere's, StarCoder2's; OLMo's, in no field: 1e-5)
        if config.model_type == "jetmoe":  # (its norms' own, whatever rms_norm_eps says, as transformers builds them;
            self.eps = 1e-6  # its queries' heads: each chosen attention expert's group of num_key_value_heads)
            self.num_heads = config.num_key_value_heads * config.num_experts_per_tok
        self.max_context = getattr(config, "max_position_embeddings", None) or 1 << 20  # (Mamba's: no bound)
        switch = longrope_switch(config)
        self.switch = switch if switch is not None and switch < self.max_context else None
        self.family = Family.of(config, dtype)
        self.window, sliding = sliding_layers(config)
        if config.model_type == "llama4_text" and config.attention_chunk_size:  # its layers with rope attend in chunks
            self.chunk, sliding = config.attention_chunk_size, [t == "chunked_attention" for t in config.layer_types]
        types = getattr(config, "layer_types", None) or [None] * self.num_layers
        rotates = getattr(config, "no_rope_layers", None) or [1] * self.num_layers  # SmolLM3's: 0 = no rope
        if config.model_type == "granitemoehybrid" and config.position_embedding_type != "rope" or \
                config.model_type in ("nemotron_h", "jamba") or \
                config.model_type == "olmo_hybrid" and not (config.rope_parameters or {}).get("rope_theta"):
            rotates = [0] * self.num_layers  # Granite 4.0's hybrids' attention, Nemotron-H's, Jamba's, OLMo-Hybrid's
            # released checkpoints' (no rope_parameters): no rope
        if config.model_type == "kimi_linear":  # its latent attention without rope (its rotated part's width none the
            rotates = [0] * self.num_layers  # less)
        if config.model_type in ("exaone4", "exaone_moe", "cohere2", "cohere2_moe", "afmoe", "kolibri1", "flint",
                                 "lara_mini") \
                and config.sliding_window:
            # rope on the windowed layers alone
            rotates = [t == "sliding_attention" for t in types]
        if config.model_type == "cohere_compass_text":  # rope on the layer types its rope parameters name
            rotates = [t in rope_types(config) for t in types]
        if config.model_type == "cohere2_moe" and config.prefix_dense_sliding_window_pattern == 1:
            # its dense first layers too, which then have no windows
            rotates = [r or m == "dense" for r, m in zip(rotates, config.mlp_layer_types)]
        if self.family.learned_positions is not None or self.family.alibi:  # GPT-2's, ALiBi's: no rope
            rotates = [0] * self.num_layers
        layer_ropes = getattr(config, "layer_rope_theta", None)  # Granite-SWA's base per layer (0: no rope)
        if layer_ropes:
            rotates = [theta != 0 for theta in layer_ropes]
        linear = linear or pick_linear(device, dtype)
        assert linear in LINEAR_KINDS, linear
        if multi_row is None:  # the verify-packed copy, when the weights and it fit in memory
            multi_row = linear == "onednn" and 2 * linear_bytes(config) + expert_bytes(config) < 0.75 * mem_available()
        self.multi_row = multi_row
        self._init_rope(config)

        r = CheckpointReader(weights, device, dtype, self.family, linear, multi_row, quant_config(config))
        # (the embedding's rows in the checkpoint's dtype, ``embedding``, unless the head shares its tensor: a tied
        # head whose kind copies its weight anyway, oneDNN's or int8's, gets its own)
        tied = "lm_head.weight" not in r
        self.embed = r.table("model.embed_tokens.weight") if not tied or linear != "dense" else \
            r.get("model.embed_tokens.weight")
        self.positions = r.get("model.embed_positions.weight") if self.family.learned_positions is not None else None
        self.embed_norm = r.norm("model.embed_norm.weight") if "model.embed_norm.weight" in r \
            or self.family.weightless_norms else None  # (BLOOM's, NanoChat's)
        self.recurrent = recurrent_mixer(config)  # DeltaNet, Mamba2, Mamba1, ShortConv or None
        places = kv_places(config, self.kv_heads, self.head_dim)  # (Gemma 4's: attention's shape per layer)
        self.layers, kinds = [], [0, 0]  # layers so far: attention, recurrent
        for i, moe in enumerate(moe_layers(config)):
            rec = self.recurrent if types[i] in RECURRENT_TYPES else None
            # (see decoder_layer)
            block = types[i] if config.model_type in ("nemotron_h", "falcon_h1") + PURE_RECURRENT else None
            pre = f"model.layers.{i}."
            if config.model_type == "zamba2":  # a Mamba-2 layer alone (``_zamba_layer``), after a shared block on some
                block, pre = LINEAR_ATTENTION, pre + "mamba_decoder." * (types[i] == "hybrid")
            self.layers.append(decoder_layer(r, config, pre, moe, sliding=sliding[i],
                                             rope=layer_ropes[i] if layer_ropes else
                                             types[i] if types[i] in self.rope else None,
                                             rotates=bool(rotates[i]), latent=self.latent, recurrent=rec,
                                             index=kinds[rec is not None], block=block,
                                             kv=places[i] if places else None))
            kinds[rec is not None] += block not in ("mlp", "moe")
            kinds[0] += block == "hybrid"  # (its attention too: the same index, every layer being so)
        if config.model_type == "zamba2":
            kinds[0] = zamba_shared_blocks(r, config, self.layers, rotates=bool(config.use_mem_rope))
        self.kv_layers, self.state_layers = kinds
        for L, heads in zip(self.layers, getattr(config, "num_attention_heads_per_layer", None) or ()):
            L["heads"] = heads  # (Laguna's queries: a number of heads per layer)
        if self.sparse_index is not None:  # (the layers with an indexer of their own, in order)
            owners = [i for i, own in enumerate(self.sparse_index.owns) if own]
            for slot, i in enumerate(owners):
                self.layers[i]["indexer"] = index_weights(r, f"model.layers.{i}.self_attn.indexer.", slot,
                                                          self.sparse_index.in_float)
        self.second_kv = None  # (layers, kv heads, head dim) of a second group of K/V shapes (``KVCache``)
        self.v_dim = config.v_head_dim if config.model_type == "mimo_v2_flash" else None
        if places:
            self.kv_layers = sum(not p.second and not p.reuse for p in places)
            wide = [p for p in places if p.second and not p.reuse]
            self.second_kv = (len(wide), wide[0].heads, wide[0].dim) if wide else None
        # Gemma 3n's and 4's per-layer inputs (``_per_layer_inputs``): a table of each token's, and a projection of its
        # embedding; their scales (Gemma 3n's rounded to the model's dtype)
        self.per_layer = None
        if "model.embed_tokens_per_layer.weight" in r:
            scales = [config.hidden_size ** -0.5, 2 ** -0.5]
            if config.model_type == "gemma3n_text":
                scales = [torch.tensor(v, dtype=dtype).item() for v in scales]
            self.per_layer = (r.table("model.embed_tokens_per_layer.weight"),
                              r.linear(r.get("model.per_layer_model_projection.weight"), None),
                              r.norm("model.per_layer_projection_norm.weight"), *scales)
        if self.recurrent is not None:  # a recurrent state: no graph (yet); prefixes in whole prompt chunks only (their
            self.reuses_prefixes = self.masks_reach_cache = False  # ends' states are kept); trees in one forward
            self.reuses_prompt_chunks = True
            self.state_depth = DEFAULT_DEPTH
        self.norm = r.norm("model.final_layernorm.weight" if "model.final_layernorm.weight" in r else "model.norm.weight")
        # (Bamba's name)
        self.taps: tuple[int, ...] = ()  # hidden states each forward keeps (``capture``)
        self.features: torch.Tensor | None = None  # the last forward's: [B, T, len(taps) * hidden]
        self.lm_head = r.linear(r.get("lm_head.weight"), r.opt("lm_head.bias")) if not tied \
            else r.linear(self.embed.to(dtype), None)  # tied: widened where kept narrow (a bias: ERNIE 4.5 MoE's)
        self.hc = self.hc_head = None  # Hy4's hyper-connections (``ops.HyperConnections``), the head's mix; its head
        self.float_head = False  # in float32
        if config.model_type == "hy_v4":
            self.float_head = True
            self.hc = HyperConnections(config.hc_mult, config.hc_magnitude, config.hc_eps, config.rms_norm_eps)
            self.hc_head = {n: r.raw("model.hc_head." + n) for n in ("fn", "base", "scale")}
            self.lm_head = r.linear(r.raw("lm_head.weight"), None)
        self.altup = None  # Gemma 3n's streams (``ops.AltUp``, ``_altup_layer``); the embedding's projections into
        if config.model_type == "gemma3n_text":  # them, and the last streams' back
            self.altup = AltUp(config.altup_num_inputs, config.altup_active_idx,
                               torch.tensor(config.hidden_size ** -1.0, dtype=dtype).item())
            self.altup_in, self.altup_out = ([r.linear(r.get(f"model.{n}.{i}.weight"), None)
                                              for i in range(config.altup_num_inputs - 1)]
                                             for n in ("altup_projections", "altup_unembed_projections"))
        self.vocab_size = self.lm_head.out_features  # the logits' width (Apertus 1.5's head: the text tokens alone,
        # its embedding's first output_vocab_size rows)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        graphable = not any(layer["experts"] or layer["moe_block"] or layer.get("moa") for layer in self.layers) \
            or grouped_mm_graphable(device, dtype)
        if cuda_graphs and self.recurrent is not None:
            raise ValueError("CUDA graphs do not hold recurrent layers' states yet")
        use_graphs = device.type == "cuda" and graphable and self.recurrent is None if cuda_graphs is None else cuda_graphs
        self.graphs = CudaGraphs(self) if use_graphs else None
        self.one_row_packed = all(lin.multi is not None for lin in self._linears()) and self._packed_one_row_pays()
        for lin in self._linears():  # if so, the packed copy serves every product, the other goes
            lin.pack_one_row(self.one_row_packed, free=True)

    def capture(self, taps: Sequence[int]) -> None:
        """From now on each forward keeps the hidden states ``taps`` names in ``features``
        ``[B, T, len(taps) * hidden]``, side by side in the order of the layers (a tap named
        twice, twice: EAGLE-3's defaults on a model of few layers): tap ``i`` is
        transformers' ``hidden_states[i]``, the input of layer ``i`` (0: the embeddings), and
        ``num_layers`` the last layer's output after the final norm (what an EAGLE drafter
        reads)."""
        taps = tuple(sorted(taps))
        if taps and (self.hc is not None or self.altup is not None):
            raise ValueError("hidden states between layers of hyper-connections (Hy4's) or alternating updates "
                             "(Gemma 3n's) are several streams: no drafter reads them")
        if taps and not 0 <= taps[0] <= taps[-1] <= self.num_layers:
            raise ValueError(f"hidden states {list(taps)}: this model has {self.num_layers} layers, "
                             f"so 0 to {self.num_layers}")
        self.taps, self.features = taps, None
        if self.graphs is not None:  # graphs captured before give no features
            self.graphs = CudaGraphs(self)

    def _linears(self) -> list[Linear]:
        """Every product of the layers (a shared block's, Zamba2's, once) and the head."""
        layers = self.layers + [layer["shared"] for layer in self.layers if layer.get("shared")]
        found = {id(lin): lin for layer in layers for n in ("qkv", "q_b", "o", "mix_in", "mix_out", "gate_up", "down")
                 if (lin := layer.get(n))}
        return [*found.values(), self.lm_head]

    def _packed_one_row_pays(self) -> bool:
        """Whether a one-token forward (plain decoding) through the verify-packed weights costs
        at most ``PACKED_ONE_ROW_SLACK`` times one through oneDNN's own: it depends on the CPU
        (Qwen2.5-Coder-1.5B on a 2-core AMD EPYC with AVX-512: 0.7-0.9x). Timed once per
        model shape, dtype, threads, machine and torch version, then read from specdec's cache
        directory, so that every process makes the same choice (a noisy timing near the
        threshold used to flip it from run to run)."""
        shapes = ",".join("x".join(map(str, lin.weight.shape)) for lin in self._linears()[:4] + [self.lm_head])
        key = "|".join([f"layers={self.num_layers}", shapes, str(self.dtype), f"threads={torch.get_num_threads()}",
                        disk_cache.machine(), f"torch={torch.__version__}"])
        path = disk_cache.directory() / "torch_one_row.json"
        ratio = disk_cache.read(path).get(key)
        if not isinstance(ratio, (int, float)):
            ratio = self._time_packed_one_row()
            disk_cache.store(path, key, ratio)
        return ratio <= PACKED_ONE_ROW_SLACK

    @torch.inference_mode()
    def _time_packed_one_row(self) -> float:
        """A one-token forward's time through the verify-packed weights over oneDNN's own:
        the two in turns, medians of 5 after a warm-up."""
        cache = self.new_cache(1)
        self.forward(cache, [0], [[0] * 32])
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(6):
            for packed in (False, True):
                for lin in self._linears():
                    lin.pack_one_row(packed)
                t0 = time.perf_counter()
                self.forward(cache, [0], [[1]])
                if r:  # round 0 warms up
                    times[packed].append(time.perf_counter() - t0)
                cache.rewind(0, 32)
        for lin in self._linears():
            lin.pack_one_row(False)
        return statistics.median(times[True]) / statistics.median(times[False])

    def _init_rope(self, config) -> None:
        """``rope``: layer type (None: every layer; Granite-SWA's: a layer's base) -> (inverse
        frequencies ``[rotated / 2]``, the scale of cos and sin); ``rotated``: each head's first
        dimensions that rotate, all but where ``partial_rotary_factor`` says (``PARTIAL_ROTARY``)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.rope, self.rope_long = {}, {}  # rope_long: longrope's long inverse frequencies and scale (``switch``)
        per_layer = {theta: dict(rope_types(config)[None], rope_theta=theta)
                     for theta in getattr(config, "layer_rope_theta", None) or () if theta}  # (keyed by the base)
        # (Gemma 4's head width per layer type)
        heads = getattr(config, "layer_heads", None)
        dims = {t: dim for t, (_, dim) in zip(config.layer_types, heads)} if heads else {}
        for layer_type, params in (per_layer or rope_types(config)).items():
            rope_type = params.get("rope_type", "default")
            alpha = ntk_alpha(params)
            head_dim = dims.get(layer_type, self.head_dim)
            if rope_type == "default" or alpha:
                base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                if base is None:  # no rope at all (OLMo-Hybrid's released checkpoints)
                    continue
                d = self.latent.rope if self.latent else int(head_dim * params.get("partial_rotary_factor", 1.0))
                base *= alpha ** (d / (d - 2)) if alpha else 1.0
                inv_freq, scale = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
            else:
                source = config
                if per_layer or head_dim != self.head_dim:  # (its parameters at that base, as transformers'
                    # Granite-SWA builds them; Gemma 4's head width of that layer type)
                    source = copy.deepcopy(config)
                    source.rope_parameters = params if per_layer else source.rope_parameters
                    source.head_dim = head_dim
                kw = {"layer_type": layer_type} if layer_type is not None and not per_layer else {}
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](source, torch.device("cpu"), **kw)
                # (Phi-3.5-MoE's scales of cos and sin: short_mscale, long_mscale past the switch)
                scale = params.get("short_mscale", scale) if rope_type == "longrope" else scale
                if rope_type == "longrope" and self.switch is not None:
                    long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](source, torch.device("cpu"), seq_len=self.switch + 1,
                                                                  **kw)
                    self.rope_long[layer_type] = (long_freq.float().to(self.device), params.get("long_mscale", scale))
            self.rope[layer_type] = (inv_freq.float().to(self.device), scale)

    @property
    def speed_key(self) -> str:
        """The linears' kinds (and their multi-row copies), CUDA graphs, dtype and device."""
        kinds = sorted({next(layer[n] for n in ("qkv", "mix_in", "gate_up") if layer.get(n)).kind
                        for layer in self.layers}) \
            + (["multi-row"] if self.multi_row else []) + (["packed-one-row"] if self.one_row_packed else []) \
            + (["cuda-graphs"] if self.graphs else [])
        return ",".join(kinds + [str(self.dtype), str(self.device)])

    def new_cache(self, num_slots: int, max_rows: int | None = None) -> KVCache:
        decays = torch.stack([L["decay"] for L in self.layers if "mix_in" in L]) \
            if isinstance(self.recurrent, Mamba1) else None  # (in the order of their states)
        states = None if self.recurrent is None else \
            RecurrentStates(self.state_layers, self.recurrent, self.state_depth, self.device, self.dtype, decays)
        return KVCache(self.kv_layers, num_slots, self.kv_heads, self.head_dim, self.device, self.dtype,
                       max_rows=max_rows, keys_only=self.latent is not None, states=states,
                       tracks_ids=self.switch is not None, second=self.second_kv, v_dim=self.v_dim,
                       index=self.sparse_index and (sum(self.sparse_index.owns), self.sparse_index.dim))

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots, tokens, *, positions=None, chunk_masks=None,
                last_only: bool = False, prefill: bool = False) -> torch.Tensor:
        long = None if self.switch is None else self._factors(cache, slots, tokens, positions, chunk_masks)
        return self._forward(cache, slots, tokens, positions, chunk_masks, last_only, long)

    def _factors(self, cache: KVCache, slots, tokens, positions, chunk_masks) -> list[bool]:
        """Per row, whether its rope takes longrope's long factors (``switch``): where its
        forward goes past the switch, or its prompt will (``KVCache.expect``). A slot whose rows
        took the other ones gets them computed again first, as Phi-3's model does (not in a
        forward whose mask reaches rows of earlier forwards: a draft model's tree, fed depth by
        depth, whose rows are no sequence; its proposals then keep the factors it has)."""
        long = []
        for b, s in enumerate(slots):
            given = positions is not None and positions[b] is not None
            end = max(positions[b]) + 1 if given else cache.lengths[s] + len(tokens[b])
            want = max(end, cache.reach[s]) > self.switch
            mask = chunk_masks[b] if chunk_masks is not None else None
            if want != cache.long[s] and cache.lengths[s] and mask is not None and mask.shape[1] > mask.shape[0]:
                want = cache.long[s]
            elif want != cache.long[s] and cache.lengths[s]:
                self._recompute(cache, s, want)
            cache.long[s] = want
            long.append(want)
        return long

    def _recompute(self, cache: KVCache, slot: int, long: bool) -> None:
        """Compute ``slot``'s rows again, from its ids, with longrope's long (or short) factors."""
        ids = list(cache.ids[slot])
        cache.rewind(slot, 0)
        for i in range(0, len(ids), RECOMPUTE_CHUNK):
            self._forward(cache, [slot], [ids[i:i + RECOMPUTE_CHUNK]], None, None, True, [long])

    def enable_lora(self, max_loras: int) -> LoRALayers:
        """Let requests' LoRA adapters update this model's products (``LoRALayers``), up to
        ``max_loras`` of them on the device at once."""
        if self.lora is None:
            self.lora = LoRALayers(self, max_loras)
        self.lora.max_loras = max(self.lora.max_loras, max_loras)
        return self.lora

    def _forward(self, cache: KVCache, slots, tokens, positions, chunk_masks, last_only: bool,
                 long: list[bool] | None) -> torch.Tensor:
        if self.lora is None:
            return self._run(cache, slots, tokens, positions, chunk_masks, last_only, long)
        self.lora.select([cache.adapters[s] for s in slots])  # each row's slot's adapter
        try:
            return self._run(cache, slots, tokens, positions, chunk_masks, last_only, long)
        finally:
            self.lora.active = []

    def _run(self, cache: KVCache, slots, tokens, positions, chunk_masks, last_only: bool,
             long: list[bool] | None) -> torch.Tensor:
        B, T = len(slots), max(len(t) for t in tokens)
        starts = [cache.lengths[s] for s in slots]  # host ints: nothing here waits for the device
        # (CUDA graphs hold no adapter's update: a batch with one runs eagerly)
        graphed = self.graphs is not None and T <= GRAPH_MAX_TOKENS and not (self.lora and self.lora.active)
        width = graph_tokens(T) if graphed else T  # a graph's rows: padding KV lands past the lengths
        cache.ensure(max(starts) + width, max(slots) + 1)
        # a CUDA graph attends over the cache's whole capacity (its shapes are fixed), masked
        batch = self._batch(cache, starts, slots, tokens, positions, chunk_masks, width,
                            cache.capacity if graphed else None, long)
        if cache.states is not None:
            batch.states = cache.states.plan(list(slots), starts, [len(t) for t in tokens], width, chunk_masks)
        last = torch.tensor([len(t) - 1 for t in tokens], device=self.device) if last_only else None  # [B]
        if graphed:
            logits, self.features = self.graphs.run(cache, batch, T)  # [B, T, vocab], [B, T, features]
            if last is not None:
                logits = logits[torch.arange(B, device=self.device), last]  # [B, vocab]
        else:
            logits, self.features = self._layers(cache, batch, last)
        for b, s in enumerate(slots):
            cache.lengths[s] += len(tokens[b])
            if cache.ids is not None:
                cache.ids[s] += tokens[b]
        return logits

    def _batch(self, cache: KVCache, starts: list[int], slots, tokens, positions, chunk_masks, T: int,
               keys: int | None, long: list[bool] | None = None) -> "Batch":
        """A forward's inputs as device tensors, ``T`` tokens per row (the longest of
        ``tokens`` or more: padding); ``keys``: keys attended (default: up to the last new
        token's). A graphed forward's (``keys`` given: at most ``GRAPH_MAX_TOKENS`` rows) are
        built on the host and sent in two copies, not a dozen small kernels."""
        B = len(slots)
        ids = torch.zeros(B, T, dtype=torch.long)
        write = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]  # [B, T] cache index of each new token
        pos = write.clone()
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            if positions is not None and positions[b] is not None:
                pos[b, : len(positions[b])] = torch.tensor(positions[b])
        where = torch.device("cpu") if keys is not None else self.device
        mask, sliding = self._mask(starts, keys or max(starts) + T, T, chunk_masks, where, pos)
        slots = list(slots)
        packed = torch.cat([ids.flatten(), pos.flatten(), write.flatten(), torch.tensor(slots),
                            torch.tensor(long or [], dtype=torch.long)]).to(self.device)
        ids, pos, write, slots_, long_ = packed.split([B * T, B * T, B * T, B, B if long else 0])
        return Batch(ids.view(B, T), pos.view(B, T), write.view(B, T), slots_, mask.to(self.device),
                      None if sliding is None else sliding.to(self.device),
                      None if keys is not None else slot_runs(slots, mask.shape[-1]),
                      long=long_.bool() if long else None)

    def _layers(self, cache: KVCache, x: "Batch", last: torch.Tensor | None = None,
                to_float: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over one batch: logits ``[B, T, vocab]``, or ``[B, vocab]`` at row
        ``last[b]`` of each, in float32 (``to_float``) or the model's dtype; and the hidden
        states ``taps`` names, side by side ``[B, T, len(taps) * hidden]`` (None without).
        Device work alone (no host sync, no allocation that depends on values), so that a
        CUDA graph can capture it."""
        B, T = x.ids.shape
        rope = self._rope(x.pos, x.long)
        fam = self.family
        h = self.embedding(x.ids)  # [B, T, hidden]
        if self.positions is not None:  # (GPT-2's)
            h = h + F.embedding(x.pos + fam.learned_positions, self.positions)
        if fam.embed_scale is not None:
            h = h * fam.embed_scale
        if self.embed_norm is not None:
            h = norm(h, self.embed_norm, self.eps)
        per_layer = None if self.per_layer is None else self._per_layer_inputs(x.ids, h)  # [B, T, layers, width]
        if self.hc is not None:  # Hy4's: the embedding's copies [B, T, streams, hidden]
            h = h[:, :, None].expand(-1, -1, self.hc.streams, -1).contiguous()
        if self.altup is not None:  # Gemma 3n's: the embedding and its projections [B, T, streams, hidden]
            h = self.altup.spread(self.altup_in, h)
        embedded = h  # (Zamba2's shared blocks read it beside each layer's input)
        tapped = {}  # tap -> [B, T, hidden]
        for li, L in enumerate(self.layers):
            if li in self.taps:
                tapped[li] = h
            if L["altup"] is not None:
                h = self._altup_layer(cache, x, L, h, rope, per_layer[:, :, li])
                continue
            if "linear" in L:  # (Zamba2's)
                h = self._zamba_layer(cache, x, L, h, embedded, rope)
                continue
            if L["factors"] is not None:  # (MiniMax's)
                h = self._normed_residual_layer(cache, x, L, h, rope)
                continue
            if "qkv" in L or "mix_in" in L:  # (Nemotron-H's blocks: a mixer, or an MLP, alone)
                if L["hc"] is not None:  # (the streams' mix in, the output added to each out)
                    streams, (post, h) = h, self.hc.collapse(L["hc"][0], h)
                a = h if L["attn_norm"] is None else norm(h, L["attn_norm"], self.eps)  # (OLMo 2's: none before)
                mixed = 0
                if "mix_in" in L:  # a recurrent layer (beside attention: Falcon-H1's)
                    mixed = self.recurrent.forward(cache.states, L["index"], x.slots, x.states, L, a, self.eps)
                if "qkv" in L:
                    mixed = mixed + (self._attend_latent if self.latent else self._attend)(cache, x, L, a, rope)
                mixed = self._residual(mixed, L["post_attn_norm"])
                if fam.parallel:  # the MLP beside attention, of the same normed input or its own norm's (GPT-NeoX's)
                    mlp = self._mlp(L, a if L["mlp_norm"] is None else norm(h, L["mlp_norm"], self.eps))
                    h = h + mixed + mlp if fam.parallel == "residual" else h + (mixed + mlp)
                else:
                    h = h + mixed if L["hc"] is None else self.hc.expand(post, mixed, streams)
            if (L["gate_up"] is not None or L["experts"] is not None) and not fam.parallel:
                if L["hc"] is not None:
                    streams, (post, h) = h, self.hc.collapse(L["hc"][1], h)
                a = h if L["mlp_norm"] is None else norm(h, L["mlp_norm"], self.eps)
                out = self._mlp(L, a)
                if L["moe_block"] is not None:
                    out = self._experts_beside(L["moe_block"], h, out)
                out = self._residual(out, L["post_mlp_norm"])
                h = h + out if L["hc"] is None else self.hc.expand(post, out, streams)
            if L["per_layer"] is not None:  # (Gemma 4's: its per-layer input, gated by the layer's output)
                gate, project, post_norm = L["per_layer"]
                h = h + norm(project(ACTIVATIONS[fam.activation](gate(h)) * per_layer[:, :, li]), post_norm, self.eps)
            if L["scalar"] is not None:
                h = h * L["scalar"]
        if self.hc is not None:
            h = self.hc.head(self.hc_head, h)  # [B, T, hidden]
        if self.altup is not None:
            h = self.altup.gather(self.altup_out, h)  # [B, T, hidden]
        if self.num_layers in self.taps:  # transformers' last hidden state: after the final norm
            h = tapped[self.num_layers] = norm(h, self.norm, self.eps)
        if last is not None:
            h = h[torch.arange(B, device=h.device), last]  # [B, hidden]
        if self.num_layers not in self.taps:
            h = norm(h, self.norm, self.eps)
        if fam.hidden_divisor is not None:
            h = h / fam.hidden_divisor
        logits = softcap(self.lm_head(h.float() if self.float_head else h), fam.final_softcap)
        if fam.logits_divisor is not None:
            logits = logits / fam.logits_divisor
        if fam.logits_scale is not None:
            logits = logits * fam.logits_scale
        features = torch.cat([tapped[t] for t in self.taps], dim=-1) if self.taps else None
        return logits.float() if to_float else logits, features

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows of ``ids``, in the model's dtype (an embedding apart from the head is kept
        in the checkpoint's: ``CheckpointReader.table``)."""
        return F.embedding(ids, self.embed).to(self.dtype)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Gemma 3n's and 4's per-layer inputs ``[B, T, layers, width]``: each token's row of its own
        table (scaled by sqrt(width) as the model's dtype holds it; row 0 for a token past the table:
        Gemma 3n's audio and image tokens) and a projection of its embeddings ``h`` (scaled by
        hidden ** -0.5, normed per layer), their sum scaled by 2 ** -0.5."""
        table, project, post_norm, project_scale, sum_scale = self.per_layer
        width = table.shape[1] // self.num_layers
        own = F.embedding(torch.where(ids < table.shape[0], ids, 0), table).to(self.dtype)  # (its checkpoint's dtype:
        own = own * torch.tensor(width ** 0.5, dtype=self.dtype).item()  # ``CheckpointReader.table``)
        projected = project(h) * project_scale
        projected = norm(projected.view(*ids.shape, self.num_layers, width), post_norm, self.eps)
        return (projected + own.view(*ids.shape, self.num_layers, width)) * sum_scale

    def _normed_residual_layer(self, cache: KVCache, x: "Batch", L: dict, h: torch.Tensor, rope: dict) -> torch.Tensor:
        """MiniMax's layer, whose residuals are the normed inputs: ``a = norm(h)``, then ``a alpha +
        mixer(a) beta``, the same around the MLP, with the factors ``L["factors"]`` (the mixer's
        kind's, then the MLP's)."""
        alpha, beta, mlp_alpha, mlp_beta = L["factors"]
        a = norm(h, L["attn_norm"], self.eps)
        mixed = self.recurrent.forward(cache.states, L["index"], x.slots, x.states, L, a, self.eps) if "mix_in" in L \
            else self._attend(cache, x, L, a, rope)
        a = norm(a * alpha + mixed * beta, L["mlp_norm"], self.eps)
        return a * mlp_alpha + self._mlp(L, a) * mlp_beta

    def _zamba_layer(self, cache: KVCache, x: "Batch", L: dict, h: torch.Tensor, embedded: torch.Tensor,
                     rope: dict) -> torch.Tensor:
        """Zamba2's layer: a Mamba-2 layer, where ``L["shared"]`` holds a shared block (attention, then
        an MLP, over the layer's input beside the embeddings ``[B, T, 2 hidden]``, with this
        layer's own low-rank adapters and keys) whose output, through the layer's ``linear``,
        adds to the Mamba layer's input (not to the residual)."""
        S, eps = L["shared"], self.eps
        into = h
        if S is not None:
            a = norm(torch.cat([h, embedded], dim=-1), S["attn_norm"], eps)  # [B, T, 2 hidden]
            out = self._attend(cache, x, S, a, rope)
            into = h + L["linear"](self._mlp(S, norm(out, S["mlp_norm"], eps)))
        a = norm(into, L["attn_norm"], eps)
        return h + self.recurrent.forward(cache.states, L["index"], x.slots, x.states, L, a, eps)

    def _altup_layer(self, cache: KVCache, x: "Batch", L: dict, streams: torch.Tensor, rope: dict,
                     per_layer: torch.Tensor) -> torch.Tensor:
        """Gemma 3n's layer over its streams ``[B, T, streams, hidden]`` (``ops.AltUp``): attention
        and the MLP on the active stream's prediction, LAuReL's low-rank residual beside attention
        (their sum scaled by 2 ** -0.5), the predictions corrected by the output, and the layer's
        per-layer input ``[B, T, width]``, gated by the corrected active stream, added to streams 1 on."""
        altup, w, eps = self.altup, L["altup"], self.eps
        predictions = altup.predict(w, streams, eps)  # [B, T, streams, hidden]
        active = predictions[:, :, altup.active]  # [B, T, hidden]
        a = norm(active, L["attn_norm"], eps)
        left, right, laurel_norm = L["laurel"]
        laurel = a + norm(right(left(a)), laurel_norm, eps)
        h = (active + norm(self._attend(cache, x, L, a, rope), L["post_attn_norm"], eps) + laurel) / math.sqrt(2)
        h = h + norm(self._mlp(L, norm(h, L["mlp_norm"], eps)), L["post_mlp_norm"], eps)
        corrected = altup.correct(w, predictions, h, eps)
        first = corrected[:, :, altup.active] if w["scale"] is None else corrected[:, :, altup.active] * w["scale"]
        gate, project, post_norm = L["per_layer"]
        first = norm(project(ACTIVATIONS[self.family.activation](gate(first)) * per_layer), post_norm, eps)
        return torch.cat([corrected[:, :, :1], corrected[:, :, 1:] + first[:, :, None]], dim=2)

    def _rope(self, pos: torch.Tensor, long: torch.Tensor | None = None) -> dict:
        """Per layer type, (cos, sin) ``[B, 1, T, rotated]`` at positions ``pos [B, T]``
        (``long [B]``: the rows that take longrope's long factors)."""
        rope = {}
        for layer_type, (inv_freq, scale) in self.rope.items():
            if long is not None and layer_type in self.rope_long:
                long_freq, long_scale = self.rope_long[layer_type]
                inv_freq = torch.where(long[:, None, None], long_freq, inv_freq)  # [B, 1, rotated/2]
                if long_scale != scale:  # [B, 1, 1]
                    scale = torch.where(long[:, None, None], long_scale, scale)
            freqs = pos[..., None].float() * inv_freq  # [B, T, rotated/2]
            emb = freqs.repeat_interleave(2, dim=-1) if self.family.interleaved_rope else torch.cat((freqs, freqs), dim=-1)
            dtype = torch.float32 if self.family.rope_math == "float" else self.dtype
            sin = -emb.sin() if self.family.rope_reversed else emb.sin()
            rope[layer_type] = ((emb.cos() * scale).to(dtype)[:, None], (sin * scale).to(dtype)[:, None])
        return rope

    def _attend(self, cache: KVCache, x: "Batch", L: dict, a: torch.Tensor, rope: dict) -> torch.Tensor:
        """Layer ``L``'s attention over ``a [B, T, in]`` (its input, normed): writes the new
        tokens' K/V to the cache and returns the output projection's ``[B, T, hidden]``."""
        fam, (B, T) = self.family, x.ids.shape
        S = x.mask.shape[-1]
        place = L["kv"]  # (Gemma 4's: this layer's shape, and where its rows are)
        H = L.get("heads") or self.num_heads  # (Laguna's: its own number per layer)
        KV, D = (place.heads, place.dim) if place else (self.kv_heads, self.head_dim)
        Dv = self.v_dim or D  # (MiMo-V2-Flash's values: narrower than its keys)
        reuse = place is not None and place.reuse  # its queries over an earlier layer's rows
        qkv = L["qkv"](a)  # [B, T, (H + KV) D + KV Dv], Qwen3-Next's / 3.5's gates after them: + H D
        moa = L.get("moa")
        if moa is not None:  # (JetMoE's: each chosen expert's queries, a group of KV heads; heads ordered as the
            route = moa.route(a)  # key/value heads they attend with, as grouped-query attention reads them)
            q = moa.project_queries(a, route).view(B, T, moa.routing.top_k, KV, D).transpose(2, 3)
            qkv = torch.cat([q.reshape(B, T, H * D), qkv], dim=-1)
        if L.get("qkv_adapters"):  # (Zamba2's: low-rank adapters of this layer's, beside a shared block's products)
            qkv = qkv + torch.cat([up(down(a)) for down, up in L["qkv_adapters"]], dim=-1)
        own = 0 if reuse else 1 if L["v_from_k"] else 2  # key/value projections
        q, *kv = qkv.split([H * D] + [KV * D, KV * Dv][:own] + ([L["gated"]] if L.get("gated") else []), dim=-1)
        k, v, gate = (kv[0], kv[own - 1], kv[own:]) if own else (None, None, kv)  # (attention_k_eq_v: v is k unnormed)
        if L["v_norm"] and v is not None:  # (Gemma 4's: values normed, without a weight)
            v = rms_norm(v.view(B, T, KV, D), None, self.eps)
        if fam.value_scale is not None and v is not None:
            v = v * fam.value_scale
        if fam.scale_queries:  # (OPT's)
            q = q * D ** -0.5
        if L["q_norm"] is not None and not fam.norm_after_rope:  # over each head, or all (a weight that wide: OLMo 2's)
            q = norm(q.view(B, T, -1, norm_width(L["q_norm"])), L["q_norm"], self.eps)
            if k is not None:
                k = norm(k.view(B, T, -1, norm_width(L["k_norm"])), L["k_norm"], self.eps)
        if fam.clip_qkv is not None:
            q, k, v = (t.clamp(-fam.clip_qkv, fam.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        k = None if k is None else k.view(B, T, KV, D).transpose(1, 2)  # [B, KV, T, D]
        if L["rotates"]:
            cos, sin = rope[L["rope"]]
            q, k = (None if t is None else rotate(t if fam.rope_math == "model" else t.float(), cos, sin,
                                                  fam.interleaved_rope).to(t.dtype) for t in (q, k))
        if L["q_norm"] is not None and fam.norm_after_rope:
            q, k = rms_norm(q, L["q_norm"], self.eps), rms_norm(k, L["k_norm"], self.eps)
        if fam.l2_qk_norm and L["rotates"]:
            q, k = rms_norm(q, None, self.eps), rms_norm(k, None, self.eps)
        temperature = fam.query_temperature
        if temperature is not None and not (temperature.nope_only and L["rotates"]):
            q = temperature.scale(q, x.pos)
        kc, vc = (cache.k2, cache.v2) if place is not None and place.second else (cache.k, cache.v)
        kc, vc = kc[L["index"]], vc[L["index"]]  # [slots, KV, cap, D]
        if not reuse:
            kc[x.slots[:, None], :, x.write] = k.transpose(1, 2)  # [B, T, KV, D]
            vc[x.slots[:, None], :, x.write] = v.view(B, T, KV, Dv)
        mask = x.sliding if L["sliding"] else x.mask
        if x.runs is not None:  # views of each run's cache rows [b1 - b0, KV, S, D]
            parts = [attention(q[b0:b1], kc[s0:s0 + b1 - b0, :, :S], vc[s0:s0 + b1 - b0, :, :S], mask[b0:b1],
                               fam.attn_scale, fam.attn_softcap, L["sinks"]) for b0, b1, s0 in x.runs]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:  # a gathered copy [B, KV, S, D]
            o = attention(q, kc[x.slots, :, :S], vc[x.slots, :, :S], mask, fam.attn_scale, fam.attn_softcap,
                          L["sinks"])
        o = o.transpose(1, 2)  # [B, T, H, Dv]
        if gate:  # each element's gate, or each head's (LFM3's, Laguna's)
            g = F.softplus(gate[0].float()).to(o.dtype) if L["softplus_gate"] else torch.sigmoid(gate[0])  # [B, T, H Dv]
            # or [B, T, H]
            o = o * (g.view(B, T, H, Dv) if g.shape[-1] == H * Dv else g[..., None])
        if moa is not None:  # (each expert's group of heads back to it)
            return moa.project_out(o.reshape(B, T, KV, moa.routing.top_k, Dv).transpose(2, 3).flatten(-2), route)
        o = o.reshape(B, T, H * Dv)
        return L["o"](o if L.get("o_norm") is None else norm(o, L["o_norm"], self.eps))  # [B, T, hidden]

    def _attend_latent(self, cache: KVCache, x: "Batch", L: dict, a: torch.Tensor, rope: dict) -> torch.Tensor:
        """``_attend`` for latent attention (``Latent``): the cache's rows are ``[c, k_rope]``."""
        lat, (B, T), H = self.latent, x.ids.shape, self.num_heads
        S = x.mask.shape[-1]
        first, c, k_rope = L["qkv"](a).split([lat.q_rank or H * (lat.nope + lat.rope), lat.rank, lat.rope], dim=-1)
        q_low = None if L["q_b"] is None else rms_norm(first, L["q_norm"], LATENT_NORM_EPS)
        if L["q_gated"]:  # (A.X K2's: each head's query, then its output's gates)
            q, gate = L["q_b"](torch.cat([q_low, first], dim=-1)).view(B, T, H, -1).split(
                [lat.nope + lat.rope, lat.value], dim=-1)  # [B, T, H, nope + rope], [B, T, H, value]
        else:
            q, gate = first if q_low is None else L["q_b"](q_low), None
        q_nope, q_rope = q.reshape(B, T, H, lat.nope + lat.rope).transpose(1, 2).split([lat.nope, lat.rope], dim=-1)
        if self.family.query_temperature is not None:  # (Mistral 4's, on the whole query)
            q_nope, q_rope = (self.family.query_temperature.scale(t, x.pos) for t in (q_nope, q_rope))
        cos, sin = rope[L["rope"]]  # [B, 1, T, rope]
        k_rope = k_rope[:, None]  # [B, 1, T, rope]
        if L["rotates"]:
            q_rope = rotate(q_rope, cos, sin, self.family.interleaved_rope)  # [B, H, T, rope]
            k_rope = rotate(k_rope, cos, sin, self.family.interleaved_rope)
        kc = cache.k[L["index"]]  # [slots, 1, cap, rank + rope]
        kc[x.slots[:, None], 0, x.write] = torch.cat([rms_norm(c, L["kv_norm"], LATENT_NORM_EPS), k_rope[:, 0]], dim=-1)
        expand = lat.expands(T)
        query = torch.cat([q_nope if expand else q_nope @ L["uk"], q_rope], dim=-1)  # [B, H, T, nope or rank + rope]
        if L["indexer"] is not None:  # DeepSeek Sparse Attention: the keys this layer's indexer keeps (else the
            x.selected = self._select(cache, x, L, a, q_low, (cos, sin))  # last one's: GLM-5's shared layers)
        seen = x.mask if x.selected is None else x.selected

        def attend(b0: int, b1: int, rows: torch.Tensor) -> torch.Tensor:  # rows [b1 - b0, 1, S, rank + rope]
            latents = rows[..., :lat.rank]  # [b, 1, S, rank]
            if not expand:  # multi-query attention over the rows, the latents as values: the heads'
                b, S = b1 - b0, rows.shape[2]  # queries side by side as one head's (no copy of the rows per head)
                mask = seen[b0:b1].expand(b, H, T, S).reshape(b, 1, H * T, S)
                sinks = None if L["sinks"] is None else L["sinks"].repeat_interleave(T)[None]  # [1, H * T]: by row
                o = attention(query[b0:b1].reshape(b, 1, H * T, -1), rows, latents, mask, self.family.attn_scale, None,
                              sinks)
                return o.view(b, H, T, lat.rank) @ L["uv"]
            keys = torch.cat([latents @ L["uk"].transpose(1, 2), rows[..., lat.rank:].expand(-1, H, -1, -1)], dim=-1)
            return attention(query[b0:b1], keys, latents @ L["uv"], seen[b0:b1], self.family.attn_scale, None,
                             L["sinks"])

        if x.runs is not None:  # views of each run's cache rows
            parts = [attend(b0, b1, kc[s0:s0 + b1 - b0, :, :S]) for b0, b1, s0 in x.runs]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:  # a gathered copy
            o = attend(0, B, kc[x.slots, :, :S])
        o = o.transpose(1, 2)  # [B, T, H, value]
        if gate is not None:
            o = (o * torch.sigmoid(gate.float())).to(o.dtype)
        if L["out_gate"] is not None:  # (Ling's per head, Hy4's per element: in the model's dtype)
            o = o * torch.sigmoid(L["out_gate"](a).float()).to(o.dtype).view(B, T, H, -1)
        return L["o"](o.reshape(B, T, H * lat.value))  # [B, T, hidden]

    def _select(self, cache: KVCache, x: "Batch", L: dict, a: torch.Tensor, q_low: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """The keys each new token sees under layer ``L``'s DeepSeek Sparse Attention indexer
        (``SparseIndex``): ``x.mask`` and the ``topk`` it keeps, ``[B, 1, T, S]`` bool, None where
        the mask's ``S`` keys are no more than its ``topk`` (all kept); writes the new tokens' index
        keys. ``a [B, T, hidden]``: the layer's normed input; ``q_low [B, T, q_rank]``: the query's
        normed low-rank step; ``rope``: the layer's ``(cos, sin)`` ``[B, 1, T, rope]``."""
        ix, I, (B, T), S = self.sparse_index, L["indexer"], x.ids.shape, x.mask.shape[-1]
        cos, sin = (t.transpose(1, 2) for t in rope)  # [B, T, 1, rope], laid out for attention's rotation
        if self.family.interleaved_rope:  # the indexer's rotation by halves: its table by halves
            cos, sin = (torch.cat([t[..., 0::2]] * 2, dim=-1) for t in (cos, sin))
        q = I["wq_b"](q_low).view(B, T, ix.heads, ix.dim)  # [B, T, Hi, Di]
        k = norm(I["wk"](a), I["k_norm"], ix.norm_eps)[:, :, None]  # [B, T, 1, Di]
        # the rotated dimensions in transformers' order, first: GLM-5's pairs (each pair's first dimensions, then its
        # second ones, rotate as halves), Hy4's last ones (moved first: the dot products are the same)
        if ix.layout == "pairs":
            q, k = (torch.cat([t[..., 0:ix.rope:2], t[..., 1:ix.rope:2], t[..., ix.rope:]], dim=-1) for t in (q, k))
        elif ix.layout == "last":
            q, k = (torch.cat([t[..., -ix.rope:], t[..., :-ix.rope]], dim=-1) for t in (q, k))
        q, k = (rotate(t, cos, sin) for t in (q, k))
        rows = cache.index[I["slot"]]  # [slots, 1, capacity, Di]
        rows[x.slots[:, None], 0, x.write] = k[:, :, 0]
        if S <= ix.topk:
            return None
        keys = rows[x.slots, 0, :S]  # [B, S, Di]
        scores = F.relu((q.float() @ keys.float().transpose(1, 2)[:, None]) * ix.dim ** -0.5)  # [B, T, Hi, S]
        weights = I["weights"](a.float() if ix.in_float else a).float() * ix.heads ** -0.5  # [B, T, Hi]
        total = (weights[:, :, None] @ scores)[:, :, 0].masked_fill(~x.mask[:, 0], float("-inf"))  # [B, T, S]
        kept = torch.zeros_like(x.mask[:, 0]).scatter(-1, total.topk(ix.topk, dim=-1).indices, True)[:, None]
        return x.mask & kept

    def _mlp(self, L: dict, a: torch.Tensor) -> torch.Tensor:
        """A layer's MLP over ``a [B, T, hidden]``: dense, experts, or experts beside shared
        experts (GLM-4.5's; Qwen2-MoE's under a sigmoid gate)."""
        out = None
        if L["gate_up"] is not None:
            gate_up = L["gate_up"](a)
            if L.get("gate_up_adapter"):  # (Zamba2's)
                down, up = L["gate_up_adapter"]
                gate_up = gate_up + up(down(a))
            gate, *up = gate_up.chunk(1 + self.family.gated_mlp, dim=-1)  # (not gated: Nemotron-H's)
            if L["sparsity"] is not None:  # (Gemma 3n's first layers')
                gate = gaussian_top_k(gate, L["sparsity"])
            h = xielu(gate, *L["xielu"]) if L["xielu"] else ACTIVATIONS[self.family.activation](gate)
            h = h * up[0] if up else h
            out = L["down"](h if L.get("down_norm") is None else norm(h, L["down_norm"], self.eps))
            if L["shared_gate"] is not None:
                out = torch.sigmoid(F.linear(a, L["shared_gate"])) * out
        if L["experts"] is not None:
            # (Hy3's enable_moe_fp32_combine sums in float32, then casts: one rounding, as a sum in the model's dtype)
            out = L["experts"](a) if out is None else L["experts"](a) + out
            if L["experts_bias"] is not None:
                out = out + L["experts_bias"]
            out = out / 2 if self.family.experts_mean else out
        return out

    def _experts_beside(self, block: dict, h: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Gemma 4's MLP block: the dense MLP's output ``dense`` and its experts' (of the layer's
        input ``h`` normed their own way, routed by ``h`` normed without a weight, times the
        router's scale and hidden ** -0.5), each normed, summed."""
        route = rms_norm(h, None, self.eps) * block["router_scale"] * h.shape[-1] ** -0.5
        experts = block["experts"](norm(h, block["pre_norm"], self.eps), route=route)
        return norm(dense, block["dense_norm"], self.eps) + norm(experts, block["experts_norm"], self.eps)

    def _residual(self, out: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        """What attention's or the MLP's ``out`` adds to the residual stream: normed after
        (Gemma 2/3) or scaled (Granite) where the family says so."""
        if post_norm is not None:
            out = norm(out, post_norm, self.eps)
        return out if self.family.residual_scale is None else out * self.family.residual_scale

    def _mask(self, starts: list[int], S: int, T: int, chunk_masks, dev: torch.device,
              pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, 1, T, S]`` bool, and with a sliding window the same with only the keys within
        it (None without). Row b's chunk mask ``[n_b, m_b]`` covers its last ``m_b`` keys: the
        ``m_b - n_b`` cached keys before the chunk (a draft tree's earlier depths) and the
        chunk itself; every key before those is the committed prefix, always seen. No mask:
        causal over the chunk (``m_b = n_b``). ``starts``: each row's cached tokens; ``pos
        [B, T]`` (host): the new tokens' positions; built on ``dev``.

        A key's position is its row, but for a tree's nodes (a node's row is past its depth's):
        a token sees its ancestors there, a chain whose positions end at its own, so within a
        row's chunk mask the key with ``a`` seen keys after it is ``a`` positions back.

        Llama 4's chunked attention (``chunk``) is the sliding mask's other use: a query at
        position p sees the keys of its own chunk of ``chunk`` positions, a window of ``p %
        chunk + 1``. With ALiBi (``Family.alibi``) the mask is its biases ``[B, heads, T, S]``
        (float, -inf where not seen), of the keys' positions."""
        B = len(starts)
        tails = [0] * B
        if chunk_masks is not None:
            tails = [0 if m is None else m.shape[1] - m.shape[0] for m in chunk_masks]
        M = T + max(tails)
        # window[b, i, j]: new token i sees key (start_b + j), start_b = starts_b - tail_b
        window = torch.zeros(B, T, M, dtype=torch.bool, device=dev)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        for b in range(B):
            m = None if chunk_masks is None else chunk_masks[b]
            if m is None:
                window[b, :, :T] = causal
            else:
                assert m.shape[1] >= m.shape[0] and tails[b] <= starts[b], (m.shape, starts[b])
                n_b, t = m.shape[0], tails[b]
                window[b, :n_b, : m.shape[1]] = m.to(dev)
                pad = torch.arange(n_b, T, device=dev)  # padding rows see themselves (no NaN rows)
                window[b, pad, t + pad] = True
        start = torch.tensor([n - t for n, t in zip(starts, tails)], device=dev)  # [B]
        rel = torch.arange(S, device=dev)[None, :] - start[:, None]  # [B, S] key index in the window
        seen = window.gather(2, rel.clamp(0, M - 1)[:, None, :].expand(B, T, S))
        seen &= ((rel >= 0) & (rel < M))[:, None, :]
        mask = (rel < 0)[:, None, :] | seen  # [B, T, S]
        if self.window is None and self.chunk is None and self.family.alibi is None:
            return mask[:, None], None
        pos = pos.to(dev)
        key_pos = torch.arange(S, device=dev).expand(B, T, S)  # [B, T, S] each seen key's position: its row,
        masked = [b for b in range(B) if chunk_masks is not None and chunk_masks[b] is not None]
        if masked:  # but a chunk mask's keys': the new token's position less the keys seen after them
            key_pos = key_pos.clone()
            after = window.flip(-1).cumsum(-1).flip(-1) - window.long()  # [B, T, M] keys seen after each
            for b in masked:
                lo = starts[b] - tails[b]
                hi = min(lo + M, S)
                key_pos[b, :, lo:hi] = pos[b, :, None] - after[b, :, :hi - lo]
        if self.family.alibi is not None:  # (its biases in place of the mask)
            return self.family.alibi.bias(mask, key_pos, self.dtype), None
        width = self.window if self.chunk is None else (pos % self.chunk + 1)[:, :, None]  # int or [B, T, 1]
        return mask[:, None], (mask & (key_pos > pos[:, :, None] - width))[:, None]

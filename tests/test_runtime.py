"""The torch runtime against transformers on the same weights, and its cache mechanics."""
import math
import re
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime.torch_llama import TorchLlama

from tiny import (BAMBA, DELTA_NET, FALCON_H1, GEMMA4, GEMMA4_MOE, GRANITE, GRANITE_HYBRID_DENSE, JAMBA, LATENT, LFM3,
                  LLAMA4, MAMBA, MAMBA2_ALONE, MINISTRAL3_ROPE, MOE, NEMOTRON_H, OLMO_HYBRID, COHERE2_MOE, MIMO, DSA, VOCAB,
                  LAGUNA, PHIMOE, KIMI_LINEAR, LING, HY4, LARA, GEMMA3N, ZAMBA2, RECURRENT_GEMMA, MINIMAX, JETMOE,
                  greedy_by_whole_forwards)

ATOL = 1e-4  # fp32 logits, tiny random models


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("linear", ["dense", "onednn", "onednn-multi-row"])
def test_logits_match_transformers(tiny_dirs, arch, linear):
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights

    path = tiny_dirs[arch]
    multi = linear == "onednn-multi-row"  # 2+ row products through the verify-packed weights
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"),
                    torch.float32, linear=linear.removesuffix("-multi-row"), multi_row=multi)
    assert (rt.layers[0]["qkv"].multi is not None) == multi
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [20, vocab]
    cache = rt.new_cache(2)
    first = rt.forward(cache, [1], [ids[0, :13].tolist()])[0]  # prefill, then a chunk via the cache
    second = rt.forward(cache, [1], [ids[0, 13:].tolist()])[0]
    ours = torch.cat([first, second])
    assert (ours - ref).abs().max().item() < ATOL
    assert cache.lengths == [0, 20]


LONGROPE_PARTIAL = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                        short_factor=[1.0 + 0.2 * i for i in range(6)], long_factor=[3.0 + 0.7 * i for i in range(6)])
VARIANTS = {  # config fields the torch runtime reads, each against transformers' own model
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-rope-llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 16})),
    "llama-rope-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 16})),
    "mistral-window": ("mistral", dict(sliding_window=7)),
    "qwen2-window-layer-1": ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
    "qwen2-window-unused": ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2)),
    "qwen3-window": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    # Phi-3's fused projections, Granite's multipliers, SmolLM3's layers without rope
    "phi3-window": ("phi3", dict(sliding_window=7, pad_token_id=0)),
    "granite-multipliers": ("granite", dict(embedding_multiplier=3.0, attention_multiplier=0.3,
                                            residual_multiplier=0.5, logits_scaling=2.5)),
    "smollm3-no-rope-layer": ("smollm3", dict(no_rope_layers=[1, 0], pad_token_id=0)),
    # Gemma's family: norms of 1 + weight, scaled embeddings, tanh-gelu; Gemma 2's norms after
    # attention and MLP, capped attention scores and logits, windows on every other layer;
    # Gemma 3's q/k norms and a rope per layer type (the full layers' scaled)
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2-caps-window": ("gemma2", dict(head_dim=16, sliding_window=7, query_pre_attn_scalar=24,
                                          attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3-rope-per-layer-window": ("gemma3_text", dict(
        head_dim=16, sliding_window=7, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # the attention cap is in Gemma 3's config but transformers' model never applies it
    "gemma3-caps": ("gemma3_text", dict(head_dim=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # fields an architecture's model does not read: no window off for Gemma 2 / SmolLM3, no
    # layer types for Phi-3, no logit cap for Gemma, no hidden_activation for Granite
    "gemma2-window-flag-unread": ("gemma2", dict(head_dim=16, sliding_window=5, use_sliding_window=False)),
    "smollm3-window-flag-unread": ("smollm3", dict(pad_token_id=0, sliding_window=5, use_sliding_window=False,
                                                   layer_types=["sliding_attention", "full_attention"])),
    "phi3-layer-types-unread": ("phi3", dict(pad_token_id=0, sliding_window=5, layer_types=["full_attention"] * 2)),
    "gemma-cap-unread": ("gemma", dict(head_dim=16, final_logit_softcapping=3.0)),
    "granite-activation-unread": ("granite", dict(hidden_activation="gelu_pytorch_tanh")),
    # mixtures of experts (tiny.MOE): Mixtral's renormalised top 2 of 4 with a window on every
    # layer; Qwen2-MoE's shared expert under its gate, a dense layer (mlp_only_layers), or
    # experts on every other layer (decoder_sparse_step) renormalised; Qwen3-MoE's top 2 of 8
    "mixtral-window": ("mixtral", dict(**MOE["mixtral"], sliding_window=7)),
    "qwen2moe-shared-expert-dense-layer": ("qwen2_moe", dict(**MOE["qwen2_moe"], mlp_only_layers=[1])),
    "qwen2moe-sparse-step-renormalised": ("qwen2_moe", dict(MOE["qwen2_moe"], decoder_sparse_step=2,
                                                            norm_topk_prob=True, num_experts_per_tok=3)),
    "qwen3moe": ("qwen3_moe", MOE["qwen3_moe"]),
    "qwen3moe-window-not-renormalised": ("qwen3_moe", dict(MOE["qwen3_moe"], norm_topk_prob=False,
                                                           use_sliding_window=True, sliding_window=7)),
    # GPT-OSS: attention sinks, a window on every other layer, the softmax of the top k router
    # logits (router biases), clamped swiglu experts with biases, gate and up interleaved;
    # yarn past its original context, gate and up clamped (a low limit)
    "gptoss-sinks-window": ("gpt_oss", dict(MOE["gpt_oss"], sliding_window=7)),
    # GLM-4.5: a dense first layer, sigmoid routing among the best 2 of 4 groups with a correction
    # bias, scaled weights, a shared expert, half of each head rotated; with q/k norms, biases and
    # yarn, one group, weights not renormalised
    "glm45-groups-shared": ("glm4_moe", MOE["glm4_moe"]),
    "glm45-qk-norm-bias-yarn": ("glm4_moe", dict(MOE["glm4_moe"], use_qk_norm=True, attention_bias=True, n_group=1,
                                                 topk_group=1, norm_topk_prob=False, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5})),
    # latent attention (tiny.LATENT): DeepSeek-V3's with GLM-4.5's routing and interleaved rotary
    # pairs; without the query's low-rank step, rotary halves, yarn (its mscale_all_dim scales the
    # scores), one group, not renormalised; DeepSeek-V2's softmax routing, greedy or among the best
    # 2 of 4 groups by their best expert; GLM-4.7-Flash's (GLM-4.5's experts where mlp_layer_types says)
    "deepseekv3-groups-interleaved": ("deepseek_v3", MOE["deepseek_v3"]),
    "deepseekv3-no-q-lora-halves-yarn": ("deepseek_v3", dict(MOE["deepseek_v3"], q_lora_rank=None, rope_interleave=False,
                                                             n_group=1, topk_group=1, norm_topk_prob=False, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0})),
    "deepseekv2-greedy": ("deepseek_v2", dict(MOE["deepseek_v2"], topk_method="greedy", q_lora_rank=None)),
    # biases: the latent's beside a query projection without one; the latents' norms at transformers'
    # 1e-6 whatever rms_norm_eps says (a large one shows it)
    "deepseekv2-bias-no-q-lora-eps": ("deepseek_v2", dict(MOE["deepseek_v2"], q_lora_rank=None, attention_bias=True,
                                                          rms_norm_eps=1e-2)),
    "deepseekv3-bias-eps": ("deepseek_v3", dict(MOE["deepseek_v3"], attention_bias=True, rms_norm_eps=1e-2)),
    "deepseekv2-groups": ("deepseek_v2", MOE["deepseek_v2"]),
    "glm47flash": ("glm4_moe_lite", dict(MOE["glm4_moe_lite"], mlp_layer_types=["dense", "sparse", "dense"])),
    # GLM-4: rotary pairs interleaved on half of each head, norms after attention and the MLP
    "glm4-interleaved-partial-rope": ("glm4", dict(head_dim=16, attention_bias=True, pad_token_id=0)),
    "phi3-partial-rotary": ("phi3", dict(pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                           "partial_rotary_factor": 0.5})),
    # Phi-4-mini's longrope on three quarters of each head: the short factors (the 40 tokens stay
    # before the switch, 64) and the long ones (past it, 8, from the first forward on), each beside
    # the attention factor of max / original positions
    "phi3-longrope-partial": ("phi3", dict(pad_token_id=0, head_dim=16, original_max_position_embeddings=64,
                                           rope_parameters=dict(LONGROPE_PARTIAL, original_max_position_embeddings=64))),
    "phi3-longrope-long": ("phi3", dict(pad_token_id=0, head_dim=16, original_max_position_embeddings=8,
                                        rope_parameters=dict(LONGROPE_PARTIAL, original_max_position_embeddings=8))),
    "gptoss-yarn-clamped": ("gpt_oss", dict(MOE["gpt_oss"], num_local_experts=8, num_experts_per_tok=3, swiglu_limit=0.3, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    # Qwen3.5: DeltaNet layers (recurrent states, short convolutions) beside gated attention
    # with a quarter of each head rotated, norms of 1 + weight; an attention bias
    "qwen35-delta-net": ("qwen3_5_text", DELTA_NET),
    "qwen35-bias-conv-kernel-2": ("qwen3_5_text", dict(DELTA_NET, attention_bias=True, linear_conv_kernel_dim=2)),
    "qwen3next-experts-dense-layer": ("qwen3_next", MOE["qwen3_next"]),
    "qwen35moe-experts": ("qwen3_5_moe_text", MOE["qwen3_5_moe_text"]),
    # Granite's mixtures: softmax over the top k logits, shared experts beside them; Granite 4.0's hybrids:
    # Mamba-2 layers (states in groups of heads, convolutions with a bias; a prompt's scan in several
    # chunks) beside attention without rope and experts, or with rope and a dense MLP; Bamba's beside
    # attention that rotates half of each head
    "granitemoe": ("granitemoe", MOE["granitemoe"]),
    "granitemoeshared": ("granitemoeshared", MOE["granitemoeshared"]),
    "granite4h-mamba2-experts": ("granitemoehybrid", MOE["granitemoehybrid"]),
    "granite4h-dense-rope": ("granitemoehybrid", GRANITE_HYBRID_DENSE),
    # Zamba2: Mamba-2 layers, shared blocks with adapters between them (``tiny.ZAMBA2``); and one block, run by the
    # first layer too, without attention adapters or rope, over 2 key/value heads, its norms at 1e-2 (its Mamba-2
    # layers' gated norms at 1e-5 whatever rms_norm_eps says, as transformers builds them)
    "zamba2-shared-blocks-adapters": ("zamba2", ZAMBA2),
    # RecurrentGemma: RG-LRU blocks beside windowed multi-query attention (``tiny.RECURRENT_GEMMA``); and blocks wider
    # than the model (96) in 2 heads of gates, a convolution of 3, attention over 4 key/value heads
    "recurrentgemma-rglru-window": ("recurrent_gemma", RECURRENT_GEMMA),
    # MiniMax-Text-01: lightning attention beside full attention, experts (``tiny.MINIMAX``); and its residual factors
    # other than 1, a window of 6 on its full attention
    "minimax-lightning-experts": ("minimax", MINIMAX),
    # JetMoE: attention experts beside MLP experts (``tiny.JETMOE``); and 8 of each, 3 a token, over 4 key/value heads
    # (the config's num_attention_heads left stale, as transformers saves it)
    "jetmoe-attention-experts": ("jetmoe", JETMOE),
    # BitNet (unquantized: its bf16 masters as transformers runs them without a quantization_config): a norm before
    # attention's output product and before the MLP's down product, relu2 gated
    "bitnet-sub-norms-relu2": ("bitnet", {}),
    "jetmoe-three-of-eight": ("jetmoe", dict(JETMOE, num_key_value_heads=4, kv_channels=8, num_local_experts=8,
                                             num_experts_per_tok=3)),
    "minimax-factors-window": ("minimax", dict(MINIMAX, sliding_window=6, full_attn_alpha_factor=1.5,
                                               full_attn_beta_factor=0.7, linear_attn_alpha_factor=0.9,
                                               linear_attn_beta_factor=1.2, mlp_alpha_factor=1.1, mlp_beta_factor=0.8)),
    "recurrentgemma-wide-lru-mha": ("recurrent_gemma", dict(RECURRENT_GEMMA, lru_width=96, num_attention_heads=2,
                                                            num_key_value_heads=2, conv1d_width=3)),
    "zamba2-one-block-gqa-nope": ("zamba2", dict(ZAMBA2, num_mem_blocks=1, use_shared_attention_adapter=False,
                                                 use_mem_rope=False, num_key_value_heads=2, rms_norm_eps=1e-2,
                                                 layers_block_type=["hybrid", "mamba", "mamba", "hybrid", "mamba",
                                                                    "hybrid"])),
    "bamba-half-rope": ("bamba", BAMBA),
    # Nemotron-H: blocks of one mixer or one MLP each (Mamba-2, experts of relu2 not gated under sigmoid
    # routing in groups with a shared expert, attention without rope, a dense MLP), its names (backbone.)
    "nemotronh-blocks": ("nemotron_h", NEMOTRON_H),
    # LFM2: short convolutions (B * x convolved, times C) beside attention with q/k norms, its names
    "lfm2-conv": ("lfm2", dict(layer_types=["conv", "full_attention", "conv"], layers=3)),
    # LFM3: LFM2's convolutions beside windowed and full attention (a part of each head rotated, proportional rope),
    # norms after the mixer and the MLP too, a gate per head on attention's output
    "lfm3-windows-gates": ("lfm3", dict(LFM3, layers=5)),
    # OLMo-Hybrid: Gated DeltaNet layers (projections apart, beta in [0, 2]) beside OLMo 3's attention (norms after),
    # with rope or without (its released checkpoints')
    "olmohybrid-rope": ("olmo_hybrid", OLMO_HYBRID),
    "olmohybrid-nope": ("olmo_hybrid", dict(OLMO_HYBRID, rope_parameters={"rope_type": "default", "rope_theta": None})),
    "lfm3-plain": ("lfm3", dict(LFM3, layers=5, use_sandwich_norm=False, use_attention_gate=False)),
    "lfm2moe-expert-bias": ("lfm2_moe", MOE["lfm2_moe"]),
    # Falcon-H1: attention and Mamba-2 side by side, its muP multipliers; the Mamba-2 output normed before the
    # gate, or not normed
    "falconh1-parallel-mup": ("falcon_h1", FALCON_H1),
    "falconh1-no-mamba-norm": ("falcon_h1", dict(FALCON_H1, mamba_rms_norm=False)),
    # Mamba's selective scan alone in each block (per-channel decays; a prompt's scan in chunks), with Falcon-Mamba's
    # dt, B and C normed without weights; Mamba-2 alone; Jamba's Mamba layers (dt, B and C normed by weights) beside
    # attention without rope, experts on every other layer
    "mamba-tied": ("mamba", dict(MAMBA, tie_word_embeddings=True)),
    "falconmamba": ("falcon_mamba", MAMBA),
    "mamba2-alone": ("mamba2", MAMBA2_ALONE),
    "jamba-experts": ("jamba", JAMBA),
    "jamba-dense": ("jamba", dict(JAMBA, num_experts=1)),
    # norms after attention and the MLP alone (none before): OLMo 2's with q/k norms over all heads and rope in float32,
    # OLMo 3's windows on 3 of 4 layers (a rope per layer type), Exaone 4's with q/k norms per head and no rope on
    # the full-attention layers (or rope everywhere without windows); OLMoE's experts
    "olmo2-norms-after": ("olmo2", {}),
    "olmo3-windows": ("olmo3", dict(layers=4, sliding_window=6)),
    "exaone4-windows-nope": ("exaone4", dict(layers=4, sliding_window=6, layer_types=["sliding_attention"] * 3
                                             + ["full_attention"])),
    "exaone4-no-windows": ("exaone4", dict(sliding_window=None, sliding_window_pattern=None,
                                           layer_types=["full_attention"] * 2)),
    "olmoe-experts": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    # ERNIE 4.5: rotary pairs interleaved over whole heads, in float32, biases; Arcee: relu2(up), not gated; Seed-OSS:
    # biases on q/k/v and on the output apart; Ministral: windows on one layer of two
    "ernie45-interleaved-bias": ("ernie4_5", dict(use_bias=True)),
    "arcee-relu2": ("arcee", dict(hidden_act="relu2")),
    "seedoss-biases": ("seed_oss", dict(attention_bias=True, attention_out_bias=True, head_dim=16)),
    "ministral-windows": ("ministral", dict(head_dim=16, sliding_window=6,
                                            layer_types=["sliding_attention", "full_attention"])),
    # HunYuan: q/k norms after the rotation (its names), rope "dynamic" with a fixed alpha (a stretched base);
    # dots.llm1: Qwen3's attention, DeepSeek-V3's experts (sigmoid routing in groups, shared experts, a dense layer)
    "hunyuan-norms-after-rope-alpha": ("hunyuan_v1_dense", dict(head_dim=16, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
    "dots1-experts": ("dots1", dict(MOE["glm4_moe"], head_dim=16, norm_topk_prob=True)),
    # layer norms: Cohere's (no bias, in float32) before attention and the MLP side by side, rotary pairs interleaved,
    # the logits scaled; Command R7B's (cohere2) windows on 3 layers of 4 and no rope on the others; StarCoder2's
    # (biases, as on every projection), its MLP gelu(c_fc) not gated, windows
    "cohere-parallel-layernorm": ("cohere", dict(logit_scale=0.3)),
    "cohere2-windows-nope": ("cohere2", dict(layers=4, sliding_window=6, logit_scale=0.3)),
    "starcoder2-layernorm-biases": ("starcoder2", dict(use_bias=True, sliding_window=6, hidden_act="gelu_pytorch_tanh")),
    # Ministral 3 (Mistral 3's text model): yarn, queries scaled by 1 + beta log(1 + floor(position / 16)) past 16
    "ministral3-yarn-temperature": ("ministral3", dict(head_dim=16, rope_parameters=MINISTRAL3_ROPE)),
    # ERNIE 4.5's experts: chosen by the softmax plus a correction bias, weighted by the softmax renormalised, a shared
    # expert beside them, a dense first layer; its interleaved rope in float32, biases
    "ernie45moe-correction": ("ernie4_5_moe", dict(use_bias=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                                   moe_num_shared_experts=1, layers=3)),
    # Apertus: xIELU(up) of each layer's own trained parameters, not gated; q/k norms; its norms' names; llama3 rope
    "apertus-xielu": ("apertus", dict(head_dim=16)),
    # Apertus 1.5's: Apertus's layers, its head pruned to the text tokens (the logits narrower than the embedding)
    "apertus1p5-pruned-head": ("apertus1p5_text", dict(head_dim=16, output_vocab_size=VOCAB - 6)),
    # Mistral 4: DeepSeek-V3's latent attention, its queries scaled past the original context (Llama 4's), experts
    # chosen by the softmax among the best groups (each by its best two), renormalised, a dense first layer
    "mistral4-latent-temperature": ("mistral4", dict(MOE["glm4_moe"], **LATENT, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, llama_4_scaling_beta=0.3,
        mscale_all_dim=1.0, mscale=1.0, beta_fast=32.0, beta_slow=1.0, partial_rotary_factor=0.4))),
    # layer norms, a quarter or half of each head rotated, MLPs not gated: GPT-NeoX's (Pythia's) attention and MLP side
    # by side, each of its own norm, its fused projection per head ([heads, 3, head_dim]), biases, erf gelu (or one
    # after the other); Phi's side by side of one norm, its tanh gelu written out, its head's bias (and q/k layer
    # norms); StableLM's q/k norms one per head, biases (or side by side of one norm)
    "gptneox-parallel": ("gpt_neox", dict(num_key_value_heads=None)),
    "gptneox-sequential": ("gpt_neox", dict(num_key_value_heads=None, use_parallel_residual=False)),
    "phi-parallel": ("phi", {}),
    "phi-qk-layernorm": ("phi", dict(qk_layernorm=True)),
    "stablelm-norms-per-head": ("stablelm", dict(qk_layernorm=True, use_qkv_bias=True)),
    "stablelm-parallel": ("stablelm", dict(use_parallel_residual=True)),
    # Command R+'s q/k layer norms, a weight per head, in float32; queries, keys and values clamped: OLMoE's after its
    # q/k norms, OLMo's (norms without weights, rope in float32)
    # GPT-J: attention beside a gelu MLP of one layer norm, rotary pairs interleaved on rotary_dim of each head, its
    # head's bias; Falcon: multi-query attention beside the MLP (Falcon-7B's), its new decoder architecture's groups of
    # heads sharing keys and values with a norm before each side (Falcon-40B's) or one (Falcon2-11B's), or one after the
    # other (heads fused per head), biases
    "gptj-interleaved-partial": ("gptj", dict(rotary_dim=8)),
    "falcon-multi-query": ("falcon", {}),
    "falcon-groups-two-norms": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    "falcon-groups-one-norm": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2,
                                               num_ln_in_parallel_attn=1)),
    "falcon-sequential": ("falcon", dict(multi_query=False, parallel_attn=False, bias=True)),
    # GPT-2: learned positions added to the embeddings, no rope, products' weights transposed (Conv1D); scores unscaled
    "gpt2-learned-positions": ("gpt2", dict(num_key_value_heads=None)),
    "gpt2-unscaled": ("gpt2", dict(num_key_value_heads=None, scale_attn_weights=False, std=0.05)),
    # OPT: learned positions from row 2, queries scaled as they come out of their product, a relu MLP
    "opt-learned-positions": ("opt", dict(num_key_value_heads=None, ffn_dim=128)),
    # GPT-BigCode (StarCoder): GPT-2's layers with multi-query attention (or its projection fused per head); Nemotron:
    # layer norms of 1 + weight, relu2(up), half of each head rotated
    "bigcode-multi-query": ("gpt_bigcode", dict(num_key_value_heads=None)),
    "bigcode-per-head": ("gpt_bigcode", dict(num_key_value_heads=None, multi_query=False)),
    "nemotron-layernorm1p": ("nemotron", dict(head_dim=16)),
    # Llama's layers under other names: EXAONE 3's (as saved: transformer.h.{i}.attn.attention...), InternLM 3's
    # (biases), IQuest-Coder's
    "exaone3-names": ("exaone", {}),
    "internlm3-biases": ("internlm3", dict(head_dim=16, qkv_bias=True, bias=True)),
    "iquestcoder": ("iquestcoder", dict(head_dim=16)),
    "helium-interleaved-float-norms": ("helium", dict(head_dim=16)),  # Helium: rotary pairs interleaved, norms in float32
    # EXAONE-MoE: EXAONE 4's attention (windows on 3 layers of 4, rope on those alone) before the MLP, DeepSeek-V3's
    # experts (a correction bias saved beside the router, shared experts) after a dense first layer
    "exaonemoe-windows-experts": ("exaone_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                     num_shared_experts=1, n_group=4, topk_group=2,
                                                     routed_scaling_factor=2.5, layers=4, sliding_window=6, head_dim=16,
                                                     layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                                     mlp_layer_types=["dense", "sparse", "sparse", "sparse"])),
    # Granite-SWA: Granite's multipliers, windows on the layers layer_types names, a sink per head, a rope base per
    # layer (none on the first)
    "graniteswa-sinks-bases": ("granite_swa", dict(GRANITE, layers=4, sliding_window=6,
                                                   layer_types=["full_attention"] + ["sliding_attention"] * 3,
                                                   layer_rope_theta=[0, 10000.0, 500.0, 10000.0])),
    "cohere-qk-norms": ("cohere", dict(use_qk_norm=True, logit_scale=0.3)),
    "olmoe-clip": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, clip_qkv=0.5)),
    "olmo-plain-norms-clip": ("olmo", dict(clip_qkv=0.5)),
    # ALiBi's position biases, no rope: BLOOM's (6 heads: slopes past the power of two; its embeddings' layer norm,
    # per-head fused projection, biases), MPT's (its own slopes, its norms without biases, queries, keys and values
    # clamped, its softmax scale), Falcon-RW's (scores and biases scaled together)
    "bloom-alibi": ("bloom", dict(num_key_value_heads=None, num_attention_heads=6, hidden_size=48)),
    "mpt-alibi-clip": ("mpt", dict(num_key_value_heads=None, max_seq_len=512, num_attention_heads=6, hidden_size=48,
                                   attn_config=dict(clip_qkv=0.5, softmax_scale=0.2))),
    "falconrw-alibi": ("falcon", dict(alibi=True, multi_query=False, parallel_attn=False, bias=True)),
    # GLM (GLM-4-9B's first release): GLM-4's layers without its norms after (biases on q/k/v, rotary pairs interleaved
    # on half of each head); VaultGemma: Gemma 2's without its norms after; FlexOlmo: OLMo 2's attention and norms
    # after, OLMoE's experts; GraniteMoE-SWA: Granite-SWA's attention (windows, sinks, a rope base per layer) before
    # Granite's experts and shared MLP
    "glm-interleaved-half": ("glm", dict(head_dim=16, pad_token_id=0)),
    "vaultgemma-softcaps": ("vaultgemma", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24)),
    "flexolmo-experts": ("flex_olmo", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
    "granitemoeswa-sinks-experts": ("granitemoe_swa", dict(MOE["granitemoeshared"], layers=4, sliding_window=6,
                                                           layer_types=["full_attention"] + ["sliding_attention"] * 3,
                                                           layer_rope_theta=[0, 10000.0, 500.0, 10000.0])),
    # Solar Open: Llama's attention before GLM-4.5's experts on every layer; Jais 2: layer norms, relu2(up) not gated,
    # biases; HunYuan-MoE: HunYuan's attention (q/k norms after the rotation) before experts routed in float32 (the top
    # k of the softmax, renormalised) beside a shared MLP
    "solaropen-experts": ("solar_open", dict({k: v for k, v in MOE["glm4_moe"].items() if k != "first_k_dense_replace"},
                                             head_dim=16, pad_token_id=0)),
    "jais2-layernorm-relu2": ("jais2", dict(head_dim=16)),
    "hunyuanmoe-experts": ("hunyuan_v1_moe", dict(num_experts=4, moe_topk=2, head_dim=16, intermediate_size=32)),
    # NanoChat: norms without weights (the embeddings' too), rope turned the other way, q/k norms after it, relu2(up)
    # not gated, the logits capped
    "nanochat-weightless-norms": ("nanochat", dict(head_dim=16)),
    # AFMoE (Arcee's Trinity): q/k norms, rope on its windowed layers alone, its output gated by its own product (a
    # gate without the queries' bias), norms after attention and the MLP too, in float32; experts chosen by the
    # sigmoid (in float32) plus an expert bias, renormalised and scaled, beside shared experts, after a dense layer;
    # muP's embeddings times sqrt(hidden)
    "afmoe-gated-windows-experts": ("afmoe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  num_shared_experts=1, num_dense_layers=1, layers=4, head_dim=16,
                                                  sliding_window=6, route_scale=2.5, mup_enabled=True,
                                                  attention_bias=True,
                                                  layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    # GPT-Neo: learned positions, scores not scaled, windows on its "local" layers, layer norms, a gelu MLP
    "gptneo-local-layers": ("gpt_neo", dict(num_key_value_heads=None, window_size=6,
                                            attention_types=[[["global", "local"], 1]])),
    # CWM: Llama's layers, windows on 3 of 4; Youtu: DeepSeek-V3's latent attention before dense MLPs; A.X K1:
    # DeepSeek-V3's, its experts' output (with the shared ones') normed
    "cwm-windows": ("cwm", dict(layers=4, sliding_window=6)),
    "youtu-latent-dense": ("youtu", dict(LATENT)),
    # MiniCPM3: latent attention (halves rotated, not pairs) before dense MLPs, muP's multipliers (the
    # embeddings', the residual branches', the last hidden state divided), longrope without a switch
    # Gemma 4: heads of two widths, keys as values, per-layer inputs, keys shared by the last layers (``GEMMA4``); and
    # its 31B's kind: no per-layer inputs, no shared keys, values of their own
    "gemma4-shared-kv-per-layer": ("gemma4_text", GEMMA4),
    "gemma4-plain": ("gemma4_text", dict(GEMMA4, attention_k_eq_v=False, hidden_size_per_layer_input=0,
                                         num_kv_shared_layers=0, use_double_wide_mlp=False)),
    "gemma4-experts-beside": ("gemma4_text", GEMMA4_MOE),
    # MiniMax-M2: q/k norms over all heads, half of each head rotated (rotary_dim), experts chosen by their sigmoid
    # plus a correction bias
    "minimax-m2-experts": ("minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, rotary_dim=8)),
    # Cohere2-MoE (Command A Plus): Cohere's parallel block, rope on windowed layers and dense first ones, experts
    # weighted by the top logits' softmax averaged with a shared one; or their sigmoid summed with it, RMS norms
    "cohere2moe-softmax-average": ("cohere2_moe", dict(COHERE2_MOE, layers=4)),
    # MiMo-V2-Flash: values narrower than keys (and scaled), twice the key/value heads and a sink per head on its
    # windowed layers, a third of each head rotated, DeepSeek-V3's routing without shared experts after a dense layer
    "mimo-windows-sinks-experts": ("mimo_v2_flash", dict(MIMO, layers=4)),
    # DeepSeek-V3.2: DeepSeek-V3's layers under sparse attention (an indexer keeping each token's best 6 keys, rotated
    # by halves where attention's pairs are neighbours); GLM-5's: pairs in its indexer too, its middle layer keeping
    # the first one's choice
    # Hy3 (Tencent): q/k norms, a float32 router's sigmoid choosing with a correction bias, renormalised and scaled,
    # beside a shared expert; a dense first layer
    "hy3-qk-norms-experts": ("hy_v3", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 head_dim=16, layers=3, router_scaling_factor=2.5)),
    # Sarvam's: Sarvam-30B's GLM-4.5 layers (q/k norms, biases, the whole head rotated) under their original names
    # (word_embeddings, a fused query_key_value, dense, query/key_layernorm, expert_bias), as transformers saves them;
    # Sarvam-105B's DeepSeek-V3 layers, its queries in one product (no q_lora_rank)
    "sarvam-moe-original-names": ("sarvam_moe", dict(MOE["glm4_moe"], head_dim=16, use_qk_norm=True,
                                                     attention_bias=True)),
    "sarvam-mla-one-query-product": ("sarvam_mla", dict(MOE["glm4_moe"], **dict(LATENT, q_lora_rank=None))),
    # Laguna (poolside): a number of query heads per layer, each head's output gated through a softplus (or each
    # element's), q/k norms, windows and half of each head rotated on the full-attention layers; AFMoE's routing, its
    # logits capped, scaled; a shared expert (saved as shared_expert, its correction bias under experts.)
    "laguna-heads-per-layer-gates": ("laguna", LAGUNA),
    "laguna-element-gates": ("laguna", dict(LAGUNA, gating="per-element", moe_router_logit_softcapping=0.0)),
    # Phi-3.5-MoE: layer norms, biases (the head's too), longrope's scales past 8 positions (its factors alike before
    # and after: ``test_phimoe_long_factors``), experts by its sparsemixer (the best, then the best of the others, each
    # weighted among those near it), under Mixtral's names
    "phimoe-sparsemixer-longrope": ("phimoe", PHIMOE),
    # A.X K2: DeepSeek-V3.2's layers, its second query product giving each head's output gates too (from the normed
    # low-rank step beside the raw one), RMS norms gated by a low-rank sigmoid (W_down / W_up as released), the experts
    # outside the best groups scored 0
    "axk2-gated-norms-query-gates": ("axk2", dict(DSA, gated_norm_rank=4)),
    "deepseekv32-sparse-attention": ("deepseek_v32", DSA),
    # Kimi Linear: Kimi Delta Attention (a decay per key channel, low-rank forget and output gates, the output's norm
    # gated by a sigmoid) beside latent attention without rope (its query in one product, or a low-rank step), experts
    "kimilinear-kda-latent-nope": ("kimi_linear", KIMI_LINEAR),
    "kimilinear-query-low-rank": ("kimi_linear", dict(KIMI_LINEAR, q_lora_rank=20)),
    # Ling's hybrids: Kimi Delta Attention with full-rank gates, decays bounded by a sigmoid (kda_safe_gate) or Kimi's
    # softplus, its convolution in float32; latent attention with rope, a sigmoid gate per head on its output
    "ling-kda-bounded-decays": ("bailing_hybrid", LING),
    "ling-kda-softplus-no-q-lora": ("bailing_hybrid", dict(LING, kda_safe_gate=False, q_lora_rank=None)),
    # Hy4: hyper-connections (3 streams a token), DeepSeek Sparse Attention (its indexer rotating its last dimensions,
    # by halves, its key norm and weights in float32) over latent attention (rope by halves) with a sink per head and
    # a gate per element on its output, experts whose silu clamps, its head in float32; its names as saved
    "hy4-hyper-connections-sparse-sinks": ("hy_v4", HY4),
    # Gemma 3n: 4 streams a token (alternating updates), LAuReL's low-rank residual, sparse gates on 2 layers, per-layer
    # inputs, keys shared by the last 2 layers (``tiny.GEMMA3N``); and 3 streams, the second active, its corrected
    # output unscaled, no shared keys or sparse gates, MLPs of two widths
    "gemma3n-altup-laurel-sparse": ("gemma3n_text", GEMMA3N),
    "gemma3n-active-second-unscaled": ("gemma3n_text", dict(GEMMA3N, altup_num_inputs=3, altup_active_idx=1,
                                                            altup_correct_scale=False, num_kv_shared_layers=0,
                                                            activation_sparsity_pattern=[0.0] * 6,
                                                            intermediate_size=[96, 128] * 3)),
    # HyperCLOVA X: Granite's muP multipliers (its logits times logits_scaling), norms after attention and the MLP too
    # (Peri-LN: post_norm1 / post_norm2), before the residual multiplier
    "hyperclovax-peri-norms-mup": ("hyperclovax", dict(GRANITE, head_dim=16)),
    # Lara: Qwen3.5's DeltaNet layers (one fused input product, their gated norm in float32) beside windowed and full
    # attention without a gate, float32 norms, experts of a float32 router beside an ungated shared expert
    "lara-delta-windows-experts": ("lara_mini", LARA),
    # Aria's text model: experts on every layer (the softmax of the top 2 logits; silu whatever hidden_act says, the
    # shared experts' gelu here), stored [experts, in, out] (fc1 / fc2), beside shared experts twice as wide
    # Cohere Compass's text model (North): Command R7B's layers, rope by halves on the windowed layers alone (its rope
    # parameters per layer type, None for the full ones), logits scaled
    "cohere-compass-halves-nope-full": ("cohere_compass_text", dict(
        layers=4, head_dim=16, sliding_window=6, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
        logit_scale=0.5, pad_token_id=0)),
    "aria-experts-transposed": ("aria_text", dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2,
                                                  intermediate_size=32, pad_token_id=0, hidden_act="gelu_pytorch_tanh")),
    "glm5-sparse-attention-shared": ("glm_moe_dsa", dict(DSA, indexer_types=["full", "shared", "full"])),
    # Mellum 2 (JetBrains): Qwen3-MoE's attention and experts, windows and a rope base per layer type, a dense layer
    "mellum-windows-experts": ("mellum", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, layers=4,
                                              head_dim=16, sliding_window=6, mlp_layer_types=["dense"] + ["sparse"] * 3,
                                              layer_types=["sliding_attention", "full_attention"] * 2)),
    "cohere2moe-sigmoid-sum-rms": ("cohere2_moe", dict(COHERE2_MOE, layers=4, expert_selection_fn="sigmoid",
                                                       shared_expert_combination_strategy="sum", rms_norm_eps=1e-6,
                                                       prefix_dense_sliding_window_pattern=2)),
    # Gemma 4 12B's kind (the unified model: no per-layer inputs, keys as values on its full layers)
    "gemma4-unified": ("gemma4_unified_text", {k: v for k, v in GEMMA4.items() if k not in (
        "vocab_size_per_layer_input", "hidden_size_per_layer_input", "use_double_wide_mlp", "num_kv_shared_layers")}),
    "minicpm3-latent-mup": ("minicpm3", dict(LATENT, scale_emb=3.0, scale_depth=1.4, dim_model_base=16,
                                             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                                  original_max_position_embeddings=512,
                                                                  short_factor=[1.0, 1.5, 2.0, 4.0],
                                                                  long_factor=[8.0] * 4))),
    "axk1-latent-experts-normed": ("axk1", dict(MOE["deepseek_v3"], mlp_layer_types=["dense", "sparse", "sparse"])),
    # CodeGen: GPT-J's layers, its fused projection in 4 blocks of queries, values and keys (2 heads a block here)
    "codegen-blocks": ("codegen", dict(num_key_value_heads=None, num_attention_heads=8, rotary_dim=4)),
    # Persimmon: GPT-NeoX's fused projection per head, q/k layer norms, half of each head rotated, a relu2 MLP
    "persimmon-qk-layernorm": ("persimmon", dict(num_key_value_heads=None)),
    # DBRX: grouped-query attention through one fused projection, clamped, layer norms without biases, experts on every
    # layer (the top k of the softmax renormalised), stored as w1 / v1 / w2 of [experts x inter, hidden]
    "dbrx-experts-clip": ("dbrx", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512,
                                       attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500.0),
                                       rope_parameters=dict(rope_type="default", rope_theta=500.0),
                                       ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    # Kolibri: EXAONE 4's attention (rope on its windowed layers alone) in GLM-4's norms, experts on every layer chosen
    # by the router's logits plus a correction bias, weighted by their sigmoid, beside shared experts; its norms' and
    # bias's names as saved
    "kolibri1-windows-experts": ("kolibri1", dict(layers=4, head_dim=16, sliding_window=6, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, pad_token_id=0,
                                                  layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    # Flint: a sink per head, rope on its windowed layers alone, norms' products in float32, experts chosen by the
    # sigmoid of a float32 router beside a shared expert, after a dense layer
    "flint-sinks-windows-experts": ("flint", dict(layers=4, head_dim=16, sliding_window=6, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, pad_token_id=0,
                                                  mlp_only_layers=[0],
                                                  layer_types=["full_attention"] + ["sliding_attention"] * 3)),
    "llama4-chunks-experts": ("llama4_text", LLAMA4),  # (``tiny.LLAMA4``)
    # Maverick's kind: no q/k norms, experts on every layer (one each), no chunks, no temperature
    "llama4-maverick-kind": ("llama4_text", dict(LLAMA4, use_qk_norm=False, interleave_moe_layer_step=1,
                                                 num_experts_per_tok=1, attention_chunk_size=None,
                                                 attn_temperature_tuning=False)),
}


def test_kimi_linear_dense_mlp_as_released(tmp_path):
    """Kimi Linear's released checkpoints keep their dense MLPs under ``mlp.`` and their experts under
    ``block_sparse_moe.``; transformers saves both under ``block_sparse_moe.``: either loads to the same logits."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    path = make_tiny(tmp_path / "saved", "kimi_linear", seed=5, **KIMI_LINEAR)
    released = tmp_path / "released"
    shutil.copytree(path, released)
    tensors = load_file(path / "model.safetensors")
    dense = [n for n in tensors if re.search(r"block_sparse_moe\.(gate|up|down)_proj\.", n)]
    assert dense
    save_file({n.replace(".block_sparse_moe.", ".mlp.") if n in dense else n: t for n, t in tensors.items()},
              released / "model.safetensors", metadata={"format": "pt"})
    runtimes = [TorchLlama(AutoConfig.from_pretrained(p), Weights(p), torch.device("cpu"), torch.float32)
                for p in (path, released)]
    assert torch.equal(*(rt.forward(rt.new_cache(1), [0], [list(range(3, 20))]) for rt in runtimes))


def test_hy4_long_chunk_expands_with_sinks(tmp_path):
    """Hy4's sinks join the softmax of latent attention in both of its forms: a long chunk's
    (keys and values expanded per head) and a short one's (the heads as rows of one, each row its
    head's sink): both give transformers' logits."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import causal_lm, make_tiny

    path = make_tiny(tmp_path / "hy4", "hy_v4", seed=5, **HY4)
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = causal_lm(path).eval()(ids).logits[0]  # [40, vocab]
    assert rt.latent.expands(40) and not rt.latent.expands(8)
    cache = rt.new_cache(1)
    ours = torch.cat([rt.forward(cache, [0], [ids[0, a:b].tolist()])[0] for a, b in ((0, 32), (32, 40))])
    assert (ours - ref).abs().max().item() < ATOL * ref.abs().max().item()
    assert rt.layers[0]["sinks"].abs().min() > 0.5  # (sinks that weigh: Hy4's tiny starts them at 3)


def test_phimoe_long_factors(tmp_path):
    """Past its original context Phi-3.5-MoE's rows rotate by its long factors and scale by its
    long_mscale, as its released code and vLLM compute them (transformers' model keeps the short
    factors at every length: ``VARIANTS`` checks the rest against it with factors alike)."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    rope = dict(PHIMOE["rope_parameters"], long_factor=[3.0 + 0.7 * i for i in range(8)])
    path = make_tiny(tmp_path / "phimoe", "phimoe", seed=5, **dict(PHIMOE, rope_parameters=rope))
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    base = 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    (short, short_scale), (long, long_scale) = rt.rope[None], rt.rope_long[None]
    torch.testing.assert_close(short, 1 / (torch.tensor(rope["short_factor"]) * base))
    torch.testing.assert_close(long, 1 / (torch.tensor(rope["long_factor"]) * base))
    assert (short_scale, long_scale) == (rope["short_mscale"], rope["long_mscale"]) and rt.switch == 8


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    """Biases on every projection, scaled rotary embeddings, and sliding windows (Mistral's on
    every layer, Qwen's on some) over a sequence several windows long, fed as a prompt, a
    chunk and single tokens through the cache, each row against transformers' logits."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import causal_lm, make_tiny

    arch, config = VARIANTS[variant]
    path = make_tiny(tmp_path / variant, arch, seed=5, **config)
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    hf = causal_lm(path).eval()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [40, vocab]
    cache = rt.new_cache(1)
    ours = [rt.forward(cache, [0], [ids[0, a:b].tolist()])[0] for a, b in [(0, 11), (11, 30)] + [(i, i + 1) for i in range(30, 40)]]
    assert (torch.cat(ours) - ref).abs().max().item() < ATOL * ref.abs().max().item(), variant
    assert rt.max_context == 512  # a window does not bound the context


@pytest.mark.parametrize("arch", ["llama", "granite", "gemma2", "gemma3_text", "mixtral-window",
                                  "qwen2moe-shared-expert-dense-layer", "qwen3moe", "gptoss-sinks-window",
                                  "glm45-groups-shared", "glm4-interleaved-partial-rope", "qwen35-delta-net",
                                  "qwen3next-experts-dense-layer", "qwen35moe-experts", "granitemoe", "granitemoeshared",
                                  "lfm2-conv", "lfm2moe-expert-bias", "olmo2-norms-after", "olmo3-windows",
                                  "exaone4-windows-nope", "olmoe-experts", "ernie45-interleaved-bias", "arcee-relu2",
                                  "seedoss-biases", "ministral-windows", "hunyuan-norms-after-rope-alpha",
                                  "dots1-experts", "cohere-parallel-layernorm", "cohere2-windows-nope",
                                  "starcoder2-layernorm-biases", "ministral3-yarn-temperature", "ernie45moe-correction",
                                  "apertus-xielu", "apertus1p5-pruned-head", "gptneox-parallel", "gptneox-sequential", "phi-parallel",
                                  "phi-qk-layernorm", "stablelm-norms-per-head", "stablelm-parallel", "cohere-qk-norms",
                                  "olmoe-clip", "olmo-plain-norms-clip", "gptj-interleaved-partial",
                                  "falcon-groups-one-norm", "gpt2-learned-positions", "gpt2-unscaled",
                                  "opt-learned-positions", "bigcode-multi-query", "bigcode-per-head",
                                  "nemotron-layernorm1p", "exaone3-names", "internlm3-biases", "iquestcoder",
                                  "exaonemoe-windows-experts", "helium-interleaved-float-norms",
                                  "llama4-chunks-experts", "llama4-maverick-kind", "glm-interleaved-half",
                                  "vaultgemma-softcaps", "flexolmo-experts", "solaropen-experts", "jais2-layernorm-relu2",
                                  "hunyuanmoe-experts", "nanochat-weightless-norms", "afmoe-gated-windows-experts",
                                  "cwm-windows", "codegen-blocks", "persimmon-qk-layernorm",
                                  "phi3-longrope-partial", "phi3-longrope-long", "gemma4-shared-kv-per-layer",
                                  "gemma4-plain", "gemma4-unified", "minimax-m2-experts", "lfm3-windows-gates",
                                  "lfm3-plain", "olmohybrid-rope", "olmohybrid-nope", "cohere2moe-softmax-average",
                                  "cohere2moe-sigmoid-sum-rms", "mellum-windows-experts", "hy3-qk-norms-experts",
                                  "sarvam-moe-original-names", "phimoe-sparsemixer-longrope",
                                  "laguna-heads-per-layer-gates", "laguna-element-gates", "hyperclovax-peri-norms-mup",
                                  "lara-delta-windows-experts", "aria-experts-transposed",
                                  "cohere-compass-halves-nope-full", "gemma3n-altup-laurel-sparse",
                                  "gemma3n-active-second-unscaled", "recurrentgemma-rglru-window",
                                  "recurrentgemma-wide-lru-mha", "jetmoe-attention-experts", "jetmoe-three-of-eight",
                                  "bitnet-sub-norms-relu2"])
def test_bfloat16_logits_equal_transformers(tmp_path, arch):
    """In bfloat16 the logits equal transformers' bit for bit: Gemma's norms scale in float32
    by 1 + the weight as bfloat16 holds it, its embeddings by sqrt(hidden) rounded to
    bfloat16 (Llama's norms scale in bfloat16; GPT-OSS's in float32 by the weight as bfloat16
    holds it); Mixtral's routing weights stay float32, the Qwens' are cast to bfloat16 before
    they weight the experts' outputs; GPT-OSS's sinks and its softmax in bfloat16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    extra = {"llama": {}, "granite": dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5,
                                          logits_scaling=2.5)}.get(arch, dict(head_dim=16, sliding_window=7,
                                                                              query_pre_attn_scalar=24))
    if arch in VARIANTS:
        arch, extra = VARIANTS[arch]
    path = make_tiny(tmp_path / arch, arch, seed=5, **extra)
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()  # [24, vocab]
    assert torch.equal(rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0], ref)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_expands_long_chunks(tmp_path, arch):
    """A chunk of many new tokens attends through keys and values expanded from the cached
    latents (multi-head), a short one through the latents with the weights absorbed
    (multi-query): both give transformers' logits, in one batch of two rows (slots 0 and 2:
    a gathered copy of the rows) as alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights
    from specdec.runtime.torch_llama import Latent

    from tiny import make_tiny

    deepseek = Latent(rank=512, rope=64, nope=128, value=128, q_rank=1536)
    assert deepseek.expands(171) and not deepseek.expands(170)
    path = make_tiny(tmp_path / arch, arch, seed=6, **MOE[arch])
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    assert rt.latent.expands(30) and not rt.latent.expands(8)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits  # [2, 40, vocab]
    cache = rt.new_cache(3)
    ours = [rt.forward(cache, [0, 2], [ids[0, a:b].tolist(), ids[1, a:b].tolist()]) for a, b in [(0, 30), (30, 38)]]
    ours += [rt.forward(cache, [2], [ids[1, 38:].tolist()])]
    assert (torch.cat(ours[:2], dim=1) - ref[:, :38]).abs().max().item() < ATOL * ref.abs().max().item()
    assert (ours[2][0] - ref[1, 38:]).abs().max().item() < ATOL * ref.abs().max().item()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "granite4h-dense-rope", "bamba-half-rope",
                                  "nemotronh-blocks", "falconh1-parallel-mup", "falconmamba", "mamba2-alone",
                                  "jamba-dense", "falcon-multi-query", "falcon-groups-two-norms", "falcon-sequential",
                                  "mistral4-latent-temperature", "graniteswa-sinks-bases", "bloom-alibi",
                                  "mpt-alibi-clip", "falconrw-alibi", "granitemoeswa-sinks-experts",
                                  "gptneo-local-layers", "youtu-latent-dense", "axk1-latent-experts-normed",
                                  "kolibri1-windows-experts", "flint-sinks-windows-experts", "minicpm3-latent-mup",
                                  "gemma4-experts-beside", "mimo-windows-sinks-experts",
                                  "deepseekv32-sparse-attention", "glm5-sparse-attention-shared",
                                  "sarvam-mla-one-query-product",
                                  "axk2-gated-norms-query-gates", "kimilinear-kda-latent-nope",
                                  "ling-kda-bounded-decays", "hy4-hyper-connections-sparse-sinks",
                                  "zamba2-shared-blocks-adapters", "zamba2-one-block-gqa-nope",
                                  "minimax-lightning-experts", "minimax-factors-window"])
def test_latent_attention_and_mamba2_in_bfloat16(tmp_path, arch):
    """Latent attention with the weights absorbed multiplies in another order than
    transformers' (which expands every cached latent to keys and values), Mamba-2 layers
    scan in float32 where transformers' one-token step rounds to bfloat16, Falcon's
    products add their biases after the product (a second rounding) and attend its one key
    head broadcast, Granite-SWA's sinks scale the output in float32 (GPT-OSS's: a logit in the
    softmax, in the model's dtype; MiMo-V2-Flash's full-attention layers softmax in the model's dtype in
    transformers' eager attention, in float32 in PyTorch's fused one), and ALiBi's biases join the scores in
    another order (BLOOM's in one fused product, MPT's and Falcon's in float32), so in bfloat16
    their logits are not transformers' bit for bit; they are as close to the float32 logits as
    transformers' bfloat16 logits are (within 1.5x of that error, relative to the largest
    logit; dense layers, as near-ties in routing flip experts under either rounding)."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import causal_lm, make_tiny

    arch, config = VARIANTS[arch] if arch in VARIANTS else (arch, dict(MOE[arch], first_k_dense_replace=3))
    path = make_tiny(tmp_path / arch, arch, seed=5, **config)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = causal_lm(path).eval()(ids).logits[0]  # [40, vocab] float32
        theirs = causal_lm(path, dtype=torch.bfloat16).eval()(ids).logits[0].float()
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.bfloat16)
    cache = rt.new_cache(1)
    ours = torch.cat([rt.forward(cache, [0], [ids[0, a:b].tolist()])[0] for a, b in [(0, 30)] + [(i, i + 1) for i in range(30, 40)]])
    assert (ours - ref).abs().max() <= 1.5 * (theirs - ref).abs().max()
    # not garbage: the typical row is close (in Gemma 4's experts one row's near-tie in routing flips an expert
    # under either rounding, transformers' as far off as ours there)
    assert (ours - ref).abs().amax(-1).median() < 0.1 * ref.abs().max()


def test_multimodal_gemma3n_text_model(tmp_path):
    """Gemma 3n's checkpoints as released (E2B, E4B: an image-text-to-text model with vision and
    audio towers, its text model under ``model.language_model.``, the head tied) run their text
    model on the torch runtime: logits equal those of the text model's own checkpoint, bit for bit
    (float32 and bfloat16; transformers' multimodal model needs timm's vision tower, not installed
    here), its eos read from the text config, greedy output under speculation equal to
    transformers' causal LM's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from specdec import LLM, SamplingParams, SpecConfig
    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights

    from tiny import causal_lm, make_tiny

    text = make_tiny(tmp_path / "text", "gemma3n_text", seed=3, **dict(GEMMA3N, tie_word_embeddings=True))
    path = tmp_path / "gemma3n"
    path.mkdir()
    for f in text.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    config = AutoConfig.for_model("gemma3n", text_config=AutoConfig.from_pretrained(text).to_dict()).to_dict()
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3nForConditionalGeneration"]}))
    tensors = {"model.language_model." + n.removeprefix("model."): t for n, t in load_file(text / "model.safetensors").items()}
    assert "lm_head.weight" not in tensors
    tensors["model.embed_vision.embedding.weight"] = torch.randn(8, 48)  # (a tower's, never read)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        rts = [TorchLlama(AutoConfig.from_pretrained(p), Weights(p), torch.device("cpu"), dtype) for p in (path, text)]
        mm, own = (rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] for rt in rts)
        assert torch.equal(mm, own), dtype
    model = load_model(str(path))
    assert isinstance(model.runtime, TorchLlama) and 257 in model.eos_ids
    hf = causal_lm(text).eval()
    sp, prompts = SamplingParams(max_tokens=20, ignore_eos=True), ["hello hello world", "abcabc"]
    want = greedy_by_whole_forwards(hf, [LLM(model).encode(p) for p in prompts], 20)
    for kw in (dict(), dict(speculative="self"),
               dict(speculative=SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3))):
        assert [o.token_ids for o in LLM(model, chunked_prefill_size=4, **kw).generate(prompts, sp)] == want, kw


@pytest.mark.parametrize("name,kind", [("recurrentgemma", "recurrent_gemma"), ("minimax", "minimax")])
def test_models_of_their_own_state_run_on_the_torch_runtime(tiny_dirs, name, kind):
    """RecurrentGemma keeps its state in its modules, MiniMax in a cache of its own, outside
    transformers' ``DynamicCache``: ``backend="auto"`` runs them on the torch runtime;
    ``backend="hf"`` refuses them and says where they run."""
    from specdec.runtime import load_model

    assert isinstance(load_model(str(tiny_dirs[name])).runtime, TorchLlama)
    with pytest.raises(ValueError, match=f"'{kind}' keeps its state outside .*the torch runtime runs it"):
        load_model(str(tiny_dirs[name]), backend="hf")


@pytest.mark.parametrize("variant", ["llama", "gemma3n-altup-laurel-sparse"])
def test_tables_stay_in_the_checkpoints_narrower_dtype(tmp_path, monkeypatch, variant):
    """A checkpoint saved in bfloat16 run in float32: its embedding and Gemma 3n's per-layer table stay
    bfloat16 (half the memory), their rows widened as gathered, and the logits are those of the tables
    widened at load, bit for bit; a tied embedding too, the head its own float32 copy as oneDNN's
    products take anyway, but where the head's product would share its tensor (``dense``) it is widened."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights
    from specdec.runtime.torch_llama import CheckpointReader

    from tiny import causal_lm, make_tiny

    arch, config = VARIANTS.get(variant, (variant, {}))
    path = make_tiny(tmp_path / "fp32", arch, seed=5, **config)
    hf = causal_lm(path).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    path = tmp_path / "bf16"
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))[0].tolist()
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    assert rt.embed.dtype == torch.bfloat16 and rt.norm.dtype == torch.float32
    if rt.per_layer is not None:
        assert rt.per_layer[0].dtype == torch.bfloat16
    ours = rt.forward(rt.new_cache(1), [0], [ids])[0]
    monkeypatch.setattr(CheckpointReader, "table", CheckpointReader.get)
    wide = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    assert wide.embed.dtype == torch.float32 and torch.equal(ours, wide.forward(wide.new_cache(1), [0], [ids])[0])
    monkeypatch.undo()
    tied = make_tiny(tmp_path / "tied", "llama", seed=5, tie_word_embeddings=True)
    causal_lm(tied).to(torch.bfloat16).save_pretrained(tmp_path / "tied-bf16")
    config, tied = AutoConfig.from_pretrained(tmp_path / "tied-bf16"), Weights(tmp_path / "tied-bf16")
    logits = {}
    for linear in ("onednn", "dense"):
        rt = TorchLlama(config, tied, torch.device("cpu"), torch.float32, linear=linear)
        assert rt.embed.dtype == (torch.bfloat16 if linear == "onednn" else torch.float32)
        logits[linear] = rt.forward(rt.new_cache(1), [0], [ids])[0]
    torch.testing.assert_close(logits["onednn"], logits["dense"], atol=1e-5, rtol=1e-5)  # (their products' rounding)
    monkeypatch.setattr(CheckpointReader, "table", CheckpointReader.get)
    wide = TorchLlama(config, tied, torch.device("cpu"), torch.float32, linear="onednn")
    assert torch.equal(wide.forward(wide.new_cache(1), [0], [ids])[0], logits["onednn"])


def test_minimax_rotates_its_rotary_dim(tmp_path, monkeypatch):
    """MiniMax-Text-01's config names ``rotary_dim`` (64 of its heads' 128): rope on each head's first
    ``rotary_dim`` channels, as its own code and vLLM's apply it. transformers 5.24's MiniMax ignores
    the field and rotates whole heads (a config of 8 of 16 here: its logits differ); patched to rotate
    that part, its logits are ours."""
    from transformers import AutoConfig
    from transformers.models.minimax import modeling_minimax

    from specdec.runtime.loading import Weights

    from tiny import MINIMAX, causal_lm, make_tiny

    path = make_tiny(tmp_path / "minimax", "minimax", seed=5, **dict(MINIMAX, rotary_dim=8))
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    ours = rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0]
    with torch.no_grad():
        whole = causal_lm(path).eval()(ids).logits[0]
    assert (ours - whole).abs().max().item() > 0.05

    def inv_freq(config, **kw):  # (transformers' MiniMax-M2's, over rotary_dim)
        d = config.rotary_dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0

    def rotate_part(q, k, cos, sin, unsqueeze_dim=1):
        d = cos.shape[-1]
        qr, kr = apply(q[..., :d], k[..., :d], cos, sin, unsqueeze_dim)
        return torch.cat([qr, q[..., d:]], dim=-1), torch.cat([kr, k[..., d:]], dim=-1)

    apply = modeling_minimax.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_minimax, "apply_rotary_pos_emb", rotate_part)
    monkeypatch.setattr(modeling_minimax.MiniMaxRotaryEmbedding, "compute_default_rope_parameters",
                        staticmethod(inv_freq))
    with torch.no_grad():
        ref = causal_lm(path).eval()(ids).logits[0]
    assert (ours - ref).abs().max().item() < ATOL * ref.abs().max().item()


@pytest.mark.parametrize("name", ["hy4", "gemma3n"])
def test_streams_give_no_features(loaded, name):
    """Hy4's hyper-connections and Gemma 3n's alternating updates carry several streams a token
    between layers: an EAGLE head's taps are refused with the reason, the last layer's output
    too (no drafter of theirs reads one)."""
    for taps in ([1], [loaded(name).runtime.num_layers]):
        with pytest.raises(ValueError, match="several streams"):
            loaded(name).runtime.capture(taps)


def test_multimodal_gemma3_text_model(tmp_path):
    """A Gemma 3 checkpoint with a vision tower (4B and up) runs its text model on the torch
    runtime: logits equal transformers' multimodal model's on text (bit for bit, float32 and
    bfloat16), greedy output under speculation equal to transformers' runtime's, its eos read
    from the text config (it failed to load before), random weights as on transformers'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec import LLM, SamplingParams, SpecConfig
    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights

    from tiny import make_tiny, make_tiny_vision_language

    path = make_tiny_vision_language(tmp_path / "gemma3", "gemma3", seed=3)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype)
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()(input_ids=ids).logits[0].float()
        assert torch.equal(rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0], ref), dtype
    model = load_model(str(path))
    assert isinstance(model.runtime, TorchLlama) and 257 in model.eos_ids
    draft = make_tiny(tmp_path / "draft", "gemma3_text", seed=4, layers=1, head_dim=16, query_pre_attn_scalar=24)
    sp, prompts = SamplingParams(max_tokens=24, ignore_eos=True), ["hello hello world", "abcabc"]
    want = [o.token_ids for o in LLM(load_model(str(path), backend="hf")).generate(prompts, sp)]
    for kw in (dict(speculative="self"), dict(draft=str(draft)),
               dict(speculative=SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3))):
        assert [o.token_ids for o in LLM(model, chunked_prefill_size=4, **kw).generate(prompts, sp)] == want, kw
    dummy = [load_model(str(path), backend=b, load_format="dummy").runtime for b in ("torch", "hf")]
    logits = [rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] for rt in dummy]
    assert (logits[0] - logits[1]).abs().max().item() < ATOL


RECURRENT_VL = ("qwen3_5", "lfm2_vl", "lfm3_vl")  # text models with recurrent states: chains, float32 within rounding


@pytest.mark.parametrize("kind", ["mistral3", "ministral3", "llava", "llava_next", "llava_onevision", "qwen2_vl",
                                  "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "glm46v", "internvl", "smolvlm", "lfm2_vl",
                                  "lfm3_vl", "exaone4_5", "apertus1p5", "aria", "cohere_compass",
                                  "qwen3_5", "gemma4", "gemma4_unified", "mllama"])
def test_vision_language_text_model(tmp_path, kind):
    """Mistral 3's (with a Mistral text model, or Ministral 3's: its queries scaled past the
    original context), LLaVA's, LLaVA-NeXT's, LLaVA-OneVision's, Qwen2-VL's to Qwen3-VL's, GLM-4.1V's, GLM-4.5V's, InternVL's, SmolVLM's (its text
    model under model.text_model.), LFM2-VL's and Apertus 1.5's (its head pruned to the text tokens) checkpoints (no causal LMs in
    transformers: its hf runtime cannot run them) and Qwen3.5's and Gemma 4's (E2B to 31B's, and 12B's unified model),
    and Llama 3.2 Vision's (its self-attention layers: the cross-attention layers between them skipped on text, as
    transformers' model skips them), as released, run their text
    model on the torch runtime: logits equal transformers' image-text-to-text model's on text
    (bit for bit, float32 and bfloat16; the Qwens' multimodal rope on text alone; Qwen3.5's
    DeltaNet layers' fused input products, LFM2's convolutions, Gemma 4's norms (a power of -0.5
    where specdec takes the reciprocal square root) and Cohere Compass's (transformers' eager attention) round
    otherwise in float32: within rounding there), greedy output under speculation equal to its argmax (chains only
    through Qwen3.5's and LFM2's recurrent states), a window on Mistral 3's layers, dummy weights."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from specdec import LLM, SamplingParams, SpecConfig
    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights

    from tiny import make_tiny_vision_language

    vl = "mistral3" if kind == "ministral3" else kind
    text = {"mistral3": dict(sliding_window=6),
            "ministral3": dict(model_type="ministral3", head_dim=16, rope_parameters=MINISTRAL3_ROPE)}.get(kind, {})
    path = make_tiny_vision_language(tmp_path / kind, vl, seed=3, **text)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids).logits[0].float()
        ours = rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0]
        if kind in RECURRENT_VL + ("gemma4", "gemma4_unified", "cohere_compass") and dtype == torch.float32:
            assert (ours - ref).abs().max() < ATOL * ref.abs().max(), (ours - ref).abs().max()
        else:
            assert torch.equal(ours, ref), dtype
    model = load_model(str(path))
    assert isinstance(model.runtime, TorchLlama) and 257 in model.eos_ids
    hf = AutoModelForImageTextToText.from_pretrained(path).eval()
    sp, prompts = SamplingParams(max_tokens=20, ignore_eos=True), ["hello hello world", "abcabc"]
    want = greedy_by_whole_forwards(hf, [LLM(model).encode(p) for p in prompts], 20)
    ngram = SpecConfig(method="ngram", tree_topk=1 if kind in RECURRENT_VL else 2, num_draft_tokens=3)
    for kw in (dict(), dict(speculative="self"), dict(speculative=ngram)):
        assert [o.token_ids for o in LLM(model, chunked_prefill_size=4, **kw).generate(prompts, sp)] == want, kw
    dummy = load_model(str(path), load_format="dummy").runtime
    assert dummy.forward(dummy.new_cache(1), [0], [ids[0].tolist()])[0].std().item() > 0.1
    if kind not in ("qwen3_5", "gemma4", "gemma4_unified", "mllama"):  # (transformers has a causal LM for Qwen3.5's,
        # Gemma 4's, Llama 3.2 Vision's)
        with pytest.raises(ValueError, match=f"no causal LM for '{vl}' .* use backend 'torch' or 'auto'"):
            load_model(str(path), backend="hf")
    import json  # a processor's chat template (LLaVA's), where the tokenizer has none

    (path / "chat_template.jinja").unlink()  # one that reads content parts only (LLaVA's kind), in transformers' tags
    template = ("{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] | selectattr('type', 'equalto', "
                "'text') %}{% generation %} {{ part['text'] }}{% endgeneration %}{% endfor %};{% endfor %}")
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(load_model(str(path)))
    for content in ("hi", [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]):
        want = "user: hi;" if isinstance(content, str) else "user: hi there;"
        assert llm.chat([{"role": "user", "content": content}], sp)[0].prompt == want, content


def test_qwen3_vl_moe_experts_as_released(tmp_path):
    """Qwen3-VL-MoE's checkpoints as released keep each layer's experts fused the other way
    round (``gate_up_proj [experts, hidden, 2 x inter]``, ``down_proj [experts, inter, hidden]``),
    which transformers transposes at load: its logits equal those of transformers' own layout,
    bit for bit, and transformers' on the released copy."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from specdec.runtime.loading import Weights

    from tiny import make_tiny_vision_language

    path = make_tiny_vision_language(tmp_path / "own", "qwen3_vl_moe", seed=5)
    released = tmp_path / "released"
    shutil.copytree(path, released)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if ".mlp.experts." in n]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(released / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    logits = []
    for where in (path, released):
        rt = TorchLlama(AutoConfig.from_pretrained(where), Weights(where), torch.device("cpu"), torch.float32)
        logits.append(rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0])
    with torch.no_grad():
        ref = AutoModelForImageTextToText.from_pretrained(released).eval()(input_ids=ids).logits[0]
    assert torch.equal(logits[0], logits[1])
    assert (logits[1] - ref).abs().max() < ATOL * ref.abs().max()


def test_llama4_text_model(tmp_path):
    """Llama 4's checkpoints (Scout's, Maverick's: an image-text-to-text model) run their text model
    on the torch runtime: its logits are transformers' text model's (within rounding in float32,
    where transformers rotates by complex products; bit for bit in bfloat16), greedy output under
    speculation (chains and trees across its chunks) equals transformers' runtime's, and dummy
    weights give both runtimes the same logits. (transformers 5.24's multimodal model's forward
    fails on text alone, so the reference is its text model.)"""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from specdec import LLM, SamplingParams, SpecConfig
    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights

    from tiny import make_tiny_vision_language

    path = make_tiny_vision_language(tmp_path / "llama4", "llama4", seed=3)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            ref = hf.language_model(input_ids=ids).logits[0].float()
        ours = rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0]
        assert torch.equal(ours, ref) if dtype == torch.bfloat16 else (ours - ref).abs().max() < ATOL * ref.abs().max()
    model = load_model(str(path))
    assert isinstance(model.runtime, TorchLlama) and 257 in model.eos_ids
    sp, prompts = SamplingParams(max_tokens=24, ignore_eos=True), ["hello hello world", "abcabc"]
    want = [o.token_ids for o in LLM(load_model(str(path), backend="hf")).generate(prompts, sp)]
    tree = SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3)
    for kw in (dict(), dict(speculative="self"), dict(speculative=tree)):
        assert [o.token_ids for o in LLM(model, chunked_prefill_size=4, **kw).generate(prompts, sp)] == want, kw
    dummy = [load_model(str(path), backend=b, load_format="dummy").runtime for b in ("torch", "hf")]
    logits = [rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] for rt in dummy]
    assert (logits[0] - logits[1]).abs().max().item() < ATOL and logits[0].std() > 0.1


def test_dbrx_rope_base_from_its_attention_config():
    """DBRX's checkpoints keep their rope base in ``attn_config.rope_theta`` (500000), which
    transformers 5.24's model leaves for ``rope_parameters``' default (10000): the torch runtime
    reads it, as vLLM and llama.cpp do."""
    from transformers import AutoConfig

    from specdec.runtime.torch_llama import text_model

    config = AutoConfig.for_model("dbrx", attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0))
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert text_model(config)[0].rope_parameters["rope_theta"] == 500000.0


def test_rope_rescaled_by_length_runs_on_transformers(tmp_path):
    """Rotary scalings that depend on the whole sequence's length (dynamic; longrope but where
    the model computes its cache again past the switch, Phi-3's, or the switch is past the
    context) are not the torch runtime's: ``auto`` loads them on transformers' own model,
    ``torch`` refuses."""
    from transformers import AutoConfig

    from specdec import LLM, SamplingParams
    from specdec.runtime import load_model
    from specdec.runtime.hf import HFRuntime
    from specdec.runtime.torch_llama import unsupported

    from tiny import make_tiny

    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
    path = make_tiny(tmp_path / "longrope", "llama", rope_parameters=rope)
    assert "keys keep the factors" in unsupported(AutoConfig.from_pretrained(path))  # (Phi-3's model recomputes)
    assert unsupported(AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, rope_parameters=rope,
                                                original_max_position_embeddings=16)) is None
    assert unsupported(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4,
                                                max_position_embeddings=16, rope_parameters=rope)) is None  # no switch
    assert "'dynamic'" in unsupported(AutoConfig.for_model("llama", rope_parameters=dict(rope_type="dynamic", factor=2.0)))
    assert "rwkv" in unsupported(AutoConfig.for_model("rwkv"))
    assert "residual" in unsupported(AutoConfig.for_model("bloom", apply_residual_connection_post_layernorm=True))
    assert "qk_ln" in unsupported(AutoConfig.for_model("mpt", attn_config=dict(qk_ln=True)))
    assert "OPT's norms before" in unsupported(AutoConfig.for_model("opt", do_layer_norm_before=False))
    assert "quick_gelu" in unsupported(AutoConfig.for_model("llama", hidden_act="quick_gelu"))
    assert "not 'awq' ones" in unsupported(AutoConfig.for_model("llama", quantization_config={"quant_method": "awq"}))
    assert "rotates a part of each head for phi3, glm, glm4, glm4_moe, bamba" in unsupported(AutoConfig.for_model("llama", partial_rotary_factor=0.75))
    assert "bidirectional" in unsupported(AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True))
    per_type = AutoConfig.for_model("gemma3_text", rope_parameters={  # each layer type's rope is checked
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert "'dynamic'" in unsupported(per_type)
    model = load_model(str(path), device="cpu")
    assert isinstance(model.runtime, HFRuntime)
    with pytest.raises(ValueError, match="keys keep the factors"):
        load_model(str(path), device="cpu", backend="torch")
    out = LLM(model).generate("abc abc", SamplingParams(max_tokens=30, ignore_eos=True))[0]  # past the 16 positions
    assert len(out.token_ids) == 30


def test_recurrent_states_decode_without_drafts(tmp_path):
    """On transformers' runtime a recurrent state (Mamba's) cannot go back to drop rejected drafts
    (the torch runtime's can: ``test_recurrent_model_speculates_as_transformers_decodes``): plain decoding runs,
    with prompts whole (transformers' Mamba reads a later many-token forward as a new prompt)
    and no finished prompt reused (its state holds the whole output); drafting is refused
    (as transformers refuses assisted generation), and so is a model whose state lies
    outside transformers' cache."""
    from transformers import AutoModelForCausalLM

    from specdec import LLM, SamplingParams, SpecConfig

    from tiny import make_tiny

    path = make_tiny(tmp_path / "mamba", "mamba", state_size=8, conv_kernel=4, expand=2)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), backend="hf")  # (auto: the torch runtime, whose Mamba states rewind)
    assert llm.engine_config.chunked_prefill_size == 0
    with pytest.raises(ValueError, match="prompts go whole"):
        LLM(str(path), backend="hf", chunked_prefill_size=8)
    first = "The quick brown fox jumps over the lazy dog. "
    for prompt in (first, first + "And then it ran away."):  # the second starts with the first's chunks
        out = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0]
        ids = llm.encode(prompt)
        with torch.no_grad():
            for _ in range(20):  # greedy by whole forwards
                ids.append(hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax().item())
        assert out.token_ids == ids[-20:] and out.metrics["cached_prompt_tokens"] == 0
    for kw in (dict(speculative=SpecConfig(method="ngram")), dict(draft=str(path))):
        with pytest.raises(ValueError, match="recurrent state .mamba."):
            LLM(str(path), backend="hf", **kw)
    with pytest.raises(ValueError, match="'openai-gpt' keeps its state outside"):
        LLM(str(make_tiny(tmp_path / "gpt1", "openai-gpt", n_positions=512)))
    with pytest.raises(ValueError, match="'minimax' keeps its state outside"):  # at load, not at the first forward
        LLM(str(make_tiny(tmp_path / "minimax", "minimax", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["linear_attention", "full_attention"])), backend="hf")
    with pytest.raises(ValueError, match="'xlstm' keeps its state outside.*DynamicCache cannot hold it"):  # takes a
        # cache argument, and failed deep in transformers at the first forward
        LLM(str(make_tiny(tmp_path / "xlstm", "xlstm", embedding_dim=64, num_heads=4, num_blocks=2, mode="inference")))


def test_fallback_gives_positions_and_reads_the_context(tmp_path):
    """On transformers' model the forwards get their tokens' positions: Bamba's attention
    layers counted from 0 at every forward without them (its plain decoding differed from
    transformers' own after a few tokens). The context comes from where a config keeps it: a
    multimodal config's text_config, MPT's max_seq_len."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec import LLM, SamplingParams
    from specdec.runtime.hf import context_window

    from tiny import make_tiny

    path = make_tiny(tmp_path / "bamba", "bamba", mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16,
                     attn_layer_indices=[1], mamba_chunk_size=16, pad_token_id=None)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path))
    for prompt in ("The quick brown fox", "abc"):
        ids = llm.encode(prompt)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, len(ids):]
        assert llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids == want.tolist()
    assert context_window(AutoConfig.for_model("gemma3", text_config={"max_position_embeddings": 128})) == 128
    assert context_window(AutoConfig.for_model("mpt", max_seq_len=32)) == 32


@pytest.mark.parametrize("packed", [False, True])
def test_one_row_products_through_either_copy(tiny_dirs, monkeypatch, tmp_path, packed):
    """With the verify-packed copy, one-token forwards (plain decoding) go through whichever
    copy the runtime timed faster; when that is the packed one, the other is freed. The
    timing is kept in the cache directory, so a second load makes the same choice without
    timing. Either way a one-token forward gives transformers' logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights

    path = tiny_dirs["qwen2"]
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    timed = TorchLlama._time_packed_one_row
    monkeypatch.setattr(TorchLlama, "_time_packed_one_row", lambda self: timed(self) * 0 + (0.5 if packed else 2.0))

    def load():
        return TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"),
                          torch.float32, linear="onednn", multi_row=True)

    rt = load()
    monkeypatch.setattr(TorchLlama, "_time_packed_one_row", lambda self: pytest.fail("timed again"))
    assert load().one_row_packed == packed  # from the cache
    assert (tmp_path / "torch_one_row.json").exists()
    lin = rt.layers[0]["gate_up"]
    assert rt.one_row_packed == lin.one_row_packed == packed and (lin.weight is None) == packed
    assert ("packed-one-row" in rt.speed_key) == packed
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits[0, -3:]  # [3, vocab]
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [ids[0, :9].tolist()])
    ours = torch.cat([rt.forward(cache, [0], [[t]])[0] for t in ids[0, 9:].tolist()])  # [3, vocab]
    assert (ours - ref).abs().max().item() < ATOL


def test_ragged_batch_matches_single(loaded):
    rt = loaded("qwen2").runtime
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    batch_cache = rt.new_cache(3)
    batched = rt.forward(batch_cache, [2, 0, 1], seqs)  # [3, 5, vocab], ragged
    for b, s in enumerate(seqs):
        one = rt.forward(rt.new_cache(1), [0], [s])[0]
        torch.testing.assert_close(batched[b, : len(s)], one, atol=1e-5, rtol=0)
    assert batch_cache.lengths == [2, 3, 5]
    last = rt.forward(rt.new_cache(3), [0, 1, 2], seqs, last_only=True)  # [3, vocab]
    for b, s in enumerate(seqs):
        torch.testing.assert_close(last[b], batched[b, len(s) - 1], atol=1e-5, rtol=0)
    # consecutive slots not from 0 (attended through a view of the cache) continue their own rows
    more = rt.forward(batch_cache, [1, 2], [[20, 21], [22]])  # slot 1 holds seqs[2], slot 2 seqs[0]
    for row, (s, new) in enumerate([(seqs[2], [20, 21]), (seqs[0], [22])]):
        one = rt.forward(rt.new_cache(1), [0], [s + new])[0, len(s):]
        torch.testing.assert_close(more[row, : len(new)], one, atol=1e-5, rtol=0)


def test_slot_runs_attend_as_the_gather_does(loaded, monkeypatch):
    """Rows in runs of consecutive slots attend over views of the cache, run by run (from
    ``RUNS_FROM_KEYS`` keys; forced here), with the same logits as a gathered copy."""
    import specdec.runtime.torch_llama as tl

    rt = loaded("qwen2").runtime
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
    slots = [3, 0, 1, 5]  # runs: [3], [0, 1], [5]
    assert tl.slot_runs(slots, 300) == ((0, 1, 3), (1, 3, 0), (3, 4, 5)) and tl.slot_runs(slots, 10) is None
    gathered = rt.forward(rt.new_cache(6), slots, seqs)
    monkeypatch.setattr(tl, "RUNS_FROM_KEYS", 0)
    cache = rt.new_cache(6)
    runs = rt.forward(cache, slots, seqs)
    torch.testing.assert_close(runs, gathered, atol=0, rtol=0)
    more = rt.forward(cache, [0, 1, 3], [[20], [21, 22], [23]])  # continuing, in other runs
    for row, (s, new) in enumerate([(seqs[1], [20]), (seqs[2], [21, 22]), (seqs[0], [23])]):
        one = rt.forward(rt.new_cache(1), [0], [s + new])[0, len(s):]
        torch.testing.assert_close(more[row, : len(new)], one, atol=1e-5, rtol=0)


def test_rewind_then_continue_equals_fresh(loaded):
    rt = loaded("llama").runtime
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [[1, 2, 3, 4]])
    rt.forward(cache, [0], [[50, 60, 70]])  # drafts that get rejected
    cache.rewind(0, 4)
    after = rt.forward(cache, [0], [[5, 6]])[0]
    fresh = rt.forward(rt.new_cache(1), [0], [[1, 2, 3, 4, 5, 6]])[0, 4:]
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=0)


def test_cache_grows(loaded):
    rt = loaded("llama").runtime
    cache = rt.new_cache(1)
    ids = list(range(1, 200)) * 2  # 398 tokens > initial capacity 256
    out = rt.forward(cache, [0], [ids], last_only=True)
    assert cache.capacity >= 398 and cache.lengths[0] == 398
    step = torch.cat([rt.forward(c := rt.new_cache(1), [0], [ids[:300]], last_only=True),
                      rt.forward(c, [0], [ids[300:]], last_only=True)])
    torch.testing.assert_close(step[1], out[0], atol=1e-4, rtol=0)


def test_chunk_mask_and_positions(loaded):
    """A custom chunk mask + positions (what trees need): two sibling tokens at the same
    position, each seeing only the prefix, equal two separate chains."""
    rt = loaded("llama").runtime
    prefix = [3, 4, 5]
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [prefix])
    mask = torch.eye(2, dtype=torch.bool)  # siblings don't see each other
    out = rt.forward(cache, [0], [[7, 8]], positions=[[3, 3]], chunk_masks=[mask])[0]
    a = rt.forward(rt.new_cache(1), [0], [prefix + [7]])[0, -1]
    b = rt.forward(rt.new_cache(1), [0], [prefix + [8]])[0, -1]
    torch.testing.assert_close(out[0], a, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1], b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen35", "granite4h", "nemotronh", "lfm2", "lfm3", "falconh1", "mamba", "jamba",
                                  "olmohybrid", "kimilinear", "ling", "lara", "zamba2", "recurrentgemma",
                                  "minimax"])
def test_tree_through_recurrent_states(loaded, name):
    """A token tree through recurrent layers (DeltaNet's, Mamba-2's, Mamba's, LFM2's convolutions) in one
    forward: each node's logits are those of its path as a chain; after ``keep`` of a path
    (each of the tree's leaves' in turn, on a copy of the slot) the next tokens' logits are the
    whole sequence's from scratch, and the slot still rewinds into the kept path; a chain beside
    a tree in one batch is as alone. A draft model's tree (masks that see earlier forwards'
    rows) is refused."""
    rt = loaded(name).runtime
    assert rt.supports_masks and not rt.masks_reach_cache
    rt.state_depth = 8
    prefix = [3, 4, 5, 6, 7]
    tree = [11, 12, 13, 14, 15, 16]  # 11 the root (the last committed token); 12, 13 its children; 14 under 12;
    parents = [-1, 0, 0, 1, 1, 4]  # 15 under 12; 16 under 15
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i] = mask[p] if p >= 0 else mask[i]
        mask[i, i] = True
    depth = mask.sum(1) - 1
    paths = [[j for j in range(6) if mask[i, j]] for i in range(6)]

    def fresh(ids):
        return rt.forward(rt.new_cache(1), [0], [ids])[0]

    for leaf in (2, 3, 5):
        cache = rt.new_cache(2)
        rt.forward(cache, [0], [prefix])
        out = rt.forward(cache, [0], [tree], positions=[(len(prefix) + depth).tolist()], chunk_masks=[mask])[0]
        for i in range(6):
            want = fresh(prefix + [tree[j] for j in paths[i]])[-1]
            torch.testing.assert_close(out[i], want, atol=1e-4, rtol=1e-4)
        cache.keep(0, len(prefix), paths[leaf])
        kept = prefix + [tree[j] for j in paths[leaf]]
        assert cache.lengths[0] == len(kept)
        nxt = rt.forward(cache, [0], [[20, 21]])[0]
        torch.testing.assert_close(nxt, fresh(kept + [20, 21])[-2:], atol=1e-4, rtol=1e-4)
        cache.rewind(0, len(prefix) + 1)  # back into the kept path
        torch.testing.assert_close(rt.forward(cache, [0], [[22]])[0], fresh(kept[:len(prefix) + 1] + [22])[-1:],
                                   atol=1e-4, rtol=1e-4)
    cache = rt.new_cache(2)  # a chain beside a tree in one forward: its states as a chain's alone
    rt.forward(cache, [0, 1], [prefix, prefix[:3]])
    out = rt.forward(cache, [0, 1], [tree, [30, 31, 32]], positions=[(len(prefix) + depth).tolist(), None],
                     chunk_masks=[mask, None])
    torch.testing.assert_close(out[1, :3], fresh(prefix[:3] + [30, 31, 32])[-3:], atol=1e-4, rtol=1e-4)
    cache.keep(0, len(prefix), paths[5])
    nxt = rt.forward(cache, [0, 1], [[20], [33]])  # (the chain's state after it: not rewound)
    torch.testing.assert_close(nxt[0, 0], fresh(prefix + [tree[j] for j in paths[5]] + [20])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(nxt[1, 0], fresh(prefix[:3] + [30, 31, 32, 33])[-1], atol=1e-4, rtol=1e-4)
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [prefix])
    with pytest.raises(AssertionError, match="in one forward"):  # a tail: rows of an earlier forward
        rt.forward(cache, [0], [[11]], chunk_masks=[torch.ones(1, 2, dtype=torch.bool)])


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text", "llama4_text", "bloom"])
def test_tree_deeper_than_the_window(tmp_path, arch):
    """A tree path deeper than a sliding window (3; Llama 4's chunks of 3) after a branch: its
    nodes' rows lie past their positions, and each sees only the ancestors within the window by
    position, as a chain of the path's tokens does; the draft model's depth-by-depth feed
    (earlier depths cached) alike. ALiBi's biases (BLOOM's) go by those positions too."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights
    from specdec.tree import DraftTree

    from tiny import make_tiny

    extra = {"mistral": dict(sliding_window=3), "llama4_text": dict(LLAMA4, attention_chunk_size=3),
             "bloom": dict(num_key_value_heads=None)}.get(
        arch, dict(sliding_window=3, head_dim=16, layer_types=["sliding_attention", "full_attention"]))
    path = make_tiny(tmp_path / arch, arch, seed=5, **extra)
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    prefix, tree = [10, 20, 30, 40, 50, 60], DraftTree([70, 71, 72, 73, 74, 75, 76], [-1, 0, 0, 2, 3, 4, 5])
    on_path = [0, 2, 3, 4, 5, 6]  # 70, then 72 (row 2, position 1) and its chain
    chain = rt.forward(rt.new_cache(1), [0], [prefix + [tree.tokens[r] for r in on_path]])[0, len(prefix):]
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [prefix])
    whole = rt.forward(cache, [0], [tree.tokens], positions=[tree.positions(len(prefix))], chunk_masks=[tree.mask()])[0]
    assert (whole[on_path] - chain).abs().max().item() < ATOL
    cache.rewind(0, len(prefix))
    mask, pos = tree.mask(), tree.positions(len(prefix))
    fed = [rt.forward(cache, [0], [tree.tokens[a:b]], positions=[pos[a:b]], chunk_masks=[mask[a:b, :b]])[0]
           for a, b in ((0, 3), (3, 5), (5, 7))]  # the later pieces see the earlier ones cached
    assert (torch.cat(fed)[on_path] - chain).abs().max().item() < ATOL


def test_int8_linear_close_but_not_exact():
    """int8 (draft-only) linears: about 1% error per product, never used for a target."""
    from specdec.runtime.linear import Linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.05
    b = torch.randn(300, generator=g)
    x = torch.randn(3, 5, 200, generator=g)
    exact = Linear(w, b, "dense")(x)
    approx = Linear(w, b, "int8")(x)
    assert approx.shape == exact.shape == (3, 5, 300)
    rel = ((approx - exact).abs().max() / exact.abs().max()).item()
    assert 0 < rel < 0.03
    torch.testing.assert_close(Linear(w, b, "onednn")(x), exact, atol=1e-5, rtol=1e-5)


def test_int8_draft_model_stays_lossless(loaded, tiny_dirs):
    from specdec import LLM, SamplingParams, SpecConfig

    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["Hello there", "The quick brown fox"]
    base = LLM(loaded("llama")).generate(prompts, sp)
    llm = LLM(loaded("llama"), draft=str(tiny_dirs["llama"]),
              speculative=SpecConfig(method="draft", num_draft_tokens=3, draft_quantization="int8"))
    assert all(layer["qkv"].kind == "int8" for layer in llm.draft.runtime.layers)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert sum(o.metrics["accepted_tokens"] for o in outs) > 0  # an int8 copy of the target mostly agrees


def test_a_gpu_is_fixed_with_its_index(monkeypatch):
    """``cuda`` (and no device, on a GPU machine) is the GPU current at load, as ``cuda:N``:
    tensors made later on other threads (the server's) land beside the weights; a GPU the
    machine lacks is refused at load."""
    from specdec.runtime.loading import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device(None) == pick_device("cuda") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0) and pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="cuda:0 to cuda:1"):
        pick_device("cuda:2")


def test_a_draft_path_goes_beside_a_loaded_target(loaded, tiny_dirs, monkeypatch):
    """With no ``device``, a draft loaded from a path joins a given target's device, not the
    machine's default (on a GPU machine: cuda, where an int8 draft is refused)."""
    from specdec import LLM, SpecConfig

    target = loaded("llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the default device: cuda
    llm = LLM(target, draft=str(tiny_dirs["llama"]),
              speculative=SpecConfig(method="draft", num_draft_tokens=3, draft_quantization="int8"))
    assert llm.draft.runtime.device == target.runtime.device == torch.device("cpu")


def test_int8_rows_do_not_depend_on_their_neighbours():
    """fbgemm quantizes activations on one range per tensor; int8 linears quantize each row
    on its own, so a row's output is the same alone or beside others (bit for bit), and a
    large row does not coarsen the rest."""
    from specdec.runtime.linear import Linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * 0.05
    b = torch.randn(300, generator=g)
    x = torch.randn(6, 200, generator=g)
    x[2] *= 100
    lin = Linear(w, b, "int8")
    together = lin(x)
    for i in range(6):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])
    exact = Linear(w, b, "dense")(x)
    rel = (together - exact).norm(dim=1) / exact.norm(dim=1)  # [6]
    assert rel.max() < 0.03


def test_seeded_draws_with_an_int8_draft_do_not_depend_on_earlier_requests(tiny_dirs):
    """A seeded sampled request drafting with an int8 draft model draws the same tokens sent
    again after other requests, though its prompt's rows are then reused (the draft computes
    one row where it computed the whole prompt). Beside other requests the torch runtime
    rounds attention unlike alone, so there it repeats only in distribution."""
    from specdec import LLM, SamplingParams, SpecConfig

    llm = LLM(str(tiny_dirs["llama"]), draft=str(tiny_dirs["draft"]), device="cpu",
              speculative=SpecConfig(method="draft", num_draft_tokens=3))
    assert llm.draft.runtime.layers[0]["qkv"].kind == "int8" and llm.draft.runtime.reuses_prefixes
    sp = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True)
    prompt = "abc abc abd hello world"
    alone = llm.generate(prompt, sp)[0]
    llm.generate([prompt, "The quick brown fox jumps"], [sp, other])
    again = llm.generate(prompt, sp)[0]
    assert again.token_ids == alone.token_ids


def test_tail_mask_reaches_earlier_chunks(loaded):
    """A draft tree fed one depth per forward: depth-2 nodes see their depth-1 parent among
    the cached keys before the chunk (the tail mask), not its sibling. Batched with a plain
    causal chunk on another slot."""
    rt = loaded("llama").runtime
    prefix = [3, 4, 5]
    cache = rt.new_cache(2)
    rt.forward(cache, [0, 1], [prefix, prefix])
    rt.forward(cache, [0], [[7, 8]], positions=[[3, 3]], chunk_masks=[torch.eye(2, dtype=torch.bool)])
    tail = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # 9 under 7, 10 under 8
    out = rt.forward(cache, [0, 1], [[9, 10], [6, 7, 8]], positions=[[4, 4], None],
                     chunk_masks=[tail, None])  # [2, 3, vocab]
    assert cache.lengths == [7, 6]
    a = rt.forward(rt.new_cache(1), [0], [prefix + [7, 9]])[0, -1]
    b = rt.forward(rt.new_cache(1), [0], [prefix + [8, 10]])[0, -1]
    c = rt.forward(rt.new_cache(1), [0], [prefix + [6, 7, 8]])[0, 3:]
    torch.testing.assert_close(out[0, 0], a, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0, 1], b, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1], c, atol=1e-5, rtol=0)


def weightless(src, dest, **config_changes):
    """A copy of the HF directory ``src`` without its weights (config and tokenizer only)."""
    import json
    import shutil

    dest.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dest


@pytest.mark.parametrize("tied", [False, True])
def test_dummy_weights_need_no_checkpoint_and_agree_across_runtimes(tiny_dirs, tmp_path, tied):
    """``load_format="dummy"`` reads only config and tokenizer; the torch runtime and
    transformers' model get the same random weights (so the same logits, as on a real
    checkpoint), every load alike; tied embeddings stay tied (transformers ties its head to
    the embedding: a separate random head in the torch runtime would part the logits)."""
    from specdec.runtime import load_model

    path = weightless(tiny_dirs["qwen2"], tmp_path / "cfg", tie_word_embeddings=tied)
    with pytest.raises(ValueError, match="no weights in .*: neither .safetensors nor pytorch_model"):
        load_model(str(path))
    ids = list(range(40, 57))
    logits = {}
    for name, backend in (("torch", "torch"), ("torch again", "torch"), ("hf", "hf")):
        rt = load_model(str(path), backend=backend, load_format="dummy").runtime
        logits[name] = rt.forward(rt.new_cache(1), [0], [ids])[0]  # [17, vocab]
    assert torch.equal(logits["torch"], logits["torch again"])
    assert (logits["torch"] - logits["hf"]).abs().max().item() < ATOL
    assert logits["torch"].std().item() > 0.1  # not all ties: greedy decoding is well defined
    with pytest.raises(ValueError, match="GGUF's own weights"):
        load_model(str(path), backend="llamacpp", load_format="dummy")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(str(path), load_format="zeros")
    from transformers import AutoConfig

    from specdec.runtime.loading import DummyWeights
    gpt2 = DummyWeights(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    # norms by their module, not their name: GPT-2's ln_* (zeros made every logit equal)
    assert all(gpt2[n].eq(1).all() for n in ("transformer.ln_f.weight", "transformer.h.0.ln_1.weight"))
    assert gpt2["transformer.ln_f.bias"].eq(0).all()


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "gptoss", "glm45", "deepseek", "llama", "qwen35", "granite4h",
                                  "nemotronh", "lfm2", "lfm3", "olmohybrid", "falconh1", "mamba", "jamba", "mamba2-alone",
                                  "arcee-relu2",
                                  "olmoe-experts", "starcoder2-layernorm-biases", "ernie45moe-correction",
                                  "apertus-xielu", "gptneox-parallel", "phi-parallel", "stablelm-norms-per-head",
                                  "gptj-interleaved-partial", "falcon-groups-two-norms", "gpt2-learned-positions",
                                  "opt-learned-positions", "bigcode-multi-query", "nemotron-layernorm1p",
                                  "exaonemoe-windows-experts", "llama4-chunks-experts", "bloom-alibi",
                                  "mpt-alibi-clip", "flexolmo-experts", "granitemoeswa-sinks-experts",
                                  "solaropen-experts", "hunyuanmoe-experts", "nanochat-weightless-norms",
                                  "jais2-layernorm-relu2", "glm-interleaved-half", "vaultgemma-softcaps",
                                  "afmoe-gated-windows-experts", "gptneo-local-layers", "youtu-latent-dense",
                                  "axk1-latent-experts-normed", "codegen-blocks", "persimmon-qk-layernorm",
                                  "dbrx-experts-clip", "kolibri1-windows-experts", "flint-sinks-windows-experts",
                                  "minicpm3-latent-mup", "gemma4-shared-kv-per-layer", "gemma4-plain", "gemma4-unified",
                                  "minimax-m2-experts", "lfm3-windows-gates", "lfm3-plain", "olmohybrid-rope",
                                  "olmohybrid-nope", "cohere2moe-softmax-average", "cohere2moe-sigmoid-sum-rms",
                                  "mimo-windows-sinks-experts", "mellum-windows-experts", "gemma4-experts-beside",
                                  "deepseekv32-sparse-attention", "glm5-sparse-attention-shared",
                                  "hy3-qk-norms-experts", "apertus1p5-pruned-head", "sarvam-moe-original-names",
                                  "sarvam-mla-one-query-product", "laguna-heads-per-layer-gates",
                                  "laguna-element-gates", "phimoe-sparsemixer-longrope", "axk2-gated-norms-query-gates",
                                  "kimilinear-kda-latent-nope", "kimilinear-query-low-rank", "ling-kda-bounded-decays",
                                  "ling-kda-softplus-no-q-lora", "hy4-hyper-connections-sparse-sinks",
                                  "hyperclovax-peri-norms-mup", "lara-delta-windows-experts", "aria-experts-transposed",
                                  "cohere-compass-halves-nope-full", "gemma3n-altup-laurel-sparse",
                                  "gemma3n-active-second-unscaled", "zamba2-shared-blocks-adapters",
                                  "zamba2-one-block-gqa-nope", "recurrentgemma-rglru-window",
                                  "recurrentgemma-wide-lru-mha", "minimax-lightning-experts",
                                  "jetmoe-attention-experts", "jetmoe-three-of-eight", "bitnet-sub-norms-relu2"])
def test_weight_bytes_from_the_config(tiny_dirs, tmp_path, name):
    """The fp32 bytes of the ``Linear`` weights (attention's, dense MLPs', shared experts', the
    head) and of the experts, read from the config before loading (whether a verify-packed
    copy of the linears fits in memory beside them), are the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.linear import expert_bytes, linear_bytes

    from tiny import make_tiny

    path = tiny_dirs[name] if name in tiny_dirs else make_tiny(tmp_path / name, VARIANTS[name][0], **VARIANTS[name][1])
    config = AutoConfig.from_pretrained(path)
    params = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    experts = sum(p.numel() for n, p in params.items()
                  if ".experts." in n and (p.dim() == 3 or n.endswith(("mlp.w1", "mlp.v1", "mlp.w2")))  # (DBRX's: 2-D)
                  or p.dim() == 3 and n.endswith((".mlp.input_linear.weight", ".mlp.output_linear.weight")))  # (JetMoE's)
    linears = sum(p.numel() for n, p in params.items() if p.dim() == 2 and ".experts." not in n
                  and not any(e in n.replace("unembed", "") for e in ("embed", ".wte.", ".wpe.", ".word_embeddings."))
                  and not n.endswith(("mlp.gate.weight", "mixer.gate.weight", "router.weight", "shared_expert_gate.weight",
                                      "gate.wg.weight", "router.gate.weight", "router.layer.weight", "router.proj.weight",
                                      "A_log", "e_score_correction_bias", "_gate_bias")))  # (Mamba's decays:
    # [channels, state]; RG-LRU's gates' biases: [heads, block]; ERNIE 4.5's correction: [1, experts]; Gemma 3n's
    # altup_unembed_projections are products)
    if config.tie_word_embeddings:  # (the head: the embedding, which transformers' parameters name once)
        linears += config.vocab_size * config.hidden_size
    assert (expert_bytes(config), linear_bytes(config)) == (4 * experts, 4 * linears)


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "gptoss", "glm45", "deepseek"])
def test_experts_under_transformers_own_names(tiny_dirs, tmp_path, name):
    """A checkpoint saves one tensor per expert and projection (Mixtral's ``w1``/``w3``/``w2``);
    transformers' model fuses them (``mlp.experts.gate_up_proj``), and those names come
    from dummy weights and converted GGUFs: both load to the same logits, and dummy weights
    give the torch runtime transformers' logits."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from specdec.runtime import load_model

    fused = tmp_path / "fused"
    shutil.copytree(tiny_dirs[name], fused)
    state = AutoModelForCausalLM.from_pretrained(tiny_dirs[name]).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    ids = list(range(40, 57))
    logits = []
    for path, fmt, backend in ((tiny_dirs[name], "auto", "torch"), (fused, "auto", "torch"),
                               (fused, "dummy", "torch"), (fused, "dummy", "hf")):
        rt = load_model(str(path), backend=backend, load_format=fmt).runtime
        logits.append(rt.forward(rt.new_cache(1), [0], [ids])[0])  # [17, vocab]
    assert torch.equal(logits[0], logits[1])
    assert (logits[2] - logits[3]).abs().max().item() < ATOL
    assert not torch.equal(logits[1], logits[2])


@pytest.mark.parametrize("name", ["gemma4", "gemma3n", "zamba2"])
def test_dummy_weights_of_other_layers_agree_across_runtimes(tiny_dirs, name):
    """Gemma 4's dummy weights scale each layer's output by 1, as transformers starts its layer
    scalars (0, as other vectors but norms, made every logit 0): both runtimes' logits agree;
    so do Gemma 3n's (its corrected outputs scaled by 0, as transformers starts them) and
    Zamba2's (its shared blocks' weights named under each hybrid layer, read from the first)."""
    from specdec.runtime import load_model

    ids = list(range(40, 57))
    logits = []
    for backend in ("torch", "hf"):
        rt = load_model(str(tiny_dirs[name]), backend=backend, load_format="dummy").runtime
        logits.append(rt.forward(rt.new_cache(1), [0], [ids])[0])  # [17, vocab]
    assert (logits[0] - logits[1]).abs().max().item() < ATOL * logits[1].abs().max().item()
    assert logits[0].std().item() > 0.1


def test_gpt_oss_mxfp4_experts(tmp_path):
    """GPT-OSS as released, its experts in MXFP4, dequantized at load: the logits equal the
    torch runtime's and transformers' on the checkpoint holding transformers' own
    dequantization of them (``convert_moe_packed_tensors``), float32 and bfloat16."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from specdec.runtime import load_model
    from specdec.runtime.loading import Weights

    from tiny import make_tiny, mxfp4_copy

    src = make_tiny(tmp_path / "gptoss", "gpt_oss", seed=5, **VARIANTS["gptoss-sinks-window"][1])
    quantized = mxfp4_copy(src, tmp_path / "mxfp4")
    reference = mxfp4_copy(src, tmp_path / "dequantized")
    tensors = load_file(str(reference / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        tensors[base] = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(base + "_scales"), dtype=torch.float32)
    save_file(tensors, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((src / "config.json").read_text())
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        logits = [rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] for rt in (
            TorchLlama(AutoConfig.from_pretrained(p), Weights(p), torch.device("cpu"), dtype) for p in (quantized, reference))]
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(reference, dtype=dtype).eval()(ids).logits[0].float()
        assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], ref), dtype
    model = load_model(str(quantized))
    assert isinstance(model.runtime, TorchLlama)


@pytest.mark.parametrize("arch,block", [("llama", (24, 16)), ("qwen3_moe", (24, 16)), ("deepseek_v3", (24, 16)),
                                        ("llama", None), ("qwen3_moe", None)])
def test_fp8_checkpoints_dequantize_at_load(tmp_path, arch, block):
    """A checkpoint in transformers' fine-grained FP8 (``tiny.fp8_copy``: blocks of 24 x 16, which the
    tiny dimensions leave short at their ends), or compressed-tensors' (a scale per row), runs on
    the torch runtime, dequantized at load:
    its logits equal those of the checkpoint holding the dequantized weights (computed block by
    block), on the torch runtime bit for bit and on transformers' within rounding, float32 and
    bfloat16 (a dense model; experts, each its own blocks; latent attention); the default
    backend takes it, and ``quantization`` names it ("fp8", "compressed-tensors")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec import LLM, SamplingParams
    from specdec.runtime.loading import Weights

    from tiny import fp8_copy, make_tiny

    config = {} if arch == "llama" else dict(MOE[arch], first_k_dense_replace=1) if arch == "deepseek_v3" else MOE[arch]
    quantized, reference = fp8_copy(make_tiny(tmp_path / arch, arch, seed=5, **config), tmp_path / "fp8", block=block)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float32):
        logits = [rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] for rt in (
            TorchLlama(AutoConfig.from_pretrained(p), Weights(p), torch.device("cpu"), dtype) for p in (quantized, reference))]
        assert torch.equal(logits[0], logits[1]), dtype
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(reference).eval()(ids).logits[0]
    assert (logits[0] - ref).abs().max() < ATOL * ref.abs().max()
    llm = LLM(str(quantized), device="cpu", quantization="fp8" if block else "compressed-tensors")
    assert isinstance(llm.target.runtime, TorchLlama)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate(["hello"], sp)[0].token_ids == LLM(str(reference), device="cpu").generate(["hello"], sp)[0].token_ids


@pytest.fixture(scope="module")
def bitnet_dirs(tmp_path_factory):
    """A tiny BitNet (``tiny.make_tiny``) and its ternary copies (``tiny.bitnet_copy``): packed with
    bfloat16 scales, as released ("offline"); packed with float32 scales ("offline-fp32"); its masters,
    quantized at load ("online")."""
    from tiny import bitnet_copy, make_tiny

    root = tmp_path_factory.mktemp("bitnet")
    plain = make_tiny(root / "plain", "bitnet", seed=5)
    return {"offline": bitnet_copy(plain, root / "offline"), "online": bitnet_copy(plain, root / "online", "online"),
            "offline-fp32": bitnet_copy(plain, root / "offline-fp32", scale_dtype=torch.float32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitnet_ternary_weights_equal_transformers(bitnet_dirs, dtype):
    """BitNet b1.58's packed ternary weights (microsoft/bitnet-b1.58-2B-4T's form) run as integers on
    the CPU (``linear.Ternary``: int8 weights, a quarter of float32's memory) and give transformers'
    ``BitLinear`` model's logits bit for bit, in float32 and bfloat16 (its scales rounded and its
    products computed as transformers' compiled functions do), a whole prompt at once; in chunks and
    single tokens through the cache, within float32's rounding."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import bitnet_reference

    path = bitnet_dirs["offline"]
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype)
    assert type(rt.layers[0]["qkv"]).__name__ == "Ternary" and rt.layers[0]["down"].weight.dtype == torch.int8
    assert type(rt.lm_head).__name__ == "Linear"  # (the head is not ternary)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = bitnet_reference(path, dtype)(ids).logits[0].float()  # [40, vocab]
    assert torch.equal(rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0], ref)
    if dtype == torch.float32:
        cache = rt.new_cache(1)
        ours = torch.cat([rt.forward(cache, [0], [ids[0, a:b].tolist()])[0]
                          for a, b in [(0, 11), (11, 30)] + [(i, i + 1) for i in range(30, 40)]])
        assert (ours - ref).abs().max().item() < ATOL * ref.abs().max().item()


def test_bitnet_masters_quantize_at_load_to_the_packed_model(bitnet_dirs):
    """A BitNet's bf16 masters (its "-bf16" release: ``autobitlinear``, ``online``) are quantized at
    load to the ternary weights and scales the packed checkpoint holds, so they give its logits bit for
    bit (those of transformers' ``BitLinear`` model). transformers' ``AutoBitLinear`` instead computes
    its quantized activations and weights as floats, whose rounding moves its logits away from its own
    packed model's (by several hundredths here). ``modules_to_not_convert`` leaves projections as they are,
    as transformers' quantizer matches its patterns (not one of two products specdec fuses: refused)."""
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import bitnet_reference

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    logits = {}
    for form in ("online", "offline-fp32"):
        path = bitnet_dirs[form]
        rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
        logits[form] = rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0]
    assert torch.equal(logits["online"], logits["offline-fp32"])
    with torch.no_grad():
        assert torch.equal(bitnet_reference(bitnet_dirs["offline-fp32"])(ids).logits[0], logits["offline-fp32"])
    config = AutoConfig.from_pretrained(bitnet_dirs["online"])  # the modules its quantization leaves as they are
    config.quantization_config["modules_to_not_convert"] = ["model.layers.1.mlp.down_proj", "o_proj"]
    rt = TorchLlama(config, Weights(bitnet_dirs["online"]), torch.device("cpu"), torch.float32)
    kinds = [tuple(type(L[n]).__name__ for n in ("qkv", "o", "gate_up", "down")) for L in rt.layers]
    assert kinds == [("Ternary", "Linear", "Ternary", "Ternary"), ("Ternary", "Linear", "Ternary", "Linear")]
    config.quantization_config["modules_to_not_convert"] = ["gate_proj"]  # (one of the MLP's fused products)
    with pytest.raises(ValueError, match="gate_proj.weight, model.layers.0.mlp.up_proj.weight: modules_to_not_convert"):
        TorchLlama(config, Weights(bitnet_dirs["online"]), torch.device("cpu"), torch.float32)


def test_bitnet_speculates_as_transformers_decodes(bitnet_dirs, monkeypatch, tmp_path):
    """The packed BitNet decodes greedily as transformers' ``BitLinear`` model does, a whole forward a
    token, plain and under speculation (always-right drafts, 4 deep; n-gram chains and trees; a draft
    tree 8 deep; under the cost model, which times its forwards), in batches of 3 with chunked prompts: a
    row's ternary products do not depend on the rows beside it or on how many tokens a forward holds."""
    from specdec import LLM, SamplingParams, SpecConfig

    from tiny import bitnet_reference, greedy_by_whole_forwards

    monkeypatch.setenv("SPECDEC_COST_CACHE", str(tmp_path / "costs.json"))
    path = bitnet_dirs["offline"]
    prompts = [list(b"def fib(n): return fib(n-1) + "), list(b"abcabcabcabc"), list(b"The cat sat on")]
    want = greedy_by_whole_forwards(bitnet_reference(path), prompts, 24)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for method, k, topk, cost in [("none", 1, 1, False), ("self", 4, 1, False), ("ngram", 3, 1, False),
                                  ("ngram", 3, 2, False), ("self", 8, 2, False), ("self", 4, 1, True)]:
        llm = LLM(str(path), device="cpu", chunked_prefill_size=4, max_batch_size=3, quantization="bitnet",
                  speculative=SpecConfig(method=method, num_draft_tokens=k, tree_topk=topk, cost_model=cost))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [o.token_ids for o in outs] == want, (method, k, topk, cost)
    assert "ternary" in llm.target.runtime.speed_key  # (the cost model's forward times are kept by it)


def test_dummy_weights_of_a_packed_bitnet_are_ternary(bitnet_dirs):
    """``load_format="dummy"`` on a packed BitNet's config gives ternary products, as its checkpoint
    would (speed and memory as the real model's): int8 of -1, 0 and 1, scaled by 1 / mean |w| of
    N(0, initializer_range) weights; its masters' config (quantized at load) the same way."""
    from transformers import AutoConfig

    from specdec.runtime.loading import DummyWeights

    for form in ("offline", "online"):
        config = AutoConfig.from_pretrained(bitnet_dirs[form])
        rt = TorchLlama(config, DummyWeights(config), torch.device("cpu"), torch.float32)
        qkv = rt.layers[1]["qkv"]
        assert type(qkv).__name__ == "Ternary" and set(qkv.weight.unique().tolist()) == {-1, 0, 1}
        assert qkv.scale.min().item() == pytest.approx((math.pi / 2) ** 0.5 / config.initializer_range, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ternary_products_on_a_gpu_equal_the_integer_ones(dtype):
    """``Ternary``'s product off the CPU (the model's dtype's ``F.linear``, as transformers computes it)
    equals its integer product on the CPU bit for bit: run here on the CPU, with the bias, over rows of
    different scales (one all zeros); and a row alone (through the weights by rows) as among others
    (through their copy by columns)."""
    from specdec.runtime.linear import Ternary, TernaryWeight

    g = torch.Generator().manual_seed(0)
    t = torch.randint(-1, 2, (48, 200), generator=g, dtype=torch.int8)
    weight = TernaryWeight(t, torch.rand(48, generator=g) + 0.5)
    x = (torch.randn(2, 5, 200, generator=g) * torch.tensor([0.01, 1, 30, 0, 2])[None, :, None]).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    cpu = Ternary(weight, bias, torch.device("cpu"), dtype, multi_row=True)
    gpu = Ternary(weight, bias, torch.device("cpu"), dtype)
    gpu.integers, gpu.weight = False, t.to(dtype)  # (what a CUDA device holds)
    assert cpu.weight.dtype == cpu.columns.dtype == torch.int8 and cpu.columns.shape == (200, 48)
    y = cpu(x)
    assert y.shape == (2, 5, 48) and y.dtype == dtype and torch.equal(y, gpu(x))
    assert torch.equal(cpu(x[1:, 2:3]), y[1:, 2:3])
    assert torch.equal(y[:, 3], bias.expand(2, 48))  # (a row of zeros: its product is 0)


def test_quantized_checkpoints_the_torch_runtime_reads():
    """FP8 weights the torch runtime dequantizes (``fp8_block``: the blocks one scale covers),
    and the quantizations it leaves to transformers' runtime, refused with their names."""
    from transformers import AutoConfig

    from specdec.runtime.torch_llama import fp8_block, unsupported

    channel = {"num_bits": 8, "type": "float", "strategy": "channel"}
    assert fp8_block({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (128, 128)
    assert fp8_block({"quant_method": "fp8"}) is None
    assert fp8_block({"quant_method": "compressed-tensors", "format": "float-quantized",
                      "config_groups": {"group_0": {"weights": channel}}}) is None
    assert fp8_block({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"weights": dict(channel, strategy="block", block_structure=[128, 128])}}}) == (128, 128)
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}
    for qc in (int4, {"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"}):
        assert fp8_block(qc) is False
        config = AutoConfig.for_model("llama", quantization_config=qc)
        assert f"not {qc['quant_method']!r} ones" in unsupported(config)
    assert unsupported(AutoConfig.for_model("llama", quantization_config={"quant_method": "fp8"})) is None
    # BitNet's ternary weights: packed (bitlinear, offline) or masters (autobitlinear, online); not a norm inside
    # each product, not autobitlinear's offline form, not in another architecture
    for qc, ok in (({}, True), ({"linear_class": "autobitlinear", "quantization_mode": "online"}, True),
                   ({"use_rms_norm": True}, False), ({"linear_class": "autobitlinear"}, False)):
        qc = {"quant_method": "bitnet", **qc}
        assert (unsupported(AutoConfig.for_model("bitnet", quantization_config=qc)) is None) == ok, qc
    assert "BitNet" in unsupported(AutoConfig.for_model("llama", quantization_config={"quant_method": "bitnet"}))


class EagerGraphs:
    """Stands in for ``CudaGraphs`` on the CPU: the graphed branch of ``forward`` (inputs over
    the cache's whole capacity, logits of every row, the last rows picked after), with the
    layers run eagerly instead of replayed. What a CUDA graph replays is exactly that call."""

    def __init__(self, runtime):
        self.runtime, self.shapes = runtime, set()

    def run(self, cache, x, tokens):
        assert x.mask.shape[-1] == cache.capacity
        self.shapes.add(tuple(x.ids.shape))
        logits, features = self.runtime._layers(cache, x)
        return logits[:, :tokens], None if features is None else features[:, :tokens]


@pytest.mark.parametrize("name", ["llama", "gemma3", "gemma2-caps-window", "granite-multipliers", "qwen2moe",
                                  "gptoss-sinks-window", "glm45-groups-shared", "glm4-interleaved-partial-rope",
                                  "deepseek", "deepseekv2-greedy"])
def test_graphed_forward_equals_eager(tiny_dirs, tmp_path, name):
    """The CUDA-graph branch of the forward (full-capacity masks, rows padded up to a graph's
    size; Gemma 3's window, Gemma 2's capped attention written out, Granite's multipliers and
    Qwen2-MoE's experts, padding rows routed too, in it) gives eager decoding's greedy tokens under plain
    decoding, chains, n-gram and draft trees, in batches and one by one."""
    from specdec.runtime.cuda_graphs import GRAPH_TOKEN_SIZES

    from specdec import LLM, SamplingParams, SpecConfig
    from specdec.runtime import load_model

    prompts = ["Hello world, this is a test", "abc", "The quick brown fox. The quick brown"]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    from tiny import make_tiny

    path = tiny_dirs[name] if name in tiny_dirs else make_tiny(tmp_path / name, VARIANTS[name][0], **VARIANTS[name][1])
    base = [o.token_ids for o in LLM(load_model(str(path))).generate(prompts, sp)]
    model = load_model(str(path))
    model.runtime.graphs = graphs = EagerGraphs(model.runtime)
    for spec in (SpecConfig(), SpecConfig(method="self", num_draft_tokens=4),
                 SpecConfig(method="ngram", tree_topk=2, num_draft_tokens=3),
                 SpecConfig(method="self", tree_topk=2, tree_depth=3, tree_nodes=5)):
        llm = LLM(model, speculative=spec)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == base, spec
        assert [llm.generate(p, sp)[0].token_ids for p in prompts] == base, spec
    assert {(1, 1), (3, 1), (1, 6), (3, 6)} <= graphs.shapes  # k = 4: 5 rows run as 6
    assert {t for _, t in graphs.shapes} <= set(GRAPH_TOKEN_SIZES)
    rt, ragged = model.runtime, [[5, 6, 7, 8, 9], [10, 11]]  # a ragged batch, padded to 6 rows
    graphed = [rt.forward(rt.new_cache(2), [0, 1], ragged, last_only=last) for last in (True, False)]
    rt.graphs = None
    eager = [rt.forward(rt.new_cache(2), [0, 1], ragged, last_only=last) for last in (True, False)]
    assert graphed[1].shape == eager[1].shape == (2, 5, rt.vocab_size)
    assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(graphed, eager))


def test_cuda_graphs_need_cuda(tiny_dirs):
    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        TorchLlama(AutoConfig.from_pretrained(tiny_dirs["llama"]), Weights(tiny_dirs["llama"]),
                   torch.device("cpu"), torch.float32, cuda_graphs=True)


def _copy_without_weights(src, dst):
    import shutil

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_pytorch_bin_checkpoints(tiny_dirs, tmp_path):
    """A checkpoint saved as PyTorch pickles (``pytorch_model.bin``, or shards with their
    index, as older hub models and ``safe_serialization=False`` save; also PyTorch's pre-1.6
    format, and names without the ``model.`` prefix) runs on the torch runtime and gives what
    its safetensors give; a pickle holding code is refused."""
    import json

    from safetensors.torch import load_file

    from specdec import LLM, SamplingParams
    from specdec.runtime.loading import Weights

    src = tiny_dirs["llama"]
    state = load_file(src / "model.safetensors")
    whole = _copy_without_weights(src, tmp_path / "whole")
    torch.save(state, whole / "pytorch_model.bin")
    sharded, names, where = _copy_without_weights(src, tmp_path / "sharded"), sorted(state), {}
    for i in range(3):
        file = f"pytorch_model-{i + 1:05d}-of-00003.bin"
        torch.save({n: state[n] for n in names[i::3]}, sharded / file)
        where.update({n: file for n in names[i::3]})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": where}))
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(src), device="cpu").generate(["hello world", "abc"], sp)]
    for path in (whole, sharded):
        llm = LLM(str(path), device="cpu")
        assert isinstance(llm.target.runtime, TorchLlama)
        assert [o.token_ids for o in llm.generate(["hello world", "abc"], sp)] == ref
    old = _copy_without_weights(src, tmp_path / "old")  # PyTorch's format before 1.6: not a zip, read whole
    torch.save(state, old / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    bare = _copy_without_weights(src, tmp_path / "bare")  # saved from the base model: no "model." prefix
    torch.save({n.removeprefix("model."): t for n, t in state.items()}, bare / "pytorch_model.bin")
    for path in (old, bare):
        assert [o.token_ids for o in LLM(str(path), device="cpu").generate(["hello world", "abc"], sp)] == ref
    evil = _copy_without_weights(src, tmp_path / "evil")
    torch.save({"w": torch.zeros(1), "f": print}, evil / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot read .* as PyTorch weights"):
        Weights(evil)
    with pytest.raises(ValueError, match="neither .safetensors nor pytorch_model"):
        Weights(_copy_without_weights(src, tmp_path / "empty"))


CUSTOM_CONFIG = '''
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"
'''
CUSTOM_MODEL = '''
from transformers import LlamaForCausalLM

from .configuration_tinycustom import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    """Llama under a name of its own, taking its cache as older remote code does."""

    config_class = TinyCustomConfig

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, cache=past_key_values, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)
'''


def test_trust_remote_code(tiny_dirs, tmp_path):
    """A checkpoint with its own code (``auto_map``; here Llama renamed, its forward taking
    ``past_key_values``) is refused with the keyword to pass; with ``trust_remote_code`` it runs
    that code on transformers' runtime, plain and drafting, from the library and the CLI."""
    import json
    import shutil

    from specdec import LLM, SamplingParams
    from specdec.runtime.hf import HFRuntime

    from test_api_errors import run_cli

    path = tmp_path / "custom"
    shutil.copytree(tiny_dirs["llama"], path)
    (path / "configuration_tinycustom.py").write_text(CUSTOM_CONFIG)
    (path / "modeling_tinycustom.py").write_text(CUSTOM_MODEL)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="tinycustom", architectures=["TinyCustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_tinycustom.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="its own Python code .* trust_remote_code=True"):
        LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="runs its own modeling code .* backend 'auto' or 'hf'"):
        LLM(str(path), device="cpu", trust_remote_code=True, backend="torch")
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(tiny_dirs["llama"]), device="cpu").generate(["hello world", "abc"], sp)]
    llm = LLM(str(path), device="cpu", trust_remote_code=True)
    assert isinstance(llm.target.runtime, HFRuntime) and llm.target.runtime.cache_name == "past_key_values"
    assert [o.token_ids for o in llm.generate(["hello world", "abc"], sp)] == ref
    drafted = LLM(str(path), draft=str(path), device="cpu", trust_remote_code=True).generate(["hello world", "abc"], sp)
    assert [o.token_ids for o in drafted] == ref and drafted[0].metrics["acceptance_rate"] == 1
    r = run_cli("generate", "--model", str(path), "--trust-remote-code", "--device", "cpu", "--prompt", "abc",
                "--max-tokens", "12", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == ref[1]


def test_tokenizer_from_elsewhere(tiny_dirs, loaded, tmp_path):
    """``tokenizer=`` (vLLM's): the target's tokenizer from another directory; the model is the
    same (token ids in, the same ids out), its text is that tokenizer's. One whose base
    vocabulary is larger than the model's is refused (tokens added past the embedding are not:
    they are refused per request, as with the model's own), and so is the keyword beside a
    model loaded already."""
    from specdec import LLM, SamplingParams

    from tiny import byte_tokenizer

    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    own = LLM(str(tiny_dirs["llama"]), device="cpu")
    other = LLM(str(tiny_dirs["llama"]), device="cpu", tokenizer=str(tiny_dirs["alien"]))  # 'a' and 'b' swapped
    assert own.encode("a") != other.encode("a") and other.encode("a") == own.encode("b")
    ids = {"prompt_token_ids": own.encode("hello world")}
    a, b = own.generate(ids, sp)[0].outputs[0], other.generate(ids, sp)[0].outputs[0]
    assert a.token_ids == b.token_ids and b.text == other.get_tokenizer().decode(b.token_ids)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    added = byte_tokenizer()
    added.add_tokens([f"<extra{i}>" for i in range(10)])  # 268 tokens against 264 rows
    added.save_pretrained(tmp_path / "added")
    assert len(LLM(str(tiny_dirs["llama"]), device="cpu", tokenizer=str(tmp_path / "added")).get_tokenizer()) == 268
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="300 tokens, more than the model's vocabulary of 264"):
        LLM(str(tiny_dirs["llama"]), device="cpu", tokenizer=str(tmp_path / "other"))
    with pytest.raises(ValueError, match="loaded already"):
        LLM(loaded("llama"), tokenizer=str(tiny_dirs["alien"]))


def test_hub_downloads(tiny_dirs, monkeypatch):
    """What a hub id fetches (the hub itself is out of reach here, so its two calls are
    replaced): config and tokenizer files, the model's safetensors where the repo has them
    (``weight_pattern``), else its
    ``pytorch_model*.bin`` (not both), its Python files with ``trust_remote_code``, all at
    ``revision``; from the local snapshot when the listing fails (offline); no weights for a
    tokenizer alone."""
    import huggingface_hub

    from specdec import LLM, SpecConfig
    from specdec.runtime.loading import load_tokenizer, resolve

    calls, listing = [], []

    def list_repo_files(repo_id, revision=None):
        if listing is None:
            raise OSError("offline")
        return listing

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, set(allow_patterns)))
        return str(tiny_dirs["llama"])

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    meta = {"*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"}
    listing[:] = ["config.json", "model.safetensors", "pytorch_model.bin"]
    llm = LLM("org/model", device="cpu", revision="v1.0")
    assert calls[-1] == ("org/model", "v1.0", meta | {"model*.safetensors"}) and llm.generate("abc")[0].token_ids
    listing[:] = ["config.json", "pytorch_model.bin"]
    resolve("org/old", code=True)
    assert calls[-1] == ("org/old", None, meta | {"pytorch_model*.bin", "*.py"})
    listing = None
    resolve("org/cached")
    assert calls[-1][2] == meta | {"*.safetensors", "pytorch_model*.bin"}
    load_tokenizer("org/model")
    assert calls[-1] == ("org/model", None, meta)
    listing = ["config.json", "model.safetensors"]  # a hub tokenizer: at the model's revision, or its own
    LLM(str(tiny_dirs["llama"]), device="cpu", tokenizer="org/tok", revision="v2")
    assert calls[-1] == ("org/tok", "v2", meta)
    LLM(str(tiny_dirs["llama"]), device="cpu", tokenizer="org/tok", revision="v2", tokenizer_revision="t1")
    assert calls[-1] == ("org/tok", "t1", meta)
    listing = ["config.json", "model.safetensors"]  # a hub draft: at its own revision (vLLM's speculative_config)
    LLM(str(tiny_dirs["llama"]), device="cpu", speculative_config={"model": "org/draft", "revision": "d1"})
    assert calls[-1] == ("org/draft", "d1", meta | {"model*.safetensors"})
    with pytest.raises(ValueError, match="loaded already"):
        LLM(str(tiny_dirs["llama"]), device="cpu", draft=LLM(str(tiny_dirs["llama"]), device="cpu").target,
            speculative=SpecConfig(method="draft", draft_revision="d1"))


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_broken_checkpoints_are_value_errors(tiny_dirs, tmp_path, backend):
    """A checkpoint cut short, a foreign file, a shard its index names but the directory lacks,
    or a tensor missing: a ``ValueError`` naming it (one line from the CLI), on specdec's
    runtime and on transformers' (which would start a missing tensor from random values).
    A ``consolidated.safetensors`` beside ``model.safetensors`` (Mistral's own format) is
    not read, as transformers reads the directory."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.runtime import load_model

    def broken(name, change):
        d = tmp_path / name
        shutil.copytree(tiny_dirs["llama"], d)
        change(d / "model.safetensors")
        return str(d)

    def drop(f):
        tensors = load_file(f)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, f, metadata={"format": "pt"})

    def shard(f):  # an index naming a second file that is not there
        tensors = load_file(f)
        f.unlink()
        save_file(tensors, f.with_name("model-00001-of-00002.safetensors"), metadata={"format": "pt"})
        weight_map = {n: "model-00001-of-00002.safetensors" for n in tensors}
        weight_map["model.layers.1.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors"
        f.with_name("model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    cases = {"cut": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "safetensors|deserializ"),
             "foreign": (lambda f: f.write_bytes(b"\x00" * 4096), "safetensors|deserializ|header"),
             "dropped": (drop, "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
             "shard": (shard, "model-00002-of-00002.safetensors")}
    for name, (change, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_model(broken(name, change), device="cpu", backend=backend)

    def consolidated(f):  # the same weights under Mistral's names, beside
        save_file({n.removeprefix("model."): t for n, t in load_file(f).items()},
                  f.with_name("consolidated.safetensors"), metadata={"format": "pt"})

    from specdec import LLM, SamplingParams

    sp, prompt = SamplingParams(max_tokens=8, ignore_eos=True), {"prompt_token_ids": [5, 6, 7]}
    outs = [LLM(load_model(d, device="cpu", backend=backend)).generate(prompt, sp)[0].token_ids
            for d in (broken("consolidated", consolidated), str(tiny_dirs["llama"]))]
    assert outs[0] == outs[1]


def test_hub_weight_files():
    """What a hub download fetches of a repo's weights: transformers' own files, not a
    consolidated or original/ copy beside them (Mistral's, Llama 3's: as large again)."""
    from fnmatch import fnmatch

    from specdec.runtime.loading import weight_pattern

    repos = {("model.safetensors", "consolidated.safetensors", "original/consolidated.00.pth"): ["model.safetensors"],
             ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "original/model.safetensors",
              "model.safetensors.index.json"): ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
             ("weights.safetensors",): ["weights.safetensors"],
             ("pytorch_model.bin", "original/consolidated.safetensors"): ["pytorch_model.bin"]}
    for files, want in repos.items():
        pattern = weight_pattern(list(files))
        assert [f for f in files if fnmatch(f, pattern)] == want, files


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_in_bfloat16(method):
    """DeepSeek-V2's router in bfloat16 models: logits and weights in float32, the same
    experts and weights as transformers' router for every token."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from specdec.runtime.moe import Routing

    config = AutoConfig.for_model("deepseek_v2", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, topk_method=method, routed_scaling_factor=2.5)
    router = DeepseekV2TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(16, 64, generator=g)
    x = torch.randn(500, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_e = router(x)
    weights, chosen = Routing.of(config).weights(F.linear(x.float(), router.weight))
    assert weights.dtype == torch.float32
    order, want = chosen.sort(dim=-1), want_e.sort(dim=-1)
    assert torch.equal(order.values, want.values)
    assert torch.equal(weights.gather(1, order.indices), want_w.gather(1, want.indices))


def test_axk2_routing_scores_other_groups_zero():
    """A.X K2's router scores the experts outside each token's best groups 0, not -inf: where the
    correction bias drives the best groups' scores below 0, another group's expert is chosen.
    The same experts and weights as transformers' router for every token."""
    from transformers import AutoConfig
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    from specdec.runtime.moe import Routing

    config = AutoConfig.for_model("axk2", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                  topk_group=2, q_lora_rank=16, routed_scaling_factor=2.5)
    router = AXK2TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(16, 64, generator=g)
    # one expert per group lifted, the others' scores pushed under 0: the best groups hold two experts worth more than
    # nothing, so two of a token's four come from the others, scored 0
    router.e_score_correction_bias.data = torch.tensor([0.5, -2.0, -2.0, -2.0] * 4)
    x = torch.randn(500, 64, generator=g)
    with torch.no_grad():
        _, want_w, want_e = router(x)
    routing = Routing.of(config)
    weights, chosen = routing.weights(F.linear(x, router.weight), router.e_score_correction_bias)
    order, want = chosen.sort(dim=-1), want_e.sort(dim=-1)
    assert torch.equal(order.values, want.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want.indices))
    ours_inf = replace(routing, group_fill=float("-inf")).weights(F.linear(x, router.weight),
                                                                 router.e_score_correction_bias)[1]
    assert not torch.equal(ours_inf.sort(dim=-1).values, want.values)  # (the case arises)


@pytest.mark.parametrize("arch,prefix", [("gpt2", "transformer."), ("opt", "model."), ("bloom", "transformer.")])
def test_original_checkpoints_with_bare_names(tmp_path, arch, prefix):
    """GPT-2's original checkpoints name their tensors without ``transformer.`` (``wte.weight``,
    ``h.0.attn.c_attn.weight``), OPT's without ``model.`` (``decoder.layers.0...``), BLOOM's
    without ``transformer.`` (``word_embeddings.weight``), as transformers loads them too: the
    logits are transformers'."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    path = make_tiny(tmp_path / arch, arch, num_key_value_heads=None, tie_word_embeddings=True, ffn_dim=128)
    tensors = load_file(path / "model.safetensors")
    save_file({k.removeprefix(prefix): v for k, v in tensors.items() if k != "lm_head.weight"},
              path / "model.safetensors", metadata={"format": "pt"})
    assert {"wte.weight", "decoder.embed_tokens.weight", "word_embeddings.weight"} & \
        set(load_file(path / "model.safetensors"))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits[0]
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    assert (rt.forward(rt.new_cache(1), [0], [ids[0].tolist()])[0] - ref).abs().max() < ATOL


@pytest.mark.parametrize("channels", [False, True])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_delta_rule_in_closed_form_equals_token_by_token(T, channels):
    """A verify's few tokens through the gated delta rule in closed form (``delta_chunk``): the
    outputs, the state after and each token's correction equal the rule token by token (``S =
    exp(g) S; delta = beta (v - k S); S += k delta; o = scale q S``) within float32 rounding,
    with one log decay per head or one per key channel (Kimi Delta Attention's: ``exp(g)``
    scales the state's rows); a padding token (g = beta = 0) leaves the state as it was."""
    from specdec.runtime.recurrent import delta_chunk

    gen = torch.Generator().manual_seed(T)
    B, H, dk, dv = 2, 3, 8, 5
    q, k = (F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1) for _ in range(2))
    v, state = torch.randn(B, T, H, dv, generator=gen), torch.randn(B, H, dk, dv, generator=gen)
    g, beta = -torch.rand(B, T, H, dk if channels else 1, generator=gen), torch.rand(B, T, H, generator=gen)
    g[1, -1], beta[1, -1] = 0.0, 0.0  # row 1's last token: padding
    o, after, delta = delta_chunk(state, q, k, v, g, beta, 0.3)
    s = state.clone()
    for t in range(T):
        s = g[:, t].exp()[..., None] * s
        d = beta[:, t, :, None] * (v[:, t] - (k[:, t, :, None, :] @ s)[:, :, 0])  # [B, H, dv]
        s = s + k[:, t, :, :, None] * d[:, :, None, :]
        assert torch.allclose(delta[:, t], d, atol=1e-5)
        assert torch.allclose(o[:, t], 0.3 * (q[:, t, :, None, :] @ s)[:, :, 0], atol=1e-5)
        if t == T - 2:
            before_padding = s[1].clone()
    assert torch.allclose(after, s, atol=1e-5)
    if T > 1:
        assert torch.allclose(after[1], before_padding, atol=1e-6) and not delta[1, -1].any()


@pytest.mark.parametrize("arch", ["qwen35-delta-net", "granite4h-dense-rope", "lfm2-conv", "falconh1-parallel-mup",
                                  "falconmamba", "jamba-experts", "kimilinear-kda-latent-nope",
                                  "zamba2-shared-blocks-adapters", "recurrentgemma-rglru-window",
                                  "minimax-lightning-experts"])
def test_recurrent_states_random_rewinds(tmp_path, arch):
    """Random forwards (1 to 7 tokens, now and then a prompt-sized chunk), rewinds to any
    length the cache says it holds, prompt chunk ends saved and copies between slots, on two
    slots at once: each forward's logits are those of the whole sequence so far computed from
    scratch, so the ring, its replays (Mamba-2's, DeltaNet's) and the saved states never give a wrong state;
    a state the cache does not hold raises rather than being guessed."""
    import random

    from transformers import AutoConfig

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    path = make_tiny(tmp_path / arch, VARIANTS[arch][0], seed=5, **VARIANTS[arch][1])
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    rt.state_depth = 8
    rng = random.Random(0)
    cache, seqs = rt.new_cache(2), [[], []]

    def fresh(ids):  # the last len(new) rows of the whole sequence, one forward from scratch
        return rt.forward(rt.new_cache(1), [0], [ids])[0]

    for step in range(60):
        slot = rng.randrange(2)
        op = rng.random()
        if op < 0.55 or not seqs[slot]:
            n = rng.choice([1, 1, 2, 3, 5, 7] + [20] * (step % 9 == 0))
            new = [rng.randrange(256) for _ in range(n)]
            out = rt.forward(cache, [slot], [new])[0]
            seqs[slot] += new
            ref = fresh(seqs[slot])[-n:]
            assert (out - ref).abs().max().item() < 10 * ATOL * ref.abs().max().item(), (step, slot, n)
            if rng.random() < 0.3:
                cache.save_prefix(slot)
        elif op < 0.85:
            held = [m for m in range(len(seqs[slot]) + 1) if cache.holds(slot, m)]
            missing = [m for m in range(len(seqs[slot]) + 1) if m not in held]
            if missing and rng.random() < 0.2:
                with pytest.raises(RuntimeError, match="cannot go back"):
                    cache.rewind(slot, rng.choice(missing))
                continue
            m = rng.choice(held)
            cache.rewind(slot, m)
            del seqs[slot][m:]
        else:
            other = 1 - slot
            held = [m for m in range(len(seqs[other]) + 1) if cache.holds(other, m) and m >= cache.lengths[slot]
                    and seqs[other][:cache.lengths[slot]] == seqs[slot]]
            if held:
                m = rng.choice(held)
                cache.copy(other, slot, m)
                seqs[slot] = seqs[other][:m]


@pytest.mark.parametrize("arch", ["qwen35-delta-net", "granite4h-dense-rope"])
def test_recurrent_states_rewind_and_batch(tmp_path, arch):
    """Qwen3.5's DeltaNet layers and Granite 4.0's Mamba-2 layers keep a recurrent state per
    slot: in a batch, a row's padding
    leaves its state as it is (two rows of 3 and 7 tokens give what each gives alone); a
    rewind into the last forwards (a verify's rejected drafts, 1-token draft steps) restores
    the state there, as does a rewind to the start of a prompt-sized forward (the chunked
    rule); a rewind past the states kept raises, rather than decoding from a wrong state; a
    state saved at a prompt chunk's end (prefix reuse) is rewound to, and copied to another
    slot, much later."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.runtime.loading import Weights

    from tiny import make_tiny

    path = make_tiny(tmp_path / arch, VARIANTS[arch][0], seed=5, **VARIANTS[arch][1])
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), torch.float32)
    assert (rt.supports_masks, rt.masks_reach_cache, rt.reuses_prefixes, rt.kv_layers, rt.state_layers) == \
        (True, False, False, 1, 2)
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]  # [80, vocab]

    def close(ours, a, b):  # (the chunked rule cut elsewhere than transformers' rounds differently)
        assert (ours - ref[a:b]).abs().max().item() < 10 * ATOL * ref.abs().max().item(), (a, b)

    cache = rt.new_cache(3)
    rt.forward(cache, [0, 2], [ids[:10], ids[:20]])
    out = rt.forward(cache, [0, 2], [ids[10:13], ids[20:27]])  # [2, 7, vocab]
    close(out[0, :3], 10, 13)
    close(out[1], 20, 27)
    cache.rewind(2, 22)  # 5 of 7 rejected
    close(rt.forward(cache, [2], [ids[22:26]])[0], 22, 26)
    for i in range(26, 30):  # draft steps, one token each, then back over all of them
        rt.forward(cache, [2], [ids[i:i + 1]])
    cache.rewind(2, 25)
    close(rt.forward(cache, [2], [ids[25:30]])[0], 25, 30)
    first = rt.forward(cache, [2], [ids[30:80]])[0]  # longer than the ring: the chunked rule
    close(first, 30, 80)
    cache.rewind(2, 30)
    assert torch.equal(rt.forward(cache, [2], [ids[30:80]])[0], first)
    with pytest.raises(RuntimeError, match="cannot go back 20 tokens"):
        cache.rewind(2, 60)
    cache.rewind(2, 0)
    close(rt.forward(cache, [2], [ids[:5]])[0], 0, 5)
    # a prompt chunk's end kept (prefix reuse): rewound to, and copied to another slot, long after
    rt.forward(cache, [2], [ids[5:8]])
    cache.save_prefix(2)
    rt.forward(cache, [2], [ids[8:40]])
    assert cache.holds(2, 8) and cache.holds(2, 40) and not cache.holds(2, 12)
    cache.copy(2, 1, 8)
    close(rt.forward(cache, [1], [ids[8:12]])[0], 8, 12)
    cache.rewind(2, 8)
    close(rt.forward(cache, [2], [ids[8:12]])[0], 8, 12)


"""Tiny random-config checkpoints (HF directories) with a byte-level tokenizer, for fast tests."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

SPECIALS = ["<s>", "</s>"]  # ids 256, 257: bos, eos
VOCAB = 256 + len(SPECIALS) + 6  # a few padded rows the tokenizer never emits
# Qwen3.5's DeltaNet layers beside gated attention: 2 key heads of 8 for 4 value heads of 12
DELTA_NET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                 layer_types=["linear_attention", "full_attention", "linear_attention"], layers=3)
# Mamba-2 layers beside attention (Granite 4.0's hybrids, Bamba): 4 heads of 32 channels, states of 16, in 2
# groups; chunks of 8 (a prompt's scan runs several)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8,
              layer_types=["mamba", "attention", "mamba"], layers=3)
GRANITE = dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=2.5)
# Granite 4.0's dense hybrid (H-Micro's kind: a dense MLP, its shared_mlp), here with rope; Bamba's attention
# rotates half of each head
GRANITE_HYBRID_DENSE = dict(GRANITE, **MAMBA2, num_local_experts=0, shared_intermediate_size=96,
                            position_embedding_type="rope")
BAMBA = dict({k: v for k, v in MAMBA2.items() if k != "layer_types"}, attn_layer_indices=[1])
# Falcon-H1: attention and a Mamba-2 layer side by side in each layer (its d_ssm narrower than 2 x hidden), its
# muP multipliers, the Mamba-2 output normed before the gate
FALCON_H1 = dict(mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                 mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True, embedding_multiplier=1.5,
                 lm_head_multiplier=0.7, attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.6,
                 ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
                 mlp_multipliers=[0.7, 1.4], layers=3)
# Nemotron-H's blocks, each one mixer or one MLP (relu2, not gated): Mamba-2, experts (sigmoid routing in groups,
# a shared expert), attention without rope, a dense MLP, Mamba-2 again
NEMOTRON_H = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"], layers=5,
                  mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                  head_dim=16)
# Mamba's selective scan (Mamba, Falcon-Mamba: a Mamba layer alone in each block): 128 channels with states of 16
MAMBA = dict(state_size=16, conv_kernel=4, expand=2, layers=2)
# Mamba-2 alone in each block (Mamba-Codestral's kind): 4 heads of 32 channels in 2 groups, chunks of 8
MAMBA2_ALONE = dict(num_heads=4, head_dim=32, state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, layers=2)
# Jamba: Mamba layers (dt, B and C normed) and attention without rope, every other layer's MLP experts
JAMBA = dict(layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
             num_experts=4, num_experts_per_tok=2, mamba_d_state=16)
# Ministral 3's (Mistral 3's text model's) rope: yarn, and queries scaled past the original context (16 here)
MINISTRAL3_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0,
                   "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.1}
# Llama 4's: rope (llama3's scaling) on 3 layers of 4, attending in chunks of 8 there, with q/k L2 norms; the 4th
# without rope, over every key, its queries' temperature past 4 positions; experts on every other layer (the sigmoid
# of the top 2 logits scaling their inputs, a shared expert beside them), dense MLPs of their own width on the others
LLAMA4 = dict(layers=4, head_dim=16, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2,
              interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.3,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
# Gemma 4 (E2B / E4B's kind): windows of 6 on 2 layers of 3, the third full with wider heads (32) and one key/value
# head, its keys its values (attention_k_eq_v) and a quarter of each head rotated (proportional rope); per-layer
# inputs; the last 2 layers attend over the last earlier layers' of their type (num_kv_shared_layers), with MLPs twice
# as wide; logits capped
GEMMA4 = dict(layers=6, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
              use_double_wide_mlp=True, final_logit_softcapping=30.0)
# Gemma 3n (E2B / E4B's kind): 4 streams (alternating updates), a low-rank residual (LAuReL), sparse gates on the
# first 2 layers, windows of 6 on 2 layers of 3, per-layer inputs of a table narrower than the vocabulary (tokens
# past it read row 0), the last 2 layers over earlier layers' keys; a width of 48 (its scales 48 ** -0.5, 1 / 48 not
# exact in bfloat16); logits capped
GEMMA3N = dict(layers=6, hidden_size=48, head_dim=16, sliding_window=6, laurel_rank=8, altup_num_inputs=4,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
               vocab_size_per_layer_input=200, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
               activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0], final_logit_softcapping=30.0)
# Zamba2's kind: a Mamba-2 layer each (8 heads of 16 channels, states of 16 in 2 groups, chunks of 8), every other one
# after a shared block (2 blocks in turn: attention over the layer's input beside the embeddings, with rope, then an
# MLP) with the layer's own low-rank adapters; tied embeddings, as released (transformers 5.24 ties its shared blocks
# only then: untied, its loaded model's later blocks are random); weights of std 0.1 (at 0.2 it amplifies rounding:
# bfloat16's logits are noise, transformers' too)
ZAMBA2 = dict(std=0.1, layers=6, layers_block_type=["mamba", "hybrid"] * 3, num_attention_heads=4, num_key_value_heads=4,
              mamba_d_state=16, n_mamba_heads=8, mamba_ngroups=2, chunk_size=8, num_mem_blocks=2, adapter_rank=8,
              use_shared_attention_adapter=True, use_mem_rope=True, intermediate_size=96, pad_token_id=0,
              tie_word_embeddings=True)
# RecurrentGemma's kind (Griffin): RG-LRU blocks (4 heads of gates) on 2 layers of 3, windowed multi-query attention
# (6 tokens, half of each head rotated) on the third; MLPs half intermediate_size wide, with biases; tied embeddings
RECURRENT_GEMMA = dict(layers=4, num_attention_heads=4, num_key_value_heads=1, intermediate_size=192,
                       attention_window_size=6, tie_word_embeddings=True)
# MiniMax-Text-01's kind: lightning attention (linear attention, a decay per head and layer) on 3 layers of 4, full
# attention on the second, 4 experts (2 a token) on every layer; residuals of the normed inputs; weights of std 0.1
# (at 0.2 its bfloat16 logits are noise, transformers' too: experts flip)
MINIMAX = dict(std=0.1, layers=4, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, head_dim=16, block_size=8,
               layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
# JetMoE's kind: attention experts (4, 2 a token: each its queries and output for 2 key/value heads of 16 shared by
# all) and MLP experts (4, 2 a token), each with a bias after the sum
JETMOE = dict(num_key_value_heads=2, kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
# LFM3's kind: convolutions, windowed attention (6) and full attention (a part of each head rotated) in turn
LFM3 = dict(head_dim=16, sliding_window=6, pad_token_id=0,
            layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"])
# Cohere2-MoE's kind: a dense first layer (its own width, rope), windows of 6 on every other layer after it, 4
# experts (2 a token) beside a shared one
COHERE2_MOE = dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                   prefix_dense_intermediate_size=96, sliding_window=6, sliding_window_pattern=2, head_dim=16)
# MiMo-V2-Flash's kind: heads of 24 (values of 16), windows of 6 on three layers of four, 4 experts (2 a token)
MIMO = dict(head_dim=24, v_head_dim=16, num_key_value_heads=2, sliding_window=6, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, layer_types=["full_attention"] + ["sliding_attention"] * 3,
            mlp_layer_types=["dense"] + ["sparse"] * 3)
# OLMo-Hybrid's kind: three Gated DeltaNet layers (4 key heads of 8, as many value heads of 16) then full attention
OLMO_HYBRID = dict(layers=4, pad_token_id=0, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=16)
# Gemma 4's 26B-A4B's kind: experts beside the dense MLP on every layer
GEMMA4_MOE = dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
MOE = {  # a tiny mixture of experts per architecture (make_tiny's config fields)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    layer_types=["sliding_attention", "full_attention"]),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, layers=3),
    # DeltaNet layers: Qwen3-Next's input products grouped per key head, its dense layer; Qwen3.5-MoE's
    "qwen3_next": dict(DELTA_NET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_5_moe_text": dict(DELTA_NET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48),
    # Granite's: softmax over the top k logits; shared experts beside them (granitemoeshared); Granite 4.0's
    # Mamba-2 layers beside attention without rope
    "granitemoe": dict(GRANITE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "granitemoeshared": dict(GRANITE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48),
    "granitemoehybrid": dict(GRANITE, **MAMBA2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                             shared_intermediate_size=48),
    # LFM2-MoE's: short convolutions beside attention, a dense first layer, sigmoid routing with an expert bias
    "lfm2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1,
                     routed_scaling_factor=1.5, layer_types=["conv", "full_attention", "conv"], layers=3),
}
# latent attention (DeepSeek's MLA): a key/value latent of 24, the query's own of 20, heads of 12 + 8
# (rotated) query/key and 10 value dimensions; every head its own (transformers expands the latent to them)
LATENT = dict(num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12,
              v_head_dim=10)
MOE.update({
    "deepseek_v3": dict(MOE["glm4_moe"], **LATENT),  # GLM-4.5's routing: sigmoid, groups, correction bias
    "deepseek_v2": dict(MOE["glm4_moe"], **LATENT, topk_method="group_limited_greedy"),  # softmax, groups by max
    "glm4_moe_lite": dict(MOE["glm4_moe"], **LATENT, first_k_dense_replace=None),  # mlp_layer_types: dense first
})
MOE["glm4_moe_lite"].pop("first_k_dense_replace")
# Laguna's kind: 2 to 6 query heads by layer, windows of 6 on every other layer, a dense first layer
LAGUNA = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              head_dim=16, layers=4, sliding_window=6, layer_types=["full_attention", "sliding_attention"] * 2,
              num_attention_heads_per_layer=[4, 2, 6, 4], moe_router_logit_softcapping=3.0, moe_routed_scaling_factor=2.0)
# Phi-3.5-MoE's kind: biases, longrope past 8 positions (its scales; factors alike before and after), 4 experts
PHIMOE = dict(num_local_experts=4, router_jitter_noise=0.01, attention_bias=True, lm_head_bias=True, pad_token_id=0,
              original_max_position_embeddings=8,
              rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=8,
                                   short_mscale=1.1, long_mscale=1.3, short_factor=[1.0 + 0.2 * i for i in range(8)],
                                   long_factor=[1.0 + 0.2 * i for i in range(8)]))
# DeepSeek Sparse Attention (DeepSeek-V3.2's, GLM-5's): DeepSeek-V3's layers, an indexer keeping each token's best 6
# keys (8 small heads: keys whose every head's score is 0, ties at the cut, are rare)
DSA = dict(MOE["deepseek_v3"], index_n_heads=8, index_head_dim=16, index_topk=6)


def byte_tokenizer(swap: bool = False):
    """Byte-level BPE without merges; ``swap`` exchanges the ids of two byte tokens (same
    size, different vocabulary: an incompatible tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    if swap:
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    return fast


def metaspace_tokenizer():
    """A SentencePiece-style fast tokenizer, as Llama 2's and Mistral's: spaces are "▁", the
    text gets one in front, and decoding strips the text's first space; a few whole words
    ("▁world"...) and single characters. Its size: ``len(tok)`` (under ``VOCAB``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁Hello", "▁world", "▁the", "▁cat"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "▁", *"abcdefghijklmnopqrstuvwxyzH,."])}
    merges = []
    for word in words:  # each word merged left to right
        for end in range(2, len(word) + 1):
            merges.append((word[:end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def char_tokenizer(chars, **kw):
    """A slow (Python) tokenizer: one token per character of ``chars``, '?' (when there)
    for any other; ``kw`` go to ``PreTrainedTokenizer`` (bos/eos tokens...)."""
    from transformers import PreTrainedTokenizer

    class CharTokenizer(PreTrainedTokenizer):
        def __init__(self, **kw):
            self._vocab = {c: i for i, c in enumerate(chars)}
            super().__init__(**kw)

        @property
        def vocab_size(self):
            return len(self._vocab)

        def get_vocab(self):
            return {**self._vocab, **self.added_tokens_encoder}

        def _tokenize(self, text, **kw):
            return list(text)

        def _convert_token_to_id(self, token):
            return self._vocab.get(token, self._vocab.get("?"))

        def _convert_id_to_token(self, index):
            return chars[index] if 0 <= index < len(chars) else None

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    return CharTokenizer(**kw)

# Kimi Linear's kind: Kimi Delta Attention (4 heads of 8, a decay per key channel) on two layers of three, latent
# attention without rope (its query without a low-rank step, as released) on the second; a dense first layer, then
# DeepSeek-V3's experts (sigmoid routing in 2 groups, a correction bias, a shared expert)
KIMI_LINEAR = dict(LATENT, q_lora_rank=None, pad_token_id=0, linear_num_heads=4, linear_head_dim=8, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                   layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                   mlp_layer_types=["dense", "sparse", "sparse"])
# Hy4's kind: DeepSeek Sparse Attention (each token's best 6 keys; its middle layer shared) over latent attention with
# a sink per head and a gate per element on its output, 3 hyper-connection streams, a dense first layer, then experts
# whose silu clamps gate and up at 0.5
HY4 = dict(LATENT, pad_token_id=0, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
           topk_group=1, routed_scaling_factor=2.0, layers=3, index_n_heads=8, index_head_dim=16, index_topk=6,
           indexer_types=["full", "shared", "full"], hc_mult=3, swiglu_limit=0.5, learnable_sink_init=3.0)
# Lara's kind (lara_mini): Qwen3.5's Gated DeltaNet layers (their input products fused in one), windowed (6) and full
# attention with q/k norms and no gate, norms' products in float32, experts (a float32 router) beside a shared expert
LARA = dict(DELTA_NET, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, sliding_window=6, layers=4,
            layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"])
# Ling's hybrids' kind (bailing_hybrid): Kimi Delta Attention with full-rank gates and bounded decays, beside latent
# attention with rope and a gate per head, DeepSeek-V3's experts after a dense layer; its names as saved
LING = dict(LATENT, pad_token_id=0, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
            topk_group=1, routed_scaling_factor=2.0, first_k_dense_replace=1, num_mtp_layers=0, layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"])


def make_tiny(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2, std: float = 0.2,
              swap_tokens: bool = False, vocab: int = VOCAB, tokenizer=None, **config) -> Path:
    """Write a tiny random ``arch`` checkpoint to ``path``. A large init std gives peaked
    logits, so greedy decoding has no near-ties that fp rounding could flip. ``vocab``: the
    embedding's rows (fewer than ``VOCAB``: a draft narrower than the targets); ``config``:
    more config fields (``mlp_bias``, ``sliding_window``, ``rope_parameters``...);
    ``tokenizer``: another than ``byte_tokenizer``'s."""
    from transformers import AutoConfig, AutoModelForCausalLM, Mistral4ForCausalLM

    tok = tokenizer or byte_tokenizer(swap=swap_tokens)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  initializer_range=std, tie_word_embeddings=False)
    if arch in ("qwen3", "qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"):
        common["head_dim"] = 16
    config = AutoConfig.for_model(arch, **{**common, **config})
    torch.manual_seed(seed)
    # (Mistral 4's causal LM, which transformers' AutoModelForCausalLM does not map)
    model = (Mistral4ForCausalLM(config) if arch == "mistral4" else AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():  # norms and biases are zeros/ones at init: randomize them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(std * torch.randn_like(p))
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus's xIELU, its own per layer
                p.copy_(p + 0.3 * torch.randn_like(p))
            elif name.endswith("router.gate.weight"):  # (AFMoE's router starts at zeros)
                p.copy_(std * torch.randn_like(p))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # (Gemma 4's, 1 at init)
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("altup.correct_output_scale"):  # (Gemma 3n's, 0 at init)
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif arch == "hy_v4" and name.endswith(("hc.scale", "hc.base", "hc_scale", "hc_base", "self_attn.sinks")):
                p.copy_(p + 0.5 * torch.randn_like(p))  # (Hy4's hyper-connections' scales 0.01, sinks 0 at init)
        for name, b in model.named_buffers():  # GLM-4.5's router correction, LFM2-MoE's expert bias
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(std * torch.randn_like(b))
            elif name.endswith("layer_scalar"):  # (Gemma 4's, 1 at init)
                b.copy_(1 + 0.3 * torch.randn_like(b))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def greedy_by_whole_forwards(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The ``n`` tokens transformers' model ``hf`` gives greedily after each prompt (token ids), a
    whole forward per token (``input_ids=``: an image-text-to-text model's too)."""
    want = []
    for seq in map(list, prompts):
        with torch.no_grad():
            for _ in range(n):
                seq.append(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax().item())
        want.append(seq[-n:])
    return want


def causal_lm(path: Path, **kw):
    """transformers' own model of the checkpoint at ``path``, by the class its config names (else
    ``AutoModelForCausalLM``'s)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if not config.architectures:  # (a GGUF's directory, as specdec converts it)
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw)
    return getattr(transformers, config.architectures[0]).from_pretrained(path, **kw)


def add_mtp(path: Path, seed: int = 0, std: float = 0.2, own_head: bool = False) -> Path:
    """Give the tiny DeepSeek-V3 (or V3.2, or GLM-5) or GLM-4.5 checkpoint at ``path`` a random multi-token
    prediction layer after its last, as their checkpoints store one (``model.layers.{L}.``:
    ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer of the model's kind, experts (and an indexer) included,
    ``shared_head.norm`` / ``.head`` and ``embed_tokens``: copies of the model's, but for a
    head of its own with ``own_head``), and ``num_nextn_predict_layers`` 1 in its config. A
    Qwen3-Next or Qwen3.5 checkpoint gets Qwen's (``mtp.``: ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``fc``, an attention layer ``layers.0``, ``norm``; the model's
    embedding and head) and ``mtp_num_hidden_layers`` 1. A MiMo-V2-Flash checkpoint gets its
    three, as released (``model.mtp.layers.{i}.``: ``enorm``, ``hnorm``, ``eh_proj``, a windowed
    layer with a dense MLP, its norm before the MLP ``pre_mlp_layernorm``, ``final_layernorm``),
    and no config field, as released."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((path / "config.json").read_text())
    L, h = config["num_hidden_layers"], config["hidden_size"]
    qwen = "layer_types" in config and "linear_attention" in config["layer_types"]
    mimo, dsa = config["model_type"] == "mimo_v2_flash", config["model_type"] in ("deepseek_v32", "glm_moe_dsa")
    torch.manual_seed(seed)
    more = dict(layer_types=config["layer_types"] + ["full_attention"]) if qwen else \
        dict(layer_types=config["layer_types"] + ["sliding_attention"], mlp_layer_types=config["mlp_layer_types"] +
             ["dense"]) if mimo else \
        dict(layer_types=config["layer_types"] + ["indexed_attention"], mlp_layer_types=config["mlp_layer_types"] +
             ["sparse"], **({"indexer_types": config["indexer_types"] + ["full"]} if config.get("indexer_types") else {})) \
        if dsa else {}
    deeper = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, num_hidden_layers=L + 1, **more))
    tensors = load_file(path / "model.safetensors")
    for pre in [f"model.mtp.layers.{i}." for i in range(3)] if mimo else ["mtp.layers.0." if qwen else f"model.layers.{L}."]:
        for name, t in {**dict(deeper.model.layers[L].named_parameters()),
                        **dict(deeper.model.layers[L].named_buffers())}.items():
            random = 1 + 0.1 * torch.randn_like(t) if "norm" in name else std * torch.randn_like(t)
            tensors[pre + name.replace("post_attention_layernorm", "pre_mlp_layernorm" if mimo else
                                       "post_attention_layernorm")] = random.detach().contiguous()
        if mimo:
            for name in ("enorm", "hnorm", "final_layernorm"):
                tensors[pre + name + ".weight"] = 1 + 0.1 * torch.randn(h)
            tensors[pre + "eh_proj.weight"] = std * torch.randn(h, 2 * h)
    if mimo:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    if qwen:
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"mtp.{name}.weight"] = 0.1 * torch.randn(h)  # of 1 + weight
        tensors["mtp.fc.weight"] = std * torch.randn(h, 2 * h)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))
        return path
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[pre + name + ".weight"] = 1 + 0.1 * torch.randn(h)
    tensors[pre + "eh_proj.weight"] = std * torch.randn(h, 2 * h)
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors["lm_head.weight"]
    tensors[pre + "shared_head.head.weight"] = std * torch.randn_like(head) if own_head else head.clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))
    return path


GLM4V_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, image_size=28,
                    patch_size=14)
GLM4V_TOKENS = dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, image_start_token_id=VOCAB - 3,
                    image_end_token_id=VOCAB - 4, video_start_token_id=VOCAB - 5, video_end_token_id=VOCAB - 6)
VISION_LANGUAGE = {  # kind -> (its text model's fields, its vision tower's, the model's own)
    # Gemma 4's (``GEMMA4``'s text model, tied embeddings; no audio tower)
    "gemma4": (dict(model_type="gemma4_text", **{k: v for k, v in GEMMA4.items() if k != "layers"}, num_hidden_layers=6,
                    tie_word_embeddings=True),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
               dict(audio_config=None)),
    # Gemma 4 12B's (the unified model: ``GEMMA4``'s text model without per-layer inputs or shared keys)
    "gemma4_unified": (dict(model_type="gemma4_unified_text", num_hidden_layers=6, tie_word_embeddings=True,
                            **{k: v for k, v in GEMMA4.items() if k not in (
                                "layers", "vocab_size_per_layer_input", "hidden_size_per_layer_input",
                                "use_double_wide_mlp", "num_kv_shared_layers")}),
                       dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
                       dict(audio_config=None)),
    # Gemma 3's 4B and up: windows on one layer of two, eos in the text config, tied embeddings
    "gemma3": (dict(model_type="gemma3_text", head_dim=16, sliding_window=6, query_pre_attn_scalar=24, pad_token_id=0,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14),
               dict(mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                    eoi_token_index=VOCAB - 2)),
    # Llama 3.2 Vision's: a cross-attention layer between its self-attention ones (skipped on text), an embedding 8
    # rows wider than its head
    "mllama": (dict(model_type="mllama_text_model", num_hidden_layers=4, cross_attention_layers=[1, 3], pad_token_id=0,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                    image_size=28, patch_size=14, max_num_tiles=1, intermediate_layers_indices=[0],
                    vision_output_dim=64, supported_aspect_ratios=[[1, 1]]),
               dict(image_token_index=VOCAB)),
    "mistral3": (dict(model_type="mistral"), dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
                 dict(image_token_index=VOCAB - 1)),
    # Aria's: its text model's experts on every layer beside shared ones, an Idefics3 vision tower
    "aria": (dict(model_type="aria_text", moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2, intermediate_size=32,
                  pad_token_id=0),
             dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14),
             dict(image_token_index=VOCAB - 1, projector_patch_to_query_dict={4: 2})),
    "llava": (dict(model_type="llama"), dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14), dict(image_token_index=VOCAB - 1)),
    # LLaVA-NeXT's (Mistral text), LLaVA-OneVision's (Qwen2 text, SigLIP vision)
    "llava_next": (dict(model_type="mistral"), dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
                   dict(image_token_index=VOCAB - 1, image_grid_pinpoints=[[28, 28]])),
    "llava_onevision": (dict(model_type="qwen2"), dict(model_type="siglip_vision_model", hidden_size=32,
                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
                        dict(image_token_index=VOCAB - 1, video_token_index=VOCAB - 2, image_grid_pinpoints=[[28, 28]])),
    # multimodal rope in sections (interleaved for Qwen3-VL), biases on Qwen2.5-VL's q/k/v, q/k norms on Qwen3-VL's
    "qwen2_5_vl": (dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
                   dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
                   dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)),
    # Cohere Compass's (North's): its text model ``VARIANTS["cohere-compass-halves-nope-full"]``'s kind (logits not
    # scaled: dummy weights' logits stay wide), Qwen3-VL's vision
    "cohere_compass": (dict(model_type="cohere_compass_text", head_dim=16, sliding_window=6, num_hidden_layers=4,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], logit_scale=1.0, pad_token_id=0,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}, "full_attention": None}),
                       dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
                       dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)),
    "qwen3_vl": (dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3],
                                                    "mrope_interleaved": True}),
                 dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
                 dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)),
    # Qwen3-VL-MoE's: Qwen3-VL's with Qwen3-MoE's experts (renormalised), a dense layer where mlp_only_layers says
    "qwen3_vl_moe": (dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                        "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1]),
                     dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
                     dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)),
    # GLM-4.1V: GLM-4's layers, rotary pairs interleaved on half of each head, in sections (on text: the text model's);
    # GLM-4.5V: GLM-4.5's experts
    "glm4v": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2],
                                    "partial_rotary_factor": 0.5}), GLM4V_VISION, GLM4V_TOKENS),
    # GLM-4.6V's: GLM-4.1V's text model
    "glm46v": (dict(model_type="glm4v_text", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                              "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}),
               dict(model_type="glm4v_vision", **GLM4V_VISION), GLM4V_TOKENS),
    "glm4v_moe": (dict(head_dim=16, **{k: v for k, v in MOE["glm4_moe"].items() if k != "layers"}, num_hidden_layers=3,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2],
                                        "partial_rotary_factor": 0.5}), GLM4V_VISION, GLM4V_TOKENS),
    # Qwen2-VL: Qwen2's layers, rope in sections; InternVL (its "-hf" checkpoints): Qwen2's, tied; SmolVLM: Llama's under
    # model.text_model.; LFM2-VL: LFM2's convolutions
    "qwen2_vl": (dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
                 dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)),
    "internvl": (dict(model_type="qwen2", tie_word_embeddings=True),
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=[28, 28], patch_size=[14, 14]), dict(image_token_id=VOCAB - 1)),
    "smolvlm": (dict(model_type="llama"), dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14),
                dict(image_token_id=VOCAB - 1)),
    "lfm2_vl": (dict(model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
                dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_patches=16, patch_size=14), dict(image_token_id=VOCAB - 1)),
    # EXAONE 4.5's (EXAONE 4's text model: windows on three layers of four, rope on those alone)
    # Apertus 1.5's: images and audio as tokens of its vocabulary (a VQ tokenizer, WavTokenizer's encoder), the head
    # pruned to the text tokens
    "apertus1p5": (dict(head_dim=16, output_vocab_size=VOCAB - 6),
                   dict(codebook_size=2, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1],
                        num_res_blocks=1, attn_resolutions=[], resolution=8),
                   dict(audio_config=dict(model_type="wavtokenizer_encoder", num_filters=4, upsampling_ratios=[2],
                                          hidden_size=8, codebook_size=2, codebook_dim=8, decoder_hidden_size=8,
                                          decoder_intermediate_size=16, decoder_num_layers=1, num_lstm_layers=1,
                                          decoder_attention_num_groups=1, adanorm_num_embeddings=1),
                        image_token_id=VOCAB - 5, audio_token_id=VOCAB - 6, image_token_offset=VOCAB - 4,
                        audio_token_offset=VOCAB - 2)),
    "exaone4_5": (dict(model_type="exaone4", num_hidden_layers=4, sliding_window=6, head_dim=16,
                       layer_types=["sliding_attention"] * 3 + ["full_attention"]),
                  dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                       fullatt_block_indexes=[0], num_key_value_heads=2),
                  dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)),
    "lfm3_vl": (dict(model_type="lfm3", num_hidden_layers=5, **LFM3),
                dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_patches=16, patch_size=14), dict(image_token_id=VOCAB - 1)),
    # Llama 4's (Scout's kind: ``LLAMA4``), its text model under language_model.
    "llama4": (dict(model_type="llama4_text", **{k: v for k, v in LLAMA4.items() if k != "layers"},
                    num_hidden_layers=4),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64),
               dict(image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)),
    # DeltaNet layers beside gated attention, its norms of 1 + weight (but the DeltaNet output's)
    "qwen3_5": (dict(head_dim=16, **{k: v for k, v in DELTA_NET.items() if k != "layers"}, num_hidden_layers=3,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [1, 1, 0],
                                      "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
                dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
                dict(image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)),
}


def make_tiny_vision_language(path: Path, kind: str, seed: int = 0, **text) -> Path:
    """A tiny multimodal checkpoint (an image-text-to-text model, ``VISION_LANGUAGE``):
    ``gemma3`` (the 4B-and-up kind, weights under ``language_model.model.``, which transformers
    also loads as a causal LM), or one that is no causal LM in transformers: ``mistral3``
    (Mistral Small 3.1 and up: a Mistral text model, Pixtral vision), ``llava`` (a Llama text
    model, CLIP vision), ``qwen2_5_vl`` (saved with its text model under ``model.``, as
    released), ``qwen3_vl`` or ``qwen3_5``; ``text``: more text config fields."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    tok = byte_tokenizer()
    own_text, vision, own = VISION_LANGUAGE[kind]
    text = {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False),
            **own_text, **text}
    offset = kind in ("gemma3", "qwen3_5")  # their norms scale by 1 + weight: weights near 0
    config = AutoConfig.for_model(kind, text_config=text, vision_config=vision, **own)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if offset and "linear_attn" not in name else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") and "language_model" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def fp8_copy(src: Path, path: Path, block: tuple[int, int] | None = (24, 24)) -> tuple[Path, Path]:
    """The checkpoint at ``src`` in transformers' fine-grained FP8 (``quant_method: fp8``, as
    DeepSeek-V3's and Qwen3's FP8 releases): each layer's 2-D weights as float8 e4m3, one
    ``weight_scale_inv`` per ``block`` of rows and columns (the block's largest magnitude over
    448; the last blocks of a dimension ``block`` does not divide cut short); embeddings, head and
    norms as they are. ``block`` None: compressed-tensors' FP8 (vLLM's FP8-dynamic checkpoints), a
    ``weight_scale`` per row. And beside it (``path`` + "-dequantized") the same checkpoint
    unquantized, each weight the FP8 one times its block's scale, computed block by block."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors, fp8, plain = load_file(src / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        if ".layers." not in name or w.dim() != 2 or "norm" in name or not name.endswith("weight"):
            fp8[name] = plain[name] = w
            continue
        rows, cols = w.shape
        b0, b1 = block or (1, cols)
        scale = torch.zeros(-(-rows // b0), -(-cols // b1))
        q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        back = torch.zeros(rows, cols)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                part = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
                scale[i, j] = part.abs().max().clamp(min=1e-12) / 448
                q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (part / scale[i, j]).to(torch.float8_e4m3fn)
                back[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = \
                    q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() * scale[i, j]
        fp8[name], fp8[name + ("_scale_inv" if block else "_scale")], plain[name] = q, scale, back
    out = []
    for where, weights, quantized in ((path, fp8, True), (path.with_name(path.name + "-dequantized"), plain, False)):
        shutil.copytree(src, where)
        save_file(weights, str(where / "model.safetensors"))
        if quantized:
            config = json.loads((where / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "weight_block_size": list(block)} if block else {
                "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
            (where / "config.json").write_text(json.dumps(config))
        out.append(where)
    return out[0], out[1]


def mxfp4_copy(src: Path, path: Path) -> Path:
    """The GPT-OSS checkpoint at ``src`` with its experts in MXFP4, as released: each group of
    32 weights (along a projection's input) as 4-bit E2M1 codes (``*_blocks``, two per byte,
    the low one first) times a power of two (``*_scales``, biased by 127), out before in."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.runtime.moe import FP4_VALUES

    values = torch.tensor(FP4_VALUES)
    shutil.copytree(src, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).float().transpose(1, 2)  # [experts, out, in]
        groups = w.reshape(*w.shape[:2], -1, 32)  # [experts, out, G, 32]
        exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))  # [experts, out, G]
        codes = ((groups / torch.exp2(exp)[..., None])[..., None] - values).abs().argmin(-1)  # [experts, out, G, 32]
        codes = codes.to(torch.uint8).reshape(*groups.shape[:3], 16, 2)
        tensors[name + "_blocks"] = codes[..., 0] | (codes[..., 1] << 4)
        tensors[name + "_scales"] = (exp + 127).to(torch.uint8)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (path / "config.json").write_text(json.dumps(config))
    return path


def noisy_copy(src: Path, path: Path, noise: float, seed: int = 0) -> Path:
    """A draft that resembles the checkpoint at ``src`` (each weight plus gaussian noise of
    ``noise`` times its tensor's std): its q overlaps the target's p without equalling it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p += torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return path


def make_tiny_gemma4_assistant(path: Path, target: Path, seed: int = 0, ordered: bool = True,
                                layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
                                std: float = 0.2) -> Path:
    """A random Gemma 4 assistant (``gemma4_assistant``: Gemma 4's drafter, whose layers attend over
    its target's keys and values; ``gemma4_unified_assistant`` for a unified model, 12B's) for the
    tiny Gemma 4 checkpoint at ``target``: layers of
    ``layer_types`` with its target's head shapes, narrower (32) than it; ``ordered``: its head
    over the tokens of the best 2 of 8 clusters (``use_ordered_embeddings``, E2B's and E4B's), else
    the whole vocabulary (26B-A4B's, 31B's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t = json.loads((target / "config.json").read_text())
    kept = ("head_dim", "num_key_value_heads", "attention_k_eq_v",
            "sliding_window", "rope_parameters", "rms_norm_eps", "vocab_size", "max_position_embeddings",
            "hidden_activation", "final_logit_softcapping", "bos_token_id", "eos_token_id")
    unified = t["model_type"] == "gemma4_unified_text"  # (12B's: its assistant's kind, without these fields)
    text = {**{k: t[k] for k in kept if k in t}, "model_type": t["model_type"], "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": len(layer_types),
            "layer_types": list(layer_types), "num_kv_shared_layers": len(layer_types), "use_double_wide_mlp": False,
            "initializer_range": std,
            **({} if unified else dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                       enable_moe_block=False))}
    full = t["per_layer_config"][str(t["layer_types"].index("full_attention"))]  # (its heads' shape)
    text["per_layer_config"] = {str(i): full for i, kind in enumerate(layer_types) if kind == "full_attention"}
    config = AutoConfig.for_model("gemma4_unified_assistant" if unified else "gemma4_assistant", text_config=text,
                                  backbone_hidden_size=t["hidden_size"],
                                  use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn_like(b))
            elif name.endswith("token_ordering"):  # the tokens of each cluster, side by side
                b.copy_(torch.randperm(b.shape[0]))
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def make_tiny_eagle(path: Path, target: Path, kind: str = "eagle3", seed: int = 0, draft_vocab: int | None = None,
                    std: float = 0.2, **config) -> Path:
    """A random EAGLE (``kind="eagle"``, saved as ``pytorch_model.bin`` with EAGLE's names:
    ``fc`` with a bias, ``layers.0.*`` without an input norm) or EAGLE-3 head (``midlayer.*``,
    ``fc``, ``norm``, ``lm_head``, with ``draft_vocab`` its ``d2t`` and ``t2d``; safetensors)
    for the tiny checkpoint at ``target``; ``config``: more config fields
    (``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``)."""
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d, inner, vocab = h // heads, t["intermediate_size"], t["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    width = 2 * h if kind == "eagle3" else h  # what attention reads
    pre = "midlayer." if kind == "eagle3" else "layers.0."
    w = {pre + "self_attn.q_proj.weight": rand(heads * d, width), pre + "self_attn.k_proj.weight": rand(kv * d, width),
         pre + "self_attn.v_proj.weight": rand(kv * d, width), pre + "self_attn.o_proj.weight": rand(h, heads * d),
         pre + "post_attention_layernorm.weight": norm(), pre + "mlp.gate_proj.weight": rand(inner, h),
         pre + "mlp.up_proj.weight": rand(inner, h), pre + "mlp.down_proj.weight": rand(h, inner)}
    cfg = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")}
    cfg.update(model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False,
               rope_theta=t.get("rope_parameters", {}).get("rope_theta", t.get("rope_theta", 10000.0)), **config)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "eagle3":
        dv = draft_vocab or vocab
        w.update({pre + "input_layernorm.weight": norm(), pre + "hidden_norm.weight": norm(), "fc.weight": rand(h, 3 * h),
                  "norm.weight": norm(), "lm_head.weight": rand(dv, h)})
        if draft_vocab:
            kept = torch.randperm(vocab, generator=g)[:dv].sort().values  # the target ids it drafts
            w["d2t"] = kept - torch.arange(dv)
            w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
        save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    else:
        w.update({"fc.weight": rand(h, 2 * h), "fc.bias": rand(h)})
        cfg.update(architectures=["LlamaForCausalLM"])
        torch.save(w, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def bitnet_copy(src: Path, path: Path, form: str = "offline", scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """The BitNet checkpoint at ``src`` (unquantized) as BitNet b1.58's releases hold it: ``offline``
    (microsoft/bitnet-b1.58-2B-4T's): each decoder layer's projection ternary, ``t = round(w / mean
    |w|)`` clamped to -1..1, packed four to a byte by transformers' ``pack_weights``, beside its
    ``weight_scale`` (1 / mean |w|, in bfloat16); ``online`` (its -bf16 release's): the weights as
    they are, which transformers' ``AutoBitLinear`` quantizes on every forward."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.bitnet import pack_weights

    shutil.copytree(src, path)
    tensors = load_file(src / "model.safetensors")
    if form == "offline":
        for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
            w = tensors[name].float()
            scale = 1.0 / w.abs().mean().clamp(min=1e-5)
            tensors[name] = pack_weights((w * scale).round().clamp(-1, 1).to(torch.int8))
            tensors[name + "_scale"] = scale.reshape(1).to(scale_dtype)
        save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "modules_to_not_convert": None,
                                     "linear_class": "bitlinear" if form == "offline" else "autobitlinear",
                                     "quantization_mode": form}
    (path / "config.json").write_text(json.dumps(config))
    return path


def bitnet_reference(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the BitNet checkpoint at ``path`` (``bitnet_copy``'s), its projections
    transformers' ``BitLinear`` / ``AutoBitLinear`` (``replace_with_bitnet_linear``, the head left
    out as its quantizer leaves it): what ``from_pretrained`` builds, without the ``accelerate``
    package its quantizer asks for."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, BitNetForCausalLM
    from transformers.integrations.bitnet import replace_with_bitnet_linear
    from transformers.utils.quantization_config import BitNetQuantConfig

    config = AutoConfig.from_pretrained(path)
    qc = BitNetQuantConfig(**{k: v for k, v in config.quantization_config.items() if k != "quant_method"})
    del config.quantization_config
    model = BitNetForCausalLM._from_config(config, dtype=dtype)  # (its rope's frequencies kept in float32)
    replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qc)
    tensors = {n: t if t.dtype == torch.uint8 else t.to(dtype) for n, t in load_file(path / "model.safetensors").items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()


def make_lora(base: Path, path: Path, seed: int = 0, r: int = 4, alpha: int = 8,
              targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
              std: float = 0.1, **config) -> Path:
    """A PEFT LoRA adapter of the tiny checkpoint at ``base``, saved by PEFT itself to ``path``:
    random ``A`` and ``B`` (PEFT's default ``B`` is zeros, a no-op) of rank ``r`` on ``targets``;
    ``config``: more ``LoraConfig`` fields (``use_rslora``, ``rank_pattern``, ...)."""
    from peft import LoraConfig, get_peft_model

    model = causal_lm(base)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                            init_lora_weights=False, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn_like(p))
    peft.save_pretrained(path)
    return path


@contextlib.contextmanager
def through(ref, adapter: str | None):
    """PEFT's model ``ref`` (``lora_reference``) through its adapter named ``adapter``, or the base
    model without any (None)."""
    if adapter is None:
        with ref.disable_adapter():
            yield ref
    else:
        ref.set_adapter(adapter)
        yield ref


def lora_reference(base: Path, *adapters: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of ``base`` with PEFT's adapters loaded (as ``PeftModel`` names them:
    the first "default", then "a1", ...), for ``set_adapter`` to choose one."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(causal_lm(base, dtype=dtype), str(adapters[0])).eval()
    for i, a in enumerate(adapters[1:], 1):
        model.load_adapter(str(a), adapter_name=f"a{i}")
    return model

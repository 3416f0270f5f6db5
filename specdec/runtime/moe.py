"""Sparse mixtures of experts for the torch runtime: which layers are ``Experts``, how a
router picks and weights them (``Routing``), and the grouped products that run them (Mixtral,
Qwen2-MoE, Qwen3-MoE, GPT-OSS with its MXFP4 experts, GLM-4.5, DeepSeek-V2 and V3, GLM-4.7-Flash,
Qwen3.5-MoE, Qwen3-Next, Granite's, Nemotron-H, LFM2-MoE, Jamba, OLMoE, dots.llm1, GLM-4.5V, ERNIE 4.5,
Mistral 4, EXAONE-MoE, Llama 4, FlexOlmo, Solar Open, HunYuan-MoE, AFMoE, A.X K1, DBRX, Kolibri, Flint, MiniMax-M2,
Cohere2-MoE, MiMo-V2-Flash, Mellum, Qwen3-VL-MoE, DeepSeek-V3.2, GLM-5, Hy3, Sarvam, Laguna, Phi-3.5-MoE, A.X K2,
Kimi Linear, Ling's hybrids, Hy4, Lara, Aria)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops import ACTIVATIONS

# their MLPs (some, or all) are ``Experts``; DeepSeek's and GLM-4.7-Flash's attend through latents
# (``torch_llama.Latent``), Qwen3-Next's and Qwen3.5's have DeltaNet layers (``recurrent``)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
             "qwen3_next", "qwen3_5_moe_text", "granitemoe", "granitemoeshared", "granitemoehybrid", "nemotron_h",
             "lfm2_moe", "jamba", "olmoe", "dots1", "glm4v_moe_text", "ernie4_5_moe", "mistral4", "exaone_moe",
             "llama4_text", "flex_olmo", "granitemoe_swa", "solar_open", "hunyuan_v1_moe",
             "afmoe", "axk1", "dbrx", "kolibri1", "flint", "minimax_m2", "cohere2_moe", "mimo_v2_flash", "mellum",
             "qwen3_vl_moe_text", "deepseek_v32", "glm_moe_dsa", "hy_v3", "sarvam_moe", "sarvam_mla", "laguna",
             "phimoe", "axk2", "kimi_linear", "bailing_hybrid", "hy_v4", "lara_mini", "aria_text", "minimax", "jetmoe")
# ``block_sparse_moe``, routed as GPT-OSS's
GRANITE_MOES = ("granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa")
# GLM-4.5's router (``Routing.sigmoid``)
SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "nemotron_h", "dots1", "glm4v_moe_text", "exaone_moe",
                  "solar_open", "axk1", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa", "sarvam_moe", "sarvam_mla",
                  "axk2", "kimi_linear", "bailing_hybrid", "hy_v4")
# (Solar Open's: GLM-4.5's experts on every layer; A.X K1's, MiMo-V2-Flash's, DeepSeek-V3.2's, GLM-5's: DeepSeek-V3's;
# Sarvam's: GLM-4.5's, DeepSeek-V3's; A.X K2's: DeepSeek-V3's, the other groups' experts at 0, not -inf)


def moe_layers(config) -> list[bool]:
    """Which layers' MLP is ``Experts``, as each architecture's transformers model places them:
    Mixtral's, GPT-OSS's, Qwen3.5's and Granite's every layer; GLM-4.5's and DeepSeek's from ``first_k_dense_replace``
    on; GLM-4.7-Flash's where ``mlp_layer_types`` says "sparse"; Qwen2-MoE's and Qwen3-MoE's every ``decoder_sparse_step``-th but those in
    ``mlp_only_layers`` (a dense MLP), and Qwen3-Next's so."""
    n, kind = config.num_hidden_layers, config.model_type
    if kind not in MOE_ARCHS:
        return [False] * n
    if kind in ("mixtral", "gpt_oss", "qwen3_5_moe_text", "olmoe", "flex_olmo", "solar_open", "hunyuan_v1_moe",
                "dbrx", "kolibri1", "minimax_m2", "phimoe", "lara_mini", "aria_text", "minimax", "jetmoe") + GRANITE_MOES:
        return [num_experts(config) > 0] * n  # (Granite 4.0's dense hybrids have none)
    if kind in ("glm4_moe", "deepseek_v2", "deepseek_v3", "dots1", "glm4v_moe_text", "mistral4", "sarvam_moe",
                "sarvam_mla"):
        return [i >= config.first_k_dense_replace for i in range(n)]
    if kind in ("glm4_moe_lite", "exaone_moe", "axk1", "cohere2_moe", "mimo_v2_flash", "mellum", "deepseek_v32",
                "glm_moe_dsa", "hy_v3", "laguna", "axk2", "kimi_linear", "bailing_hybrid", "hy_v4"):
        return [t == "sparse" for t in config.mlp_layer_types]
    if kind == "nemotron_h":  # its blocks: one mixer or one MLP each
        return [t == "moe" for t in config.layer_types]
    if kind in ("lfm2_moe", "afmoe"):
        return [i >= config.num_dense_layers for i in range(n)]
    if kind == "llama4_text":
        return [i in config.moe_layers for i in range(n)]
    if kind == "jamba":  # every ``expert_layer_period``-th from ``expert_layer_offset``
        return [e > 1 for e in config.layers_num_experts]
    if kind == "ernie4_5_moe":  # every ``moe_layer_interval``-th from its start to its end index
        first, last = config.moe_layer_start_index, config.moe_layer_end_index
        return [(i + 1) % config.moe_layer_interval == 0 and first <= i <= last for i in range(n)]
    dense = set(config.mlp_only_layers or [])
    return [i not in dense and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
            for i in range(n)]


def num_experts(config) -> int:
    """The routed experts of a mixture's layer (0 without)."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or \
        getattr(config, "n_routed_experts", 0) or getattr(config, "moe_num_experts", 0) or 0  # (Aria's)


grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # F.grouped_mm from torch 2.10


def grouped_mm_graphable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs without a host sync, so that a CUDA graph can hold it:
    PyTorch's CUTLASS kernel, for bfloat16 on Hopper and data-centre Blackwell GPUs (compute
    capability 9.x and 10.x); elsewhere it loops over the groups on the host (``offs.cpu()``)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 by code


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 weights (GPT-OSS's experts) dequantized: ``blocks [..., rows, G, 16]`` (uint8, two
    4-bit codes per byte, the low one first) and ``scales [..., rows, G]`` (each group of 32
    values' power of two, biased by 127) -> ``[..., rows, G * 32]``, exact in bfloat16."""
    table = torch.tensor(FP4_VALUES, device=device, dtype=torch.float32)
    blocks, scales = blocks.to(device), scales.to(device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., rows, G, 32]
    values = torch.ldexp(table[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class Routing:
    """How a router's logits pick ``top_k`` experts and weight them, and the experts' gated
    activation, as each architecture's transformers model does. Mixtral and the Qwens: the
    top k of the softmax (scaled to sum 1 where ``renormalize``: Mixtral's always, the
    Qwens' ``norm_topk_prob``; weights in float32 where ``float_weights``, Mixtral's, else the
    model's dtype), ``activation(gate) * up``; GPT-OSS (``gpt_oss``): the softmax of the top k
    logits, in the model's dtype, and ``(up + 1) * gate * sigmoid(alpha * gate)`` with gate
    and up clamped at ``limit`` (Hy4's: its silu's gate and up so); Granite's (``top_softmax``):
    the softmax of the top k logits in float32, then the model's dtype, ``activation(gate) * up``; GLM-4.5,
    DeepSeek-V3, GLM-4.7-Flash (``sigmoid``): the router
    in float32 (``float_router``), sigmoid scores, the top k of those plus a correction bias
    among the ``top_groups`` best of ``groups`` groups of experts (each group by its best
    two), their scores renormalised and times ``scale``, in float32; DeepSeek-V2: the router
    in float32, the top k of the softmax among the ``top_groups`` best of ``groups`` groups
    (each by its best one: ``group_limited_greedy``; one group: ``greedy``), times ``scale``,
    in float32; LFM2-MoE's (``sigmoid`` too): the top k of the sigmoid scores in the model's
    dtype plus an expert bias, renormalised (``renorm_eps`` 1e-6) and times ``scale``; ERNIE
    4.5's: the router in float32, the top k of the softmax plus a correction bias, their softmax
    scores renormalised by a sum of at least ``renorm_min``; Mistral 4's: the top k of the softmax
    among the ``top_groups`` best groups, each by its best two (``groups_by_two``), renormalised
    where ``norm_topk_prob``, times ``scale``; Llama 4's (``scales_inputs``): the sigmoid of the top
    k logits (in float32, then the model's dtype) scales each chosen expert's input, not its output;
    AFMoE's (``sigmoid``, ``float_scores``): the router in the model's dtype, its logits' sigmoid in
    float32, the top k of those plus an expert bias, renormalised and times ``scale``; Kolibri's
    (``sigmoid``, ``choose_by_logits``): the router in float32, the top k of its logits plus a
    correction bias, weighted by their sigmoid, renormalised where ``norm_topk_prob``; Cohere2-MoE's
    (``top_softmax``, or ``top_sigmoid``: the sigmoid of the top k logits, renormalised where
    ``norm_topk_prob``); Laguna's: AFMoE's, the logits capped first where ``softcap`` (``cap *
    tanh(logits / cap)``), its weights in the model's dtype and ``scale`` times their experts' sum
    (``scale_sum``); Phi-3.5-MoE's (``sparsemixer``, its ``router_jitter_noise``: ``_sparsemixer``);
    A.X K2's: DeepSeek-V3's, the experts outside the best groups scored 0 (``group_fill``), not -inf."""

    top_k: int
    renormalize: bool = False
    float_weights: bool = False
    activation: str = "silu"
    gpt_oss: bool = False
    top_softmax: bool = False
    gated: bool = True
    alpha: float = 1.702
    limit: float | None = None  # GPT-OSS's clamp; Hy4's, of a plain silu (None or <= 0: none)
    sigmoid: bool = False
    float_router: bool = False
    groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    renorm_eps: float = 1e-20
    renorm_min: float | None = None
    groups_by_two: bool = False
    scales_inputs: bool = False
    float_scores: bool = False
    choose_by_logits: bool = False
    top_sigmoid: bool = False
    softcap: float = 0.0
    scale_sum: bool = False  # (Laguna's: ``scale`` times the experts' sum, the weights in the model's dtype)
    sparsemixer: float | None = None
    group_fill: float = float("-inf")

    @classmethod
    def of(cls, config) -> "Routing":
        kind = config.model_type
        if kind == "gpt_oss":
            return cls(config.num_experts_per_tok, gpt_oss=True, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        if kind in GRANITE_MOES or kind == "jetmoe":
            return cls(config.num_experts_per_tok, top_softmax=True,
                       activation=config.activation_function if kind == "jetmoe" else config.hidden_act)
        if kind == "phimoe":  # (``sparsemixer``)
            return cls(2, sparsemixer=config.router_jitter_noise, activation=config.hidden_act)
        if kind in ("afmoe", "laguna"):  # (Laguna's logits capped first, where moe_router_logit_softcapping)
            return cls(config.num_experts_per_tok, renormalize=True, sigmoid=True, float_scores=True,
                       scale=config.route_scale if kind == "afmoe" else config.moe_routed_scaling_factor,
                       softcap=getattr(config, "moe_router_logit_softcapping", 0.0), activation=config.hidden_act,
                       scale_sum=kind == "laguna")
        if kind == "flint":  # the router in float32, the top k of its sigmoid, renormalised where norm_topk_prob
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, sigmoid=True, float_router=True,
                       activation=config.hidden_act)
        if kind == "cohere2_moe":  # the top k logits' softmax (float32, then cast), or their sigmoid (renormalised
            # where norm_topk_prob)
            if config.expert_selection_fn == "softmax":
                return cls(config.num_experts_per_tok, top_softmax=True, activation=config.hidden_act)
            return cls(config.num_experts_per_tok, top_sigmoid=True, renormalize=config.norm_topk_prob,
                       activation=config.hidden_act)
        if kind == "hy_v3":  # the sigmoid of a float32 router's logits, chosen with a correction bias, the top k
            # renormalised and scaled
            return cls(config.num_experts_per_tok, renormalize=True, sigmoid=True, float_router=True,
                       scale=config.router_scaling_factor, activation=config.hidden_act)
        if kind == "minimax_m2":  # the sigmoid of the router's logits (in the model's dtype) in float32, chosen with
            # a correction bias, the top k renormalised
            return cls(config.num_experts_per_tok, renormalize=True, sigmoid=True, float_scores=True,
                       activation=config.hidden_act)
        if kind == "kolibri1":
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, sigmoid=True, float_router=True,
                       choose_by_logits=True, activation=config.hidden_act)
        if kind == "dbrx":  # the top k of the softmax (renormalised: moe_normalize_expert_weights 1)
            return cls(config.num_experts_per_tok, renormalize=config.moe_normalize_expert_weights is not None,
                       activation=config.hidden_act)
        if kind == "hunyuan_v1_moe":  # its router in float32, the top k of the softmax renormalised, in float32
            top_k = config.moe_topk if isinstance(config.moe_topk, int) else config.moe_topk[0]
            return cls(top_k, renormalize=True, float_weights=True, float_router=True, activation=config.hidden_act)
        if kind == "gemma4_text":  # the top k of the softmax renormalised, in float32 (then each expert's factor)
            return cls(config.top_k_experts, renormalize=True, float_weights=True, activation=config.hidden_activation)
        if kind == "aria_text":  # the softmax of the top k logits; its routed experts silu's whatever hidden_act says
            return cls(config.moe_topk, top_softmax=True)
        if kind == "lara_mini":  # the router in float32, the top k of its softmax renormalised where norm_topk_prob
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, float_router=True,
                       activation=config.hidden_act)
        if kind == "jamba":  # the top k of the softmax, not renormalised
            return cls(config.num_experts_per_tok, activation=config.hidden_act)
        if kind == "ernie4_5_moe":
            return cls(config.num_experts_per_tok, renormalize=True, float_router=True, renorm_min=config.moe_norm_min,
                       activation=config.hidden_act)
        if kind == "lfm2_moe":  # sigmoid scores in the model's dtype, an expert bias on the choice
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, sigmoid=True,
                       scale=config.routed_scaling_factor, renorm_eps=1e-6)
        if kind == "llama4_text":
            return cls(config.num_experts_per_tok, activation=config.hidden_act, scales_inputs=True)
        if kind == "mistral4":
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, activation=config.hidden_act,
                       groups=config.n_group, top_groups=config.topk_group, scale=config.routed_scaling_factor,
                       groups_by_two=True)
        if kind == "deepseek_v2":
            grouped = config.topk_method == "group_limited_greedy"
            return cls(config.num_experts_per_tok, float_weights=True, activation=getattr(config, "hidden_act", "silu"),
                       float_router=True, groups=config.n_group if grouped else 1,
                       top_groups=config.topk_group if grouped else 1, scale=config.routed_scaling_factor)
        if kind in SIGMOID_ROUTED:
            nemotron = kind == "nemotron_h"  # its experts not gated: relu2(up)
            return cls(config.num_experts_per_tok, renormalize=config.norm_topk_prob, gated=not nemotron,
                       activation=config.mlp_hidden_act if nemotron else getattr(config, "hidden_act", "silu"),
                       sigmoid=True, float_router=True,
                       groups=config.n_group, top_groups=config.topk_group, scale=config.routed_scaling_factor,
                       group_fill=0.0 if kind == "axk2" else float("-inf"),
                       limit=config.swiglu_limit if kind == "hy_v4" else None)
        return cls(config.num_experts_per_tok,
                   renormalize=kind in ("mixtral", "minimax", "qwen3_5_moe_text", "qwen3_vl_moe_text")
                   or config.norm_topk_prob,
                   float_weights=kind in ("mixtral", "minimax"), activation=getattr(config, "hidden_act", "silu"))

    def _sparsemixer(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phi-3.5-MoE's two experts at inference (``sparsemixer``): the best, weighted by its
        softmax among the experts whose logits are within ``2 eps`` of its (relative to the larger
        magnitude), then the best of the others, weighted so among the others."""
        weights, chosen, left = [], [], logits
        for _ in range(2):
            best, pick = left.max(dim=-1, keepdim=True)  # [N, 1]
            far = (best - logits) / logits.abs().clamp(min=best) > 2 * self.sparsemixer
            weights.append(torch.softmax(left.masked_fill(far, float("-inf")), dim=-1).gather(-1, pick))
            chosen.append(pick)
            left = left.scatter(-1, pick, float("-inf"))
        return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)

    def weights(self, logits: torch.Tensor, correction: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)`` ``[N, top_k]`` of router ``logits [N, experts]`` (``correction
        [experts]``: GLM-4.5's, ERNIE 4.5's bias on the scores that choose; ``dtype``: the
        input's, which a softmax's weights are cast to but for ``float_weights``)."""
        if self.scales_inputs:
            top, chosen = logits.topk(self.top_k, dim=-1)
            return top.float().sigmoid().to(top.dtype), chosen
        if self.sparsemixer is not None:
            return self._sparsemixer(logits)
        if self.top_sigmoid:  # (Cohere2-MoE's: the sigmoid of the top k logits)
            top, chosen = logits.topk(self.top_k, dim=-1)
            weights = top.sigmoid()
            return (weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights), chosen
        if self.gpt_oss or self.top_softmax:
            top, chosen = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype if self.gpt_oss else torch.float32).to(top.dtype), chosen
        if self.sigmoid:
            if self.softcap:  # (Laguna's: ``cap * tanh(logits / cap)``, in float32)
                logits = torch.tanh(logits.float() / self.softcap) * self.softcap
            scores = (logits.float() if self.float_scores else logits).sigmoid()  # [N, experts]
            choice = logits if self.choose_by_logits else scores
            choice = choice if correction is None else choice + correction
            if self.groups > 1:  # each group by its best two
                choice = self._best_groups(choice, lambda g: g.topk(2, dim=-1)[0].sum(dim=-1), self.group_fill)
            chosen = choice.topk(self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, chosen)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.renorm_eps)
            if self.scale_sum:
                return weights.to(dtype or logits.dtype), chosen
            return weights * self.scale, chosen
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, experts]
        if self.groups > 1:  # DeepSeek-V2's group_limited_greedy: each group by its best expert (Mistral 4's: two)
            rank = (lambda g: g.topk(2, dim=-1)[0].sum(dim=-1)) if self.groups_by_two else (lambda g: g.max(dim=-1).values)
            scores = self._best_groups(scores, rank, 0.0)
        if correction is None:
            weights, chosen = scores.topk(self.top_k, dim=-1)
        else:  # (ERNIE 4.5's: chosen with a bias, weighted without)
            chosen = (scores + correction).topk(self.top_k, dim=-1)[1]
            weights = scores.gather(1, chosen)
        if self.renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total if self.renorm_min is None else total.clamp(min=self.renorm_min))
        if self.scale != 1.0:
            weights = weights * self.scale
        return (weights if self.float_weights else weights.to(dtype or logits.dtype)), chosen

    def _best_groups(self, scores: torch.Tensor, rank, fill: float) -> torch.Tensor:
        """``scores [N, experts]`` with those outside each token's ``top_groups`` best groups
        (by ``rank [N, groups, per group] -> [N, groups]``) set to ``fill``."""
        N, E = scores.shape
        by_group = scores.view(N, self.groups, E // self.groups)
        best = rank(by_group).topk(self.top_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros(N, self.groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        return scores.masked_fill(~keep[..., None].expand_as(by_group).reshape(N, E), fill)

    def glu(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' activation of ``gate`` times ``up`` (of ``gate`` alone, not ``gated``)."""
        if not self.gated:
            return ACTIVATIONS[self.activation](gate)
        if self.limit is not None and self.limit > 0:  # (GPT-OSS's clamp; Hy4's)
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if not self.gpt_oss:
            return ACTIVATIONS[self.activation](gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def pairs_by_expert(chosen: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token-expert pairs of ``chosen [N, k]`` grouped by expert: ``(each pair's expert, the pairs'
    order [N k], where each expert's pairs end [experts])``, for ``grouped_mm``."""
    expert, order = chosen.flatten().sort()
    counts = torch.zeros(experts, dtype=torch.int32, device=chosen.device).scatter_add_(
        0, expert, torch.ones_like(expert, dtype=torch.int32))
    return expert, order, counts.cumsum(0, dtype=torch.int32)


def in_token_order(pairs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``pairs [N k, ...]``, grouped by expert (``pairs_by_expert``'s ``order``), back in token order."""
    by_token = torch.empty_like(pairs)
    by_token[order] = pairs
    return by_token


class MixtureOfAttention:
    """JetMoE's attention experts: a router picks and weights ``top_k`` experts per token (the
    softmax of the top logits, Granite's); each chosen expert projects the token's queries
    (``queries [experts, hidden, kv heads x head_dim]``), which attend over the layer's one set of
    keys and values as ``top_k`` groups of heads, and projects its group's output back
    (``out [experts, kv heads x head_dim, hidden]``), weighted; their sum plus ``bias``."""

    def __init__(self, routing: Routing, router: torch.Tensor, queries: torch.Tensor, out: torch.Tensor,
                 bias: torch.Tensor):
        self.routing, self.router, self.queries, self.out, self.bias = routing, router, queries, out, bias

    @classmethod
    def load(cls, config, r, pre: str) -> "MixtureOfAttention":
        """The experts under ``pre`` (``...self_attention.experts.``), stored ``[experts, out, in]``."""
        return cls(Routing.of(config), r.get(pre + "router.layer.weight"),
                   r.get(pre + "input_linear.weight").transpose(1, 2), r.get(pre + "output_linear.weight").transpose(1, 2),
                   r.get(pre + "bias"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., hidden]``'s routing: ``(weights [N, k], the pairs' order, the experts' ends)``
        (``pairs_by_expert``)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.routing.weights(F.linear(flat, self.router), dtype=x.dtype)
        return (weights, *pairs_by_expert(chosen, self.router.shape[0])[1:])

    def project_queries(self, x: torch.Tensor, route: tuple) -> torch.Tensor:
        """Each token's chosen experts' queries ``[..., k, kv heads x head_dim]``."""
        flat, k = x.reshape(-1, x.shape[-1]), self.routing.top_k
        _, order, ends = route
        q = grouped_mm(flat[order // k], self.queries, offs=ends)  # [N k, width], grouped by expert
        return in_token_order(q, order).view(*x.shape[:-1], k, -1)

    def project_out(self, o: torch.Tensor, route: tuple) -> torch.Tensor:
        """The experts' outputs ``o [..., k, width]`` back to ``[..., hidden]``: each projected by its
        expert, weighted, summed, plus the bias."""
        weights, order, ends = route
        pairs = o.reshape(-1, o.shape[-1])[order]  # [N k, width], grouped by expert
        out = grouped_mm(pairs, self.out, offs=ends) * weights.flatten()[order, None]
        return in_token_order(out, order).view(*o.shape[:-1], -1).sum(dim=-2) + self.bias


class Experts:
    """A sparse mixture-of-experts MLP (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, GPT-OSS's,
    GLM-4.5's, DeepSeek's) as transformers' grouped experts compute it: the router picks and weights
    experts per token (``Routing``); the token-expert pairs, sorted by expert, go through one
    grouped product per projection (``F.grouped_mm``: no shape that depends on the routing,
    so a CUDA graph holds it where ``grouped_mm_graphable``); each token sums its experts'
    outputs, weighted. Qwen2-MoE's gated shared expert and GLM-4.5's and DeepSeek's shared experts are the
    layer's dense MLP (``TorchLlama._mlp``). Weights are ``[experts, in, out]``
    (``grouped_mm``'s), the gate's columns before the up ones; biases (GPT-OSS's)
    ``[experts, out]``."""

    def __init__(self, routing: Routing, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *,
                 router_bias: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                 expert_scale: torch.Tensor | None = None):
        self.routing = routing
        self.router, self.router_bias = router, router_bias  # [experts, hidden], [experts]
        self.correction = correction  # [experts] float32: GLM-4.5's bias on the scores that choose
        self.expert_scale = expert_scale  # [experts]: Gemma 4's factor of each chosen expert's weight
        self.gate_up, self.gate_up_bias = gate_up, gate_up_bias  # [experts, hidden, 2 * inter], [experts, 2 * inter]
        self.down, self.down_bias = down, down_bias  # [experts, inter, hidden], [experts, hidden]

    @classmethod
    def load(cls, config, weights, layer: str, device: torch.device, dtype: torch.dtype) -> "Experts":
        """Layer ``layer``'s (``"model.layers.{i}."``) from a checkpoint as saved (one tensor
        per expert and projection: ``experts.{e}.gate_proj.weight``..., Mixtral's
        ``block_sparse_moe.experts.{e}.w1.weight``...; GPT-OSS's fused, in MXFP4 or not) or
        under transformers' own names (its experts fused: ``mlp.experts.gate_up_proj``; dummy
        weights, converted GGUFs), each tensor copied once into the stacked ones on ``device``."""
        if config.model_type == "gpt_oss":
            return cls._load_gpt_oss(config, weights, layer + "mlp.", device, dtype)
        if config.model_type == "dbrx":
            return cls._load_dbrx(config, weights, layer + "mlp.", device, dtype)
        if config.model_type == "gemma4_text":
            return cls._load_gemma4(config, weights, layer, device, dtype)

        def stacked(names: list[list[str]]) -> torch.Tensor:  # [experts, out, in]: each expert's tensors' rows
            tensors = [[weights[n] for n in expert] for expert in names]
            out = torch.empty(len(tensors), sum(len(t) for t in tensors[0]), tensors[0][0].shape[1], device=device,
                              dtype=dtype)
            for e, expert in enumerate(tensors):
                torch.cat([t.to(device=device, dtype=dtype) for t in expert], out=out[e])
            return out

        # (MiniMax-Text-01's, MiniMax-M2's and Phi-3.5-MoE's released names are Mixtral's: ``block_sparse_moe.experts.{e}.w1``)
        mixtral = config.model_type in ("mixtral", "minimax", "minimax_m2", "phimoe")
        granite = config.model_type in GRANITE_MOES
        block = layer + ("block_sparse_moe." if granite or mixtral and layer + "mlp.gate.weight" not in weights
                         else "feed_forward." if config.model_type in ("jamba", "llama4_text") else "mlp.")
        routing = Routing.of(config)
        fused = [block + "experts." + ("gate_up_proj" if routing.gated else "up_proj"), block + "experts.down_proj"]
        if block + "input_linear.weight" in weights:  # Granite's as saved
            fused = [block + "input_linear.weight", block + "output_linear.weight"]
        if block + "experts.fc1.weight" in weights:  # Aria's as saved ([experts, in, out])
            fused = [block + "experts.fc1.weight", block + "experts.fc2.weight"]
        if fused[0] in weights:  # fused, [experts, out, in] (Llama 4's [experts, in, out]; Qwen3-VL-MoE's either,
            # [experts, in, out] as released: where not [experts, out, in], as transformers reads them)
            gate_up, down = (weights[n].to(device=device, dtype=dtype, copy=True) for n in fused)
            if config.model_type in ("llama4_text", "aria_text"):
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            if config.model_type == "qwen3_vl_moe_text":
                h, i = config.hidden_size, config.moe_intermediate_size
                gate_up = gate_up if gate_up.shape[1:] == (2 * i, h) else gate_up.transpose(1, 2).contiguous()
                down = down if down.shape[1:] == (h, i) else down.transpose(1, 2).contiguous()
        else:  # (not gated: the up projection alone, Nemotron-H's)
            w123 = mixtral or block + "experts.0.w1.weight" in weights  # (Mixtral's names, LFM2-MoE's)
            gate, up, down = ("w1", "w3", "w2") if w123 else ("gate_proj" if routing.gated else "up_proj", "up_proj",
                                                              "down_proj")
            experts = [f"{block}experts.{i}." for i in range(num_experts(config))]
            gate_up = stacked([list(dict.fromkeys([x + gate + ".weight", x + up + ".weight"])) for x in experts])
            down = stacked([[x + down + ".weight"] for x in experts])

        router_name = next(block + n for n in ("gate.weight", "router.layer.weight", "router.weight", "gate.wg.weight",
                                               "router.gate.weight")
                           if block + n in weights)  # (Granite's as saved, as transformers names it; HunYuan's, AFMoE's)
        # a float32 router kept so where transformers keeps it so (Lara's: as the model's dtype holds it, widened)
        held = torch.float32 if routing.float_router and config.model_type != "lara_mini" else dtype
        router = weights[router_name].to(device=device, dtype=held, copy=True)
        router = router.float() if routing.float_router else router
        correction = next((block + n for n in ("gate.e_score_correction_bias", "expert_bias",
                                               "moe_statics.e_score_correction_bias", "e_score_correction_bias",
                                               "experts.e_score_correction_bias")
                           if block + n in weights),
                          None)  # GLM-4.5's, LFM2-MoE's, ERNIE 4.5's ([1, experts]), EXAONE-MoE's as saved, Laguna's
        return cls(routing, router, gate_up.transpose(1, 2), down.transpose(1, 2),
                   correction=weights[correction].to(device=device, dtype=torch.float32, copy=True).flatten()
                   if correction else None)

    @classmethod
    def _load_gpt_oss(cls, config, weights, mlp: str, device: torch.device, dtype: torch.dtype) -> "Experts":
        """GPT-OSS's: ``experts.gate_up_proj [experts, hidden, 2 * inter]`` (gate and up columns
        interleaved: they are put in halves) and ``down_proj [experts, inter, hidden]``, or as
        released, in MXFP4 (``*_blocks``, ``*_scales``, out before in), biases beside them."""
        def get(name: str) -> torch.Tensor:
            return weights[mlp + name].to(device=device, dtype=dtype, copy=True)

        def projection(name: str) -> torch.Tensor:  # [experts, in, out]
            if mlp + f"experts.{name}_blocks" in weights:
                blocks, scales = weights[mlp + f"experts.{name}_blocks"], weights[mlp + f"experts.{name}_scales"]
                return torch.stack([mxfp4(blocks[e], scales[e], device, dtype) for e in range(len(blocks))]
                                   ).transpose(1, 2)
            return get(f"experts.{name}")

        gate_up, gate_up_bias = projection("gate_up_proj"), get("experts.gate_up_proj_bias")
        halves = torch.cat([torch.arange(0, gate_up.shape[-1], 2), torch.arange(1, gate_up.shape[-1], 2)]).to(device)
        return cls(Routing.of(config), get("router.weight"), gate_up[..., halves].contiguous(),
                   projection("down_proj").contiguous(), router_bias=get("router.bias"),
                   gate_up_bias=gate_up_bias[:, halves].contiguous(), down_bias=get("experts.down_proj_bias"))

    @classmethod
    def _load_dbrx(cls, config, weights, mlp: str, device: torch.device, dtype: torch.dtype) -> "Experts":
        """DBRX's: ``experts.mlp.w1``, ``v1`` (gate, up) and ``w2`` (down) each ``[experts x
        inter, hidden]``, the router ``router.layer``."""
        def get(name: str) -> torch.Tensor:  # [experts, inter, hidden]
            w = weights[mlp + name]
            return w.to(device=device, dtype=dtype, copy=True).view(num_experts(config), -1, w.shape[-1])

        gate_up = torch.cat([get("experts.mlp.w1"), get("experts.mlp.v1")], dim=1).transpose(1, 2)
        router = weights[mlp + "router.layer.weight"].to(device=device, dtype=dtype, copy=True)
        return cls(Routing.of(config), router, gate_up, get("experts.mlp.w2"))

    @classmethod
    def _load_gemma4(cls, config, weights, layer: str, device: torch.device, dtype: torch.dtype) -> "Experts":
        """Gemma 4's, beside its dense MLP: ``experts.gate_up_proj [experts, 2 * inter, hidden]``
        and ``down_proj [experts, hidden, inter]`` (transformers' fused layout), the router
        ``router.proj`` and each expert's weight factor ``router.per_expert_scale``."""
        def get(name: str) -> torch.Tensor:
            return weights[layer + name].to(device=device, dtype=dtype, copy=True)

        return cls(Routing.of(config), get("router.proj.weight"), get("experts.gate_up_proj").transpose(1, 2),
                   get("experts.down_proj").transpose(1, 2), expert_scale=get("router.per_expert_scale"))

    def __call__(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output for ``x [..., hidden]``, routed by ``x`` or by ``route`` (of its
        shape: Gemma 4's router reads the layer's input otherwise normed than the experts')."""
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        N, k, E = flat.shape[0], self.routing.top_k, self.router.shape[0]
        by = flat if route is None else route.reshape(-1, route.shape[-1])
        logits = F.linear(by.float() if self.routing.float_router else by, self.router, self.router_bias)
        weights, chosen = self.routing.weights(logits, self.correction, x.dtype)  # [N, k]
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]
        expert, order, ends = pairs_by_expert(chosen, E)
        inputs = flat[order // k]  # [N k, hidden]
        if self.routing.scales_inputs:  # (Llama 4's)
            inputs = inputs * weights.flatten()[order, None]
        h = grouped_mm(inputs, self.gate_up, offs=ends)  # [N k, 2 inter]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[expert]
        out = grouped_mm(self.routing.glu(*h.chunk(1 + self.routing.gated, dim=-1)), self.down, offs=ends)  # [N k, hidden]
        if self.down_bias is not None:
            out = out + self.down_bias[expert]
        if not self.routing.scales_inputs:
            out = out * weights.flatten()[order, None]
        out = in_token_order(out, order).view(N, k, -1).sum(dim=1).to(x.dtype).view_as(x)
        return out * self.routing.scale if self.routing.scale_sum else out

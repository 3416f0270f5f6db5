"""The torch runtime's linear layers (``Linear``): plain ``F.linear``, oneDNN on CPU float32
(with a copy pre-packed for the 2-16 row products of verification), or dynamic int8 for draft
models; BitNet's ternary products (``Ternary``); and the memory their weights take."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .moe import moe_layers, num_experts
from .recurrent import LINEAR_ATTENTION, PURE_RECURRENT, RECURRENT_TYPES, DeltaNet, recurrent_mixer


LINEAR_KINDS = ("dense", "onednn", "int8")


class Linear:
    """``y = x W^T + b`` in one of three kinds:

    * ``dense``: ``F.linear`` (any device and dtype);
    * ``onednn``: CPU fp32 through oneDNN (``mkldnn_linear``), ~1.5-2x faster than the
      default sgemm for the 1-16 row products of decoding and verification. With
      ``multi_row`` a second copy of the weight, pre-packed by oneDNN for 8-row inputs, serves
      every product of 2+ rows (verification, prefill): on Qwen2.5-Coder-1.5B a 9-token
      forward then costs ~1.5x one token instead of ~2.5x, at twice the weight memory.
      Where that copy is also as fast for one row (``one_row_packed``: the runtime times
      both), it serves every product and the first copy is freed;
    * ``int8``: CPU dynamic int8 (fbgemm, per-output-channel symmetric weights), ~4x
      faster again at ~1e-2 relative error: for draft models only, where it costs some
      acceptance but never exactness (the target still verifies every token).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, multi_row: bool = False):
        self.out_features = weight.shape[0]
        self.kind = kind
        self.multi = None
        self.one_row_packed = False
        if kind == "onednn":
            self.weight = weight.contiguous().to_mkldnn()
            self.bias = bias.contiguous().to_mkldnn() if bias is not None else None
            if multi_row and MULTI_ROW_OPS:
                self.multi = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
                self.dense_bias = bias.contiguous() if bias is not None else None
        elif kind == "int8":
            w = weight.float()
            scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-8).double()  # [out]
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # "quantized tensor creation is deprecated" (torch 2.13)
                warnings.simplefilter("ignore")
                qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
            self.bias = bias.float() if bias is not None else None
            self.anchor = torch.zeros(1, w.shape[1])  # [1, in]: pins the activation range to [-1, 1]
            self.anchor[0, :2] = torch.tensor([1.0, -1.0])
        else:
            self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if self.multi is not None and (flat.shape[0] > 1 or self.one_row_packed):
            y = torch.ops.mkldnn._linear_pointwise(flat, self.multi, self.dense_bias, "none", [], "")
        elif self.kind == "onednn":
            y = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self.weight, self.bias).to_dense()
        else:  # int8, per row: see int8_rows
            y = int8_rows(flat, self.packed, self.anchor, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def pack_one_row(self, on: bool = True, free: bool = False) -> None:
        """Products of one row through the multi-row copy (``on``); ``free``: drop the other."""
        self.one_row_packed = on and self.multi is not None
        if free and self.one_row_packed:
            self.weight = self.bias = None


@dataclass(frozen=True)
class TernaryWeight:
    """A BitNet b1.58 projection's weights as its checkpoint gives them (``CheckpointReader.get``):
    ``t [out, in]`` int8 of -1, 0 and 1, and ``scale [out]`` float32, its rows' scales (one per
    projection, repeated; the projections a product fuses keep their own). ``Ternary`` computes
    with them."""

    t: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def cat(parts: list[TernaryWeight]) -> TernaryWeight:
        """Projections fused into one product (queries, keys and values; gate and up), row after row."""
        return TernaryWeight(torch.cat([p.t for p in parts]), torch.cat([p.scale for p in parts]))


class Ternary:
    """BitNet b1.58's product (transformers' ``BitLinear``, and ``AutoBitLinear`` quantizing bf16
    masters at load): each row of the input quantized to int8 on its own scale ``s = 127 / max
    |x|`` (as the model's dtype holds it; the products in float32, as transformers' compiled
    ``activation_quant`` computes them), its integer product with the ternary weights ``t``,
    that divided by ``scale * s`` in float32, plus the bias. The integer product is
    exact in any dtype's accumulator (at most 127 x ``in`` < 2^24), so computing it on the CPU in
    integers (``torch._int_mm``: a quarter of float32's weight memory, several times faster than
    oneDNN's float32 product for 1-16 rows) gives what transformers' float product gives; on a GPU it
    is the model's dtype's ``F.linear``, as transformers computes it."""

    kind = "ternary"  # (``Linear``'s kinds: ``TorchLlama.speed_key``)
    multi = None  # (not ``Linear``'s verify-packed copy: ``columns``)
    one_row_packed = False

    def __init__(self, weight: TernaryWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 multi_row: bool = False):
        self.integers = device.type == "cpu"
        self.weight = weight.t.to(device) if self.integers else weight.t.to(device, dtype)  # [out, in]
        # (``multi_row``: a copy by columns [in, out] for products of 2+ rows, which oneDNN's integer product takes
        # 1.3-1.8x faster than the rows' layout; one row goes faster through the rows')
        self.columns = self.weight.t().contiguous() if self.integers and multi_row else None
        self.scale = weight.scale.to(device)  # [out] float32
        self.bias, self.out_features = bias, weight.t.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        s = (127 / x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)).to(x.dtype).float()  # [..., 1]
        q = (x32 * s).round().clamp(-128, 127).reshape(-1, x.shape[-1])  # [n, in]
        if not self.integers:
            y = F.linear(q.to(x.dtype), self.weight)
        else:
            y = torch._int_mm(q.to(torch.int8), self.columns if self.columns is not None and q.shape[0] > 1
                              else self.weight.t())
        y = y.to(x.dtype).float().view(*x.shape[:-1], self.out_features)  # (rounded as transformers' product is)
        y = (y / (self.scale * s)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def pack_one_row(self, on: bool = True, free: bool = False) -> None:
        """(No packed copy to serve one row: ``Linear.pack_one_row``.)"""


def int8_rows(x: torch.Tensor, packed, anchor: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` through fbgemm's dynamic int8 linear, with each row of ``x`` ``[n, in]``
    quantized on its own scale. fbgemm quantizes activations on one range for the whole
    tensor, so a row's result would depend on the rows beside it (a draft's q on its batch
    and chunking, and so a seeded draw on them), and one large row would coarsen the rest
    (with one row 20x larger: ~28% relative error for the others, against ~2%). Each row is
    scaled to max |x| = 1 and the ``anchor`` row (1, -1, 0, ...) pins the tensor's range to
    [-1, 1]; the integer products are exact, so a row's output no longer depends on its
    neighbours."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [n, 1]
    y = torch.ops.quantized.linear_dynamic(torch.cat([x / scale, anchor]), packed, reduce_range=True)
    y = y[:-1] * scale  # [n, out]
    return y if bias is None else y + bias


PACKED_ONE_ROW_SLACK = 1.03  # packed one-row products may cost this much more: they halve the weights' memory
MULTI_ROW_OPS = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_bytes(config) -> int:
    """fp32 bytes of a model's ``Linear`` weights (from its config): attention's (latent or not) or a recurrent layer's,
    the dense MLPs' (a MoE layer's shared experts': Qwen2-MoE's, GLM-4.5's, Granite's) and the head; not ``Experts``';
    BitNet's ternary ones a byte each."""
    from .torch_llama import GEMMA_N, Family, SparseIndex, bitnet_form, quant_config, text_model  # (its module
    # imports this one)

    config = text_model(config)[0]  # (GPT-J's and Falcon's fields under Llama's names)
    h, heads = config.hidden_size, getattr(config, "num_attention_heads", None) or 1
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    rec = recurrent_mixer(config)  # Qwen3.5's DeltaNet layers beside its gated attention (queries' gates too)
    if config.model_type in GEMMA_N:  # heads per layer; shared keys, or keys as values; wider shared MLPs
        n = config.num_hidden_layers
        first_shared = n - (config.num_kv_shared_layers or 0)
        per_layer = getattr(config, "hidden_size_per_layer_input", None) or 0  # its per-layer inputs' projections: 3
        # per layer
        widths = config.intermediate_size if isinstance(config.intermediate_size, list) else [config.intermediate_size] * n
        total = config.vocab_size * h + 3 * n * h * per_layer
        for i, (kv_i, d_i) in enumerate(config.layer_heads):
            own = 0 if i >= first_shared else 1 if getattr(config, "attention_k_eq_v", False) and \
                config.layer_types[i] == "full_attention" else 2
            wide = 2 if i >= first_shared and getattr(config, "use_double_wide_mlp", False) else 1
            total += 2 * heads * d_i * h + own * kv_i * d_i * h + 3 * h * widths[i] * wide
        if config.model_type == "gemma3n_text":  # its streams' projections in and out; each layer's coefficients
            S = config.altup_num_inputs  # [S^2, S] and [S, S] and LAuReL's two products (not its router's)
            total += 2 * (S - 1) * h * h + n * (S ** 3 + S * S + 2 * h * config.laurel_rank)
        return 4 * total
    if config.model_type == "mimo_v2_flash":  # values narrower than keys; twice the key/value heads on windowed layers
        dv, total = config.v_head_dim, config.vocab_size * h
        for t, m in zip(config.layer_types, config.mlp_layer_types):
            kv_t = 2 * kv if t == "sliding_attention" else kv
            total += (heads * d + kv_t * (d + dv) + heads * dv) * h + (3 * h * config.intermediate_size if m == "dense"
                                                                        else 0)
        return 4 * total
    if config.model_type == "jetmoe":  # its keys' and values' product alone (the queries' and output's: experts)
        return 4 * (config.num_hidden_layers * 2 * kv * d * h + config.vocab_size * h)
    if config.model_type == "recurrent_gemma":  # RG-LRU blocks or windowed attention, MLPs of intermediate_size / 2
        n, attention = config.num_hidden_layers, config.layer_types.count("sliding_attention")
        return 4 * (attention * (2 * heads * d + 2 * kv * d) * h + (n - attention) * rec.projection_params(h)
                    + n * 3 * h * (config.intermediate_size // 2) + config.vocab_size * h)
    if config.model_type == "zamba2":  # a Mamba-2 layer each; shared blocks (attention over 2 h, an MLP) run by the
        # hybrid layers, each with its own output product and low-rank adapters
        n_hybrid, r, a = len(config.hybrid_layer_ids), config.adapter_rank, config.attention_hidden_size
        blocks = min(config.num_mem_blocks, n_hybrid)
        attention = (heads * d + 2 * kv * d) * a + h * heads * d
        adapters = r * (h + 2 * config.intermediate_size) + (6 * r * a if config.use_shared_attention_adapter else 0)
        return 4 * (config.num_hidden_layers * rec.projection_params(h) + config.vocab_size * h
                    + blocks * (attention + 3 * h * config.intermediate_size) + n_hybrid * (h * h + adapters))
    if config.model_type in PURE_RECURRENT:  # a Mamba layer alone in each block
        return 4 * (config.num_hidden_layers * rec.projection_params(h) + config.vocab_size * h)
    shared = getattr(config, "shared_expert_intermediate_size", 0) or getattr(config, "shared_intermediate_size", 0) \
        or (getattr(config, "n_shared_experts", 0) or getattr(config, "moe_num_shared_experts", 0)
            or getattr(config, "num_shared_experts", 0) or 0) \
        * (getattr(config, "moe_intermediate_size", 0) or 0)
    dense = shared if config.model_type == "granitemoehybrid" else config.intermediate_size  # (its shared_mlp)
    if config.model_type == "aria_text":  # its shared experts as wide as its routed ones, side by side
        shared = config.intermediate_size * config.moe_num_shared_experts
    if config.model_type == "llama4_text":  # a shared expert as wide as a routed one, dense layers of their own width
        shared, dense = config.intermediate_size, config.intermediate_size_mlp
    if config.model_type == "hunyuan_v1_moe":  # its shared MLP as wide as an expert
        shared = config.intermediate_size
    if config.model_type == "cohere2_moe":  # shared experts as wide as routed ones; dense first layers of their own
        shared = config.intermediate_size * config.num_shared_experts
        dense = config.prefix_dense_intermediate_size or config.intermediate_size
    if config.model_type == "lfm2" and config.block_auto_adjust_ff_dim:  # its MLP's width, as transformers sizes it
        dense = int(2 * dense / 3)
        if config.block_ffn_dim_multiplier is not None:
            m = config.block_multiple_of
            dense = m * ((int(config.block_ffn_dim_multiplier * dense) + m - 1) // m)
    mlp = sum(shared if moe else dense for moe in moe_layers(config))
    # queries' gates (AFMoE's: their own product; OLMo-Hybrid's DeltaNet layers beside attention without)
    gated = isinstance(rec, DeltaNet) and config.model_type not in ("olmo_hybrid", "lara_mini") \
        or config.model_type == "afmoe"
    per_attention = (heads * d * (2 if gated else 1) + 2 * kv * d) * h + h * heads * d
    if config.model_type == "lfm3" and config.use_attention_gate:  # a gate per head
        per_attention += heads * h
    if config.model_type == "nemotron_h":  # blocks of one mixer or one MLP (not gated) each
        types = config.layer_types
        mlp = types.count("mlp") * config.intermediate_size + types.count("moe") * config.moe_shared_expert_intermediate_size
        return 4 * (types.count("full_attention") * per_attention + types.count(LINEAR_ATTENTION) * rec.projection_params(h)
                    + 2 * h * mlp + config.vocab_size * h)
    recurrent = sum(map(config.layer_types.count, RECURRENT_TYPES)) if rec else 0
    attended = config.num_hidden_layers - recurrent + (config.layer_types.count("hybrid") if rec else 0)  # (Falcon-H1's)
    attention = attended * per_attention
    if config.model_type == "laguna":  # query heads per layer, a gate per head (or per element) each
        gates = 1 if config.gating is True or config.gating == "per-head" else d
        attention = sum((2 * n * d + 2 * kv * d + n * gates) * h for n in config.num_attention_heads_per_layer)
    if getattr(config, "kv_lora_rank", None) is not None:  # latent attention (``torch_llama.Latent``)
        q, r, rope = config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim
        query = heads * (config.qk_nope_head_dim + rope)
        attention = attended * ((q * (h + query) if q else h * query) + (r + rope) * h
                                + r * heads * (config.qk_nope_head_dim + config.v_head_dim)
                                + heads * config.v_head_dim * h)
        if config.model_type == "bailing_hybrid":  # (Ling's: a gate per head)
            attention += attended * heads * h
        if config.model_type == "hy_v4":  # (Hy4's: a gate per element; its hyper-connections' products, two a layer
            N = config.hc_mult  # and the head's)
            attention += attended * heads * config.v_head_dim * h + (4 * config.num_hidden_layers + 1) * N * N * h
        if config.model_type == "axk2":  # its second query product gives output gates too, from twice the rank; its
            # norms gated (before attention, and before the experts): two products of gated_norm_rank each
            attention += config.num_hidden_layers * q * (2 * (query + heads * config.v_head_dim) - query)
            attention += (config.num_hidden_layers + sum(moe_layers(config))) * 2 * h * config.gated_norm_rank
        index = SparseIndex.of(config)  # (DeepSeek-V3.2's, GLM-5's indexers: queries, a key, the heads' weights)
        if index is not None:
            attention += sum(index.owns) * (q * index.heads * index.dim + h * (index.dim + index.heads))
    if rec:  # (beside latent attention too: Kimi Linear's, Ling's)
        attention += recurrent * rec.projection_params(h)
    head = getattr(config, "output_vocab_size", None) or config.vocab_size  # (Apertus 1.5's: pruned to the text)
    layers = attention + (3 if Family.of(config).gated_mlp else 2) * h * mlp
    if bitnet_form(quant_config(config)) is not None:  # (BitNet's ternary products: a byte a weight, ``Ternary``)
        return layers + 4 * head * h
    return 4 * (layers + head * h)


def expert_bytes(config) -> int:
    """fp32 bytes of a model's ``Experts`` (from its config; 0 without)."""
    from .torch_llama import GEMMA4, text_model

    config = text_model(config)[0]  # (DBRX's fields under Llama's names)
    if config.model_type in GEMMA4:  # (its experts beside the dense MLP on every layer)
        return 4 * config.num_hidden_layers * num_experts(config) * 3 * config.hidden_size * \
            config.moe_intermediate_size if getattr(config, "enable_moe_block", False) else 0
    if not any(moe_layers(config)):
        return 0
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    per = 2 if config.model_type == "nemotron_h" else 3  # (Nemotron-H's experts are not gated)
    expert = per * config.hidden_size * inter
    if config.model_type == "jetmoe":  # its attention experts' query and output products too
        expert += 2 * config.hidden_size * config.num_key_value_heads * config.kv_channels
    return 4 * sum(moe_layers(config)) * num_experts(config) * expert


def mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pick_linear(device: torch.device, dtype: torch.dtype, quantize: bool = False) -> str:
    """The fastest exact kind for this device and dtype, or int8 when ``quantize`` (CPU only)."""
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if quantize:
        if not cpu_fp32:
            raise ValueError("int8 draft quantization needs a CPU float32 draft model")
        return "int8"
    return "onednn" if cpu_fp32 and torch.backends.mkldnn.is_available() else "dense"

"""The tensor functions of a decoder layer, shared by the torch runtime (``torch_llama``) and
an EAGLE head (``eagle``): norms, attention, rotary embeddings, activations."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GELU_C = math.sqrt(2.0 / math.pi)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "relu2": lambda x: F.relu(x).square(),  # (Nemotron-H's, not gated)
               "gelu": F.gelu,  # (GPT-NeoX's: erf)
               "relu": F.relu,  # (OPT's, not gated)
               # Phi's: the tanh form written out as transformers' NewGELUActivation has it (not bit-equal to PyTorch's)
               "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(GELU_C * (x + 0.044715 * torch.pow(x, 3.0)))),
               # (BLOOM's, as transformers writes it)
               "bloom_gelu": lambda x: x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))}
TRAINED_ACTIVATIONS = ("xielu",)  # of weights each layer keeps (``xielu``: Apertus's)


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
          eps: torch.Tensor) -> torch.Tensor:
    """xIELU (Apertus's MLP activation, as transformers' Python form computes it), of the layer's
    ``alpha_p``, ``alpha_n`` (before their softplus), ``beta`` and ``eps``."""
    alpha_p, alpha_n = F.softplus(alpha_p), beta + F.softplus(alpha_n)
    return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)


def cat_or_none(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The biases of linears fused into one, or None where they have none (the checkpoint
    has all or none of them: ``attention_bias``, ``mlp_bias``)."""
    return torch.cat(biases) if all(b is not None for b in biases) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Llama's (scaled in the model's dtype), or with a float32 ``weight`` under a lower
    precision Gemma's (scaled in float32, then cast): the same in float32; without a weight
    (Falcon-Mamba's norms of dt, B and C), not scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype == torch.float32:
        return (h * weight).to(x.dtype)
    return weight * h.to(x.dtype)


@dataclass(frozen=True)
class LayerNorm:
    """A layer norm's weights (StarCoder2's, with a bias), which ``norm`` reads; ``in_float``:
    computed in float32, then cast (Cohere's, without a bias). A ``weight [heads, head_dim]``
    scales each head of ``[..., heads, head_dim]`` its own way (Cohere's and StableLM's q/k
    norms); None: not scaled (OLMo's norms)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    in_float: bool = False


@dataclass(frozen=True)
class GatedNorm:
    """An RMS norm whose output a low-rank gate of it scales (A.X K2's): ``y = rms_norm(x)``,
    then ``y * sigmoid(up(silu(down(y))))``, the sigmoid in float32; ``down``, ``up``: the
    gate's products (callables)."""

    weight: torch.Tensor
    down: object
    up: object


def norm(x: torch.Tensor, weight: "torch.Tensor | LayerNorm | GatedNorm", eps: float) -> torch.Tensor:
    """``rms_norm``, or a ``LayerNorm``'s (one of a weight per head in float32, then cast, written
    out as transformers' ``CohereLayerNorm``), or a ``GatedNorm``'s."""
    if isinstance(weight, GatedNorm):
        y = rms_norm(x, weight.weight, eps)
        return (y * torch.sigmoid(weight.up(F.silu(weight.down(y))).float())).to(y.dtype)
    if not isinstance(weight, LayerNorm):
        return rms_norm(x, weight, eps)
    if weight.weight is not None and weight.weight.dim() > 1:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + eps) * weight.weight.float()
        return (h if weight.bias is None else h + weight.bias.float()).to(x.dtype)
    if weight.in_float:
        w, bias = (None if t is None else t.float() for t in (weight.weight, weight.bias))
        return F.layer_norm(x.float(), x.shape[-1:], w, bias, eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight.weight, weight.bias, eps)


def norm_width(weight: "torch.Tensor | LayerNorm") -> int:
    """The width a norm's weight spans: a head's, or every head's (OLMo 2's q/k norms)."""
    return (weight.weight if isinstance(weight, LayerNorm) else weight).shape[-1]


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
              cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [B, H, T, D]`` over ``k, v [B, KV, S, D]`` under ``mask [B, 1, T, S]`` (bool):
    PyTorch's fused attention, or where it cannot the product written out as transformers'
    eager attention has it: capped scores (Gemma 2's; softmax in float32) or a sink per head
    (GPT-OSS's ``sinks [H]``: a logit beside the keys' that takes a share of the softmax
    and no value; softmax in the model's dtype, or float32 where the sinks are: Hy4's; ``[H, T]``
    a sink per row)."""
    H, KV = q.shape[1], k.shape[1]
    if cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=KV != H)
    if KV != H:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = softcap(q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5), cap)  # [B, H, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sinks = sinks[None, :, None, None] if sinks.dim() == 1 else sinks[None, :, :, None]  # (per head, or [H, T] by row)
    scores = torch.cat([scores, sinks.expand(*scores.shape[:3], 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values  # [B, H, T, S + 1]
    return torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(v.dtype) @ v


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``rotate_half`` for rotary pairs of neighbouring dimensions (GLM-4's interleaved rope)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [B, heads, T, head_dim]``: its first ``cos.shape[-1]``
    dimensions rotate (as halves, or ``interleaved`` as neighbouring pairs), the rest pass (a
    partial rotary factor)."""
    r, turn = cos.shape[-1], (rotate_pairs if interleaved else rotate_half)
    if r == x.shape[-1]:
        return x * cos + turn(x) * sin
    part = x[..., :r]
    return torch.cat([part * cos + turn(part) * sin, x[..., r:]], dim=-1)


@dataclass(frozen=True)
class HyperConnections:
    """Hy4's hyper-connections: each token carries ``streams`` copies of the hidden state
    ``[B, T, streams, hidden]`` (the embedding's, at first). A block (attention, or the MLP) reads
    their mix ``sum_i pre_i x_i`` and adds its output to each stream ``i`` times ``post_i``; ``pre``
    and ``post`` come from one product of the streams side by side (``fn [2 streams, streams
    hidden]``) times their inverse RMS, through ``sigmoid(logits scale + base)`` (``post`` times
    ``magnitude``), plus ``eps``; all in float32. The head's mix (``head``) has ``pre`` alone."""

    streams: int
    magnitude: float
    eps: float
    norm_eps: float

    def _logits(self, w: dict, streams: torch.Tensor) -> torch.Tensor:
        """``[B, T, 2 streams or streams]``: the streams' product, times their inverse RMS."""
        flat = streams.flatten(2).float()  # [B, T, streams hidden]
        return F.linear(flat, w["fn"]) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)

    def collapse(self, w: dict, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(post [B, T, streams], the block's input [B, T, hidden])`` of ``streams [B, T, streams, hidden]``."""
        pre, post = self._logits(w, streams).split(self.streams, dim=-1)
        base_pre, base_post = w["base"].split(self.streams)
        pre = torch.sigmoid(pre * w["scale"][0] + base_pre) + self.eps
        post = self.magnitude * torch.sigmoid(post * w["scale"][1] + base_post) + self.eps
        return post, (pre[..., None] * streams).sum(2).to(streams.dtype)

    @staticmethod
    def expand(post: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The streams after a block: ``out [B, T, hidden]`` added to each, times its ``post``."""
        return (post[..., None] * out.float()[..., None, :] + streams.float()).to(streams.dtype)

    def head(self, w: dict, streams: torch.Tensor) -> torch.Tensor:
        """The last streams' mix ``[B, T, hidden]``, before the final norm."""
        pre = torch.sigmoid(self._logits(w, streams) * w["scale"] + w["base"]) + self.eps
        return (pre[..., None] * streams).sum(2).to(streams.dtype)


@dataclass(frozen=True)
class AltUp:
    """Gemma 3n's alternating updates: each token carries ``streams`` predictions of the hidden
    state ``[B, T, streams, hidden]`` and a layer computes on one of them, the ``active`` one.
    ``predict``: each stream plus a mix of all ``sum_j C_ij x_j``, whose coefficients ``C [streams,
    streams]`` a router (``tanh`` of a product of the active stream, normed, times 1 / hidden)
    gives each token; ``correct``: the layer's output less its predicted input (the innovation)
    added to each stream times ``1 + c_i`` (the router's of the output). ``spread`` / ``gather``:
    the embedding into streams and the streams back into one, each projected stream rescaled to
    the first's RMS. In the model's dtype, as transformers' model rounds (``router_scale``: 1 / hidden as
    that dtype holds it)."""

    streams: int
    active: int
    router_scale: float

    def _route(self, w: dict, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The router's ``[B, T, streams]`` of ``x [B, T, hidden]``."""
        routed = F.linear(norm(x, w["router_norm"], eps) * self.router_scale, w["router"])
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, w: dict, streams: torch.Tensor, eps: float) -> torch.Tensor:
        """``[B, T, streams, hidden]``: each stream's prediction of the layer's input."""
        S = self.streams
        coefs = F.linear(self._route(w, streams[:, :, self.active], eps), w["predict"])  # [B, T, S * S]
        coefs = coefs.unflatten(-1, (S, S)).transpose(-1, -2)  # [B, T, S, S] [j, i]: stream i's weight of x_j
        return (streams.transpose(-1, -2) @ coefs).transpose(-1, -2) + streams

    def correct(self, w: dict, predictions: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
        """``[B, T, streams, hidden]``: the predictions corrected by the layer's ``out [B, T, hidden]``."""
        innovation = out - predictions[:, :, self.active]  # [B, T, hidden]
        coefs = F.linear(self._route(w, out, eps), w["correct"]) + 1.0  # [B, T, S]
        return innovation[:, :, None] * coefs[..., None] + predictions

    @staticmethod
    def _rescaled(x: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
        return x * rms / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))

    def spread(self, projections: list, h: torch.Tensor) -> torch.Tensor:
        """The embeddings ``h [B, T, hidden]`` as streams: ``h`` and its projections."""
        rms = torch.mean(h ** 2, dim=-1, keepdim=True) ** 0.5
        return torch.stack([h] + [self._rescaled(p(h), rms) for p in projections], dim=2)

    def gather(self, projections: list, streams: torch.Tensor) -> torch.Tensor:
        """The last streams' mean ``[B, T, hidden]``: the first and the others' projections back."""
        first = streams[:, :, 0]
        rms = torch.mean(first ** 2, dim=-1, keepdim=True) ** 0.5
        rest = [self._rescaled(p(streams[:, :, i + 1]), rms) for i, p in enumerate(projections)]
        return torch.stack([first] + rest).mean(0)

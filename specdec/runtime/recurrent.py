"""Linear attention with a recurrent state for the torch runtime: the Gated DeltaNet layers of
Qwen3-Next and Qwen3.5 (``DeltaNet``, ``delta_net``), and the states they keep per slot
(``RecurrentStates``), which a rewind takes back.

A DeltaNet layer keeps no row per token. Each slot holds, per layer, the last ``kernel - 1``
inputs of its short convolution (``conv``) and one ``[v_heads, k_dim, v_dim]`` matrix, the
delta rule's state (``ssm``). A token's step: the state decays by ``exp(g)``, then moves
towards ``k -> v`` by ``beta`` (``S += beta k (v - k S)``); the token reads ``q S``.

Speculation drops rejected drafts, and a state cannot subtract the tokens it has taken in.
So each slot also keeps a ring of its states *before* each of its last ``depth`` tokens,
the ring row of position ``p`` being ``p % depth`` (SGLang and vLLM keep one state per draft
token the same way). A rewind to length ``L`` copies the ring's state of position ``L`` back.
A forward of more than ``depth`` tokens (a prompt) takes the chunked form of the rule and
keeps only the state it started from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops import rms_norm

LINEAR_ATTENTION = "linear_attention"  # its name in ``layer_types``
DEFAULT_DEPTH = 18  # ring rows per slot: a rewind of up to 17 tokens (16 drafts and the bonus token)


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's widths: ``k_heads`` query/key heads of ``k_dim``, ``v_heads``
    value heads of ``v_dim`` (each key head serves ``v_heads // k_heads`` consecutive value
    heads), and the convolution's ``kernel``."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @classmethod
    def of(cls, config) -> "DeltaNet | None":
        if LINEAR_ATTENTION not in (getattr(config, "layer_types", None) or ()):
            return None
        return cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys and values side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    def projection_params(self, hidden: int) -> int:
        """One layer's linears' weights (``linear.linear_bytes``)."""
        return hidden * (self.conv_dim + 2 * self.value_width + 2 * self.v_heads)


def delta_net_weights(r, a: str, net: DeltaNet) -> dict:
    """The weights under ``a`` (``...linear_attn.``): ``mix_in`` the input's four products
    fused (queries, keys and values as convolved; then the output gate ``z``; ``b``, beta's;
    ``a``, the decay's), ``conv [conv_dim, kernel]``, ``decay`` ``-exp(A_log)`` (float32) and
    ``dt_bias``, as transformers computes ``g``, ``gate_norm`` (the output's norm, of plain
    weight) and ``mix_out``. Qwen3-Next stores the products grouped per key head
    (``in_proj_qkvz``, ``in_proj_ba``): they are reordered into Qwen3.5's layout."""
    if a + "in_proj_qkvz.weight" in r:
        per = net.v_heads // net.k_heads  # value heads per key head
        qkvz = r.get(a + "in_proj_qkvz.weight").view(net.k_heads, -1, r.get(a + "out_proj.weight").shape[0])
        q, k, v, z = qkvz.split([net.k_dim, net.k_dim, per * net.v_dim, per * net.v_dim], dim=1)
        ba = r.get(a + "in_proj_ba.weight").view(net.k_heads, 2 * per, -1)
        b, a_ = ba.split([per, per], dim=1)
        parts = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a_)]
    else:
        parts = [r.get(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
    return {
        "mix_in": r.linear(torch.cat(parts), None),
        "conv": r.get(a + "conv1d.weight")[:, 0],  # [conv_dim, kernel]
        "decay": -torch.exp(r.get(a + "A_log").float()),  # [v_heads], A_log as the model's dtype holds it
        "dt_bias": r.get(a + "dt_bias"),  # [v_heads]
        "gate_norm": r.get(a + "norm.weight"),  # [v_dim]
        "mix_out": r.linear(r.get(a + "out_proj.weight"), None),
    }


@dataclass
class StatePlan:
    """Where one forward's states go (device tensors, built on the host): ``valid [B, T]``
    the rows' real tokens (padding leaves a state as it is); ``last [B]`` each row's count of
    them; ``ring [B, T or 1]`` the ring row of the state before each token (or before the
    forward alone: ``every`` False), ``depth`` (a spare row) for padding."""

    valid: torch.Tensor
    last: torch.Tensor
    ring: torch.Tensor
    every: bool


class RecurrentStates:
    """Each slot's states per DeltaNet layer, after its ``lengths`` tokens (``conv [layers,
    slots, conv_dim, kernel - 1]`` in the model's dtype, ``ssm [layers, slots, v_heads,
    k_dim, v_dim]`` in float32), and the ring of earlier ones (``ring_conv``, ``ring_ssm``:
    ``depth + 1`` rows, the last for padding); ``held[slot][row]`` is the position a ring row
    holds (-1: none). Slots are allocated up to the highest one used."""

    def __init__(self, layers: int, net: DeltaNet, depth: int, device: torch.device, dtype: torch.dtype):
        self.net, self.depth = net, depth
        self.conv = torch.zeros(layers, 0, net.conv_dim, net.kernel - 1, device=device, dtype=dtype)
        self.ssm = torch.zeros(layers, 0, net.v_heads, net.k_dim, net.v_dim, device=device, dtype=torch.float32)
        self.ring_conv = torch.zeros(layers, 0, depth + 1, *self.conv.shape[2:], device=device, dtype=dtype)
        self.ring_ssm = torch.zeros(layers, 0, depth + 1, *self.ssm.shape[2:], device=device, dtype=torch.float32)
        self.held: list[list[int]] = []

    def ensure(self, slots: int) -> None:
        have = self.conv.shape[1]
        if slots <= have:
            return
        for name in ("conv", "ssm", "ring_conv", "ring_ssm"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], slots, *old.shape[2:])
            new[:, :have] = old
            setattr(self, name, new)
        self.held += [[-1] * self.depth for _ in range(slots - have)]

    def plan(self, slots: list[int], starts: list[int], counts: list[int], T: int) -> StatePlan:
        """The plan of a forward of ``counts[b]`` tokens into ``slots[b]`` after ``starts[b]``
        (``T``: the padded width), its ring rows marked held."""
        self.ensure(max(slots) + 1)
        every = T <= self.depth
        ring = torch.full((len(slots), T if every else 1), self.depth, dtype=torch.long)
        for b, (slot, start, n) in enumerate(zip(slots, starts, counts)):
            for j in range(n if every else min(n, 1)):
                ring[b, j] = (start + j) % self.depth
                self.held[slot][(start + j) % self.depth] = start + j
        valid = torch.arange(T)[None, :] < torch.tensor(counts)[:, None]
        dev = self.conv.device
        return StatePlan(valid.to(dev), torch.tensor(counts, device=dev), ring.to(dev), every)

    @torch.inference_mode()
    def rewind(self, slot: int, length: int, current: int) -> None:
        """Slot ``slot``'s states after its first ``length`` tokens (it holds ``current``)."""
        if length == current or slot >= len(self.held):
            return
        held = self.held[slot]
        if length == 0:
            self.conv[:, slot] = 0
            self.ssm[:, slot] = 0
        else:
            row = length % self.depth
            if held[row] != length:
                raise RuntimeError(f"a recurrent state cannot go back {current - length} tokens to {length}: "
                                   f"it keeps the states of its last {self.depth} tokens, and not {length}'s")
            self.conv[:, slot] = self.ring_conv[:, slot, row]
            self.ssm[:, slot] = self.ring_ssm[:, slot, row]
        self.held[slot] = [p if p <= length else -1 for p in held]


def delta_net(states: RecurrentStates, li: int, slots: torch.Tensor, plan: StatePlan, L: dict,
              a: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet layer ``li`` (its index among them) over ``a [B, T, hidden]`` (its input, normed)
    for the rows of ``slots [B]``: advances their states and returns ``[B, T, hidden]``, as
    transformers' Qwen3.5 computes it (the rule in float32; queries and keys L2-normed, the
    queries scaled by ``k_dim ** -0.5``; the output normed, then gated by ``silu(z)``)."""
    net, (B, T, _) = states.net, a.shape
    mixed, z, b, g_in = L["mix_in"](a).split([net.conv_dim, net.value_width, net.v_heads, net.v_heads], dim=-1)
    # the short convolution over the slot's last inputs and the new ones: [B, conv_dim, K - 1 + T]
    seq = torch.cat([states.conv[li, slots], mixed.transpose(1, 2).to(states.conv.dtype)], dim=-1)
    conv = F.silu(F.conv1d(seq, L["conv"][:, None], groups=net.conv_dim))  # [B, conv_dim, T]
    windows = seq.unfold(-1, net.kernel - 1, 1)  # [B, conv_dim, T + 1, K - 1]: after 0..T tokens
    q, k, v = conv.transpose(1, 2).to(a.dtype).split([net.k_heads * net.k_dim] * 2 + [net.value_width], dim=-1)
    per = net.v_heads // net.k_heads
    q = q.reshape(B, T, net.k_heads, net.k_dim).repeat_interleave(per, dim=2).float()  # [B, T, Hv, dk]
    k = k.reshape(B, T, net.k_heads, net.k_dim).repeat_interleave(per, dim=2).float()
    v = v.reshape(B, T, net.v_heads, net.v_dim).float()  # [B, T, Hv, dv]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)  # L2-normed (FLA's eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    valid = plan.valid[:, :, None]  # [B, T, 1]: padding neither decays the state nor writes to it
    beta = torch.where(valid, b.sigmoid().float(), 0.0)  # [B, T, Hv]
    g = torch.where(valid, L["decay"] * F.softplus(g_in.float() + L["dt_bias"]), 0.0)
    state, scale = states.ssm[li, slots], net.k_dim ** -0.5  # [B, Hv, dk, dv]
    if plan.every:  # token by token, keeping the state before each
        before, outs = [], []
        for t in range(T):
            before.append(state)
            state = state * g[:, t].exp()[..., None, None]
            kt = k[:, t, :, None, :]  # [B, Hv, 1, dk]
            delta = (v[:, t] - (kt @ state)[:, :, 0]) * beta[:, t, :, None]  # [B, Hv, dv]
            state = state + kt.transpose(-1, -2) @ delta[:, :, None, :]
            outs.append((q[:, t, :, None, :] * scale @ state)[:, :, 0])  # [B, Hv, dv]
        o = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
        states.ring_ssm[li, slots[:, None], plan.ring] = torch.stack(before, dim=1)  # [B, T, Hv, dk, dv]
        states.ring_conv[li, slots[:, None], plan.ring] = windows[:, :, :T].transpose(1, 2)
    else:  # a prompt: the rule in chunks (transformers' own), keeping the state it started from
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        states.ring_ssm[li, slots[:, None], plan.ring] = state[:, None]
        states.ring_conv[li, slots[:, None], plan.ring] = windows[:, :, :1].transpose(1, 2)
        o, state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                output_final_state=True)  # (it scales the queries)
        o = o.float()
    states.ssm[li, slots] = state
    states.conv[li, slots] = windows[torch.arange(B, device=a.device), :, plan.last]  # after each row's tokens
    o = rms_norm(o.to(a.dtype), L["gate_norm"], eps) * F.silu(z.view(B, T, net.v_heads, net.v_dim).float())
    return L["mix_out"](o.to(a.dtype).reshape(B, T, net.value_width))

"""Layers with a recurrent state for the torch runtime: the Gated DeltaNet layers of Qwen3-Next,
Qwen3.5, OLMo-Hybrid and Lara and the Kimi Delta Attention of Kimi Linear and Ling 3 (``DeltaNet``), the
Mamba-2 layers of Granite 4.0's hybrids, Bamba, Nemotron-H, Falcon-H1 and Mamba-2 (``Mamba2``), the
Mamba layers of Mamba, Falcon-Mamba and Jamba (``Mamba1``), RecurrentGemma's RG-LRU (``RGLRU``: a decay
per channel), MiniMax's lightning attention (``Lightning``: Mamba-2's recurrence) and LFM2's short convolutions (``ShortConv``: a conv window, no matrix), and the states they
keep per slot (``RecurrentStates``), which a rewind takes back.

Such a layer keeps no row per token. Each slot holds, per layer, the last ``kernel - 1``
inputs of its short convolution (``conv``) and one matrix per head that every token updates
(``ssm``). DeltaNet's ``[v_heads, k_dim, v_dim]``: the state decays by ``exp(g)``, then moves
towards ``k -> v`` by ``beta`` (``S += beta k (v - k S)``); the token reads ``q S``. Mamba-2's
``[heads, head_dim, d_state]``: the state decays by ``exp(dt A)`` and takes in ``dt x B``; the
token reads ``S C + D x``. Mamba's ``[inner, d_state]``: the same with a decay per channel and
state entry. RG-LRU's ``[width, 1]``: a decay per channel, ``h = a h + u``, the token reads ``h``.

Speculation drops rejected drafts, and a state cannot subtract the tokens it has taken in.
So each slot also keeps a ring of its states *before* each of its last ``depth`` tokens,
the ring row of position ``p`` being ``p % depth`` (SGLang and vLLM keep one state per draft
token the same way). A rewind to length ``L`` copies the ring's state of position ``L`` back.
A Mamba-2 or DeltaNet state is cheaper to recompute than to store per token (``replays``):
its ring keeps the state before each forward and each token's inputs (its decay and the outer
product it adds: ``dt x`` and ``B``, or ``k`` and the rule's correction ``delta``), a forward
runs in closed form (one chunk of the scan, ``delta_chunk``), and a rewind replays the tokens
between the last state kept and ``L``. (Mamba's ring keeps the state before each token.)
A forward of more than ``depth`` tokens (a prompt) takes the chunked form of the rule and
keeps only the state it started from. For prefix reuse, a slot also keeps its states at the
ends of its prompt's chunks (``save``: up to ``PREFIX_STATES`` of them), which a rewind or a
copy to another slot reads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from .ops import cat_or_none, rms_norm

LINEAR_ATTENTION = "linear_attention"  # their name in ``layer_types`` (transformers reads Granite's "mamba" so)
RECURRENT_TYPES = (LINEAR_ATTENTION, "conv", "hybrid")  # (LFM2's; Falcon-H1's, beside attention in every layer)
SCAN_CHUNK = 64  # tokens whose decays and inputs Mamba's scan (``selective_scan``) computes at once
DEFAULT_DEPTH = 18  # ring rows per slot: a rewind of up to 17 tokens (16 drafts and the bonus token)
MAMBA1_ARCHS = ("mamba", "falcon_mamba", "jamba")  # Mamba's selective scan (``Mamba1``); "mamba2": Mamba-2's
# recurrent layers alone, each after one norm (no attention, no MLP): Mamba's, Falcon-Mamba's, Mamba-2's
PURE_RECURRENT = ("mamba", "falcon_mamba", "mamba2")
PREFIX_STATES = 4  # states kept per slot at its prompt chunks' ends, for prefix reuse: the first 3 and the last


def layer_number(prefix: str) -> int:
    """The number of the layer whose weights are under ``prefix`` (``model.layers.{i}.``)."""
    return int(prefix.rstrip(".").rsplit(".", 1)[-1])


def recurrent_mixer(config) -> "DeltaNet | Mamba2 | Mamba1 | RGLRU | ShortConv | None":
    """The recurrent layers' kind of ``config`` (None: it has none)."""
    if not set(RECURRENT_TYPES) & set(getattr(config, "layer_types", None) or ()):
        return None
    if config.model_type == "recurrent_gemma":
        return RGLRU(config.lru_width, config.num_attention_heads, config.conv1d_width)
    if config.model_type == "minimax":
        return Lightning.of(config)
    if config.model_type in ("lfm2", "lfm2_moe", "lfm3"):
        return ShortConv(config.hidden_size, config.conv_L_cache)
    if config.model_type in MAMBA1_ARCHS:
        return Mamba1.of(config)
    return Mamba2.of(config) if hasattr(config, "mamba_n_heads") or config.model_type in ("nemotron_h", "mamba2",
                                                                                          "zamba2") \
        else DeltaNet.of(config)


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's widths: ``k_heads`` query/key heads of ``k_dim``, ``v_heads``
    value heads of ``v_dim`` (each key head serves ``v_heads // k_heads`` consecutive value
    heads), and the convolution's ``kernel``. A state advances as ``S_t = exp(g_t) S_{t-1} +
    k_t delta_t^T`` (``delta_t`` the rule's correction of ``v_t``), so that, as Mamba-2's, its
    ring keeps each token's ``(g, k, delta)`` and the state before a forward, and a rewind
    replays them (``RecurrentStates._replay``). ``kda``: Kimi Delta Attention (``channels``):
    ``g_t`` is a log decay per key channel (``exp(g_t)`` scales the state's rows), from a forget
    gate, and the output's norm is gated by a sigmoid, not by ``silu(z)``; Kimi Linear's
    (``"kimi"``) gates go through low-rank pairs of products, its decays ``-A softplus(f)``;
    Ling's (``"ling"``, ``bailing_hybrid``) are full-rank, its decays ``gate_bound sigmoid(A f)``
    (``kda_safe_gate``; else Kimi's), rounded to the model's dtype."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    beta_scale: float = 1.0  # (OLMo-Hybrid's linear_allow_neg_eigval: beta in [0, 2])
    norm_eps: float | None = None  # the output's norm's (OLMo-Hybrid's 1e-5; else the model's)
    kda: str | None = None  # Kimi Delta Attention's kind: "kimi" or "ling" (None: Gated DeltaNet)
    gate_bound: float | None = None  # (Ling's kda_lower_bound, where kda_safe_gate)
    replays = True  # (not a field)

    @classmethod
    def of(cls, config) -> "DeltaNet":
        if config.model_type in ("kimi_linear", "bailing_hybrid"):  # (as many key heads as value heads, one width)
            H, d = config.linear_num_heads, config.linear_head_dim
            ling = config.model_type == "bailing_hybrid"
            return cls(H, H, d, d, config.linear_conv_kernel_dim, kda="ling" if ling else "kimi",
                       gate_bound=config.kda_lower_bound if ling and config.kda_safe_gate else None)
        olmo = config.model_type == "olmo_hybrid"
        return cls(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   beta_scale=2.0 if olmo and config.linear_allow_neg_eigval else 1.0, norm_eps=1e-5 if olmo else None)

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys and values side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.v_heads, self.k_dim, self.v_dim

    @property
    def channels(self) -> bool:
        """Whether a log decay is per key channel (Kimi Delta Attention's), not per head."""
        return self.kda is not None

    @property
    def decay_width(self) -> int:
        """A token's log decays per head: one, or one per key channel (``channels``)."""
        return self.k_dim if self.channels else 1

    @property
    def input_shape(self) -> tuple[int, int]:
        """A token's inputs to a replay, per value head: its log decay(s) ``g``, key and ``delta``."""
        return self.v_heads, self.decay_width + self.k_dim + self.v_dim

    def projection_params(self, hidden: int) -> int:
        """One layer's linears' weights (``linear.linear_bytes``)."""
        if self.kda == "kimi":  # q, k, v, beta's, and the output's; the gates' low-rank pairs (rank k_dim)
            return hidden * (self.conv_dim + self.v_heads + self.value_width) + \
                2 * self.k_dim * (hidden + self.value_width)
        if self.kda == "ling":  # q, k, v, the two gates, beta's, the output's
            return hidden * (self.conv_dim + 3 * self.value_width + self.v_heads)
        return hidden * (self.conv_dim + 2 * self.value_width + 2 * self.v_heads)

    def weights(self, r, pre: str) -> dict:
        """The weights of the layer under ``pre`` (``...linear_attn.``): ``mix_in`` the input's four products
        fused (queries, keys and values as convolved; then the output gate ``z``; ``b``, beta's;
        ``a``, the decay's), ``conv [conv_dim, kernel]``, ``decay`` ``-exp(A_log)`` (float32) and
        ``dt_bias``, as transformers computes ``g``, ``gate_norm`` (the output's norm, of plain
        weight) and ``mix_out``. Qwen3-Next stores the products grouped per key head
        (``in_proj_qkvz``, ``in_proj_ba``): they are reordered into Qwen3.5's layout; OLMo-Hybrid's
        are apart (``q_proj``... ``g_proj``, the gate; ``o_proj``, ``o_norm``); Lara's fused in one
        (``in_proj``, Qwen3.5's order; its norm ``out_norm``, in float32)."""
        if self.channels:
            return self._kda_weights(r, pre + "self_attn.")
        a = pre + "linear_attn."
        olmo = a + "q_proj.weight" in r
        if olmo:
            parts = [r.get(a + f"{n}_proj.weight") for n in ("q", "k", "v", "g", "b", "a")]
        elif a + "in_proj.weight" in r:  # (Lara's: all four fused, in Qwen3.5's order)
            parts = [r.get(a + "in_proj.weight")]
        elif a + "in_proj_qkvz.weight" in r:
            per = self.v_heads // self.k_heads  # value heads per key head
            qkvz = r.get(a + "in_proj_qkvz.weight").view(self.k_heads, -1, r.get(a + "out_proj.weight").shape[0])
            q, k, v, z = qkvz.split([self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=1)
            ba = r.get(a + "in_proj_ba.weight").view(self.k_heads, 2 * per, -1)
            b, a_ = ba.split([per, per], dim=1)
            parts = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a_)]
        else:
            parts = [r.get(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
        return {
            "mix_in": r.linear(torch.cat(parts), None),
            # [conv_dim, kernel] (OLMo-Hybrid's as released: the queries', keys' and values' apart)
            "conv": (torch.cat([r.get(a + f"{n}_conv1d.weight") for n in "qkv"]) if a + "q_conv1d.weight" in r
                     else r.get(a + "conv1d.weight"))[:, 0],
            "conv_bias": None,
            # [v_heads]: A_log as the model's dtype holds it (OLMo-Hybrid's model holds it in float32)
            "decay": -torch.exp(r.raw(a + "A_log") if olmo else r.get(a + "A_log").float()),
            "dt_bias": r.get(a + "dt_bias"),  # [v_heads]
            # [v_dim] (Lara's, as released ``out_norm``, to float32: its product and gate in float32 too)
            "gate_norm": r.get(a + "o_norm.weight") if olmo else r.get(a + "norm.weight") if a + "norm.weight" in r
            else r.get(a + "out_norm.weight").float(),
            "mix_out": r.linear(r.get(a + ("o_proj.weight" if olmo else "out_proj.weight")), None),
        }

    def _kda_weights(self, r, a: str) -> dict:
        """Kimi Delta Attention's weights under ``a`` (``...self_attn.``), as ``weights``'s:
        ``mix_in`` fuses q, k, v (as convolved: ``q_conv1d``...), the output gate (Kimi's low-rank
        step ``g_a``; Ling's ``g``), the forget gate (``f_a``; ``f``) and beta's ``b``;
        ``gate_b`` and ``forget_b`` Kimi's second steps (``g_b``, ``f_b``); ``A`` ``exp(A_log)
        [heads, 1]``, ``dt_bias [heads, k_dim]`` (float32, as transformers keeps it; Ling's
        convolution too)."""
        kimi = self.kda == "kimi"
        conv = [a + f"{n}_conv1d.weight" for n in "qkv"]
        raw = r.get if kimi else r.raw  # (Ling's kept in float32)
        return {
            "mix_in": r.linear(torch.cat([r.get(a + f"{n}_proj.weight") for n in
                                          ("q", "k", "v", "g_a" if kimi else "g", "f_a" if kimi else "f", "b")]), None),
            "gate_b": r.linear(r.get(a + "g_b_proj.weight"), None) if kimi else None,
            "forget_b": r.linear(r.get(a + "f_b_proj.weight"), None) if kimi else None,
            "conv": (torch.cat([raw(n) for n in conv]) if conv[0] in r else raw(a + "conv1d.weight"))[:, 0],
            "conv_bias": None,
            "A": torch.exp(raw(a + "A_log").float()).view(self.v_heads, 1),
            "dt_bias": r.raw(a + "dt_bias").view(self.v_heads, self.k_dim),
            "gate_norm": r.get(a + "o_norm.weight").float(),  # (as the model's dtype holds it; scales in float32)
            "mix_out": r.linear(r.get(a + "o_proj.weight"), None),
        }

    def _gates(self, L: dict, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The input products of ``a [B, T, hidden]``: ``(mixed [B, T, conv_dim], the output's gate
        [B, T, Hv, dv] (its activation applied, float32), beta's logits [B, T, Hv], log decays
        [B, T, Hv, decay_width])``."""
        B, T, _ = a.shape
        if self.channels:
            rank = self.k_dim if self.kda == "kimi" else self.value_width
            mixed, gate, forget, b = L["mix_in"](a).split([self.conv_dim, rank, rank, self.v_heads], dim=-1)
            if L["gate_b"] is not None:  # (Kimi's second steps)
                gate, forget = L["gate_b"](gate), L["forget_b"](forget)
            gate = torch.sigmoid(gate.float())
            g_in = forget.float().view(B, T, self.v_heads, self.k_dim) + L["dt_bias"]
            if self.kda == "kimi":  # (softplus as transformers writes it out)
                g = -L["A"] * torch.where(g_in > 20.0, g_in, torch.log(1.0 + torch.exp(g_in)))  # [B, T, Hv, dk]
            else:
                g = (self.gate_bound * torch.sigmoid(L["A"] * g_in) if self.gate_bound is not None else
                     -L["A"] * F.softplus(g_in)).to(a.dtype).float()
        else:
            mixed, gate, b, g_in = L["mix_in"](a).split([self.conv_dim, self.value_width, self.v_heads, self.v_heads],
                                                        dim=-1)
            gate = F.silu(gate.float())
            g = (L["decay"] * F.softplus(g_in.float() + L["dt_bias"]))[..., None]  # [B, T, Hv, 1]
        return mixed, gate.view(B, T, self.v_heads, self.v_dim), b, g

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        """Layer ``li`` (its index among them) over ``a [B, T, hidden]`` (its input, normed) for
        the rows of ``slots [B]``: advances their states and returns ``[B, T, hidden]``, as
        transformers' Qwen3.5 computes it (the rule in float32; queries and keys L2-normed, the
        queries scaled by ``k_dim ** -0.5``; the output normed, then gated by ``silu(z)``), or
        Kimi Linear (``channels``)."""
        B, T, _ = a.shape
        mixed, gate, b, g = self._gates(L, a)
        conv = convolve(states, li, slots, plan, mixed, L).to(a.dtype)  # [B, T, conv_dim]
        q, k, v = conv.split([self.k_heads * self.k_dim] * 2 + [self.value_width], dim=-1)
        per = self.v_heads // self.k_heads
        q = q.reshape(B, T, self.k_heads, self.k_dim).repeat_interleave(per, dim=2).float()  # [B, T, Hv, dk]
        k = k.reshape(B, T, self.k_heads, self.k_dim).repeat_interleave(per, dim=2).float()
        v = v.reshape(B, T, self.v_heads, self.v_dim).float()  # [B, T, Hv, dv]
        q, k = (l2_norm(t, self.channels) for t in (q, k))
        valid = plan.valid[:, :, None]  # [B, T, 1]: padding neither decays the state nor writes to it
        beta = torch.where(valid, b.sigmoid().float() * self.beta_scale, 0.0)  # [B, T, Hv]
        g = torch.where(valid[..., None], g, 0.0)  # [B, T, Hv, decay_width]
        scale = self.k_dim ** -0.5

        deltas = []  # [B, T, Hv, dv] each: the tokens' corrections, which a rewind replays

        def step(state, t):  # [B, Hv, dk, dv], in place: one token, as transformers' own
            state.mul_(g[:, t].exp()[..., None])
            delta = (v[:, t] - (k[:, t, :, None, :] @ state)[:, :, 0]) * beta[:, t, :, None]  # [B, Hv, dv]
            state.addcmul_(k[:, t, :, :, None], delta[:, :, None, :])
            deltas.append(delta[:, None])
            return (q[:, t, :, None, :] * scale @ state)[:, :, 0]  # [B, Hv, dv]

        def chunked(state):  # a verify's tokens: one chunk in closed form; a prompt's: transformers' own (it
            if plan.every:  # scales the queries)
                o, state, delta = delta_chunk(state, q, k, v, g, beta, scale, plan.tree)
                deltas.append(delta)
                return o, state
            if self.channels:
                from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention as rule
            else:
                from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as rule

            o, state = rule(q, k, v, g=g if self.channels else g[..., 0], beta=beta, initial_state=state,
                            output_final_state=True)
            return o.float(), state

        stepped = T <= 2 and plan.tree is None  # (2 tokens: the steps cost a third of the closed form's products)
        o = scan(states, li, slots, plan, step if stepped else None, chunked)  # [B, T, Hv, dv]
        if plan.every:  # each token's inputs, which a rewind replays
            states.keep_inputs(li, slots, plan, torch.cat([g, k, torch.cat(deltas, 1)], -1))
        o = o.to(a.dtype)  # (Kimi's and Lara's norm and gate in float32 throughout, a float32 weight's; Qwen3.5's
        # norm scales in the model's dtype)
        o = rms_norm(o.float() if L["gate_norm"].dtype == torch.float32 else o, L["gate_norm"], self.norm_eps or eps) \
            * gate
        return L["mix_out"](o.to(a.dtype).reshape(B, T, self.value_width))


def l2_norm(x: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """``x`` L2-normed over its last dimension with FLA's eps inside the root, as transformers' Qwen3.5
    (times the inverse root) or Kimi Linear (``divide``: over the root) rounds it."""
    square = (x * x).sum(-1, keepdim=True) + 1e-6
    return x / torch.sqrt(square) if divide else x * torch.rsqrt(square)


def delta_chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, scale: float, tree: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over a few tokens (``q, k [B, T, H, dk]``, ``v [B, T, H, dv]``, log
    decays ``g [B, T, H, 1 or dk]``: one per head, or one per key channel (Kimi's), ``beta [B,
    T, H]``) from ``state [B, H, dk, dv]``, in closed form: ``(outputs [B, T, H, dv], the state
    after, deltas [B, T, H, dv])``. With ``G`` the decays' running sum, ``exp(g_i) S_{i-1} =
    exp(G_i) S_0 + sum_{j<i} exp(G_i - G_j) k_j delta_j^T`` (per key channel: those scale the
    rows), so that the deltas ``delta_i = beta_i (v_i - k_i^T exp(g_i) S_{i-1})`` solve one unit
    lower-triangular system, and the state is read and written once, not four times a token (5x
    faster for 9 tokens of Qwen3.5's widths on the CPU). A ``tree [B, T, T]`` (each token's
    ancestors and itself, in order) runs each token from its ancestors' states, not the tokens
    before it: ``G`` sums along each one's path; the state after is then the last token's
    path's (``keep`` replays the accepted one's)."""
    B, T, H, _ = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
    seen = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if tree is None else tree[:, None]
    G = g.cumsum(1) if tree is None else (tree.float() @ g.flatten(2)).view_as(g)
    G = G.transpose(1, 2)  # [B, H, T, 1 or dk]
    b = beta.transpose(1, 2)[..., None]  # [B, H, T, 1]
    if G.shape[-1] == 1:  # exp(G_i - G_j) [B, H, T, T] weighs the products
        decay = torch.where(seen, G - G.transpose(-1, -2), float("-inf")).exp()
        kk, qk = (k @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay  # [B, H, T, T]
    else:  # per key channel [B, H, T, T, dk]: inside them
        decay = torch.where(seen[..., None], G[..., :, None, :] - G[..., None, :, :], float("-inf")).exp()
        kk, qk = (torch.einsum("bhic,bhjc,bhijc->bhij", x, k, decay) for x in (k, q))
    eye = torch.eye(T, device=q.device)
    system = eye + b * kk * (1 - eye)  # (kk's diagonal, each key's own, out)
    before = G.exp()  # [B, H, T, 1 or dk]: exp(G_i)
    delta = torch.linalg.solve_triangular(system, b * (v - (k * before) @ state), upper=False, unitriangular=True)
    o = scale * ((q * before) @ state + qk @ delta)  # [B, H, T, dv]
    last = G[..., -1:, :]  # [B, H, 1, 1 or dk]
    state = last.exp().transpose(-1, -2) * state + (k * (last - G).exp()).transpose(-1, -2) @ delta
    return o.transpose(1, 2), state, delta.transpose(1, 2)


@dataclass(frozen=True)
class Mamba2:
    """A Mamba-2 layer's widths (Granite 4.0's hybrids', Bamba's, Nemotron-H's): ``heads`` of ``head_dim``
    channels, each with a ``[head_dim, d_state]`` state; ``groups`` of heads share their ``B``
    and ``C`` (and a group of channels its output norm); the convolution's ``kernel``; the
    chunked scan's ``chunk``; ``dt_limit``, the clamp of a prompt's time steps; ``norm``: where
    the output's norm goes (Falcon-H1's: before the gate, or none)."""

    heads: int
    head_dim: int
    d_state: int
    groups: int
    kernel: int
    chunk: int
    dt_limit: tuple[float, float]
    norm: str = "after"  # the output's grouped norm: of y * silu(z) ("after"), of y before the gate ("before"), none
    norm_eps: float | None = None  # its epsilon (Zamba2's 1e-5, as transformers builds it; else the model's)
    replays = True  # (not a field) its ring keeps each token's inputs: a rewind replays them (``RecurrentStates``)

    @classmethod
    def of(cls, config) -> "Mamba2":
        if config.model_type == "nemotron_h":  # its names; a prompt's time steps clamped from below
            return cls(config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups,
                       config.conv_kernel, config.chunk_size, (config.time_step_min, float("inf")))
        if config.model_type == "mamba2":  # (Mamba-Codestral's)
            return cls(config.num_heads, config.head_dim, config.state_size, config.n_groups, config.conv_kernel,
                       config.chunk_size, tuple(config.time_step_limit))
        if config.model_type == "zamba2":  # its names; a prompt's time steps clamped from below
            return cls(config.n_mamba_heads, config.mamba_headdim, config.mamba_d_state, config.mamba_ngroups,
                       config.mamba_d_conv, config.chunk_size, (config.time_step_min, float("inf")), norm_eps=1e-5)
        head_dim = config.mamba_d_head
        if head_dim == "auto":
            head_dim = config.mamba_expand * config.hidden_size // config.mamba_n_heads
        norm = "after"
        if config.model_type == "falcon_h1":
            norm = ("before" if config.mamba_norm_before_gate else "after") if config.mamba_rms_norm else "none"
        return cls(config.mamba_n_heads, head_dim, config.mamba_d_state, config.mamba_n_groups,
                   config.mamba_d_conv, config.mamba_chunk_size, tuple(config.time_step_limit or (0.0, float("inf"))),
                   norm)

    @property
    def value_width(self) -> int:
        """The inner channels (``mamba_expand * hidden``): x, the gate ``z``, the output."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then ``B`` and ``C`` of each group."""
        return self.value_width + 2 * self.groups * self.d_state

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.heads, self.head_dim, self.d_state

    @property
    def input_shape(self) -> tuple[int, int]:
        """A token's inputs to the state, per head: its decay ``dt A``, ``dt x``, ``B``."""
        return self.heads, 1 + self.head_dim + self.d_state

    def projection_params(self, hidden: int) -> int:
        return hidden * (self.value_width + self.conv_dim + self.heads) + self.value_width * hidden

    def weights(self, r, pre: str) -> dict:
        """The weights of the layer under ``pre`` (``...mamba.``): ``mix_in`` (``in_proj``: the gate ``z``, the
        convolved ``x B C``, then ``dt``), ``conv [conv_dim, kernel]`` and its bias, ``decay``
        ``-exp(A_log)`` (float32), ``dt_bias``, ``skip`` (``D``, float32), ``gate_norm`` (the grouped
        output norm's, of plain weight) and ``mix_out``."""
        a = pre + "mamba."
        return {
            "mix_in": r.linear(r.get(a + "in_proj.weight"), r.opt(a + "in_proj.bias")),
            "conv": r.get(a + "conv1d.weight")[:, 0],  # [conv_dim, kernel]
            "conv_bias": r.opt(a + "conv1d.bias"),
            "decay": -torch.exp(r.get(a + "A_log").float()),  # [heads]
            "dt_bias": r.get(a + "dt_bias"),  # [heads]
            "skip": r.get(a + "D").float(),  # [heads]
            "gate_norm": r.opt(a + "norm.weight"),  # [value_width] (none without a norm)
            "mix_out": r.linear(r.get(a + "out_proj.weight"), r.opt(a + "out_proj.bias")),
        }

    def ssm(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", x: torch.Tensor,
            dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """The state's recurrence over ``x [B, T, H, P]``, time steps ``dt [B, T, H]``, ``decay [H]``,
        ``b, c [B, T, H, N]`` and ``skip [H]`` (float32): the outputs ``[B, T, H, P]``; the tokens'
        inputs kept for a rewind's replay."""
        T = x.shape[1]
        dt = torch.where(plan.valid[:, :, None], dt, 0.0)  # padding neither decays the state nor writes to it
        if plan.every:  # each token's inputs, which a rewind replays
            states.keep_inputs(li, slots, plan, torch.cat(
                [(dt * decay)[..., None], dt[..., None] * x, b], dim=-1))  # [B, T, H, 1 + P + N]

        def step(state, t):  # [B, H, P, N], in place: one token (a draft step), as transformers' own
            state.mul_(torch.exp(dt[:, t] * decay)[..., None, None])
            state.addcmul_((dt[:, t, :, None] * b[:, t])[:, :, None, :], x[:, t, ..., None])
            return (state @ c[:, t, ..., None])[..., 0] + x[:, t] * skip[:, None]  # [B, H, P]

        def chunked(state):  # transformers' scan; a verify's in one chunk: closed form (a tree's: ``mamba2_tree``)
            from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

            if plan.tree is not None:
                return mamba2_tree(state, x, dt, decay, b, c, skip, plan.tree)

            return mamba2_chunk_scan(x, dt, decay, b, c, T if plan.every else self.chunk, D=skip,
                                     initial_states=state, return_final_states=True)

        return scan(states, li, slots, plan, step if T == 1 else None, chunked)

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        """``DeltaNet.forward`` for a Mamba-2 layer, as transformers' Granite 4.0 and Bamba compute
        it: the scan in float32; the output ``y * silu(z)`` normed per group of channels."""
        B, T, _ = a.shape
        H, P, N, G = self.heads, self.head_dim, self.d_state, self.groups
        z, mixed, dt = L["mix_in"](a).split([self.value_width, self.conv_dim, H], dim=-1)
        conv = convolve(states, li, slots, plan, mixed, L).to(a.dtype)  # [B, T, conv_dim]
        x, b, c = conv.split([self.value_width, G * N, G * N], dim=-1)
        x = x.reshape(B, T, H, P).float()
        b = b.reshape(B, T, G, N).repeat_interleave(H // G, dim=2).float()  # [B, T, H, N]
        c = c.reshape(B, T, G, N).repeat_interleave(H // G, dim=2).float()
        dt = F.softplus(dt.float() + L["dt_bias"].float())  # [B, T, H]
        if not plan.every:  # a prompt's time steps clamped, as transformers' scan (not its one-token step)
            dt = dt.clamp(*self.dt_limit)
        y = self.ssm(states, li, slots, plan, x, dt, L["decay"], b, c, L["skip"]).reshape(B, T, G, -1)  # [B, T, G, ...]
        gate = F.silu(z.float()).view(B, T, G, -1)
        if self.norm != "before":
            y = y * gate
        if self.norm != "none":
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + (self.norm_eps or eps))
            y = L["gate_norm"].view(G, -1) * y.to(a.dtype)
        if self.norm == "before":
            y = y * gate
        return L["mix_out"](y.reshape(B, T, -1).to(a.dtype))


@dataclass(frozen=True)
class Lightning(Mamba2):
    """MiniMax's lightning attention: linear attention whose state ``[heads, head_dim, head_dim]``
    decays by a constant per head and layer (``exp(-slope)``) and takes in ``v k^T``; the token reads
    ``S q`` (its own ``k^T v`` included). That is Mamba-2's recurrence with ``dt`` 1, ``x`` = v, ``B``
    = k, ``C`` = q, no skip, a group per head and no convolution (``ssm``: its scans, rewinds and
    trees). Its q, k and v are silu of one product (per head side by side); its output, normed over
    every head, times the sigmoid of a gate of the layer's input, through ``out_proj``."""

    layers: int = 1  # the model's (each layer's decays: ``slopes``)

    @classmethod
    def of(cls, config) -> "Lightning":
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        H = config.num_attention_heads
        return cls(H, d, d, H, 1, config.block_size, (0.0, float("inf")), "none", layers=config.num_hidden_layers)

    @property
    def conv_dim(self) -> int:
        return 0  # (no convolution: a window of nothing)

    def projection_params(self, hidden: int) -> int:
        return hidden * 4 * self.value_width + self.value_width * hidden

    def slopes(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s decay rates per head ``[heads]`` (ALiBi's slopes, smaller for later
        layers), in float32 as transformers computes them."""
        base = 1 / (2 ** (8 / self.heads))
        rate = base ** (torch.arange(self.heads) + 1)
        return rate * (1 - layer / (self.layers - 1 + 1e-5) + 1e-5)

    def weights(self, r, pre: str) -> dict:
        """The weights of the layer under ``pre`` (``model.layers.{i}.``): ``mix_in`` (``qkv_proj``),
        ``out_gate`` (``output_gate``), ``out_norm``, ``mix_out`` (``out_proj``), and ``decay``, its
        ``-slopes`` as the model's dtype holds them (transformers' buffers)."""
        a = pre + "self_attn."
        slopes = self.slopes(layer_number(pre)).to(device=r.device, dtype=r.dtype).float()
        return {"decay": -slopes, "mix_in": r.linear(r.get(a + "qkv_proj.weight"), None),
                "out_gate": r.linear(r.get(a + "output_gate.weight"), None),
                "out_norm": r.get(a + "norm.weight"),
                "mix_out": r.linear(r.get(a + "out_proj.weight"), None)}

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        """``DeltaNet.forward`` for a lightning attention layer (its decays ``L["decay"] [heads]``,
        ``-slope`` as the model's dtype holds it): the scan in float32, the rest in the model's dtype."""
        B, T, _ = a.shape
        H, d = self.heads, self.head_dim
        q, k, v = F.silu(L["mix_in"](a)).view(B, T, H, 3 * d).float().split(d, dim=-1)  # [B, T, H, d] each
        ones = torch.ones(B, T, H, device=a.device)
        y = self.ssm(states, li, slots, plan, v, ones, L["decay"], k, q, torch.zeros(H, device=a.device))
        y = rms_norm(y.reshape(B, T, H * d).to(a.dtype), None, 1e-6) * L["out_norm"]
        return L["mix_out"](torch.sigmoid(L["out_gate"](a)) * y)


def mamba2_tree(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, skip: torch.Tensor, tree: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's outputs ``[B, T, H, P]`` for a token tree (``tree [B, T, T]``: each token's
    ancestors and itself) from ``state [B, H, P, N]``, in closed form: token i's state is
    ``exp(G_i) S_0 + sum_j exp(G_i - G_j) dt_j x_j B_j^T`` over its path (``G``: the log
    decays ``dt A`` summed along it), read as ``S C_i + D x_i``; and the last token's state
    (a chain's, in a batch beside trees; a tree's accepted path's is ``keep``'s)."""
    G = (tree.float() @ (dt * decay)).transpose(1, 2)  # [B, H, T]
    along = torch.where(tree[:, None], G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [B, H, T, T]
    ct, bt, dx = c.transpose(1, 2), b.transpose(1, 2), (dt[..., None] * x).transpose(1, 2)  # [B, H, T, N or P]
    y = G.exp()[..., None] * (ct @ state.transpose(-1, -2)) + ((ct @ bt.transpose(-1, -2)) * along) @ dx
    last = G[..., -1].exp()[..., None, None] * state + (dx * along[..., -1, :, None]).transpose(-1, -2) @ bt
    return y.transpose(1, 2) + x * skip[:, None], last  # [B, T, H, P], [B, H, P, N]


@dataclass(frozen=True)
class Mamba1:
    """A Mamba (selective scan) layer's widths (Mamba's, Falcon-Mamba's, Jamba's): ``inner``
    channels, each with a state of ``d_state`` and its own decays (``A [inner, d_state]``, where
    Mamba-2's heads share one); ``dt_rank``, the time step's low-rank width; the convolution's
    ``kernel``; ``norm_eps``: dt, B and C RMS-normed (Falcon-Mamba's without weights, Jamba's
    with them; None: not normed)."""

    inner: int
    d_state: int
    dt_rank: int
    kernel: int
    norm_eps: float | None = None
    replays = False  # (not a field) its ring keeps the state before each token

    @classmethod
    def of(cls, config) -> "Mamba1":
        if config.model_type == "jamba":
            return cls(config.mamba_expand * config.hidden_size, config.mamba_d_state, config.mamba_dt_rank,
                       config.mamba_d_conv, config.rms_norm_eps)
        return cls(config.intermediate_size, config.state_size, config.time_step_rank, config.conv_kernel,
                   config.mixer_rms_eps if config.model_type == "falcon_mamba" else None)

    @property
    def conv_dim(self) -> int:
        return self.inner

    @property
    def value_width(self) -> int:
        return self.inner

    @property
    def state_shape(self) -> tuple[int, int]:
        return self.inner, self.d_state

    @property
    def input_shape(self) -> tuple[int]:
        """A tree's token's inputs, which ``keep`` runs along the accepted path: its ``dt``, ``x``, ``B``."""
        return (2 * self.inner + self.d_state,)

    def projection_params(self, hidden: int) -> int:
        return hidden * 3 * self.inner + self.inner * (2 * self.dt_rank + 2 * self.d_state)

    def weights(self, r, pre: str) -> dict:
        """The weights of the layer under ``pre`` (``...mamba.``): ``mix_in`` (``in_proj``: x, then
        the gate ``z``), ``conv [inner, kernel]`` and its bias, ``x_proj`` (dt's low rank, B, C),
        ``dt_proj`` and its bias (float32), ``decay`` ``-exp(A_log)`` ``[inner, d_state]`` and
        ``skip`` (``D``), float32, the norms of dt, B and C (Jamba's; None: of no weight) and
        ``mix_out``."""
        a = pre + "mamba."
        return {
            "mix_in": r.linear(r.get(a + "in_proj.weight"), r.opt(a + "in_proj.bias")),
            "conv": r.get(a + "conv1d.weight")[:, 0],  # [inner, kernel]
            "conv_bias": r.opt(a + "conv1d.bias"),
            "x_proj": r.linear(r.get(a + "x_proj.weight"), None),
            "dt_proj": r.linear(r.get(a + "dt_proj.weight"), None),
            "dt_bias": r.get(a + "dt_proj.bias").float(),  # [inner]
            "decay": -torch.exp(r.get(a + "A_log").float()),  # [inner, d_state]
            "skip": r.get(a + "D").float(),  # [inner]
            "dt_norm": r.opt(a + "dt_layernorm.weight"),
            "b_norm": r.opt(a + "b_layernorm.weight"),
            "c_norm": r.opt(a + "c_layernorm.weight"),
            "mix_out": r.linear(r.get(a + "out_proj.weight"), r.opt(a + "out_proj.bias")),
        }

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        """``DeltaNet.forward`` for a Mamba layer, as transformers' Mamba computes it: each
        token's ``dt, B, C`` from its convolved input (``x_proj``), the scan in float32, the
        output ``(y + D x) * silu(z)``."""
        N = self.d_state
        x, z = L["mix_in"](a).chunk(2, dim=-1)  # [B, T, inner] each
        x = convolve(states, li, slots, plan, x, L).to(a.dtype)
        dt, b, c = L["x_proj"](x).split([self.dt_rank, N, N], dim=-1)
        if self.norm_eps is not None:
            dt, b, c = (rms_norm(t, L[n], self.norm_eps) for t, n in zip((dt, b, c), ("dt_norm", "b_norm", "c_norm")))
        dt = F.softplus(L["dt_proj"](dt).float() + L["dt_bias"])  # [B, T, inner]
        dt = torch.where(plan.valid[:, :, None], dt, 0.0)  # padding neither decays the state nor writes to it
        x, b, c = x.float(), b.float(), c.float()

        if plan.tree is not None:  # a tree's tokens' inputs, which ``keep`` runs its path with
            states.node_inputs[li] = torch.cat([dt, x, b], dim=-1)

        def chunked(state):  # (a verify's states before each token too, for the ring)
            return selective_scan(x, dt, L["decay"], b, c, L["skip"], state, keep=plan.every, parents=plan.parents)

        y = scan(states, li, slots, plan, None, chunked)  # [B, T, inner]
        return L["mix_out"]((y * F.silu(z.float())).to(a.dtype))


def selective_scan(x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   skip: torch.Tensor, state: torch.Tensor, keep: bool = False,
                   parents: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Mamba's scan over ``T`` tokens: ``x, dt [B, T, C]`` (float32), ``decay [C, N]``, ``b, c
    [B, T, N]``, ``skip [C]``, from ``state [B, C, N]``. Per chunk of tokens, each token's decay
    ``exp(dt A)`` and input ``dt x B`` at once, then one fused product per token (``h = h dA +
    dBx``: the recurrence is cheaper than a closed form, whose cost grows with T squared), then
    the outputs ``h C + D x`` at once. Returns ``(y [B, T, C], the last state)``, and with
    ``keep`` the states before each token ``[B, T, C, N]`` (a verify's, for the ring). A token
    tree (``parents [B, T]``, -1 for none) runs each token from its parent's state (all at once)."""
    B, T, C = x.shape
    ys, kept = [], []
    if parents is not None:
        decays = torch.exp(dt[..., None] * decay)  # [B, T, C, N]
        h = (dt * x)[..., None] * b[:, :, None, :]
        rows = torch.arange(B, device=x.device)
        for t in range(T):
            before = torch.where(parents[:, t, None, None] < 0, state, h[rows, parents[:, t].clamp(min=0)])
            kept.append(before)
            h[:, t].addcmul_(before, decays[:, t])
        y = torch.einsum("btcn,btn->btc", h, c) + x * skip
        return (y, h[:, -1]) + ((torch.stack(kept, dim=1),) if keep else ())
    for s in range(0, T, SCAN_CHUNK):
        e = min(T, s + SCAN_CHUNK)
        decays = torch.exp(dt[:, s:e, :, None] * decay)  # [B, t, C, N]
        h = (dt[:, s:e] * x[:, s:e])[..., None] * b[:, s:e, None, :]  # [B, t, C, N]: each token's input, then its state
        if keep:
            kept += [state[:, None], h[:, :-1]]  # (h's rows: the states after each token, once the loop has run)
        for t in range(e - s):
            state = h[:, t].addcmul_(state, decays[:, t])
        ys.append(torch.einsum("btcn,btn->btc", h, c[:, s:e]))
    return (torch.cat(ys, dim=1) + x * skip, state) + ((torch.cat(kept, dim=1),) if keep else ())


@dataclass(frozen=True)
class ShortConv:
    """LFM2's convolution layer: ``B, C, x = in_proj(input)``, then ``C * conv(B * x)`` (a
    causal depthwise convolution of ``kernel``, no activation) through ``out_proj``. Its state
    is the convolution's window alone (no matrix: ``state_shape`` ``()``)."""

    conv_dim: int
    kernel: int
    replays = False
    state_shape = ()

    def projection_params(self, hidden: int) -> int:
        return 4 * hidden * hidden

    def weights(self, r, pre: str) -> dict:
        a = pre + "conv."
        return {
            "mix_in": r.linear(r.get(a + "in_proj.weight"), r.opt(a + "in_proj.bias")),
            "conv": r.get(a + "conv.weight")[:, 0],  # [hidden, kernel]
            "conv_bias": r.opt(a + "conv.bias"),
            "mix_out": r.linear(r.get(a + "out_proj.weight"), r.opt(a + "out_proj.bias")),
        }

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        b, c, x = L["mix_in"](a).chunk(3, dim=-1)  # [B, T, hidden] each
        return L["mix_out"](c * convolve(states, li, slots, plan, b * x, L, act=None).to(a.dtype))


@dataclass(frozen=True)
class RGLRU:
    """RecurrentGemma's recurrent block (Griffin's): ``width`` channels, each with a state of one
    number, gated per block of ``width / heads`` channels (block-diagonal products), and the
    convolution's ``kernel``. Its input ``x`` and gate branch ``y`` from the layer's input; ``x``
    convolved; from it, per token, an input gate ``i`` and a decay ``a = exp(-8 r softplus(L))``
    (``r`` the recurrence gate); the state takes ``h = a h + sqrt(1 - a^2) i x`` (at a sequence's
    first token ``i x``), in float32; the output ``h gelu(y)``. Its ring keeps the state before each
    token, as Mamba's; a tree's tokens' ``(a, u)`` go to ``RecurrentStates.node_inputs``."""

    width: int
    heads: int
    kernel: int
    replays = False  # (not a field)

    @property
    def conv_dim(self) -> int:
        return self.width

    @property
    def value_width(self) -> int:
        return self.width

    @property
    def state_shape(self) -> tuple[int, int]:
        return self.width, 1

    @property
    def input_shape(self) -> tuple[int]:
        """A tree's token's decay and input ``(a, u)``, which ``keep`` runs along the accepted path."""
        return (2 * self.width,)

    def projection_params(self, hidden: int) -> int:
        return 3 * hidden * self.width

    def weights(self, r, pre: str) -> dict:
        """The weights of the block under ``pre`` (``model.layers.{i}.``): ``mix_in`` (``linear_x``, then
        ``linear_y``, with their biases), ``conv [width, kernel]`` and its bias, the gates' block-diagonal
        products ``gates [2, heads, block, block]`` (the input's, the recurrence's) and their biases
        ``[2, heads, block]``, ``softplus(recurrent_param)`` (in the model's dtype) and ``mix_out``."""
        a = pre + "temporal_block."
        lru = a + "rg_lru."
        return {
            "mix_in": r.linear(torch.cat([r.get(a + "linear_x.weight"), r.get(a + "linear_y.weight")]),
                               cat_or_none([r.opt(a + "linear_x.bias"), r.opt(a + "linear_y.bias")])),
            "conv": r.get(a + "conv_1d.weight")[:, 0],  # [width, kernel]
            "conv_bias": r.opt(a + "conv_1d.bias"),
            "gates": torch.stack([r.get(lru + "input_gate_weight"), r.get(lru + "recurrent_gate_weight")]),
            "gate_bias": torch.stack([r.get(lru + "input_gate_bias"), r.get(lru + "recurrent_gate_bias")]),
            "softplus": F.softplus(r.get(lru + "recurrent_param")),  # [width]
            "mix_out": r.linear(r.get(a + "linear_out.weight"), r.opt(a + "linear_out.bias")),
        }

    def forward(self, states: "RecurrentStates", li: int, slots: torch.Tensor, plan: "StatePlan", L: dict,
                a: torch.Tensor, eps: float) -> torch.Tensor:
        """``DeltaNet.forward`` for an RG-LRU block, as transformers' RecurrentGemma computes it: the
        gates and decays in the model's dtype, the recurrence in float32."""
        B, T, C = a.shape[0], a.shape[1], self.width
        x, y = L["mix_in"](a).chunk(2, dim=-1)  # [B, T, width] each
        x = convolve(states, li, slots, plan, x, L, act=None).to(a.dtype)
        blocks = x.reshape(B * T, self.heads, -1).transpose(0, 1)  # [heads, B T, block]
        gate_in, gate_a = (torch.sigmoid(torch.baddbmm(L["gate_bias"][k][:, None], blocks, L["gates"][k])
                                         .transpose(0, 1).reshape(B, T, C)) for k in (0, 1))
        log_a = -8.0 * gate_a * L["softplus"]  # [B, T, width]
        first = (plan.first[:, None] & (torch.arange(T, device=a.device) == 0))[..., None]  # [B, T, 1]: position 0
        scale = torch.where(first, 1.0, torch.sqrt(1 - torch.exp(2 * log_a))).to(a.dtype)
        valid = plan.valid[:, :, None]
        decay = torch.where(valid, torch.exp(log_a).float(), 1.0)  # [B, T, width] (padding keeps the state)
        u = torch.where(valid, (x * gate_in * scale).float(), 0.0)
        if plan.tree is not None:  # a tree's tokens' inputs, which ``keep`` runs its path with
            states.node_inputs[li] = torch.cat([decay, u], dim=-1)
        h = scan(states, li, slots, plan, None, lambda state: lru_scan(decay, u, state, plan.every, plan.parents))
        return L["mix_out"](h.to(a.dtype) * F.gelu(y, approximate="tanh"))


def lru_scan(decay: torch.Tensor, u: torch.Tensor, state: torch.Tensor, keep: bool = False,
             parents: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """RG-LRU's recurrence ``h_t = a_t h_{t-1} + u_t`` over ``decay, u [B, T, C]`` (float32) from
    ``state [B, C, 1]``: ``(h [B, T, C], the last state)``, with ``keep`` the states before each token
    ``[B, T, C, 1]``; a token tree (``parents [B, T]``, -1 for none) runs each token from its parent's."""
    B, T, _ = u.shape
    h, kept, s = u.clone(), [], state[..., 0]  # h: each token's input, then its state
    rows = torch.arange(B, device=u.device)
    for t in range(T):
        if parents is not None:
            s = torch.where(parents[:, t, None] < 0, state[..., 0], h[rows, parents[:, t].clamp(min=0)])
        kept.append(s)
        s = h[:, t].addcmul_(s, decay[:, t])
    return (h, h[:, -1, :, None]) + ((torch.stack(kept, dim=1)[..., None],) if keep else ())


@dataclass
class StatePlan:
    """Where one forward's states go (device tensors, built on the host): ``valid [B, T]``
    the rows' real tokens (padding leaves a state as it is); ``last [B]`` each row's count of
    them; ``ring [B, T or 1]`` each token's ring row (or the first's alone: ``every`` False, a
    prompt), where its conv window and the state before it go (``replays``: its inputs, and
    the state only before the first), ``depth`` (a spare row) for padding. A token tree's
    forward (``RecurrentStates.plan``'s masks): ``tree [B, T, T]`` which tokens each one sees,
    its ancestors and itself (None: a chain each); ``window [B, T, kernel]`` each token's
    convolution window as columns of the slot's last inputs then the forward's tokens; ``parents
    [B, T]`` each token's last ancestor (-1: none; Mamba's scan steps from its state); a tree's
    tokens but the first go to the spare ring row, their windows and inputs to
    ``RecurrentStates.nodes`` (the tokens' convolution inputs, and their inputs to a replay or
    to Mamba's scan) until ``keep`` takes the accepted path's."""

    valid: torch.Tensor
    last: torch.Tensor
    ring: torch.Tensor
    every: bool
    first: torch.Tensor  # [B] the rows whose first token is their sequence's (position 0: RG-LRU's reset)
    tree: torch.Tensor | None = None
    window: torch.Tensor | None = None
    parents: torch.Tensor | None = None


class RecurrentStates:
    """Each slot's states per recurrent layer (``mixer``'s kind), after its ``lengths`` tokens
    (``conv [layers, slots, conv_dim, kernel - 1]`` in the model's dtype, ``ssm [layers, slots,
    *state_shape]`` in float32, as transformers keeps them), and the ring of earlier ones (``ring_conv``, ``ring_ssm``:
    ``depth + 1`` rows, the last for padding); ``held[slot][row]`` is the position a ring row
    holds (-1: none); ``saved[slot]``: position -> ``(conv, ssm)`` after it, a prompt chunk's
    end (``save``: where the engine reuses prefixes). Slots are allocated up to the highest one
    used."""

    def __init__(self, layers: int, mixer: DeltaNet | Mamba2 | Mamba1 | ShortConv, depth: int, device: torch.device,
                 dtype: torch.dtype, decays: torch.Tensor | None = None):
        self.depth = depth
        self.decays = decays  # [layers, C, N]: Mamba's ``A``, which ``keep`` runs a tree's path with
        self.lru = isinstance(mixer, RGLRU)
        self.input_shape = getattr(mixer, "input_shape", None)
        self.conv = torch.zeros(layers, 0, mixer.conv_dim, mixer.kernel - 1, device=device, dtype=dtype)
        self.ssm = torch.zeros(layers, 0, *mixer.state_shape, device=device, dtype=torch.float32)
        self.ring_conv = torch.zeros(layers, 0, depth + 1, *self.conv.shape[2:], device=device, dtype=dtype)
        self.ring_ssm = torch.zeros(layers, 0, depth + 1, *self.ssm.shape[2:], device=device, dtype=torch.float32)
        self.held: list[list[int]] = []
        self.replays = mixer.replays
        if self.replays:  # each token's inputs (``fed[slot][row]``: whose), and states only before forwards
            self.ring_inputs = torch.zeros(layers, 0, depth + 1, *mixer.input_shape, device=device, dtype=torch.float32)
            self.fed: list[list[int]] = []
        self.saved: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        self.nodes: dict[int, int] = {}  # a tree forward's slots -> their rows in ``node_conv`` / ``node_inputs``

    def ensure(self, slots: int) -> None:
        have = self.conv.shape[1]
        if slots <= have:
            return
        for name in ("conv", "ssm", "ring_conv", "ring_ssm") + ("ring_inputs",) * self.replays:
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], slots, *old.shape[2:])
            new[:, :have] = old
            setattr(self, name, new)
        self.held += [[-1] * self.depth for _ in range(slots - have)]
        self.saved += [{} for _ in range(slots - have)]
        if self.replays:
            self.fed += [[-1] * self.depth for _ in range(slots - have)]

    def plan(self, slots: list[int], starts: list[int], counts: list[int], T: int,
             masks: list[torch.Tensor | None] | None = None) -> StatePlan:
        """The plan of a forward of ``counts[b]`` tokens into ``slots[b]`` after ``starts[b]``
        (``T``: the padded width), its ring rows marked ``held`` (and ``fed``); ``masks[b]``
        (``[n, n]`` bool, None: a chain): row b's tokens are a tree, each seeing its ancestors,
        whose states ``keep`` then takes along the accepted path: only its first token (the last
        one committed) keeps its state in the ring (its anchor), the others go to ``nodes``."""
        self.ensure(max(slots) + 1)
        if masks is not None and all(m is None for m in masks):
            masks = None
        every = masks is not None or T <= self.depth  # (a tree's tokens, however many, run in one closed form)
        ring = torch.full((len(slots), T if every else 1), self.depth, dtype=torch.long)
        for b, (slot, start, n) in enumerate(zip(slots, starts, counts)):
            tree = masks is not None and masks[b] is not None
            for j in range(1 if tree else n if every else min(n, 1)):
                row = ring[b, j] = (start + j) % self.depth
                # the row's conv window is token j's: its state is the one before it, or (``replays``,
                # which keep a state before the first token alone) none
                self.held[slot][row] = start + j if j == 0 or not self.replays else -1
                if self.replays:  # (a prompt's forward overwrites the conv window of its first row)
                    self.fed[slot][row] = start + j if every else -1
        valid = torch.arange(T)[None, :] < torch.tensor(counts)[:, None]
        dev = self.conv.device
        plan = StatePlan(valid.to(dev), torch.tensor(counts, device=dev), ring.to(dev), every,
                         torch.tensor([s == 0 for s in starts], device=dev))
        return plan if masks is None else self._trees(plan, slots, counts, T, masks)

    def _trees(self, plan: StatePlan, slots: list[int], counts: list[int], T: int,
               masks: list[torch.Tensor | None]) -> StatePlan:
        """``plan`` with its rows' trees (``StatePlan.tree``, ``window``, ``parents``; a chain row's
        tokens each see those before it), and ``nodes`` to hold the tree rows' tokens' inputs."""
        K = self.conv.shape[-1] + 1
        seen = torch.ones(T, T, dtype=torch.bool).tril().repeat(len(slots), 1, 1)  # [B, T, T]
        for b, (n, m) in enumerate(zip(counts, masks)):
            if m is not None:
                assert m.shape == (n, n), f"a recurrent state takes a tree in one forward, not {tuple(m.shape)}"
                seen[b, :n, :n] = m
                seen[b, n:] = torch.eye(T, dtype=torch.bool)[n:]  # (padding: itself alone)
        # each token's window: the slot's last K - 1 inputs (columns 0 .. K - 2), then its ancestors and itself
        cols = torch.arange(K - 1 + T).expand(len(slots), T, -1)  # [B, T, K - 1 + T]
        order = torch.cat([torch.ones(len(slots), T, K - 1, dtype=torch.bool), seen], dim=-1)
        ranks = order.flip(-1).cumsum(-1).flip(-1)  # [B, T, K - 1 + T]: columns seen from each on
        window = torch.where(order & (ranks <= K), cols, -1).sort(-1).values[..., -K:]  # [B, T, K]
        parents = torch.where(seen.tril(-1), torch.arange(T), -1).amax(-1)  # [B, T]: the last ancestor (-1: none)
        self.nodes = {slot: b for b, (slot, m) in enumerate(zip(slots, masks)) if m is not None}
        layers, B = self.conv.shape[0], len(slots)
        self.node_conv = self.conv.new_empty(layers, B, self.conv.shape[2], T)  # the tokens' convolution inputs
        self.node_window = window  # (the host's, which ``keep`` indexes)
        if self.input_shape is not None:
            self.node_inputs = self.ssm.new_empty(layers, B, T, *self.input_shape)
        dev = self.conv.device
        return replace(plan, tree=seen.to(dev), window=window.to(dev), parents=parents.to(dev))

    def keep_inputs(self, li: int, slots: torch.Tensor, plan: StatePlan, inputs: torch.Tensor) -> None:
        """Layer ``li``'s tokens' inputs ``[B, T, *input_shape]``, which a rewind replays: in the
        ring (a tree's, in ``nodes`` until ``keep``)."""
        self.ring_inputs[li, slots[:, None], plan.ring] = inputs
        if plan.tree is not None:
            self.node_inputs[li] = inputs

    @torch.inference_mode()
    def keep(self, slot: int, start: int, rows: list[int]) -> None:
        """A tree's accepted path, its tokens ``rows`` (increasing, from its first, ``start``),
        becomes the slot's tokens ``start ..``: their windows and inputs go to the ring, and the
        states after it are the anchor's advanced over them (``_replay``; Mamba's: its scan run
        along the path, keeping the state before each token)."""
        b, n = self.nodes.pop(slot), len(rows)
        assert rows[0] == 0, rows
        path = torch.tensor(rows, device=self.conv.device)
        where = torch.tensor([(start + i) % self.depth for i in range(n)], device=self.conv.device)
        # the slot's inputs before the tree (its root's window), then the tree's [layers, C, K - 1 + T]: the path's windows
        seq = torch.cat([self.ring_conv[:, slot, start % self.depth], self.node_conv[:, b]], dim=-1)
        windows = seq[:, :, self.node_window[b, rows].to(seq.device)]  # [layers, C, n, K]
        self.ring_conv[:, slot, where] = windows[..., :-1].transpose(1, 2)
        self.conv[:, slot] = windows[:, :, -1, 1:]
        if self.replays:
            self.ring_inputs[:, slot, where] = self.node_inputs[:, b, path]
            self.ssm[:, slot] = self._replay(slot, self.ring_ssm[:, slot, start % self.depth], start, start + n)
        elif self.lru or self.decays is not None:  # Mamba's, RG-LRU's: the path run again from its root's
            # state, each state before a token kept; step(i): token i's decay and what it adds [layers, C, N]
            if self.lru:  # (each token's (a, u))
                decay, u = self.node_inputs[:, b, path, :, None].chunk(2, dim=2)  # [layers, n, C, 1] each
                def step(i):
                    return decay[:, i], u[:, i]
            else:  # (its dt, x, B: selective_scan's products, in its order)
                C, N = self.decays.shape[1:]
                dts, xs, bs = self.node_inputs[:, b, path].split([C, C, N], dim=-1)  # [layers, n, C or N]
                def step(i):
                    return torch.exp(dts[:, i, :, None] * self.decays), (dts[:, i] * xs[:, i])[..., None] * bs[:, i, None, :]
            state = self.ring_ssm[:, slot, start % self.depth]  # [layers, C, N]
            for i in range(n):
                self.ring_ssm[:, slot, where[i]] = state
                decays, added = step(i)
                state = added.addcmul(state, decays)
            self.ssm[:, slot] = state
        self.held[slot] = [p if p <= start else -1 for p in self.held[slot]]
        if self.replays:
            self.fed[slot] = [p if p < start + n else -1 for p in self.fed[slot]]
        for i in range(n):
            row = (start + i) % self.depth
            if self.replays:
                self.fed[slot][row] = start + i
            else:  # (LFM2's: its ring's state, a window, before each token)
                self.held[slot][row] = start + i
        self.saved[slot] = {p: v for p, v in self.saved[slot].items() if p <= start + n}

    @torch.inference_mode()
    def save(self, slot: int, position: int) -> None:
        """Keep ``slot``'s states after its ``position`` tokens, a prompt chunk's end (the first
        ``PREFIX_STATES - 1`` such, a shared system prompt's, and the last, a conversation's so
        far)."""
        self.ensure(slot + 1)
        saved = self.saved[slot]
        if position not in saved:
            if len(saved) >= PREFIX_STATES:
                del saved[max(saved)]
            saved[position] = (self.conv[:, slot].clone(), self.ssm[:, slot].clone())

    def holds(self, slot: int, length: int, current: int) -> bool:
        """Whether slot ``slot`` (at ``current`` tokens) can go back to ``length``."""
        return length in (0, current) or slot < len(self.held) and self._kept(slot, length) is not None

    def _kept(self, slot: int, length: int) -> int | None:
        """Where slot ``slot``'s states after ``length`` tokens come from: ``length`` (kept in the
        ring or saved), an earlier position whose state a replay of the tokens since then
        advances to ``length`` (``replays``), or None (not kept)."""
        if self.held[slot][length % self.depth] == length or length in self.saved[slot]:
            return length
        if not self.replays or self.fed[slot][length % self.depth] != length:  # (its conv window: with its inputs)
            return None
        for p in range(length - 1, max(length - self.depth, -1), -1):  # the inputs of p .. length - 1, kept
            if self.fed[slot][p % self.depth] != p:
                return None
            if self.held[slot][p % self.depth] == p or p in self.saved[slot]:
                return p
        return None

    def _at(self, slot: int, length: int, current: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Slot ``slot``'s ``(conv, ssm)`` after ``length`` of its ``current`` tokens (None: zeros)."""
        if length == 0:
            return None
        if length == current:
            return self.conv[:, slot], self.ssm[:, slot]
        p = self._kept(slot, length)
        if p is None:
            raise RuntimeError(f"a recurrent state cannot go back {current - length} tokens to {length}: it keeps the "
                               f"states of its last {self.depth} tokens and of a few prompt chunks' ends, not {length}'s")
        conv, ssm = self._ring(slot, p) if self.held[slot][p % self.depth] == p else self.saved[slot][p]
        if p == length:
            return conv, ssm
        return self._ring(slot, length)[0], self._replay(slot, ssm, p, length)  # (the window before ``length``)

    def _ring(self, slot: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring row of ``position``: the conv window and the state before that token."""
        return self.ring_conv[:, slot, position % self.depth], self.ring_ssm[:, slot, position % self.depth]

    def _replay(self, slot: int, ssm: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Mamba-2's states ``ssm [layers, H, P, N]`` (DeltaNet's ``[layers, H, dk, dv]``) before
        token ``start`` advanced over the tokens ``start .. end - 1`` (their inputs in the ring:
        log decays, one per head or per key channel, then what the state adds, ``dt x`` and ``B``
        or ``k`` and ``delta``), in closed form."""
        rows = torch.tensor([p % self.depth for p in range(start, end)], device=ssm.device)
        inputs = self.ring_inputs[:, slot, rows]  # [layers, n, H, A + P + N]
        P, N = ssm.shape[-2:]
        a, dx, b = inputs.split([inputs.shape[-1] - P - N, P, N], dim=-1)  # a: each token's log decay(s), 1 or P
        after = a.flip(1).cumsum(1).flip(1) - a  # [layers, n, H, 1 or P]: the decay after each token, to the end
        added = torch.einsum("lshp,lshn->lhpn", after.exp() * dx, b)  # [layers, H, P, N]
        return added.addcmul_(torch.exp(a.sum(1))[..., None], ssm)  # (a decay per P: Kimi's, per key channel)

    @torch.inference_mode()
    def rewind(self, slot: int, length: int, current: int) -> None:
        """Slot ``slot``'s states after its first ``length`` tokens (it holds ``current``)."""
        if length == current or slot >= len(self.held):
            return
        self._put(slot, self._at(slot, length, current))
        self.held[slot] = [p if p <= length else -1 for p in self.held[slot]]
        self.saved[slot] = {p: v for p, v in self.saved[slot].items() if p <= length}
        if self.replays:
            self.fed[slot] = [p if p < length else -1 for p in self.fed[slot]]

    @torch.inference_mode()
    def copy(self, src: int, dst: int, length: int, current: int) -> None:
        """Slot ``dst``'s states: ``src``'s after ``length`` of its ``current`` tokens, with the
        prompt chunks' ends it keeps up to there."""
        self.ensure(max(src, dst) + 1)
        self._put(dst, self._at(src, length, current))
        self.held[dst] = [-1] * self.depth
        if self.replays:
            self.fed[dst] = [-1] * self.depth
        self.saved[dst] = {p: v for p, v in self.saved[src].items() if p <= length}

    def _put(self, slot: int, state: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        for mine, theirs in zip((self.conv, self.ssm), state or (0, 0)):
            mine[:, slot] = theirs


def convolve(states: RecurrentStates, li: int, slots: torch.Tensor, plan: StatePlan, mixed: torch.Tensor,
             L: dict, act=F.silu) -> torch.Tensor:
    """Layer ``li``'s short convolution (``L["conv"]``, ``L["conv_bias"]``) over ``mixed [B, T,
    conv_dim]`` after each slot's last inputs, through ``act`` (None: none): ``[B, T, conv_dim]``;
    keeps each slot's window after its tokens, and in the ring the ones before them (``plan``)."""
    B, T, C = mixed.shape
    seq = torch.cat([states.conv[li, slots], mixed.transpose(1, 2).to(states.conv.dtype)], dim=-1)  # [B, C, K - 1 + T]
    if plan.tree is not None:  # each token's window along its ancestors (``StatePlan.window``)
        K = plan.window.shape[-1]
        cols = plan.window[:, None].expand(B, C, T, K).reshape(B, C, T * K)
        windows = seq.gather(2, cols).view(B, C, T, K)  # [B, C, T, K]
        states.node_conv[li] = seq[:, :, K - 1:]
        out = (windows * L["conv"][None, :, None, :]).sum(-1)  # [B, C, T]
        out = out if L["conv_bias"] is None else out + L["conv_bias"][None, :, None]
        out = out if act is None else act(out)
        states.ring_conv[li, slots[:, None], plan.ring] = windows[..., :-1].transpose(1, 2)
        states.conv[li, slots] = windows[torch.arange(B, device=mixed.device), :, plan.last - 1, 1:]
        return out.transpose(1, 2)
    out = F.conv1d(seq.to(L["conv"].dtype), L["conv"][:, None], L["conv_bias"], groups=C)  # [B, C, T]
    out = out if act is None else act(out)
    windows = seq.unfold(-1, states.conv.shape[-1], 1)  # [B, C, T + 1, K - 1]: after 0..T tokens
    states.ring_conv[li, slots[:, None], plan.ring] = windows[:, :, :plan.ring.shape[1]].transpose(1, 2)
    states.conv[li, slots] = windows[torch.arange(B, device=mixed.device), :, plan.last]  # after each row's tokens
    return out.transpose(1, 2)


def scan(states: RecurrentStates, li: int, slots: torch.Tensor, plan: StatePlan,
         step: Callable[[torch.Tensor, int], torch.Tensor] | None,
         chunked: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Layer ``li``'s recurrence over a forward's ``T`` tokens from each slot's state ``[B,
    *state_shape]``: token by token (``step(state, t) -> output [B, ...]``, advancing the state
    in place: a verify is memory-bound on it) keeping the state before each in the ring, or in
    chunks (``chunked(state) -> (outputs [B, T, ...], state)``; no ``step``: always so) keeping
    the one it started from (a prompt's; ``replays``), or the states before each token where it
    returns them too (``[B, T, ...]``: Mamba's verify). Returns the outputs."""
    state = states.ssm[li, slots]  # (a copy)
    if plan.every and step is not None:
        outs = []
        for t in range(plan.valid.shape[1]):
            states.ring_ssm[li, slots, plan.ring[:, t]] = state
            outs.append(step(state, t))
        o = torch.stack(outs, dim=1)  # [B, T, ...]
    else:
        states.ring_ssm[li, slots, plan.ring[:, 0]] = state
        o, state, *before = chunked(state)
        if plan.every and before:
            states.ring_ssm[li, slots[:, None], plan.ring] = before[0]
    states.ssm[li, slots] = state
    return o

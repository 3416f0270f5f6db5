"""The torch runtime's LoRA adapters (``specdec.lora``): which of its products each of PEFT's
module names updates, and a forward's updates, each batch row through its slot's adapter.

Attention's products and the dense MLP's of Llama-style layers take updates (PEFT's names
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``...mlp.{gate,up,down}_proj``, and Phi-3's
fused ``qkv_proj`` / ``gate_up_proj``). specdec computes q, k and v as one product (and gate
and up): an update of one of them adds to its columns of that product.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..lora import LoRAAdapter


@dataclass(frozen=True)
class Part:
    """The columns ``[start, end)`` of a product's output that PEFT's ``module`` computes, of
    ``inputs`` wide inputs."""

    module: str
    start: int
    end: int
    inputs: int


class Adapted:
    """A product whose parts take the active adapters' updates, on their rows: the base
    product, then ``y[rows, :, part] += s (x A^T) B^T`` per part, in float32 (PEFT's)."""

    def __init__(self, base, parts: list[Part], owner: "LoRALayers"):
        self.base, self.parts, self.owner = base, parts, owner

    def __getattr__(self, name):  # the base product's kind, out_features, ...
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, in]
        y = self.base(x)  # [B, T, out]
        for adapter, rows in self.owner.active:
            assert rows is None or x.dim() == 3, "a batch's rows take their own adapters: x must be [B, T, in]"
            xs = x if rows is None else x[rows]
            for part in self.parts:
                w = adapter.modules.get(part.module)
                if w is None:
                    continue
                cols = slice(part.start, part.end)
                if rows is None:
                    y[..., cols] = (y[..., cols].float() + w.delta(xs)).to(y.dtype)
                else:
                    y[rows, :, cols] = (y[rows, :, cols].float() + w.delta(xs)).to(y.dtype)
        return y


class LoRALayers:
    """A runtime's adapters: ``targets`` (PEFT's module name -> its ``Part``), at most
    ``max_loras`` adapters held on the device at once (the least recently taken one that no
    request holds makes room), and ``active``, a forward's ``(adapter, batch rows)``
    (None: every row), set by ``select``."""

    def __init__(self, runtime, max_loras: int):
        self.device, self.max_loras = runtime.device, max_loras
        self.targets: dict[str, Part] = {}
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # id -> adapter on the device, least recent first
        self.holders: dict[int, int] = {}  # id -> requests holding it
        self.active: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        H, KV, D = runtime.num_heads, runtime.kv_heads, runtime.head_dim
        hidden = runtime.embed.shape[-1]
        plain = runtime.latent is None and runtime.altup is None and runtime.hc is None
        for i, L in enumerate(runtime.layers):
            pre = f"model.layers.{i}."
            parts: dict[str, list[Part]] = {}
            qkv, o = L.get("qkv"), L.get("o")
            if plain and qkv is not None and o is not None and "moa" not in L and L.get("heads") is None \
                    and qkv.out_features == (H + 2 * KV) * D:
                a = pre + "self_attn."
                parts["qkv"] = [Part(a + "q_proj", 0, H * D, hidden), Part(a + "k_proj", H * D, (H + KV) * D, hidden),
                                Part(a + "v_proj", (H + KV) * D, (H + 2 * KV) * D, hidden),
                                Part(a + "qkv_proj", 0, qkv.out_features, hidden)]
                parts["o"] = [Part(a + "o_proj", 0, o.out_features, H * D)]
            gate_up, down = L.get("gate_up"), L.get("down")
            if plain and gate_up is not None and down is not None and L.get("experts") is None \
                    and "mix_in" not in L and "linear" not in L:
                m, width = pre + "mlp.", gate_up.out_features
                if runtime.family.gated_mlp:
                    parts["gate_up"] = [Part(m + "gate_proj", 0, width // 2, hidden),
                                        Part(m + "up_proj", width // 2, width, hidden),
                                        Part(m + "gate_up_proj", 0, width, hidden)]
                    inner = width // 2
                else:
                    parts["gate_up"], inner = [Part(m + "up_proj", 0, width, hidden)], width
                parts["down"] = [Part(m + "down_proj", 0, down.out_features, inner)]
            for key, ps in parts.items():
                L[key] = Adapted(L[key], ps, self)
                self.targets.update((p.module, p) for p in ps)

    def check(self, adapter: LoRAAdapter) -> None:
        """``ValueError`` unless each of the adapter's modules is a product here, of its shape."""
        name = adapter.request.lora_name
        for module, w in adapter.modules.items():
            part = self.targets.get(module)
            if part is None:
                known = sorted({t.rsplit(".", 1)[-1] for t in self.targets})
                raise ValueError(f"LoRA {name!r}: {module} is not a product specdec adapts on this model (it adapts "
                                 f"{', '.join(known) or 'none'} of attention and dense MLP layers)")
            if w.A.shape[1] != part.inputs or w.B.shape[0] != part.end - part.start:
                raise ValueError(f"LoRA {name!r}: {module}'s update is {w.B.shape[0]} x {w.A.shape[1]}, the model's "
                                 f"product {part.end - part.start} x {part.inputs}: not an adapter of this model")

    def acquire(self, adapter: LoRAAdapter) -> bool:
        """Hold ``adapter`` on the device for a request (loading it, unloading the least recently
        taken one that no request holds if ``max_loras`` are); False where all are held."""
        if adapter.id not in self.loaded:
            if len(self.loaded) >= self.max_loras:
                idle = next((i for i in self.loaded if not self.holders.get(i)), None)
                if idle is None:
                    return False
                del self.loaded[idle]
            self.loaded[adapter.id] = adapter.to(self.device)
        self.loaded.move_to_end(adapter.id)
        self.holders[adapter.id] = self.holders.get(adapter.id, 0) + 1
        return True

    def release(self, adapter_id: int) -> None:
        self.holders[adapter_id] -= 1

    def select(self, ids: list[int]) -> None:
        """The next forward's updates: batch row b through adapter ``ids[b]`` (0: none)."""
        self.active = []
        for i in dict.fromkeys(ids):
            if i:
                rows = [b for b, j in enumerate(ids) if j == i]
                self.active.append((self.loaded[i], None if len(rows) == len(ids) else
                                    torch.tensor(rows, device=self.device)))

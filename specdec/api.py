"""The Python API: ``LLM(...).generate(prompts, SamplingParams(...))``, in the spirit of vLLM."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

from .config import EngineConfig, SamplingParams, SpecConfig
from .drafters import ModelDrafter, NgramDrafter
from .engine import Engine
from .metrics import Metrics, run_metrics
from .runtime import LoadedModel, load_model
from .sampling import make_generator
from .sequence import Sequence

Prompt = Union[str, list[dict], dict]  # text | chat messages | {"prompt_token_ids": [...]}


@dataclass
class RequestOutput:
    request_id: int
    prompt: Any
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    metrics: dict


def encode_prompt(tok, prompt: Prompt) -> list[int]:
    """Token ids for a text prompt, a chat (list of messages) or ``{"prompt_token_ids": ...}``."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
    elif isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError("a chat prompt must be a list of {'role': ..., 'content': ...} messages")
        if not prompt:
            raise ValueError("the chat prompt has no messages")
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass plain text")
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        ids = tok(prompt)["input_ids"]
    else:
        raise ValueError(f"a prompt must be text, a list of chat messages or "
                         f"{{'prompt_token_ids': [...]}}, not {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return ids


class LLM:
    """A target model, optionally with a drafter, ready to generate.

    ``model`` / ``draft``: an HF model directory, a ``.gguf`` file, a hub id, or an already
    loaded ``LoadedModel`` (to share weights); ``model=None`` is the embedded default
    (SmolLM2-135M-Instruct). ``speculative.method``: ``none``,
    ``draft`` (needs ``draft``), ``ngram`` or ``self``.
    """

    def __init__(self, model: str | LoadedModel | None = None, draft: str | LoadedModel | None = None,
                 speculative: SpecConfig | None = None, device: str | None = None,
                 dtype: str | None = None, max_batch_size: int = 8, backend: str = "auto"):
        if speculative is None:
            speculative = SpecConfig(method="draft" if draft else "none")
        self.spec = speculative
        self.engine_config = EngineConfig(device=device, dtype=dtype, max_batch_size=max_batch_size,
                                          backend=backend)
        if speculative.method == "draft" and not draft:
            raise ValueError("method 'draft' needs a draft model (draft=... / --draft)")
        if draft and speculative.method != "draft":
            raise ValueError(f"a draft model was given but the method is {speculative.method!r}; "
                             "use method 'draft'")
        self.target: LoadedModel = model if isinstance(model, LoadedModel) \
            else load_model(model, device, dtype, backend)
        self.draft: LoadedModel | None = None
        drafter = None
        width = self.target.runtime.vocab_size
        if speculative.method == "draft":
            from .vocab import require_compatible

            if not isinstance(draft, LoadedModel):
                draft = load_model(draft, device, dtype, backend, quantize=speculative.draft_quantization)
            self.draft = draft
            require_compatible(self.target.tokenizer, self.draft.tokenizer)
            drafter = ModelDrafter(self.draft.runtime, max_batch_size, width)
        elif speculative.method == "self":
            drafter = ModelDrafter(self.target.runtime, max_batch_size, width)
        elif speculative.method == "ngram":
            drafter = NgramDrafter(speculative.ngram_max, speculative.ngram_min,
                                   speculative.tree_topk, speculative.node_budget)
            if speculative.tree_topk > 1 and not self.target.runtime.supports_masks:
                raise ValueError("token trees need the torch runtime (tree attention masks); "
                                 "the transformers fallback runs chains only")
        self.engine = Engine(self.target, drafter, speculative, max_batch_size)
        self.tokenizer = self.target.tokenizer
        self.last_run_metrics: Metrics | None = None
        self._next_id = 0

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a text prompt, a chat (list of messages) or ``{"prompt_token_ids": ...}``."""
        return encode_prompt(self.tokenizer, prompt)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], dict) and "role" in prompts[0]):
            prompts = [prompts]
        sampling_params = sampling_params or SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        seqs = [self._sequence(p, sp) for p, sp in zip(prompts, params)]
        start = time.perf_counter()
        for s in seqs:
            self.engine.add(s)
        while self.engine.has_work:
            self.engine.step()
        self.last_run_metrics = run_metrics([s.metrics for s in seqs], time.perf_counter() - start)
        return [self._output(s, p) for s, p in zip(seqs, prompts)]

    def _sequence(self, prompt: Prompt, sp: SamplingParams) -> Sequence:
        ids = self.encode(prompt)
        vocab = self.target.runtime.vocab_size
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        limit = min(m.max_context for m in (self.target, self.draft) if m is not None)
        if len(ids) + sp.max_new_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {sp.max_new_tokens} "
                             f"exceeds the context window of {limit} tokens")
        self._next_id += 1
        return Sequence(request_id=self._next_id, ids=ids, prompt_len=len(ids), sampling=sp,
                        generator=make_generator(sp.seed, self.target.runtime.device),
                        eos_ids=frozenset() if sp.ignore_eos else self.target.eos_ids)

    def _output(self, s: Sequence, prompt: Prompt) -> RequestOutput:
        text = s.text if s.text is not None else self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
        return RequestOutput(s.request_id, prompt, text, s.output_ids, s.finish_reason, s.metrics.to_dict())

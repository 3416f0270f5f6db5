"""Configuration: one frozen dataclass per layer, validated on construction.

Vocabulary used across specdec (one meaning each):

* **draft** - a token proposed by the drafter for the target to check.
* **accepted** - a draft token that passed verification.
* **recovered** - the token the target commits at the first rejection (its argmax when
  greedy, a draw from the residual ``normalize(max(p - q, 0))`` when sampling).
* **bonus** - the extra token drawn from the target when every draft was accepted.
* ``p`` - target probabilities; ``q`` - draft probabilities (both after temperature, min-p,
  top-k and top-p, i.e. the distributions actually sampled from).
* ``k`` - number of draft tokens in a round; *verify step* - one target forward over them.

Every invalid value raises ``ValueError`` with a one-line message naming the field.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import InitVar, dataclass, fields, replace
from enum import IntEnum

METHODS = ("none", "draft", "ngram", "self", "hybrid", "eagle", "eagle3", "mtp")
# the methods that draft with a draft model (eagle, eagle3: a head over the target's hidden states)
DRAFT_METHODS = ("draft", "hybrid", "eagle", "eagle3")
# the methods whose drafts come from a model's forwards: a draft model or head, the target itself
# (self), the target checkpoint's own multi-token prediction layer (mtp)
MODEL_METHODS = DRAFT_METHODS + ("self", "mtp")
# vLLM's speculative_config, as SpecConfig.from_vllm reads it: its method names and keys
VLLM_SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft", "eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp",
                     "deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp",
                     "mimo_mtp": "mtp"}
VLLM_SPEC_KEYS = {"num_speculative_tokens": "num_draft_tokens", "prompt_lookup_max": "ngram_max",
                  "prompt_lookup_min": "ngram_min", "revision": "draft_revision"}
BACKENDS = ("auto", "torch", "hf", "llamacpp")
LOAD_FORMATS = ("auto", "dummy")  # the checkpoint's weights, or random ones of its shapes (vLLM's dummy)
# generation_config.json keys a model's default sampling comes from, as SamplingParams fields
# (vLLM's --generation-config auto reads the same ones)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


MAX_COMPLETIONS = 16384  # the most n (vLLM's VLLM_MAX_N_SEQUENCES)
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a temperature in (0, this) is raised to it (logits / t overflow)

# device forms EngineConfig takes (torch's names; None = cuda if available, else cpu)
DEVICE = re.compile(r"(cpu|cuda)(:[0-9]+)?")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


_KINDS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


def _check_types(config) -> None:
    """Every int, float and bool field of ``config`` (a dataclass; ``X | None`` also None)
    holds one, as JSON would say: a bool is no number, an int is a float."""
    for f in fields(config):
        kind, _, rest = f.type.partition(" | ")
        if kind in _KINDS:
            value, (types, what) = getattr(config, f.name), _KINDS[kind]
            optional = rest == "None"
            ok = isinstance(value, types) and isinstance(value, bool) == (kind == "bool")
            _check(ok or (value is None and optional), f"{f.name} must be {what}{' or None' if optional else ''}, "
                                                       f"got {value!r}")


def arity(f) -> int | None:
    """How many arguments ``f`` takes, as vLLM counts a logits processor's: 3 = it takes the
    prompt's ids first (None: its signature cannot be read, a builtin's, or it takes
    ``*args``; it is called with two)."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return None
    return None if any(p.kind == p.VAR_POSITIONAL for p in params) else len(params)  # vLLM's count


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate, which JSON can carry, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_device(device) -> None:
    """``device`` is None or one of the forms ``DEVICE`` takes."""
    _check(device is None or (isinstance(device, str) and DEVICE.fullmatch(device) is not None),
           f"unknown device {device!r}; use cpu, cuda or cuda:N (N: the GPU's index; default: cuda if available)")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output's text, as vLLM's ``StructuredOutputsParams``: exactly one
    of a JSON schema (``json``: a dict or its JSON text), a regular expression, a ``choice``
    of strings, a ``grammar`` (Lark or llama.cpp's GBNF) or ``json_object`` (any JSON
    object). Tokens that would break it are masked out of the target's logits on every row
    (prefill, verify), so speculation stays lossless against the constrained target."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and all(isinstance(c, str) for c in self.choice),
                   "structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object must be true or false")
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] * bool(self.json_object)
        _check(len(kinds) == 1, "structured_outputs takes exactly one of json, regex, choice, grammar "
                                f"and json_object, got {', '.join(kinds) or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except (TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"structured_outputs.json is not a JSON schema: {e}") from None
            _check(isinstance(schema, (dict, bool)), "structured_outputs.json must be a JSON object (a schema)")
        _check(self.choice is None or len(self.choice) >= 1, "structured_outputs.choice needs at least one string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value),
                   f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """The one constraint given: json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


def generation_defaults(directory) -> dict:
    """The ``SamplingParams`` fields a model directory's ``generation_config.json`` sets
    (``GENERATION_FIELDS``; none without the file). Read as raw JSON: transformers' own
    defaults (top_k 50...) are not the model's."""
    from pathlib import Path

    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    out = {field: raw[key] for key, field in GENERATION_FIELDS.items() if raw.get(key) is not None}
    if "top_k" in out:
        out["top_k"] = max(int(out["top_k"]), 0)  # -1 / 0: off
    return out


class RequestOutputKind(IntEnum):
    """What ``AsyncLLM.generate`` yields as a request runs (vLLM's): every output so far
    (``CUMULATIVE``), only what is new since the last (``DELTA``), or the finished output
    alone (``FINAL_ONLY``). ``LLM.generate`` returns finished outputs whatever it says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    # new tokens at most (vLLM's name; transformers' max_new_tokens); None = what the context
    # window leaves after the prompt
    max_tokens: int | None = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; drop tokens less likely than min_p x the top one (vLLM's, before top-k/p)
    seed: int | None = None  # -1: None, a fresh seed (vLLM's)
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before them
    # tokens that end the output like an EOS (with ignore_eos too); kept in token_ids, not in the text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # no EOS, stop token or stop string ends the output before this many tokens (vLLM's)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token) in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # vLLM's: a space between an added (or special) token and the text around it, where a
    # slow (Python) tokenizer decodes (sequence.output_text); a fast one decodes as it does
    spaces_between_special_tokens: bool = True
    # penalties on the logits, greedy included, before temperature (as in vLLM): repetition
    # (transformers' and vLLM's: a token seen in the prompt or output has a positive logit
    # divided by it, a negative one multiplied), then OpenAI's presence (minus this once for
    # a token in the output) and frequency (minus this per occurrence in the output)
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    # OpenAI's logit_bias: added to a token's logit before the penalties, as vLLM (-100..100; a dict
    # {token id: bias} is kept as sorted pairs)
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1  # completions of the prompt (with a seed, completion i draws from seed + i); 1 when greedy (vLLM's)
    # the target's log-probability of each output token, with this many most likely
    # alternatives (0 = the chosen token's only; -1 = the whole vocabulary; None = off; at most
    # the LLM's max_logprobs, 20 by default); from the raw logits, as vLLM's
    logprobs: int | None = None
    # the same for each prompt token (the first has none), with this many alternatives
    prompt_logprobs: int | None = None
    # constrain the output to a JSON schema, regex, choice or grammar (a dict is taken as
    # StructuredOutputs' fields)
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: only these token ids may be drawn (None = all)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words whose last token is banned where the output's last tokens would complete
    # them (each word as written and with a leading space)
    bad_words: tuple[str, ...] = ()
    # vLLM's: keep only the prompt's last this many tokens (-1: the context window's worth)
    truncate_prompt_tokens: int | None = None
    # vLLM's: False = token ids only (text "", logprobs without decoded tokens, no stop strings)
    detokenize: bool = True
    # vLLM's (v0) per-request functions of the ids so far: ``f(output_ids, logits)`` or
    # ``f(prompt_ids, output_ids, logits)`` -> logits ``[vocab]``, applied in turn to the
    # target's raw logits before everything else (``sampling.processed_by_user``)
    logits_processors: tuple[Callable, ...] = ()
    # vLLM's: what AsyncLLM.generate yields (RequestOutputKind; LLM.generate: the final outputs)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's older name of structured_outputs (not kept as a field of its own)
    guided_decoding: InitVar[StructuredOutputs | dict | None] = None

    def clone(self) -> "SamplingParams":
        """A copy (vLLM's). The fields are frozen: change one with ``dataclasses.replace(sp,
        max_tokens=8)``."""
        return replace(self)

    def __post_init__(self, guided_decoding: StructuredOutputs | dict | None = None) -> None:
        _check_types(self)
        if guided_decoding is not None:
            _check(self.structured_outputs is None, "give structured_outputs or guided_decoding (its older name), "
                                                    "not both")
            object.__setattr__(self, "structured_outputs", guided_decoding)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(self.stop_token_ids or ()))))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        object.__setattr__(self, "bad_words", (self.bad_words,) if isinstance(self.bad_words, str)
                           else tuple(self.bad_words or ()))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs must be a StructuredOutputs (or a dict of its fields)")
        _check(self.output_kind in tuple(RequestOutputKind) and not isinstance(self.output_kind, bool),
               f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {self.output_kind!r}")
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        _check(all(callable(f) and arity(f) in (2, 3, None) for f in self.logits_processors),
               "logits_processors must be functions f(output_ids, logits) or f(prompt_ids, output_ids, logits) "
               "returning the logits")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        _check(self.temperature >= 0 and math.isfinite(self.temperature),
               f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # as vLLM: tiny ones overflow the logits into nan
            logging.getLogger("specdec").warning("temperature %s is below %s (logits / temperature would "
                                                 "overflow); raised to %s", self.temperature, MIN_TEMPERATURE,
                                                 MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(self.top_k >= -1, f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))  # vLLM's -1: all tokens
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be token ids (integers >= 0)")
        _check(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings")
        _check(self.detokenize or not self.stop, "stop strings are sought in the text: they need detokenize=True")
        _check(self.allowed_token_ids is None or (len(self.allowed_token_ids) >= 1 and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        _check(all(isinstance(w, str) and w.strip() and _utf8(w) for w in self.bad_words),
               "bad_words must be non-empty strings of Unicode characters (no lone surrogates)")
        _check(0 < self.repetition_penalty < math.inf,
               f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2] (0 = off), got {value}")
        _check(all(isinstance(t, int) and t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
               "logit_bias must map token ids (integers >= 0) to biases in [-100, 100]")
        _check(1 <= self.n <= MAX_COMPLETIONS, f"n must be an integer in [1, {MAX_COMPLETIONS}], got {self.n!r}")
        _check(self.n == 1 or not self.greedy, f"n must be 1 when using greedy sampling, got {self.n}")  # vLLM's
        if self.seed == -1:  # vLLM's: a random seed
            object.__setattr__(self, "seed", None)
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1,
               f"truncate_prompt_tokens must be -1 or an integer >= 1 (or None = off), got {self.truncate_prompt_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= -1,
                   f"{name} must be an integer >= 0, -1 (the vocabulary) or None (off), got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Penalties, a logit bias, allowed token ids, bad words, min_tokens or logits processors
        change the model's logits (``sampling.sequence_logits``)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words) or bool(self.logits_processors))


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter proposes tokens, and how many per round."""

    # hybrid: n-gram when it matches, else draft (with the cost model: the faster expected)
    # eagle / eagle3: the draft is an EAGLE or EAGLE-3 head (method draft with one becomes its kind)
    # mtp: the target checkpoint's own multi-token prediction layer (DeepSeek-V3's, GLM-4.5's, Qwen3.5's), or
    # with a draft a Gemma 4 assistant (google/gemma-4-*-it-assistant; method draft with one becomes mtp)
    method: str = "none"  # none | draft | ngram | self | hybrid | eagle | eagle3 | mtp
    num_draft_tokens: int = 4  # k
    ngram_max: int = 3  # longest suffix n-gram the lookup tries first
    ngram_min: int = 1
    # ngram / hybrid: also look up the texts (prompt and output) of the other requests, those
    # running and those finished (up to this many tokens, the oldest dropped first), as SGLang's
    # n-gram cache is shared across requests; 0 = the request's own text only (vLLM's prompt lookup)
    ngram_capacity: int = 0
    # int8 weights for the draft model (lossless: the target verifies every token).
    # auto = int8 when the draft runs on CPU in float32, where it is ~4x faster.
    draft_quantization: str = "auto"  # auto | none | int8
    draft_revision: str | None = None  # a hub draft's branch, tag or commit (its tokenizer's too); None = main
    # token trees: up to tree_topk candidates per node (draft/self: the draft's top-k
    # children, EAGLE-2 style; ngram: several matches' continuations), tree_depth deep
    # (default k; with topk 1 it is the chain's length), at most tree_nodes draft nodes
    # (default depth * topk); topk 1 = chain
    tree_topk: int = 1
    tree_depth: int | None = None
    tree_nodes: int | None = None
    # a measured cost model picks each step's drafter and k <= depth (tree_depth, else
    # num_draft_tokens; 0 = plain decoding) for the most expected tokens per second; forward
    # times are measured at load
    cost_model: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.method in METHODS,
               f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        _check(self.num_draft_tokens >= 1,
               f"num_draft_tokens (k) must be an integer >= 1, got {self.num_draft_tokens!r}")
        _check(1 <= self.ngram_min <= self.ngram_max,
               f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        _check(self.ngram_capacity >= 0, f"ngram_capacity must be >= 0 (0 = off), got {self.ngram_capacity}")
        _check(self.ngram_capacity == 0 or self.method in ("ngram", "hybrid"),
               f"ngram_capacity is the n-gram drafter's: it needs method ngram or hybrid, not {self.method!r}")
        _check(self.draft_quantization in ("auto", "none", "int8"),
               f"unknown draft_quantization {self.draft_quantization!r}; choose auto, none or int8")
        _check(self.tree_topk >= 1, f"tree_topk must be >= 1, got {self.tree_topk}")
        _check(self.tree_depth is None or self.tree_depth >= 1, f"tree_depth must be >= 1, got {self.tree_depth}")
        _check(self.tree_nodes is None or self.tree_nodes >= 1, f"tree_nodes must be >= 1, got {self.tree_nodes}")
        _check(self.tree_topk == 1 or self.method != "none",
               "token trees (tree_topk > 1) need a drafter: method draft, self, ngram, hybrid, eagle, eagle3 or mtp")
        _check(not self.cost_model or self.method != "none", "the cost model needs a drafter (method != none)")

    @staticmethod
    def from_vllm(config: dict, **base) -> "tuple[SpecConfig, str | None]":
        """vLLM's ``speculative_config`` (``--speculative-config``) as ``(SpecConfig, draft
        model or None)``, over the ``SpecConfig`` fields ``base`` gives: ``method``
        (``ngram``, ``draft_model``, or one of specdec's ``METHODS``; default ``draft`` when a
        ``model`` is given, as vLLM infers), ``model`` (the draft), ``num_speculative_tokens``
        (k), ``prompt_lookup_max`` / ``prompt_lookup_min`` (the n-gram sizes; one alone sets
        both, as vLLM's; neither keeps specdec's, 1 to 3, where vLLM's are 5 and 5),
        ``revision`` (the hub draft's; ``mtp`` without ``num_speculative_tokens`` drafts 1 token,
        vLLM's default: the checkpoint's MTP layers), any other ``SpecConfig`` field by name, and, as given
        in vLLM's examples, ``draft_tensor_parallel_size`` 1, ``code_revision`` equal to
        ``revision`` (a draft's code comes from the same snapshot) and ``quantization`` null."""
        _check(isinstance(config, dict), f"speculative_config must be a JSON object, got {type(config).__name__}")
        own = {f.name for f in fields(SpecConfig)}
        out, draft = {}, config.get("model")
        for key, value in config.items():
            if key == "method":
                out["method"] = VLLM_SPEC_METHODS.get(value, value)
                _check(out["method"] in METHODS,
                       f"speculative_config: method {value!r} is not supported here; choose "
                       f"{', '.join(VLLM_SPEC_METHODS)} (vLLM's names) or {', '.join(METHODS)}")
            elif key in VLLM_SPEC_KEYS or key in own:
                out[VLLM_SPEC_KEYS.get(key, key)] = value
            elif key == "draft_tensor_parallel_size":  # vLLM's examples give 1: the draft on one device
                _check(value == 1, f"speculative_config: draft_tensor_parallel_size {value!r}: specdec runs the "
                                   "draft on one device; use 1")
            elif key == "code_revision":
                _check(value is None or value == config.get("revision"),
                       f"speculative_config: code_revision {value!r}: a draft's code comes from its revision "
                       f"({config.get('revision')!r}); give the same or leave it out")
            elif key == "quantization":
                _check(value is None, f"speculative_config: quantization {value!r} is not supported here; "
                                      "specdec's draft_quantization takes auto, none or int8")
            elif key != "model":
                raise ValueError(f"speculative_config: unknown key {key!r}; specdec reads method, model, "
                                 f"{', '.join(VLLM_SPEC_KEYS)} and SpecConfig's fields")
        if "method" not in out:
            _check(draft is not None, "speculative_config needs a method (ngram, draft_model) or a draft model")
            out["method"] = "draft"
        if out["method"] == "mtp" and "num_draft_tokens" not in out:  # vLLM's: the checkpoint's MTP layers (one)
            out["num_draft_tokens"] = 1
        given, out = out, {**base, **out}
        if "ngram_max" in given and "ngram_min" not in given:  # one n-gram size given: the other is the same, as vLLM's
            out["ngram_min"] = given["ngram_max"]
        if "ngram_min" in given and "ngram_max" not in given:
            out["ngram_max"] = given["ngram_min"]
        return SpecConfig(**out), draft

    @property
    def depth(self) -> int:
        """Longest draft per round (chain length or tree depth)."""
        return self.tree_depth or self.num_draft_tokens

    @property
    def node_budget(self) -> int:
        return self.tree_nodes or self.depth * self.tree_topk


DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32"}  # vLLM's --dtype names


@dataclass(frozen=True)
class EngineConfig:
    """Where and how the models run."""

    # cpu, cuda or cuda:N (a torch.device: its name); None = cuda if available, else cpu
    device: str | None = None
    dtype: str | None = None  # None (or "auto") = float32 on cpu, bfloat16 on cuda; "half", "float": vLLM's aliases
    max_batch_size: int = 8
    backend: str = "auto"  # auto | torch | hf | llamacpp  (hf = transformers' own model and cache)
    threads: int | None = None  # CPU threads (torch.set_num_threads; llama.cpp's too); None = torch's default
    draft_backend: str | None = None  # None = backend; e.g. a llamacpp target with a torch draft
    repack: bool = True  # llama.cpp: its repacked CPU weights (see LlamaCppRuntime)
    load_format: str = "auto"  # auto | dummy: random weights of the checkpoint's shapes, to measure speed
    # prompt tokens prefilled per engine step, over all requests (SGLang's chunked prefill):
    # a long prompt goes in chunks of this many tokens, one chunk per step, and running
    # requests keep decoding in between; 0 = every admitted prompt whole, in one forward;
    # None = 256 on the CPU, 2048 on a GPU
    chunked_prefill_size: int | None = None
    # tokens (prompt + output) a request may span (vLLM's max_model_len); None = the model's
    # context (on llama.cpp 4096 per slot, its KV buffer holding max_batch_size of them)
    max_model_len: int | None = None
    # the torch runtime on CUDA replays small forwards (decoding, verification, drafting) as
    # CUDA graphs; True = always eager (vLLM's enforce_eager)
    enforce_eager: bool = False
    # default sampling (LLM.get_default_sampling_params, and the server's fields a request
    # leaves out): "auto" = the target's generation_config.json, as vLLM's; "vllm" = none
    # (SamplingParams' own defaults); else a directory holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's global seed: requests without a seed of their own draw their generators' seeds
    # from it, in order (the same in every LLM made with it); None = a fresh seed each
    seed: int | None = None
    # alternatives a request's logprobs / prompt_logprobs may ask for (vLLM's; -1 = the vocabulary)
    max_logprobs: int = 20
    # vLLM's: the GPUs a model is split over; specdec runs each model on one device (1 only)
    tensor_parallel_size: int = 1
    # vLLM's share of GPU memory reserved up front for weights and KV cache; specdec reserves
    # nothing (its KV cache grows with the requests), so the value is only checked: 0 < x <= 1
    gpu_memory_utilization: float = 0.9
    # vLLM's: a finished prompt's KV stays in its slot for a later prompt that starts the same,
    # and running requests (n completions) share their prompt's chunks; False = every prompt
    # is computed from scratch (e.g. to time prefills); None (vLLM's default) = True
    enable_prefix_caching: bool | None = True
    # vLLM's loading keywords: the target's tokenizer from another path, .gguf or hub id (None =
    # the model's own); a hub id's revision (branch, tag or commit), and the tokenizer's (None =
    # revision, as vLLM's); and trust_remote_code: run a checkpoint's own Python code (config,
    # tokenizer, model) where its config names it
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    tokenizer_revision: str | None = None
    # vLLM's: the checkpoint's quantization (gguf, or its quantization_config's quant_method:
    # gptq, awq, bitsandbytes, ...); specdec runs a checkpoint as it is quantized and quantizes
    # nothing at load, so a value is only checked against the checkpoint's; None = whatever it is
    quantization: str | None = None
    # vLLM's: requests may name LoRA adapters (PEFT's, ``LoRARequest``; the torch runtime's
    # target), up to max_loras of them on the device at once (a request for another waits
    # until one is free of requests); max_lora_rank: adapters of a higher rank are refused
    # (None: any rank; vLLM's default is 16)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if hasattr(self.device, "type") and hasattr(self.device, "index"):  # a torch.device
            object.__setattr__(self, "device", str(self.device))
        check_device(self.device)
        _check(isinstance(self.generation_config, str) and self.generation_config != "",
               f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        _check(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        _check(self.chunked_prefill_size is None or self.chunked_prefill_size >= 0,
               f"chunked_prefill_size must be an integer >= 0 (0 = off), got {self.chunked_prefill_size!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        for name in ("backend", "draft_backend"):
            value = getattr(self, name)
            _check(value in BACKENDS or (name == "draft_backend" and value is None),
                   f"unknown {name} {value!r}; choose {', '.join(BACKENDS)}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _check(self.dtype in (None, "float32", "bfloat16", "float16"),
               f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        _check(self.threads is None or self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        _check(self.max_logprobs >= -1, f"max_logprobs must be an integer >= -1 (-1 = the vocabulary), "
                                        f"got {self.max_logprobs}")
        _check(self.tensor_parallel_size == 1, f"tensor_parallel_size {self.tensor_parallel_size}: specdec runs "
                                               "each model on one device (no tensor parallelism); use 1")
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", True)
        _check(self.quantization is None or isinstance(self.quantization, str),
               f"quantization must be None or a string, got {self.quantization!r}")
        for name in ("tokenizer", "revision", "tokenizer_revision", "quantization"):
            _check(getattr(self, name) != "", f"{name} must be None or a non-empty string")
        _check(self.max_loras >= 1, f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        _check(self.max_lora_rank is None or self.max_lora_rank >= 1,
               f"max_lora_rank must be an integer >= 1 or None, got {self.max_lora_rank!r}")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.load_format in LOAD_FORMATS,
               f"unknown load_format {self.load_format!r}; choose {', '.join(LOAD_FORMATS)}")
        _check(self.load_format == "auto" or "llamacpp" not in (self.backend, self.draft_backend),
               "the llama.cpp backend runs a GGUF's own weights; load_format 'dummy' needs the "
               "torch or hf backend")

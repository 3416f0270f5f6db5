"""One request's state while it runs: the ids the engine, drafters and verifier share."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .config import SamplingParams
from .metrics import Mark, Metrics

if TYPE_CHECKING:
    from .lora import LoRAAdapter
    from .structured import Matcher


def output_text(tokenizer, ids: list[int], sp: SamplingParams, context: tuple[int, ...] | list[int] = ()) -> str:
    """The text of output ``ids``, special tokens left out unless ``sp`` keeps them, as it
    reads after ``context`` (the prompt's last tokens, ``text_context``): what ``ids`` add to
    the decoding of ``context``. So a SentencePiece tokenizer that strips the text's leading
    space (Llama 2's, Mistral's) keeps the first output token's, as vLLM's detokenizer, primed
    with the prompt, does. As in vLLM, a slow (Python) tokenizer with added tokens (specials
    among them) decodes the runs between them apart, joined by a space with
    ``sp.spaces_between_special_tokens`` (by nothing without); a fast one decodes the whole.
    A prompt that ends inside a character: the output's text starts where the prompt's last
    complete character ends (its first tokens may complete that character)."""
    if context:
        base, whole = settled_text(tokenizer, list(context), sp), _decoded(tokenizer, list(context) + list(ids), sp)
        if whole.startswith(base):
            return whole[len(base):]
    return _decoded(tokenizer, ids, sp)


def text_context(tokenizer, prompt_ids: list[int]) -> tuple[int, ...]:
    """The prompt's last tokens an output's text is decoded after (``output_text``), as vLLM
    primes its detokenizer: the fewest of the last 4 to 23 whose text (special tokens left
    out) holds no incomplete character, else the whole prompt (one that ends inside a
    character; a prompt of at most 4 tokens: all of it)."""
    if len(prompt_ids) <= 4:
        return tuple(prompt_ids)
    for n in range(4, min(len(prompt_ids), 23) + 1):
        if "\ufffd" not in tokenizer.decode(prompt_ids[-n:], skip_special_tokens=True):
            return tuple(prompt_ids[-n:])
    return tuple(prompt_ids)


def _decoded(tokenizer, ids: list[int], sp: SamplingParams) -> str:
    added = {} if getattr(tokenizer, "is_fast", True) else tokenizer.get_added_vocab()
    if not added:
        return tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    specials, pieces, run = set(tokenizer.all_special_ids), [], []
    for t in ids:
        if sp.skip_special_tokens and t in specials:
            continue
        token = tokenizer.convert_ids_to_tokens(t)
        if token in added:
            pieces += [tokenizer.convert_tokens_to_string(run)] if run else []
            pieces.append(token)
            run = []
        else:
            run.append(token)
    pieces += [tokenizer.convert_tokens_to_string(run)] if run else []
    return (" " if sp.spaces_between_special_tokens else "").join(pieces)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """How many leading ids ``a`` and ``b`` share, given that their first ``start`` agree:
    compared a block at a time (list slices compare in C; a request's prompt and output are
    compared every step), then id by id inside the first block that differs."""
    m, i = min(len(a), len(b)), min(start, len(a), len(b))
    while i < m:
        j = min(i + 256, m)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return m


def cut_after_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (all of them when there is none)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def settled_text(tokenizer, ids: list[int], sp: SamplingParams, context: tuple[int, ...] | list[int] = ()) -> str:
    """The text of output ``ids`` after ``context`` (``output_text``) as an incremental
    detokenizer has it (vLLM's): the last tokens, while their text ends in an incomplete
    character (U+FFFD until its last byte comes), wait for the rest, and are left out if it
    never comes."""
    m = len(ids)
    text = output_text(tokenizer, ids, sp, context)
    while text.endswith("\ufffd") and m:
        m -= 1
        text = output_text(tokenizer, ids[:m], sp, context)
    return "" if text.endswith("\ufffd") else text  # none settled (m = 0)


class IncrementalText:
    """Output text grown as tokens come, as vLLM's incremental detokenizer grows it: what new
    tokens add to the decoding of the few before them (a window from the previous emission
    point, so the cost per token does not grow with the output); while that window's text
    ends in an incomplete character (U+FFFD), the tokens wait for the rest. The first window
    reads after ``context`` (the prompt's last tokens, ``text_context``), as vLLM's does."""

    def __init__(self, tokenizer, sp: SamplingParams, context: tuple[int, ...] | list[int] = ()):
        self.tok, self.sp = tokenizer, sp
        self.context = list(context)
        self.base = settled_text(tokenizer, self.context, sp)  # what the output's text comes after
        self.ids: list[int] = []
        self.prefix = 0  # window start (token index)
        self.read = 0  # tokens whose text is in self.text
        self.text = ""  # decoded so far (complete characters)

    def add(self, ids: list[int]) -> str:
        """Feed the next ``ids``; the text they add to ``text`` (none while a character waits)."""
        self.ids.extend(ids)
        head = self.context if self.prefix == 0 else []
        before = self.base if self.read == 0 else output_text(self.tok, head + self.ids[self.prefix:self.read], self.sp)
        window = output_text(self.tok, head + self.ids[self.prefix:], self.sp)
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        self.text += window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(before):]


def held_back(text: str, markers) -> int:
    """Characters at the end of ``text`` that are a proper prefix of one of ``markers`` (a
    stream waits for more before sending them)."""
    hold = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:n]):
                hold = n
                break
    return hold


def ids_to_hold(decode, ids: list[int], text: "str | re.Pattern", start: int = 0) -> int | None:
    """The fewest leading ``ids``, more than ``start``, whose ``decode`` holds ``text`` (or a
    match of the pattern ``text``; None: all of them do not). A prefix's text is a prefix of
    the whole's, so holding only grows with the ids: found by bisection."""
    def holds(n: int) -> bool:
        s = decode(ids[:n])
        return text in s if isinstance(text, str) else text.search(s) is not None

    lo, hi = start + 1, len(ids)
    if lo > hi or not holds(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return lo


def bad_words_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of ``bad_words``: each word's tokens as written (leading spaces
    stripped) and with one leading space, the latter only where it tokenizes to as many
    tokens starting with another one (a word of its own after a space)."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(tuple(bare))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(tuple(spaced))
    return tuple(w for w in out if w)


class TokenLogprobs(NamedTuple):
    """One output token's log-probability under the target, its rank in the vocabulary
    (1 = the most likely) and the ``logprobs`` most likely tokens as ``(id, logprob)``."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    request_id: int
    ids: list[int]  # prompt + committed output
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator
    eos_ids: frozenset[int]  # the model's EOS ids (none with sampling.ignore_eos) and sampling.stop_token_ids
    slot: int = -1  # KV slot in the target cache (and the drafter's), -1 = not admitted
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # what stopped it, as vLLM reports: the stop string, or the stop_token_ids token (None: an
    # EOS of the model's, the length, or not finished)
    stop_reason: int | str | None = None
    text: str | None = None  # final text where the engine cut it (a stop string; a stop token or EOS left out); None: decode all
    metrics: Metrics = field(default_factory=Metrics)
    admitted: Mark | None = None  # the engine's clock at admission and at the end (metrics' time split)
    retired: Mark | None = None
    num_draft_tokens: int | None = None  # this request's cap on k (None = the engine's k)
    lora: LoRAAdapter | None = None  # the target's adapter for this request (``specdec.lora``)
    # target log-probabilities of the committed tokens, captured only when
    # ``sampling.logprobs`` is set: one ``TokenLogprobs`` per output token, from the
    # target's raw logits (prefill or verify rows)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with ``sampling.prompt_logprobs``: the same for each prompt token after the first (from
    # the prefill's rows)
    prompt_token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with ``sampling.structured_outputs``: the grammar's state after the committed output
    grammar: Matcher | None = None
    # ``sampling.bad_words`` as token sequences (``bad_words_ids``)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # what ``sampling.min_tokens`` bans before then: the model's EOS ids, even with
    # ignore_eos, and stop_token_ids (vLLM's all_stop_token_ids); None: ``eos_ids``
    min_tokens_ban: frozenset[int] | None = None
    # with ``sampling.stop``: the output's text as it grows, where stop strings are sought
    stop_text: IncrementalText | None = None
    # the prompt's last tokens the output's text is decoded after (``text_context``)
    text_context: tuple[int, ...] = ()
    # the target's logits width: ``sampling.logits_processors`` skip rows of another (a
    # narrower draft's); None: rows of any width
    vocab_size: int | None = None
    # what one of ``sampling.logits_processors`` raised on a row this step's tokens came from
    # (as plain decoding would have met it): the request ends with finish reason "error" after
    # the step, the others in the batch go on
    failure: Exception | None = None
    # ``ids`` as a numpy buffer (``id_array``): its first ``_array_len`` entries are ``ids``'
    _array: np.ndarray | None = field(default=None, repr=False, compare=False)
    _array_len: int = field(default=0, repr=False, compare=False)

    def cut(self, length: int) -> None:
        """Keep the first ``length`` ids (a stop string's cut); ``id_array`` follows."""
        del self.ids[length:]
        self._array_len = min(self._array_len, length)

    def id_array(self) -> np.ndarray:
        """``ids`` as a numpy array ``[len(ids)]`` (a view: read it before ``ids`` change),
        kept beside the list and grown by what was committed since the last call: the n-gram
        drafter reads the whole context every step, and converting a 16k-token list costs
        ~0.3 ms each time (a few percent of a GPU step). Ids only grow, but for ``cut``."""
        n, have = len(self.ids), min(self._array_len, len(self.ids))  # (a cut not through ``cut``)
        if self._array is None:
            self._array = np.empty(max(2 * n, 64), dtype=np.int64)
        elif n > len(self._array):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = self._array[:have]
            self._array = grown
        self._array[have:n] = self.ids[have:n]
        self._array_len = n
        return self._array[:n]

    @property
    def logprobs(self) -> int | None:
        """Alternatives to capture per output token (None = no log-probabilities)."""
        return self.sampling.logprobs

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @functools.cached_property
    def prompt_tensor(self) -> torch.Tensor:
        """The prompt's ids as a tensor ``[prompt_len]`` (made once: a repetition penalty reads
        them on every row the request draws from)."""
        return torch.tensor(self.ids[:self.prompt_len], dtype=torch.long)

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - self.num_output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

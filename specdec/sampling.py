"""Logits -> the probabilities actually sampled from (penalties and logit bias, temperature,
top-k, top-p), and seeded draws."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .config import SamplingParams, arity
from .structured import constrain

if TYPE_CHECKING:
    from .sequence import Sequence


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Processed distribution for sampling: ``logits [rows, vocab] -> probs [rows, vocab]`` (fp32).

    Order as in vLLM: temperature, then min-p (keeps the tokens at least ``min_p`` times as
    likely as the top one), then top-k, then top-p (nucleus keeps the smallest set whose
    mass reaches ``top_p``, always at least the top token).
    Greedy params (temperature 0) give the one-hot argmax distribution.
    """
    logits = logits.float()
    if sp.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # huge logits (a tiny repetition penalty's) stay finite: the largest share the mass, no nan
    logits = (logits / sp.temperature).nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    if sp.min_p > 0:  # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        floor = logits.max(-1, keepdim=True).values + math.log(sp.min_p)  # [rows, 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]  # [rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        logits = logits.masked_fill(~top_p_keep(logits.softmax(-1), sp.top_p), float("-inf"))
    return logits.softmax(-1)


TOP_P_CANDIDATES = 1024  # top_p looks at the most likely tokens first (x4 until they hold the mass)


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[rows, vocab]`` bool: the nucleus of each row, the most likely tokens up to and
    including the one that brings their mass to ``top_p`` (a token is kept when the mass of
    the tokens ranked before it is below ``top_p``). Ranks come from ``topk`` over the
    ``TOP_P_CANDIDATES`` most likely tokens, more only while a row's nucleus reaches past
    them: a full sort of a 150k vocabulary costs ~20x as much on a CPU."""
    vocab = probs.shape[-1]
    k = min(TOP_P_CANDIDATES, vocab)
    while True:
        top = probs.topk(k, dim=-1)  # [rows, k], most likely first
        mass_before = top.values.cumsum(-1) - top.values  # [rows, k]: mass ranked before each
        if k == vocab or bool((mass_before[:, -1] >= top_p).all()):  # every row's nucleus ends inside
            break
        k = min(4 * k, vocab)
    keep = mass_before < top_p
    keep[:, 0] = True  # the top token, though top_p is below float32's least (it compares as 0)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top.indices, keep)


def process_logits(logits: torch.Tensor, sp: SamplingParams, prompt: list[int] | torch.Tensor, output: list[int],
                   extra: list[list[int]] | None = None, *, stop_ids: frozenset[int] = frozenset(),
                   bad_words: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
    """``sp``'s logit bias, then its repetition, presence and frequency penalties (vLLM's
    order: a bias that turns a logit's sign turns how repetition scales it), then its
    allowed token ids, then ``bad_words`` (token sequences: the last token is banned on a row
    whose output ends with the others), then min_tokens (``stop_ids``, the request's EOS and
    stop tokens, banned on rows with fewer than ``min_tokens`` tokens of output before them,
    unless nothing else is left) on ``logits [rows, vocab]``: row ``i`` follows ``prompt +
    output + extra[i]`` (a verify step's row i follows the drafts before it; default: no
    extra). Repetition counts the prompt and the output, presence and frequency the output
    only (``extra`` is output). A row the processing would leave without any token (allowed
    ids against a grammar, say) keeps its logits as given. Unchanged when ``sp`` has none of
    them."""
    if not sp.processes_logits:
        return logits
    given = logits
    rows, vocab = logits.shape
    dev = logits.device

    def ids(tokens: list[int] | torch.Tensor) -> torch.Tensor:  # a narrower (draft) vocab skips ids past it
        t = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long)  # [n]
        return t[t < vocab].to(dev)

    logits = logits.float()
    if sp.logit_bias:
        bias = [(t, b) for t, b in sp.logit_bias if t < vocab]
        add = torch.tensor([float(b) for _, b in bias], device=dev).expand(rows, -1)  # [rows, biased ids]
        logits = logits.index_add(1, ids([t for t, _ in bias]), add)  # a new tensor: raw logits stay
    if sp.penalized:
        counts = torch.bincount(ids(output), minlength=vocab).float().repeat(rows, 1)  # [rows, vocab] in the output
        for i, more in enumerate(extra or []):
            if more:
                more = ids(more)
                counts[i].index_add_(0, more, torch.ones(len(more), device=dev))
        if sp.repetition_penalty != 1:
            seen = counts > 0
            seen[:, ids(prompt)] = True
            scaled = torch.where(logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        logits = logits - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
    if sp.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[ids(list(sp.allowed_token_ids))] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if bad_words:
        banned_words = torch.zeros_like(logits, dtype=torch.bool)  # [rows, vocab]
        for i, more in enumerate(extra or [[]] * rows):
            recent = (output + more)[-max(len(w) for w in bad_words):]
            for word in bad_words:
                if word[-1] < vocab and (len(word) == 1 or recent[len(recent) - len(word) + 1:] == list(word[:-1])):
                    banned_words[i, word[-1]] = True
        logits = logits.masked_fill(banned_words, float("-inf"))
    short = [len(output) + len(more) < sp.min_tokens for more in (extra or [[]] * rows)] if stop_ids else []
    if any(short):  # [rows]: banned rows
        banned = ids(sorted(stop_ids))
        if len(banned):
            mask = torch.zeros_like(logits, dtype=torch.bool)  # [rows, vocab]
            mask[torch.tensor(short, device=dev).nonzero()[:, 0, None], banned] = True
            # a row where only stop tokens remain (a complete grammar) keeps them
            mask &= (torch.isfinite(logits) & ~mask).any(-1, keepdim=True)
            logits = logits.masked_fill(mask, float("-inf"))
    return unless_empty(logits, given)


def sequence_logits(rows: torch.Tensor, seq: "Sequence", prefixes: list[list[int]],
                    allowed: torch.Tensor | None = None, failures: dict[int, Exception] | None = None) -> torch.Tensor:
    """The logits ``seq`` draws from on ``rows [n, vocab]`` (the target's verify or prefill
    rows, or a draft model's), row i following its output plus ``prefixes[i]``: the
    grammar's mask (``allowed``: its masks, when already computed; a row the mask would
    leave empty, in a draft vocabulary narrower than the target's, keeps its logits), then
    ``process_logits``, after the request's own ``logits_processors`` (on rows of the target's
    width only; ``failures``: see ``processed_by_user``). The target and a draft model score
    alike, so the self-draft's drafts are the target's own choices."""
    if seq.sampling.logits_processors and rows.shape[-1] == (seq.vocab_size or rows.shape[-1]):
        rows = processed_by_user(rows, seq, prefixes, failures)
    if seq.grammar is not None:
        allowed = seq.grammar.allowed(prefixes) if allowed is None else allowed
        rows = unless_empty(constrain(rows, allowed[:, :rows.shape[-1]]), rows)
    if not seq.sampling.processes_logits:  # before the prompt and output are copied
        return rows
    return process_logits(rows, seq.sampling, seq.prompt_tensor, seq.output_ids, prefixes,
                          stop_ids=seq.eos_ids if seq.min_tokens_ban is None else seq.min_tokens_ban,
                          bad_words=seq.bad_words_ids)


def processed_by_user(rows: torch.Tensor, seq: "Sequence", prefixes: list[list[int]],
                      failures: dict[int, Exception] | None = None) -> torch.Tensor:
    """``seq``'s ``logits_processors`` (vLLM's) on ``rows [n, vocab]`` -> ``[n, vocab]``
    (float32), row i following its output plus ``prefixes[i]``: each function in turn, given
    lists of the ids before the row (the prompt's first when it takes three arguments) and
    a copy of the row (changing it in place is fine: the raw logits stay, for logprobs); what
    it returns is the row. With speculation a row may follow drafts that are then rejected,
    and a draft model's rows are processed too, so a processor must depend on nothing but
    the ids it is given. A row whose processor raises (or returns no such row, a nan, or no
    finite logit) stays as given; with ``failures`` (the target's rows) the exception is
    kept there by row: the engine fails the request only if verification reaches that row,
    as plain decoding would have called the processor there (a draft's row: ignored)."""
    out = rows.float().clone()  # [n, vocab]
    prompt, before = seq.ids[:seq.prompt_len], seq.output_ids
    takes_prompt = [arity(f) == 3 for f in seq.sampling.logits_processors]
    for i, more in enumerate(prefixes):
        row = out[i]  # [vocab]
        try:
            for f, three in zip(seq.sampling.logits_processors, takes_prompt):
                output = before + list(more)  # a list of its own for each call
                row = f(list(prompt), output, row) if three else f(output, row)
                if not (isinstance(row, torch.Tensor) and row.shape == out[i].shape):
                    raise ValueError(f"logits processor {f!r} returned {type(row).__name__} "
                                     f"{tuple(getattr(row, 'shape', ()))}; it must return the logits, a tensor "
                                     f"of shape [{out.shape[-1]}]")
                if row.isnan().any() or not row.isfinite().any():
                    raise ValueError(f"logits processor {f!r} returned logits with a nan or with no finite one "
                                     "(no token to draw)")
        except Exception as e:  # the user's code: this row (and so this request), not the batch
            if failures is not None:
                failures[i] = e
            row = rows[i]
        out[i] = row
    return out


def unless_empty(logits: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``logits [rows, vocab]``, except that a row with no finite logit is ``given``'s."""
    empty = ~torch.isfinite(logits).any(-1, keepdim=True)  # [rows, 1]
    return torch.where(empty, given.float(), logits) if empty.any() else logits


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row: ``probs [rows, vocab] -> ids [rows]``, by inverting the running sum
    of the row (in float64, so each token's share is exact to about 1e-16; unnormalised rows
    are fine). A zero-probability token is never drawn. Over a 150k vocabulary on a CPU this
    costs about a twentieth of ``torch.multinomial`` (which draws an exponential per token)."""
    cdf = probs.double().cumsum(-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):  # nan logits: no token to return
        raise RuntimeError("a distribution to sample from has no probability mass (nan logits?)")
    u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # < total: never past the end
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)  # first i with cdf[i] > u: p[i] > 0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A per-request generator on ``device``; an unseeded request draws a fresh seed."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g

"""Incremental detokenization for streaming, holding back text that could begin a stop string,
and where each token's text lies in a completion's text (logprobs' ``text_offset``)."""
from __future__ import annotations

from ..config import SamplingParams
from ..sequence import IncrementalText, held_back, output_text, settled_text


class TextStream(IncrementalText):
    """Turns committed token ids into text deltas that are safe to send.

    Decoding is incremental (``IncrementalText``: a window from the previous emission point,
    so the cost per step does not grow with the output; a character still incomplete waits
    for more tokens). While the request runs, the tail of the text that could be the start of
    a stop string is held back, so nothing at or past a stop is ever sent (the engine
    finishes the request as soon as a stop completes).
    """

    def __init__(self, tokenizer, sp: SamplingParams = SamplingParams(), context: tuple[int, ...] = ()):
        super().__init__(tokenizer, sp, context)
        self.sent = 0  # characters of self.text already sent

    def add(self, ids: list[int]) -> str:
        """Feed newly committed ids; return the text that may be sent now."""
        super().add(ids)
        safe = len(self.text) - held_back(self.text, self.sp.stop)
        if safe <= self.sent:
            return ""
        delta = self.text[self.sent:safe]
        self.sent = safe
        return delta

    def finish(self, ids: list[int], final_text: str | None) -> str:
        """The request finished with ``ids`` as its last committed tokens: the rest of its
        text. ``final_text`` is the engine's (cut before a stop string), or None to decode
        every id. (Not ``add``: the last tokens may complete a stop string.)"""
        self.ids.extend(ids)
        final = final_text if final_text is not None else settled_text(self.tok, self.ids, self.sp, self.context)
        sent = self.text[:self.sent]
        if not final.startswith(sent):  # cannot happen with a prefix-stable tokenizer
            return ""
        self.text, self.sent = final, len(final)
        return final[len(sent):]


class TokenOffsets:
    """Where each token's text starts in the text ``sp`` decodes from the tokens (special
    tokens kept or not, as ``output_text``), from ``start`` on: a token's part is what it adds
    to the decoding of the few tokens before it. So a word's leading space, a skipped or kept
    special token and a character split over tokens (it goes to the token that completes it)
    land where the decoded text has them, at a cost that does not grow with the text."""

    CONTEXT = 4  # tokens decoded before each one
    SPLIT = 3  # more, where those would begin inside a character (up to 4 bytes, a token each)

    def __init__(self, tokenizer, sp: SamplingParams, start: int = 0, context: tuple[int, ...] = ()):
        self.tok, self.sp = tokenizer, sp
        self.pos = start  # where the next token's text starts
        self.recent: list[int] = list(context[-(self.CONTEXT + self.SPLIT):])  # the first reads after the prompt's (``text_context``)

    def _length(self, ids: list[int]) -> int:
        """Characters of ``ids``' text, an unfinished character at its end left out."""
        return len(output_text(self.tok, ids, self.sp).rstrip("\ufffd"))

    def _context(self) -> list[int]:
        """The last ``CONTEXT`` tokens, or a few more where those would begin with the end of a
        character (its cut bytes read as U+FFFD, and a context of nothing else would count
        them as the next token's)."""
        for j in range(max(len(self.recent) - self.CONTEXT, 0), -1, -1):
            if not output_text(self.tok, self.recent[j:], self.sp).startswith("\ufffd"):
                return self.recent[j:]
        return self.recent[-self.CONTEXT:]

    def add(self, ids: list[int]) -> list[int]:
        """The offsets of ``ids``, the next tokens."""
        out = []
        for t in ids:
            out.append(self.pos)
            context = self._context()
            self.pos += max(self._length(context + [t]) - self._length(context), 0)
            self.recent = (self.recent + [t])[-(self.CONTEXT + self.SPLIT):]
        return out


def prompt_offsets(tokenizer, text: str, ids: list[int]) -> list[int]:
    """Where each of ``ids`` (``text`` tokenized) starts in ``text`` as written: each token
    spans from the end of the one before to its own end in the tokenizer's character offsets,
    so a token the tokenizer added (a BOS) takes no room and a special token written in the
    text takes its own; a character split over tokens (their spans overlap) goes to the token
    that completes it, as ``TokenOffsets`` gives an output's. A tokenizer without offsets (a slow one) decodes them (``TokenOffsets``)."""
    try:
        encoded = tokenizer(text, return_offsets_mapping=True)
        spans = encoded["offset_mapping"] if list(encoded["input_ids"]) == list(ids) else None
    except (NotImplementedError, ValueError, TypeError, KeyError):
        spans = None
    if spans is None:
        return [min(o, len(text)) for o in TokenOffsets(tokenizer, SamplingParams(skip_special_tokens=False)).add(ids)]
    offsets, end = [], 0
    for (_, stop), (after, after_stop) in zip(spans, [*spans[1:], (len(text), len(text))]):
        offsets.append(end)
        if after < min(stop, after_stop):  # a character split with the next token: the one that completes it has it
            stop = after
        end = min(max(end, stop), len(text))
    return offsets

"""Incremental detokenization for streaming, holding back text that could begin a stop string."""
from __future__ import annotations

from ..config import SamplingParams
from ..sequence import held_back, output_text


class TextStream:
    """Turns committed token ids into text deltas that are safe to send.

    Decoding is incremental (a window from the previous emission point, so the cost per
    step does not grow with the output); a window whose text ends in an incomplete UTF-8
    character (``\\ufffd``) waits for more tokens. While the request runs, the tail of the
    text that could be the start of a stop string is held back, so nothing at or past a
    stop is ever sent (the engine finishes the request as soon as a stop completes).
    """

    def __init__(self, tokenizer, sp: SamplingParams = SamplingParams()):
        self.tok = tokenizer
        self.sp = sp
        self.ids: list[int] = []
        self.prefix = 0  # window start (token index)
        self.read = 0  # tokens whose text is in self.text
        self.text = ""  # decoded so far (complete characters)
        self.sent = 0  # characters of self.text already sent

    def _decode(self, ids: list[int]) -> str:
        return output_text(self.tok, ids, self.sp)

    def add(self, ids: list[int]) -> str:
        """Feed newly committed ids; return the text that may be sent now."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
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
        final = final_text if final_text is not None else self._decode(self.ids)
        sent = self.text[:self.sent]
        if not final.startswith(sent):  # cannot happen with a prefix-stable tokenizer
            return ""
        self.text, self.sent = final, len(final)
        return final[len(sent):]

"""Draft/target tokenizer compatibility.

Speculative decoding hands token *ids* from the draft model to the target model, so the
pairing is only lossless-in-practice when both tokenizers agree token by token: the same id
must mean the same string, the same text must split into the same ids, and the control
tokens (bos/eos/...) must sit at the same ids. Equal vocabulary size proves none of that
(two BPE vocabularies of the same size can differ in every entry, or hold the same entries
with different merges), while unequal sizes are often fine: a model whose embedding matrix
has padded rows, or a tokenizer with a few extra added tokens at the end, still agrees on
every id both sides have.

:func:`compare_tokenizers` checks, for two ``transformers`` tokenizers (fast or slow):

* every id in the shared range ``range(min(len(target), len(draft)))`` maps to the same
  token string (ids beyond the shared range are allowed);
* every special token of either side (bos, eos, pad, unk, ``all_special_tokens`` and added
  special tokens) that both vocabularies contain has the same id in both, and the target's
  bos and eos exist in the draft (a draft that merely *declares* another eos, e.g. a base
  model drafting for its instruct sibling, is only noted);
* for two fast BPE tokenizers, the merge lists are identical (same pairs, same order);
* a fixed probe text (English, code, digits, unicode, whitespace runs, shared special
  tokens) encodes to identical ids with ``add_special_tokens=False`` - this covers
  normalizers, pre-tokenizers and non-BPE models.

:func:`require_compatible` turns a failed comparison into a one-line ``ValueError``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROBE_TEXT", "VocabReport", "compare_tokenizers", "require_compatible"]

# Mixed content meant to exercise normalizers, pre-tokenizers and merges: contractions,
# capitalisation, code with tabs/indentation, long digit runs, decimals, dates, accents,
# CJK, Cyrillic, Arabic, emoji (incl. ZWJ sequences), and runs of spaces/newlines/CRLF.
PROBE_TEXT = (
    "Hello, world! The quick brown fox jumps over the lazy dog. I'm sure they'll say "
    "it's DON'T-STOP: hello HELLO hElLo.\n"
    "def fibonacci(n: int) -> list[int]:\n"
    "    a, b = 0, 1\n"
    "\tout = []  # tabs\tand   spaces\n"
    "    for _ in range(n):\n"
    "        out.append(a); a, b = b, a + b\n"
    "    return out\n\n\n"
    "if (x != y && z >= 10) { printf(\"%d\\n\", x++); } // C-style\n"
    "<div class=\"note\">a &amp; b</div> https://example.com/path?q=1&r=2#frag\n"
    "1234567890 0.000123 3.14159 -42 1e-10 2024-01-31 12:34:56 1,000,000 $9.99 50%\n"
    "naïve café résumé Straße Ærøskøbing ñandú\n"
    "日本語のテキスト 中文文本 한국어 텍스트 Привет, мир! مرحبا بالعالم שלום\n"
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇯🇵 ✓ → ∑ ∞ ≠ ≤ ½ ©®™\n"
    "   leading spaces, trailing spaces   \r\nCRLF line\r\n\n\n\n"
    "          ten spaces\t\t\ttabs\u00a0nbsp\u3000ideographic space\u200bzwsp"
)

_ROLES = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class VocabReport:
    """Result of :func:`compare_tokenizers`.

    ``problems`` lists at most ``limit`` human-readable disagreements (differing ids first,
    in id order, then special tokens, merges and the probe text), followed by a count line
    when some were left off. ``differing_ids`` counts shared ids whose tokens differ;
    ``num_problems`` counts every problem, listed or not. ``notes`` holds harmless
    differences worth knowing (e.g. the two sides declare different eos tokens that both
    vocabularies hold at the same ids).
    """

    compatible: bool
    shared: int
    target_size: int
    draft_size: int
    problems: list[str]
    differing_ids: int = 0
    num_problems: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One-line verdict."""
        if self.compatible:
            line = f"compatible: {self.shared} shared ids agree"
            if self.target_size != self.draft_size:
                line += f" (target has {self.target_size} tokens, draft {self.draft_size})"
            return line
        first = self.problems[0] if self.problems else "unknown problem"
        if self.differing_ids:
            line = f"incompatible: {self.differing_ids} of {self.shared} ids differ; first: {first}"
            others = self.num_problems - self.differing_ids
            if others > 0:
                line += f"; plus {others} other problem{'s' if others != 1 else ''}"
        else:
            n = self.num_problems
            line = f"incompatible: {n} problem{'s' if n != 1 else ''}; first: {first}"
        return " ".join(line.split())  # guarantee a single line


def _tok_repr(token: Any) -> str:
    return "None" if token is None else repr(str(token))


def _id_to_token(tok, vocab: dict[str, int], size: int) -> list[Any]:
    """``convert_ids_to_tokens(i)`` for ``i < size``, via the inverted vocabulary."""
    inverse = dict(zip(vocab.values(), vocab.keys()))  # C-speed; on duplicate ids the last wins
    table: list[Any] = list(map(inverse.get, range(size)))
    if len(inverse) < size or None in table:  # ids the dict does not name: ask the tokenizer
        for i, token in enumerate(table):
            if token is None:
                try:
                    table[i] = tok.convert_ids_to_tokens(i)
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot name stays None
                    pass
    return table


class _Side:
    """Per-tokenizer facts, each computed at most once."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.size = len(tok)
        self.backend = tok.backend_tokenizer if getattr(tok, "is_fast", False) and hasattr(
            tok, "backend_tokenizer") else None
        self._vocab: dict[str, int] | None = None
        self._model: tuple[str | None, str | None] | None = None

    @property
    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = self.tok.get_vocab()
        return self._vocab

    def id_of(self, token: str) -> int | None:
        """The id of ``token`` (added tokens included), or None when it is not in the vocab."""
        if self.backend is not None and self._vocab is None:
            return self.backend.token_to_id(token)
        return self.vocab.get(token)

    @property
    def model(self) -> tuple[str | None, str | None]:
        """(model type, model JSON text) of a fast tokenizer's backend, else (None, None)."""
        if self._model is None:
            self._model = (None, None)
            if self.backend is not None:
                try:  # the model alone: cheaper than to_str(), which also carries the rest
                    state = self.backend.model.__getstate__()
                    text = state.decode("utf-8") if isinstance(state, (bytes, bytearray)) else str(state)
                    self._model = (type(self.backend.model).__name__, text)
                except Exception:  # noqa: BLE001 - fall back to the documented serialisation
                    try:
                        model = json.loads(self.backend.to_str()).get("model") or {}
                        self._model = (model.get("type"), json.dumps(model, ensure_ascii=False))
                    except Exception:  # noqa: BLE001 - not serialisable: the probe text still runs
                        pass
        return self._model

    def added_below(self, size: int) -> dict[int, str] | None:
        try:
            return {i: str(t) for i, t in self.tok.added_tokens_decoder.items() if i < size}
        except Exception:  # noqa: BLE001
            return None


def _same_ids_fast(t: _Side, d: _Side, shared: int) -> bool:
    """True when cheap evidence proves every shared id names the same token: identical
    backend models (vocab and settings byte for byte; merges are checked apart) and
    identical added tokens in range."""
    t_kind, t_text = t.model
    d_kind, d_text = d.model
    if t_text is None or d_text is None or t_kind != d_kind:
        return False
    if t_text != d_text:  # BPE: the merges may differ (reported apart); the rest must not
        t_tail, d_tail = _merges_tail(t_text), _merges_tail(d_text)
        if t_tail is None or d_tail is None or \
                t_text[:len(t_text) - len(t_tail)] != d_text[:len(d_text) - len(d_tail)]:
            return False
    t_added, d_added = t.added_below(shared), d.added_below(shared)
    return t_added is not None and t_added == d_added


def _special_tokens(tok) -> set[str]:
    out: set[str] = set()
    for role in _ROLES:
        value = getattr(tok, f"{role}_token", None)
        if value is not None:
            out.add(str(value))
    try:
        out.update(str(t) for t in (tok.all_special_tokens or []))
    except Exception:  # noqa: BLE001 - older/odd tokenizers
        pass
    try:
        for added in (tok.added_tokens_decoder or {}).values():
            if getattr(added, "special", False):
                out.add(str(added))
    except Exception:  # noqa: BLE001
        pass
    return out


def _merges_tail(text: str) -> str | None:
    """The model JSON from its ``"merges"`` list to the end, found without parsing.

    Token strings are JSON-escaped, so ``"merges":[`` can only be the key itself (a vocab
    entry named ``merges`` maps to an int). Equal tails mean equal merge lists."""
    i = text.rfind('"merges":')
    if i < 0 or text[i + 9:i + 10] != "[":
        return None
    return text[i + 9:]


def _merge(item: Any) -> tuple[str, ...]:
    if isinstance(item, str):
        return tuple(item.split(" ", 1))
    return tuple(item)


_DECODER = json.JSONDecoder()


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (binary search on C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _item_at(text: str, pos: int) -> tuple[Any, int]:
    """(the JSON list item starting at ``pos`` after whitespace, the position after it and
    its comma), or (None, pos) at the end of the list."""
    n = len(text)
    while pos < n and text[pos] in " \t\n\r":
        pos += 1
    if pos >= n or text[pos] == "]":
        return None, pos
    item, pos = _DECODER.raw_decode(text, pos)
    while pos < n and text[pos] in " \t\n\r":
        pos += 1
    return item, pos + 1 if pos < n and text[pos] == "," else pos


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_ESCAPE = re.compile(r"\\.")


def _first_merge_difference(t_tail: str, d_tail: str) -> tuple[int, Any, Any] | None:
    """(index, target item, draft item) of the first differing merge of two serialised merge
    lists, found without a full parse (regexes and C-speed compares: a late difference in
    150k merges costs ~0.2 s instead of ~0.8 s for ``json.loads`` of both lists). None when
    the layout is unusual (the caller then parses in full)."""
    if t_tail[1:2] not in ("[", '"') or t_tail[1:2] != d_tail[1:2]:
        return None
    pairs = t_tail[1] == "["  # [["a","b"],...] (current tokenizers) or ["a b",...] (older)
    sep = "],[" if pairs else '","'
    p = _common_prefix(t_tail, d_tail)
    # the last item boundary before p (a separator outside any token string): the items
    # before it are the same on both sides
    k = t_tail.rfind(sep, 0, p + 1)
    while k >= 0 and _JSON_ESCAPE.sub("", t_tail[:k + 1]).count('"') % 2:
        k = t_tail.rfind(sep, 0, k + 2)
    if k < 0:
        c, count = 0, 0
    else:
        c = k + 1
        skeleton = _JSON_STRING.sub("", t_tail[:c])  # brackets and commas only
        count = skeleton.count("[") - 1 if pairs else skeleton.count(",") + 1
    t_pos = d_pos = c + 1
    try:
        while True:  # the differing item is at most a step or two past the boundary
            (a, t_pos), (b, d_pos) = _item_at(t_tail, t_pos), _item_at(d_tail, d_pos)
            if a is None or b is None or _merge(a) != _merge(b):
                break
            count += 1
    except ValueError:
        return None
    if a is None and b is None:
        return None
    return count, a, b


def _merge_problems(t: _Side, d: _Side) -> list[str]:
    t_type, t_text = t.model
    d_type, d_text = d.model
    if t_text is None or d_text is None:
        return []
    if t_type != d_type:
        return [f"tokenizer models differ: target {t_type} vs draft {d_type}"]
    if t_type != "BPE":
        return []
    t_tail, d_tail = _merges_tail(t_text), _merges_tail(d_text)
    found = None
    if t_tail is not None and d_tail is not None:
        if t_tail == d_tail:
            return []  # fast path: byte-identical merge lists
        found = _first_merge_difference(t_tail, d_tail)
    if found is None:  # unusual serialisation: parse both lists in full
        t_merges = [_merge(m) for m in json.loads(t_text).get("merges") or []]
        d_merges = [_merge(m) for m in json.loads(d_text).get("merges") or []]
        i = next((i for i, (a, b) in enumerate(zip(t_merges, d_merges)) if a != b),
                 min(len(t_merges), len(d_merges)))
        if i == len(t_merges) == len(d_merges):
            return []  # same merges, serialised differently
        found = (i, t_merges[i] if i < len(t_merges) else None, d_merges[i] if i < len(d_merges) else None)
    i, a, b = found
    if a is None or b is None:
        longer, extra = ("target", a) if b is None else ("draft", b)
        return [f"merge lists differ in length: the first {i} merges agree, then the {longer} "
                f"has more (merge #{i} {' '.join(_merge(extra))!r})"]
    return [f"merge #{i} differs: target {' '.join(_merge(a))!r} vs draft {' '.join(_merge(b))!r}"]


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _probe_problems(target_tok, draft_tok, shared_specials: list[str]) -> list[str]:
    probes = [("probe text", PROBE_TEXT)]
    if shared_specials:
        probes.append(("probe text with special tokens",
                       "A" + " x".join(shared_specials) + "\nend" + "".join(shared_specials)))
    out = []
    for name, text in probes:
        try:
            t_ids, d_ids = _encode(target_tok, text), _encode(draft_tok, text)
        except Exception as e:  # noqa: BLE001
            out.append(f"{name}: encoding failed: {type(e).__name__}: {e}")
            continue
        if t_ids == d_ids:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(t_ids, d_ids)) if a != b),
                   min(len(t_ids), len(d_ids)))
        ta = t_ids[pos] if pos < len(t_ids) else None
        da = d_ids[pos] if pos < len(d_ids) else None
        tt = target_tok.convert_ids_to_tokens(ta) if ta is not None else None
        dt = draft_tok.convert_ids_to_tokens(da) if da is not None else None
        out.append(f"{name} encodes differently ({len(t_ids)} vs {len(d_ids)} ids); first at "
                   f"position {pos}: target {ta} {_tok_repr(tt)} vs draft {da} {_tok_repr(dt)}")
    return out


def compare_tokenizers(target_tok, draft_tok, limit: int = 10) -> VocabReport:
    """Compare two ``transformers`` tokenizers token by token; see the module docstring."""
    limit = max(0, int(limit))
    t_size, d_size = len(target_tok), len(draft_tok)
    shared = min(t_size, d_size)

    t, d = _Side(target_tok), _Side(draft_tok)

    # 1. every shared id names the same token
    id_problems: list[str] = []
    differing = 0
    if not _same_ids_fast(t, d, shared):
        t_table = _id_to_token(target_tok, t.vocab, shared)
        d_table = _id_to_token(draft_tok, d.vocab, shared)
        if t_table != d_table:
            for i, (a, b) in enumerate(zip(t_table, d_table)):
                if a != b:
                    differing += 1
                    if len(id_problems) < limit:
                        id_problems.append(f"id {i} {_tok_repr(a)} vs {_tok_repr(b)}")

    # 2. special tokens: same id wherever both have them; target bos/eos present in draft
    other: list[str] = []
    notes: list[str] = []
    for role in ("bos", "eos"):
        t_s, d_s = getattr(target_tok, f"{role}_token", None), getattr(draft_tok, f"{role}_token", None)
        t_s = None if t_s is None else str(t_s)
        d_s = None if d_s is None else str(d_s)
        if t_s is not None and d.id_of(t_s) is None:
            other.append(f"target {role} token {t_s!r} (id {t.id_of(t_s)}) is missing from the draft")
        elif t_s is not None and d_s is not None and t_s != d_s:
            # Not a problem by itself (e.g. a base draft for an instruct target): both tokens
            # exist and, checked below, sit at the same ids; the target's eos decides.
            notes.append(f"{role} token differs: target {t_s!r} (id {t.id_of(t_s)}) vs "
                         f"draft {d_s!r} (id {d.id_of(d_s)})")
    shared_specials = []
    ids = {s: (t.id_of(s), d.id_of(s)) for s in _special_tokens(target_tok) | _special_tokens(draft_tok)}
    for s, (ti, di) in sorted(ids.items(), key=lambda kv: (kv[1][0] if kv[1][0] is not None else
                                                         kv[1][1] if kv[1][1] is not None else -1, kv[0])):
        if ti is not None and di is not None:
            if ti != di:
                other.append(f"special token {s!r}: target id {ti} vs draft id {di}")
            else:
                shared_specials.append(s)

    # 3. identical BPE merges (fast tokenizers)
    other.extend(_merge_problems(t, d))

    # 4. the probe text splits into the same ids
    other.extend(_probe_problems(target_tok, draft_tok, shared_specials))

    num = differing + len(other)
    # at most `limit` lines; when ids differ, still show up to half the lines of other kinds
    k_other = min(len(other), max(limit // 2, limit - len(id_problems)))
    k_ids = min(len(id_problems), limit - k_other)
    listed = id_problems[:k_ids] + other[:k_other]
    if num > len(listed):
        rest = num - len(listed)
        detail = [f"{n} {what}" for n, what in ((differing - k_ids, "differing ids"),
                                                 (len(other) - k_other, "other")) if n]
        listed.append(f"... and {rest} more problem{'s' if rest != 1 else ''} ({', '.join(detail)})")
    return VocabReport(compatible=num == 0, shared=shared, target_size=t_size, draft_size=d_size,
                       problems=listed, differing_ids=differing, num_problems=num, notes=notes)


def require_compatible(target_tok, draft_tok) -> None:
    """Raise ``ValueError`` (one line) unless the draft tokenizer agrees with the target's."""
    report = compare_tokenizers(target_tok, draft_tok)
    if not report.compatible:
        raise ValueError(f"draft tokenizer is incompatible with the target: {report.summary()}")

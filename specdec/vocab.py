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
  special tokens) that both vocabularies contain has the same id in both; the target's bos
  and eos must exist in the draft, and where both sides declare a bos/eos they must be the
  same token;
* for two fast BPE tokenizers, the merge lists are identical (same pairs, same order);
* a fixed probe text (English, code, digits, unicode, whitespace runs, shared special
  tokens) encodes to identical ids with ``add_special_tokens=False`` - this covers
  normalizers, pre-tokenizers and non-BPE models.

:func:`require_compatible` turns a failed comparison into a one-line ``ValueError``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
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
    ``num_problems`` counts every problem, listed or not.
    """

    compatible: bool
    shared: int
    target_size: int
    draft_size: int
    problems: list[str]
    differing_ids: int = 0
    num_problems: int = 0

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


def _id_to_token(tok, size: int) -> list[Any]:
    """``convert_ids_to_tokens(i)`` for ``i < size``, via the inverted vocabulary."""
    table: list[Any] = [None] * size
    for token, i in tok.get_vocab().items():
        if 0 <= i < size and table[i] is None:
            table[i] = token
    holes = [i for i, t in enumerate(table) if t is None]
    if holes:  # ids the vocabulary dict does not name: ask the tokenizer directly
        for i in holes:
            try:
                table[i] = tok.convert_ids_to_tokens(i)
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot name stays None
                table[i] = None
    return table


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


def _backend_model(tok) -> dict | None:
    if not getattr(tok, "is_fast", False) or not hasattr(tok, "backend_tokenizer"):
        return None
    try:
        return json.loads(tok.backend_tokenizer.to_str()).get("model")
    except Exception:  # noqa: BLE001 - no serialisable backend: the probe text still runs
        return None


def _merge(item: Any) -> tuple[str, ...]:
    if isinstance(item, str):
        return tuple(item.split(" ", 1))
    return tuple(item)


def _merge_problems(target_tok, draft_tok) -> list[str]:
    tm, dm = _backend_model(target_tok), _backend_model(draft_tok)
    if tm is None or dm is None:
        return []
    t_type, d_type = tm.get("type"), dm.get("type")
    if t_type != d_type:
        return [f"tokenizer models differ: target {t_type} vs draft {d_type}"]
    if t_type != "BPE":
        return []
    t_merges = [_merge(m) for m in tm.get("merges") or []]
    d_merges = [_merge(m) for m in dm.get("merges") or []]
    if t_merges == d_merges:
        return []
    for i, (a, b) in enumerate(zip(t_merges, d_merges)):
        if a != b:
            return [f"merge #{i} differs: target {' '.join(a)!r} vs draft {' '.join(b)!r} "
                    f"({len(t_merges)} vs {len(d_merges)} merges)"]
    return [f"merge lists differ in length: target {len(t_merges)} vs draft {len(d_merges)} "
            f"merges (first {min(len(t_merges), len(d_merges))} agree)"]


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

    # 1. every shared id names the same token
    t_table, d_table = _id_to_token(target_tok, shared), _id_to_token(draft_tok, shared)
    id_problems: list[str] = []
    differing = 0
    if t_table != d_table:
        for i, (a, b) in enumerate(zip(t_table, d_table)):
            if a != b:
                differing += 1
                if len(id_problems) < limit:
                    id_problems.append(f"id {i} {_tok_repr(a)} vs {_tok_repr(b)}")

    # 2. special tokens: same id wherever both have them; target bos/eos present in draft
    other: list[str] = []
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    t_specials, d_specials = _special_tokens(target_tok), _special_tokens(draft_tok)
    for role in ("bos", "eos"):
        t_s, d_s = getattr(target_tok, f"{role}_token", None), getattr(draft_tok, f"{role}_token", None)
        t_s = None if t_s is None else str(t_s)
        d_s = None if d_s is None else str(d_s)
        if t_s is not None and t_s not in d_vocab:
            other.append(f"target {role} token {t_s!r} (id {t_vocab.get(t_s)}) is missing from the draft")
        elif t_s is not None and d_s is not None and t_s != d_s:
            other.append(f"{role} token differs: target {t_s!r} (id {t_vocab.get(t_s)}) vs "
                         f"draft {d_s!r} (id {d_vocab.get(d_s)})")
    shared_specials = []
    for s in sorted(t_specials | d_specials, key=lambda s: (t_vocab.get(s, d_vocab.get(s, -1)), s)):
        if s in t_vocab and s in d_vocab:
            if t_vocab[s] != d_vocab[s]:
                other.append(f"special token {s!r}: target id {t_vocab[s]} vs draft id {d_vocab[s]}")
            else:
                shared_specials.append(s)

    # 3. identical BPE merges (fast tokenizers)
    other.extend(_merge_problems(target_tok, draft_tok))

    # 4. the probe text splits into the same ids
    other.extend(_probe_problems(target_tok, draft_tok, shared_specials))

    num = differing + len(other)
    listed = (id_problems + other)[:limit]
    if num > len(listed):
        rest = num - len(listed)
        detail = []
        if differing > len(id_problems):
            detail.append(f"{differing - len(id_problems)} differing ids")
        unlisted_other = rest - max(0, differing - len(id_problems))
        if unlisted_other:
            detail.append(f"{unlisted_other} other")
        listed.append(f"... and {rest} more problem{'s' if rest != 1 else ''} ({', '.join(detail)})")
    return VocabReport(compatible=num == 0, shared=shared, target_size=t_size, draft_size=d_size,
                       problems=listed, differing_ids=differing, num_problems=num)


def require_compatible(target_tok, draft_tok) -> None:
    """Raise ``ValueError`` (one line) unless the draft tokenizer agrees with the target's."""
    report = compare_tokenizers(target_tok, draft_tok)
    if not report.compatible:
        raise ValueError(f"draft tokenizer is incompatible with the target: {report.summary()}")

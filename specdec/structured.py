"""Structured outputs: the output's text must follow a JSON schema, a regular expression, a
choice of strings or a grammar (``StructuredOutputs``), through llguidance's matcher (one
of vLLM's structured-output backends).

The constraint is a mask on the target's logits, applied before any other processing, on
every row the target scores: the prefill's last row and each verify row. Verify row ``i``
follows the committed ids plus the drafts before it, so each row gets its own mask: the
matcher consumes the row's draft path, writes the mask, and rolls back. A draft token the
grammar forbids has ``p = 0`` on its row, so it is rejected there (greedy and sampled
alike) and the rows after it are never reached. The constrained target is thus verified
exactly as an unconstrained one: greedy output equals the constrained target's own, and
sampled output follows its distribution. A draft model drafts under the same masks (its
``q`` is the masked distribution), and an n-gram chain, or each branch of an n-gram tree,
stops before its first draft the grammar forbids (``Matcher.valid_prefix``).

A thinking model's reasoning is left free (vLLM's rule with a reasoning parser): a matcher
with a ``gate`` (the text ``</think>``, or a pattern: GPT-OSS's final channel frame) allows
everything until the output's text holds the gate, however its tokens spell it (the
reasoning parser splits the text there too), and the grammar starts after the token that
completes it. Rows before the gate, in the committed output or in a row's drafts, are
unconstrained.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import threading

import torch

from .config import StructuredOutputs
from .sequence import common_prefix, ids_to_hold

log = logging.getLogger("specdec.structured")
GATE_SPAN = 128  # characters a pattern gate's match may span (GPT-OSS's final channel frame: answer.FINAL_GATE)
_BITS = torch.arange(32, dtype=torch.int32)  # a bitmask word's bit positions (token j * 32 + b)

# llguidance's grammar formats by StructuredOutputs kind (json_object: any JSON object)
_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "grammar",
            "grammar": "grammar"}  # grammar: Lark, or llama.cpp's GBNF (converted to Lark)


def grammar_text(so: StructuredOutputs) -> str:
    """``so``'s constraint as the text of its llguidance format. A JSON schema's objects that
    list their ``properties`` take no others unless they say so (``closed_objects``). A
    choice is one lexer token of a Lark grammar (llguidance's own ``choice`` format makes a
    parser item per string, and fails past 2000 of them)."""
    if so.json_object:
        return '{"type": "object"}'
    if so.choice is not None:
        return "start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, so.choice))  # escaped: Lark takes no raw DEL
    if so.json is not None:
        schema = json.loads(so.json)
        return json.dumps(closed_objects(schema, opened=extended_refs(schema)))
    if so.regex is not None:
        return ascii_classes(so.regex)
    return getattr(so, so.kind)


ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}  # \d, \w as xgrammar and JavaScript read them


def ascii_classes(regex: str) -> str:
    """``regex`` with ``\\d`` and ``\\w`` (``\\D``, ``\\W`` outside brackets) as ASCII classes,
    as vLLM's default grammar backend (xgrammar) reads them: llguidance takes Rust's regex
    syntax, where they match any Unicode digit or letter, so a small model's constrained year
    could come out in Arabic-Indic digits. Escapes and bracket classes (nested ones, a ``]``
    first in its class) are followed; nothing else changes."""
    out, i, depth, first = [], 0, 0, False  # depth: bracket classes open; first: at a class's start
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            body = ASCII_CLASSES.get(e.lower())
            if body is not None and not (e.isupper() and depth):
                out.append(body if depth else f"[{'^' if e.isupper() else ''}{body}]")
            else:
                out.append(regex[i:i + 2])
            i, first = i + 2, False
            continue
        if c == "[":
            depth, first = depth + 1, True
            out.append(c)
            i += 1
            if i < len(regex) and regex[i] == "^":
                out.append("^")
                i += 1
            continue
        if c == "]" and depth and not first:
            depth -= 1
        out.append(c)
        i, first = i + 1, False
    return "".join(out)


COMBINATORS = ("allOf", "anyOf", "oneOf")


def adds_up(node: dict, key: str) -> bool:
    """Whether the branches under combinator ``key`` of ``node`` add their properties to
    others' (every ``allOf`` branch; any combinator's beside the node's own ``properties``)."""
    return key == "allOf" or isinstance(node.get("properties"), dict)


def extended_refs(schema) -> set[str]:
    """The ``$ref``s that stand where properties add up with others' (an ``allOf`` branch, or
    a combinator branch beside ``properties``): the definitions they name stay open too."""
    out: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for key in COMBINATORS:
                if isinstance(node.get(key), list) and adds_up(node, key):
                    out.update(b["$ref"] for b in node[key] if isinstance(b, dict) and isinstance(b.get("$ref"), str))
            for key, value in node.items():
                if key not in ("enum", "const", "default", "examples"):
                    walk(value)

    walk(schema)
    return out


def pointer(name: str) -> str:
    """``name`` as one segment of a JSON pointer (``~`` and ``/`` escaped)."""
    return name.replace("~", "~0").replace("/", "~1")


def closed_objects(schema, close: bool = True, opened: set[str] = frozenset(), where: str = "#"):
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists
    ``properties`` and sets neither ``additionalProperties`` nor ``patternProperties``: as
    vLLM's default grammar backend (xgrammar) and OpenAI's strict mode read a schema, so that
    a tool's arguments or an answer hold only the fields it declares (llguidance, like JSON
    Schema, allows others by default). An object without ``properties`` stays free-form, and
    so do the parts whose properties add up with others' (``close`` false): an object beside
    ``allOf``/``anyOf``/``oneOf`` branches and the branches of its combinators, and every
    ``allOf`` branch (closed apart, each would refuse the others' properties), written in
    place or as definitions their ``$ref`` names (``opened``, by the reference's path;
    ``where``: this part's path)."""
    if isinstance(schema, list):
        return [closed_objects(x, opened=opened, where=f"{where}/{i}") for i, x in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        at = f"{where}/{pointer(key)}"
        if key in ("enum", "const", "default", "examples"):  # values, not schemas
            out[key] = value
        elif key in ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas") and \
                isinstance(value, dict):  # name -> schema
            out[key] = {name: closed_objects(sub, close=f"{at}/{pointer(name)}" not in opened, opened=opened,
                                             where=f"{at}/{pointer(name)}") for name, sub in value.items()}
        elif key in COMBINATORS and isinstance(value, list):
            out[key] = [closed_objects(x, close=not adds_up(schema, key), opened=opened, where=f"{at}/{i}")
                        for i, x in enumerate(value)]
        else:
            out[key] = closed_objects(value, opened=opened, where=at)
    if close and isinstance(out.get("properties"), dict) and \
            not {"additionalProperties", "patternProperties", *COMBINATORS} & out.keys():
        out["additionalProperties"] = False
    return out


class Grammars:
    """Compiles ``StructuredOutputs`` against one model's tokenizer. The llguidance tokenizer
    is built on first use (about 1 s for a 150k vocabulary) and kept; ``eos_ids`` are the
    tokens that end the output once the grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._lltokenizer = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        """llguidance's tokenizer, built on the first call (a server calls this in a thread
        at startup, so that its first structured request does not wait for it)."""
        import llguidance.hf

        with self._lock:
            if self._lltokenizer is None:  # (a head narrower than the tokenizer: Apertus 1.5's, pruned to the text
                # tokens; the masks keep the head's columns)
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=max(self.vocab_size,
                                                                                             len(self.tokenizer)),
                                                                 eos_token=sorted(self.eos_ids) or None)
            return self._lltokenizer

    def warm(self) -> None:
        """Build the tokenizer now (a server's startup thread). A tokenizer llguidance cannot
        take (not a fast one) fails here quietly, and with a clear error on first use."""
        try:
            self.lltokenizer()
        except Exception as e:  # noqa: BLE001 - reported when a request needs it
            log.debug("llguidance tokenizer not built: %s", e)

    def matcher(self, so: StructuredOutputs, gate: "str | re.Pattern" = "") -> "Matcher":
        """A fresh matcher for one sequence (``ValueError`` naming the field when the
        schema, regex or grammar is invalid); ``gate``: the grammar starts after the output's
        text holds this (a reasoning's end) or a match of it, from the start when empty."""
        import llguidance

        try:
            tokenizer = self.lltokenizer()
        except ValueError as e:  # llguidance takes fast (tokenizers) tokenizers only
            raise ValueError(f"structured outputs need this model's tokenizer in llguidance: {e}") from None

        def invalid(error) -> ValueError:  # llguidance's message on one line (it may quote the whole grammar)
            message = " ".join(str(error).split())
            return ValueError(f"structured_outputs.{so.kind}: {message[:500]}{'...' if len(message) > 500 else ''}")

        try:
            grammar = llguidance.grammar_from(_FORMATS[so.kind], grammar_text(so))
        except ValueError as e:
            raise invalid(e) from None
        matcher = on_big_stack(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0))
        if matcher.is_error():
            raise invalid(matcher.get_error())
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        return Matcher(matcher, self.vocab_size, self.eos_ids, gate, decode, tokenizer.vocab_size)


class Matcher:
    """One sequence's grammar state, at the end of its committed output between steps.
    ``gate``: text after which the grammar starts ("" once passed, or from the start), or a
    pattern whose match (at most ``GATE_SPAN`` characters) it starts after, sought in
    ``decode`` of the output's ids (special tokens kept, as the reasoning parser reads)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int], gate: "str | re.Pattern" = "", decode=None,
                 table: int | None = None):
        self._m, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self._table = table or vocab_size  # llguidance's tokens (the logits' width, or the tokenizer's if wider)
        self._words = (self._table + 31) // 32  # the bitmask's int32 words per row
        self.gate, self._decode = gate, decode
        # the output's last ids while the gate is closed: a spelling of the gate ending in later
        # tokens starts in these (each token spells one character of it at least)
        self._tail: list[int] = []

    def copy(self) -> "Matcher":
        twin = Matcher(self._m.deep_copy(), self.vocab_size, self.eos_ids, self.gate, self._decode, self._table)
        twin._tail = list(self._tail)
        return twin

    def opens_after(self, tokens: list[int]) -> int | None:
        """How many of ``tokens`` (after the committed output) come before the grammar
        starts: 0 with the gate passed, None when ``tokens`` do not complete it."""
        if not self.gate:
            return 0
        # most rows: one decode, which does not hold the gate
        end = ids_to_hold(self._decode, self._tail + list(tokens), self.gate, len(self._tail))
        return None if end is None else end - len(self._tail)

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """``[rows, vocab]`` bool: the tokens the grammar allows after the committed output
        plus ``paths[i]`` (a row's drafts before it). A row behind a forbidden draft is never
        reached: it allows everything, as does a row before the gate. An empty mask (the
        matcher failed) allows EOS only."""
        words = torch.full((len(paths), self._words), -1, dtype=torch.int32)  # [rows, words]
        consumed: list[int] = []  # drafts the matcher holds beyond the committed output
        for i, path in enumerate(paths):
            j = self.opens_after(path)
            if j is None:  # still reasoning on this row: free
                continue
            path = path[j:]
            keep = common_prefix(consumed, path)
            if keep < len(consumed):
                self._m.rollback(len(consumed) - keep)
                del consumed[keep:]
            more = path[keep:]
            n = self._m.try_consume_tokens(more) if more else 0
            consumed += more[:n]
            # a forbidden draft on this path: the row is never reached; but EOS after the
            # grammar's end is allowed (the matcher consumes none), as plain decoding with
            # ignore_eos meets it, and its row allows EOS only, as plain decoding's
            if n < len(more) and not (self._m.is_stopped() and set(more[n:]) <= self.eos_ids):
                continue
            row = words[i]
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if consumed:
            self._m.rollback(len(consumed))
        return self._unpack(words)

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        """llguidance's bitmask rows ``[rows, words]`` int32 -> ``[rows, vocab]`` bool, an
        empty row (a failed matcher) allowing EOS only."""
        mask = ((words[:, :, None] >> _BITS) & 1).bool().view(len(words), -1)[:, :self.vocab_size]
        empty = ~mask.any(-1)  # [rows]
        if empty.any():
            if self._m.is_error():
                log.warning("structured output: the grammar matcher failed (%s); the output ends here",
                            self._m.get_error())
            mask[empty] = self.ends()
        return mask  # [rows, vocab]

    def ends(self) -> torch.Tensor:
        """``[vocab]`` bool: EOS only (everything for a model without one), what a row past
        the grammar's end allows."""
        if not self.eos_ids:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        ends = torch.zeros(self.vocab_size, dtype=torch.bool)
        ends[[i for i in sorted(self.eos_ids) if i < self.vocab_size]] = True
        return ends

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row after the committed output."""
        j = self.opens_after(tokens)
        return len(tokens) if j is None else j + self._m.validate_tokens(tokens[j:])

    def advance(self, tokens: list[int]) -> None:
        """Commit ``tokens`` (each one the masks allowed)."""
        j = self.opens_after(tokens)
        if j is None:
            seq = self._tail + list(tokens)
            span = len(self.gate) if isinstance(self.gate, str) else GATE_SPAN
            self._tail = seq[max(0, len(seq) - span + 1):]
            return
        self.gate, self._tail = "", []
        self._m.try_consume_tokens(tokens[j:])



def chain_masks(chains: list[tuple[Matcher, list[int]]]) -> list[torch.Tensor]:
    """``Matcher.allowed`` for the rows of several chains at once: for each ``(matcher,
    drafts)``, ``[k+1, vocab]`` with row i after ``drafts[:i]``. One call into llguidance's
    executor, which walks the chains in parallel on its own threads without the GIL (the
    engine runs it beside the verify forward)."""
    if not chains:
        return []
    words = torch.full((sum(len(d) + 1 for _, d in chains), chains[0][0]._words), -1, dtype=torch.int32)
    starts, rows = [], 0
    for _, drafts in chains:
        starts.append(rows)
        rows += len(drafts) + 1
    executor, ptr, size = _executor(), words.data_ptr(), words.shape[1] * 4
    drafted, bare = [], []
    for (m, d), start in zip(chains, starts):
        j = m.opens_after(d)  # rows before the gate stay free; the grammar starts at row j
        if j is not None and d[j:]:
            drafted.append((m._m, start + j, list(d[j:])))
        elif j is not None:
            bare.append((m._m, start + j))
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, size, rows)
    if bare:  # no drafts after the gate (k = 0): one row
        executor.unsafe_compute_mask_ptr(bare, ptr, size, rows)
    out = []
    for (m, d), start in zip(chains, starts):
        mask = m._unpack(words[start:start + len(d) + 1])  # [k+1, vocab]
        j = m.opens_after(d)  # llguidance leaves the rows after a drafted EOS free: plain
        end = next((i for i in range(len(d)) if j is not None and i >= j and d[i] in m.eos_ids), None)
        if end is not None:  # decoding past the grammar's end (ignore_eos) meets EOS only
            mask[end + 1:] = m.ends()
        out.append(mask)
    return out


BIG_STACK = 1 << 30  # bytes: llguidance compiles a grammar recursively (a chain of 1000 $refs overflowed 8 MB)
_STACK_SIZE = threading.Lock()  # threading.stack_size is process-wide: one thread's start at a time


def on_big_stack(fn):
    """``fn()`` on a thread of its own with a ``BIG_STACK``-byte stack (address space, not
    memory, until used): a deep grammar overflowing the caller's stack killed the process."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            out["error"] = e

    with _STACK_SIZE:
        old = threading.stack_size(BIG_STACK)
        try:
            thread = threading.Thread(target=run, name="specdec-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@functools.lru_cache(maxsize=1)
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def constrain(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits [rows, vocab]`` with the tokens ``allowed [rows, vocab]`` forbids at -inf."""
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))

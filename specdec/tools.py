"""Tool calls (OpenAI's ``tools`` and ``tool_choice``), as vLLM serves them.

* ``tool_choice: "required"`` and a named function constrain the output with a JSON schema
  (structured outputs, compact JSON): a list of ``{"name", "parameters"}`` calls, or the
  named function's arguments. No parser is needed; the calls are read from that JSON.
* ``tool_choice: "auto"`` lets the model answer freely; a parser (``TOOL_PARSERS``, vLLM's
  ``--tool-call-parser`` names) finds the calls in its text, in the family's own format:

  - ``hermes`` (Qwen2.5, Hermes and other templates):
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, text before the first
    call being the message's content;
  - ``llama3_json`` (Llama 3.1-3.3 and 4, JSON-based): the answer is ``{"name": ...,
    "parameters": {...}}``, perhaps after ``<|python_tag|>``, several separated by ``;``;
  - ``mistral``: after ``[TOOL_CALLS]``, a JSON list of ``{"name", "arguments"}`` (v3
    tokenizers) or ``name[ARGS]{...}`` per call (v11 and later); call ids are 9
    letters and digits, as Mistral's templates require;
  - ``pythonic`` (Llama 3.2 and 4, ToolACE): the answer is a Python list of calls with
    keyword arguments, ``[get_weather(city='Paris'), search(q="x")]``, perhaps between
    ``<|python_start|>`` and ``<|python_end|>``.

  A call that does not parse leaves the whole answer as content. So does a call to a
  function that is not among the request's tools, where the format has no tag of its own. An
  answer that is nothing but JSON calls in hermes's or mistral's shape is read without
  the tags too, perhaps in a ```json fence: Qwen2.5-Coder answers so, and a Mistral answer
  decoded without its special tokens reads so.
"""
from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Callable

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a list of at least one call (one only
    without ``parallel``), each ``{"name": one of the functions, "parameters": its arguments}``."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters") or {"type": "object"}}} for f in functions]
    return compact({"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}})


def compact(schema: dict) -> dict:
    """``schema`` written without free whitespace (llguidance's option; a schema's own
    ``x-guidance`` options win): calls are read by programs, and free whitespace lets a
    weak model run on in newlines."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a ``required_schema`` output (none when it was cut short)."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return []


Parsed = tuple  # (content or None, calls)


def parse_hermes(text: str, names: frozenset[str] = frozenset()) -> Parsed:
    """``(content, calls)`` of a Hermes-style answer: the text before the first call (None
    when blank) and each ``<tool_call>`` block's ``{"name", "arguments"}`` (a last block
    without its end tag counts). Without the tags, bare JSON calls (``_bare_or_text``)."""
    start = text.find(HERMES)
    if start < 0:
        return _bare_or_text(text, names)
    try:
        calls = [_call(json.loads(m.group(1))) for m in _HERMES_CALL.finditer(text, start)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return _content(text[:start]), calls


def parse_llama3_json(text: str, names: frozenset[str] = frozenset()) -> Parsed:
    """Llama 3's JSON-based calls: the answer (after an optional ``<|python_tag|>``) is one
    ``{"name", "parameters"}`` object or several separated by ``;``."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    try:
        while i < len(body):
            obj, i = decoder.raw_decode(body, i)
            if not (isinstance(obj, dict) and _known(obj.get("name"), names)
                    and ("parameters" in obj or "arguments" in obj)):
                return text, []
            calls.append(_call(obj))
            i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
    except (ValueError, TypeError):
        return text, []
    return (None, calls) if calls else (text, [])


def parse_mistral(text: str, names: frozenset[str] = frozenset()) -> Parsed:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list (or object) of ``{"name",
    "arguments"}``, or ``name[ARGS]{...}`` once per call, each after its own ``[TOOL_CALLS]``.
    Without the tag, bare JSON calls (``_bare_or_text``)."""
    start = text.find(MISTRAL)
    if start < 0:
        return _bare_or_text(text, names, mistral_id)
    calls = []
    for piece in text[start:].split(MISTRAL)[1:]:
        piece = piece.strip()
        try:
            if piece[:1] in ("[", "{"):
                obj = json.loads(piece)
                items = obj if isinstance(obj, list) else [obj]
                calls += [_call(c, mistral_id()) for c in items]
                continue
            name, args = re.fullmatch(r"([\w.\-]+)\s*(?:\[ARGS\])?\s*(\{.*\})", piece, re.DOTALL).groups()
            calls.append(ToolCall(name, json.dumps(json.loads(args), ensure_ascii=False), mistral_id()))
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
    return (_content(text[:start]), calls) if calls else (text, [])


def parse_pythonic(text: str, names: frozenset[str] = frozenset()) -> Parsed:
    """Pythonic calls: the answer (perhaps between ``<|python_start|>`` and
    ``<|python_end|>``) is a Python list of calls with literal keyword arguments."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                return text, []
            name = ast.unparse(node.func)
            if not _known(name, names):
                return text, []
            args = {k.arg: _literal(k.value) for k in node.keywords}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return text, []
    return None, calls


def _literal(node: ast.AST):
    """A Python literal, or JSON's true / false / null written as names."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _known(name, names: frozenset[str]) -> bool:
    """A function name the request may call (any name when ``names`` is empty)."""
    return isinstance(name, str) and bool(name) and (not names or name in names)


def _call(obj: dict, call_id: str = "") -> ToolCall:
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), call_id)


def _bare_or_text(text: str, names: frozenset[str], new_id: Callable[[], str] = lambda: "") -> Parsed:
    """An answer that is nothing but a JSON call ``{"name", "arguments"}``, or a list of them,
    to functions in ``names`` (none given: no bare calls), perhaps in a ```json fence."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    try:
        obj = json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return text, []
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(isinstance(c, dict) and c.get("name") in names and "arguments" in c for c in items):
        return text, []
    return None, [_call(c, new_id()) for c in items]


def mistral_id() -> str:
    """A call id as Mistral's templates require: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


HERMES, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_END) + r"|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
JSON_STARTS = ("{", "[", "`")


@dataclass(frozen=True)
class ToolParser:
    """How one model family writes its calls: ``parse(text, names) -> (content, calls)``;
    ``markers``: text that begins a call (a stream's content stops there); ``starts``: first
    characters of an answer that may be a call without a marker (a stream holds its content
    back until it knows); ``special``: the markers are special tokens, so an answer is
    decoded with special tokens kept (vLLM's parsers ask the same)."""

    parse: Callable[[str, frozenset[str]], Parsed]
    markers: tuple[str, ...]
    starts: tuple[str, ...]
    special: bool = False

    def could_be_call(self, text: str) -> bool:
        """Whether an answer that begins with ``text`` may still turn out to be a call."""
        head = text.lstrip()
        return not head or head[0] in self.starts


TOOL_PARSERS = {
    "hermes": ToolParser(parse_hermes, (HERMES,), JSON_STARTS),
    "llama3_json": ToolParser(parse_llama3_json, (PYTHON_TAG,), ("{",), special=True),
    "mistral": ToolParser(parse_mistral, (MISTRAL,), JSON_STARTS, special=True),
    "pythonic": ToolParser(parse_pythonic, (PYTHON_START,), ("[",), special=True),
}
PARSERS = tuple(TOOL_PARSERS)

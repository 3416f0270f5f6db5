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
    ``<|python_start|>`` and ``<|python_end|>``;
  - ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>value
    </parameter>...</function></tool_call>``, each value read as its parameter's type in the
    tool's JSON schema (text where the schema does not say).

  A call that does not parse leaves the whole answer as content. So does a call to a
  function that is not among the request's tools, where the format has no tag of its own. An
  answer that begins with JSON calls in hermes's or mistral's shape is read without the tags
  too (the text after them is the content), perhaps in a ```json fence: Qwen2.5-Coder answers so, and a Mistral answer
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
from collections.abc import Mapping
from typing import Callable, Union

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


DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the parts its "$ref"s name (from its root)


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a list of at least one call (one only
    without ``parallel``), each ``{"name": one of the functions, "parameters": its arguments}``.
    The functions' definitions (``$defs``, as pydantic writes nested models) move to the
    root, where their references point (vLLM's too); a name two functions define differently
    is a ``ValueError``."""
    calls, defs = [], {}
    for f in functions:
        params = dict(f.get("parameters") or {"type": "object"})
        for key in DEFINITIONS:
            for name, part in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, part) != part:
                    raise ValueError(f"tools define {key} {name!r} differently; give them different names")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params}})
    return compact({"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                    "items": {"anyOf": calls}, **defs})


def compact(schema: dict) -> dict:
    """``schema`` written without free whitespace (llguidance's option; a schema's own
    ``x-guidance`` options win): calls are read by programs, and free whitespace lets a
    weak model run on in newlines."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a ``required_schema`` output (none when it was cut short)."""
    try:
        if not isinstance(json.loads(text), list):
            return []
        return raw_calls(text)
    except (ValueError, TypeError, KeyError):
        return []


def required_partial(text: str) -> list[ToolCall]:
    """The calls a ``required_schema`` output written so far shows (``partial_call``)."""
    return _partial_items(text) if text.startswith("[") else []


# Streaming calls. A stream sends each call's name once it is complete, then its arguments as
# they are written: the raw JSON text of the arguments object, which is also what the whole
# answer's call carries, so that what a stream sent is always a prefix of the final call.
_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[\w.+-]*")  # a number, true, false or null (or its start)
# a whole JSON string (escapes skipped), and the next character that opens or closes something;
# regexes rather than a loop per character: a stream parses its whole answer again each step
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRUCTURE = re.compile(r'["{}\[\]]')


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string that begins at ``text[i]`` (None: not closed yet)."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that begins at ``text[i]`` (None: not finished yet; a
    number at the end of the text may go on)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        end = _SCALAR.match(text, i).end()
        if end == i:
            raise ValueError(f"not a JSON value: {text[i]!r}")
        return end if end < len(text) else None
    depth, j = 0, i
    while (m := _STRUCTURE.search(text, j)) is not None:
        j = m.start()
        if text[j] == '"':
            j = _string_end(text, j)
            if j is None:
                return None
            continue
        if text[j] in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def json_members(text: str) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object ``text`` begins with, as far as it is written:
    ``{key: (where its value begins, where it ends or None)}`` for each member whose value has
    begun, and the object's end (None: still open). ValueError where it is not an object."""
    members: dict[str, tuple[int, int | None]] = {}
    if not text.startswith("{"):
        raise ValueError("not a JSON object")
    j = _WS.match(text, 1).end()
    if text[j:j + 1] == "}":
        return members, j + 1
    while j < len(text):
        if text[j] != '"':
            raise ValueError("not a JSON object")
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = _WS.match(text, key_end).end()
        if j >= len(text):
            break
        if text[j] != ":":
            raise ValueError("not a JSON object")
        j = _WS.match(text, j + 1).end()
        if j >= len(text):
            break
        end = _value_end(text, j)
        members[key] = (j, end)
        if end is None:
            break
        j = _WS.match(text, end).end()
        if text[j:j + 1] == "}":
            return members, j + 1
        if j < len(text) and text[j] != ",":
            raise ValueError("not a JSON object")
        j = _WS.match(text, j + 1).end()
    return members, None


def _list_items(text: str) -> list[tuple[int, int | None]]:
    """Where the items of the JSON list ``text`` begins with begin and end, as far as it is
    written (the last one's end None while it is open)."""
    if not text.startswith("["):
        raise ValueError("not a JSON list")
    items, j = [], _WS.match(text, 1).end()
    while j < len(text) and text[j] != "]":
        end = _value_end(text, j)
        items.append((j, end))
        if end is None:
            break
        j = _WS.match(text, end).end()
        if text[j:j + 1] != ",":
            break
        j = _WS.match(text, j + 1).end()
    return items


def _arguments(members: dict) -> tuple[int, int | None] | None:
    """The span of a call's arguments ("parameters" in some formats) among its members."""
    return members.get("arguments", members.get("parameters"))


def raw_call(obj_text: str, call_id: str = "") -> ToolCall:
    """The call a complete JSON object ``{"name", "arguments" (or "parameters")}`` makes, its
    arguments the object's own text (a JSON string's content when the model wrote one)."""
    obj = json.loads(obj_text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    members, _ = json_members(obj_text)
    span = _arguments(members)
    if span is None:
        return ToolCall(obj["name"], "{}", call_id)
    args = obj.get("arguments", obj.get("parameters"))
    return ToolCall(obj["name"], args if isinstance(args, str) else obj_text[span[0]:span[1]], call_id)


def raw_calls(text: str, new_id: Callable[[], str] = lambda: "") -> list[ToolCall]:
    """``raw_call`` of each object of a complete JSON list of calls, or of one call object."""
    spans = _list_items(text) if text.startswith("[") else [(0, len(text))]
    return [raw_call(text[start:end], new_id()) for start, end in spans]


def partial_call(obj_text: str, call_id: str = "") -> ToolCall | None:
    """The call a JSON object written so far shows: none until its name is complete, then
    the name and the arguments so far (the object's text, a prefix of ``raw_call``'s; a
    string's only once it is complete)."""
    try:
        members, _ = json_members(obj_text)
        span = members.get("name")
        name = json.loads(obj_text[span[0]:span[1]]) if span and span[1] is not None else None
    except ValueError:
        return None
    if not isinstance(name, str):
        return None
    span = _arguments(members)
    if span is None:
        return ToolCall(name, "", call_id)
    start, end = span
    if obj_text[start] != "{":  # a string (or another value): whole, once complete
        if end is None:
            return ToolCall(name, "", call_id)
        value = json.loads(obj_text[start:end])
        return ToolCall(name, value if isinstance(value, str) else obj_text[start:end], call_id)
    return ToolCall(name, obj_text[start:end or len(obj_text)], call_id)


def _partial_items(text: str, new_id: Callable[[], str] = lambda: "") -> list[ToolCall]:
    """The calls of a JSON list of call objects (or one object) written so far."""
    try:
        spans = _list_items(text) if text.startswith("[") else [(0, None)]
    except ValueError:
        return []
    calls = []
    for start, end in spans:
        call = partial_call(text[start:end or len(text)], new_id())
        if call is None:
            break
        calls.append(call)
    return calls


Parsed = tuple  # (content or None, calls)
# the request's functions: their names, or their names mapped to their parameters' JSON
# schemas (parsers that read typed values, qwen3_coder, use the schemas)
Tools = Union[frozenset, Mapping]


def parse_hermes(text: str, names: Tools = frozenset()) -> Parsed:
    """``(content, calls)`` of a Hermes-style answer: the text before the first call (None
    when blank) and each ``<tool_call>`` block's ``{"name", "arguments"}`` (a last block
    without its end tag counts). Without the tags, bare JSON calls (``_bare_or_text``)."""
    start = text.find(HERMES)
    if start < 0:
        return _bare_or_text(text, names)
    try:
        calls = [raw_call(m.group(1)) for m in _HERMES_CALL.finditer(text, start)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return _content(text[:start]), calls


def hermes_partial(text: str, names: Tools = frozenset()) -> list[ToolCall]:
    """The calls of a Hermes answer written so far (``text``: from its first ``<tool_call>``,
    or an answer without one that may be bare JSON calls)."""
    if not text.startswith(HERMES):
        return _bare_partial(text, names)
    calls = []
    for block in text.split(HERMES)[1:]:
        call = partial_call(block.lstrip())
        if call is None:
            break
        calls.append(call)
    return calls


def parse_llama3_json(text: str, names: Tools = frozenset()) -> Parsed:
    """Llama 3's JSON-based calls: the answer (after an optional ``<|python_tag|>``) begins
    with one ``{"name", "parameters"}`` object or several separated by ``;`` (``leading_calls``)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    calls, end = leading_calls(body, names)
    return (_content(body[end:]), calls) if calls else (text, [])


def llama3_partial(text: str, names: Tools = frozenset()) -> list[ToolCall]:
    """The calls of a Llama 3 JSON answer written so far (``parse_llama3_json``'s)."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    return leading_partial(body, names)


def parse_mistral(text: str, names: Tools = frozenset()) -> Parsed:
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
                json.loads(piece)  # ValueError unless the whole piece is JSON
                calls += raw_calls(piece, mistral_id)
                continue
            name, args = re.fullmatch(r"([\w.\-]+)\s*(?:\[ARGS\])?\s*(\{.*\})", piece, re.DOTALL).groups()
            if not isinstance(json.loads(args), dict):
                raise ValueError("arguments are not an object")
            calls.append(ToolCall(name, args, mistral_id()))
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
    return (_content(text[:start]), calls) if calls else (text, [])


def mistral_partial(text: str, names: Tools = frozenset()) -> list[ToolCall]:
    """The calls of a Mistral answer written so far (``text``: from its first ``[TOOL_CALLS]``,
    or an answer without one that may be bare JSON calls)."""
    if not text.startswith(MISTRAL):
        return _bare_partial(text, names, mistral_id)
    calls = []
    for piece in text.split(MISTRAL)[1:]:
        piece = piece.lstrip()
        if piece[:1] in ("[", "{"):
            calls += _partial_items(piece, mistral_id)
            continue
        named = re.match(r"([\w.\-]+)\s*(?:\[ARGS\]\s*|(?=\{))", piece)  # the name, complete
        if named is None:
            break
        start = named.end()
        if piece[start:start + 1] != "{":
            calls.append(ToolCall(named.group(1), "", mistral_id()))
            break
        end = _value_end(piece, start)
        calls.append(ToolCall(named.group(1), piece[start:end or len(piece)], mistral_id()))
    return calls


def parse_qwen3_coder(text: str, names: Tools = frozenset()) -> Parsed:
    """Qwen3-Coder's XML calls: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...
    </function></tool_call>``; each value is read as its parameter's type in the tool's
    schema (``names`` mapping names to parameter schemas; a string where none is known)."""
    start = text.find(HERMES)
    calls = _qwen3_calls(text[start:], names, final=True) if start >= 0 else None
    return (text, []) if calls is None else (_content(text[:start]), calls)


def qwen3_coder_partial(text: str, names: Tools = frozenset()) -> list[ToolCall]:
    """The calls of a Qwen3-Coder answer written so far (``text``: from its first
    ``<tool_call>``): each once its name is complete, with the JSON of its complete
    parameters, a prefix of what ``parse_qwen3_coder`` makes of the whole answer."""
    return _qwen3_calls(text, names, final=False)


def _qwen3_calls(text: str, names: Tools, final: bool) -> list[ToolCall] | None:
    """The calls of the ``<tool_call>`` blocks of ``text`` (from its first one): the whole
    answer's (``final``: every parameter, each call closed; None where a block names no
    function), or those written so far (complete parameters; a call still open shows its
    JSON without the closing brace, and is the last)."""
    calls = []
    for block in text.split(HERMES)[1:]:
        head = _QWEN3_FUNCTION.search(block)
        if head is None:
            return None if final else calls
        body, closed, _ = block[head.end():].partition(_QWEN3_END)
        closed = bool(closed) or final
        args = {key: _qwen3_value(raw, _parameter_schema(names, head.group(1), key))
                for key, raw, complete in _qwen3_parameters(body) if complete or closed}
        arguments = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(head.group(1), arguments if closed else arguments[:-1]))
        if not closed:
            break
    return calls


_QWEN3_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_QWEN3_END = "</function>"


def _qwen3_parameters(body: str) -> list[tuple[str, str, bool]]:
    """``(key, raw value, complete)`` per ``<parameter=KEY>`` of a function's body; a value
    ends at ``</parameter>`` or the next parameter."""
    heads = list(_QWEN3_PARAMETER.finditer(body))
    out = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(body)
        raw, closed, _ = body[head.end():end].partition("</parameter>")
        out.append((head.group(1), raw, bool(closed) or i + 1 < len(heads)))
    return out


def _parameter_schema(tools: Tools, function: str, key: str) -> dict:
    schema = tools.get(function) if isinstance(tools, Mapping) else None
    props = (schema or {}).get("properties") if isinstance(schema, dict) else None
    value = props.get(key) if isinstance(props, dict) else None
    return value if isinstance(value, dict) else {}


def _qwen3_value(raw: str, schema: dict):
    """A parameter's text as its schema's type (vLLM's rules): the newline after the tag and
    the one before the end tag are dropped; ``null`` is None; strings (and parameters the
    schema does not know) stay text; numbers, booleans, objects and arrays are read as JSON
    (or a Python literal), else left as text."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type")
    if value.lower() == "null":
        return None
    if kind in (None, "string", "str", "text") or not isinstance(kind, str):
        return value
    if kind == "boolean":
        return value.lower() == "true" if value.lower() in ("true", "false") else value
    try:
        parsed = json.loads(value)
    except ValueError:
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed


def parse_pythonic(text: str, names: Tools = frozenset()) -> Parsed:
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


def _known(name, names: Tools) -> bool:
    """A function name the request may call (any name when ``names`` is empty)."""
    return isinstance(name, str) and bool(name) and (not names or name in names)


def _is_call(obj, names: Tools) -> bool:
    return isinstance(obj, dict) and _known(obj.get("name"), names) and ("arguments" in obj or "parameters" in obj)


def leading_calls(body: str, names: Tools, new_id: Callable[[], str] = lambda: "",
                  final: bool = True) -> tuple[list[ToolCall], int]:
    """The JSON calls ``{"name", "arguments" (or "parameters")}`` to functions in ``names``
    that ``body`` begins with (objects, or lists of them, separated by whitespace or ``;``),
    and where the text after them begins. The first value that is no such call ends them;
    when ``final``, one cut short (the answer ended in it) leaves none, as a broken call
    leaves a tagged answer all content."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while body[i:i + 1] in ("{", "["):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            break
        items = obj if isinstance(obj, list) else [obj]
        if not items or not all(_is_call(c, names) for c in items):
            break
        calls += raw_calls(body[i:end], new_id)
        rest = body[end:].lstrip()
        i = len(body) - len(rest.removeprefix(";").lstrip() if rest.startswith(";") else rest)
    if final and body[i:i + 1] in ("{", "[") and _value_end(body, i) is None:
        return [], 0
    return calls, i


def leading_partial(body: str, names: Tools, new_id: Callable[[], str] = lambda: "") -> list[ToolCall]:
    """The calls of ``leading_calls`` in an answer written so far: the complete ones, then the
    one in progress once its name is complete and among ``names``."""
    calls, i = leading_calls(body, names, new_id, final=False)
    if body[i:i + 1] not in ("{", "[") or _value_end(body, i) is not None:
        return calls
    for call in _partial_items(body[i:], new_id):
        if not _known(call.name, names):
            break
        calls.append(call)
    return calls


def _bare_or_text(text: str, names: Tools, new_id: Callable[[], str] = lambda: "") -> Parsed:
    """An answer that begins with JSON calls (``leading_calls``) to functions in ``names``
    (none given: no bare calls), perhaps in a ```json fence; text after them is content."""
    body = text.strip()
    fence = re.match(r"```(?:json)?\s*", body)
    body = body[fence.end():] if fence else body
    calls, end = leading_calls(body, names, new_id) if names else ([], 0)
    if not calls:
        return text, []
    rest = body[end:]
    return _content(rest.removeprefix("```") if fence else rest), calls


def _bare_partial(text: str, names: Tools, new_id: Callable[[], str] = lambda: "") -> list[ToolCall]:
    """The calls of an answer written so far that may be ``_bare_or_text``'s JSON calls."""
    body = text.lstrip()
    fence = re.match(r"```(?:json)?\s*", body)
    if fence is None and body.startswith("`") or not names:  # a fence on its way
        return []
    return leading_partial(body[fence.end():] if fence else body, names, new_id)


def mistral_id() -> str:
    """A call id as Mistral's templates require: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


HERMES, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_END) + r"|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
JSON_STARTS = ("{", "[", "`")
CALL_FENCES = ("```json", "```\n", "```{", "```[", "``` ")  # how a fenced bare call may open


# GPT-OSS's harmony frames: [<|start|>role][ to=recipient]<|channel|>name[ to=recipient][ <|constrain|>format]
# <|message|>body<end>; an answer starts after the prompt's <|start|>assistant, so perhaps with the recipient
MESSAGE, HARMONY_ENDS = "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
HARMONY_STARTS = ("<|channel|>", "<|start|>", " to=", "to=")


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None
    recipient: str | None  # "functions.get_weather": a tool call
    body: str  # so far, where ``end`` is None
    end: int | None  # where its end marker ends in the text (None: not written yet)


def harmony_messages(text: str) -> list[HarmonyMessage] | None:
    """The harmony messages of an answer, the last perhaps unfinished (its header complete);
    None where the text does not begin with a harmony frame (nor can it yet: an empty list)."""
    if not text.startswith(HARMONY_STARTS):
        return [] if any(m.startswith(text) for m in HARMONY_STARTS) else None
    messages, pos = [], 0
    while (start := text.find(MESSAGE, pos)) >= 0:
        header, body = text[pos:start], start + len(MESSAGE)
        ends = [(i, m) for m in HARMONY_ENDS if (i := text.find(m, body)) >= 0]
        end = min(ends) if ends else None
        channel = re.search(r"<\|channel\|>\s*([\w-]+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        messages.append(HarmonyMessage(channel and channel.group(1), recipient and recipient.group(1),
                                       text[body:end[0] if end else len(text)], end and end[0] + len(end[1])))
        if end is None:
            break
        pos = messages[-1].end
    return messages


def parse_openai(text: str, names: Tools = frozenset()) -> Parsed:
    """GPT-OSS's calls (vLLM's ``openai`` parser): its harmony messages addressed to
    ``functions.NAME``, the message their arguments; the content is its final message (and
    preambles): the answer as ``--reasoning-parser openai_gptoss`` reads it (which ``openai``
    with auto tool choice turns on)."""
    from .answer import HARMONY, AnswerParser

    answer = AnswerParser(HARMONY, "auto", names).view(text, final=True)
    return answer.content, answer.calls


@dataclass(frozen=True)
class ToolParser:
    """How one model family writes its calls: ``parse(text, names) -> (content, calls)``;
    ``markers``: text that begins a call (a stream's content stops there); ``starts``: first
    characters of an answer that may be a call without a marker (a stream holds its content
    back until it knows); ``special``: the markers are special tokens, so an answer is
    decoded with special tokens kept (vLLM's parsers ask the same); ``partial(text, names)``:
    the calls of an answer written so far, from its first marker (or the whole answer where
    it may be a call without one); a stream sends them as they grow, and without it calls
    arrive whole at the end."""

    parse: Callable[[str, Tools], Parsed]
    markers: tuple[str, ...]
    starts: tuple[str, ...]
    special: bool = False
    partial: Callable[[str, Tools], list[ToolCall]] | None = None

    def could_be_call(self, text: str) -> bool:
        """Whether an answer that begins with ``text`` may still turn out to be a call (a
        fence only as ```json or a bare ```: ```python opens code, never a call)."""
        head = text.lstrip()
        if not head or head[0] not in self.starts:
            return not head
        return head[0] != "`" or any(head.startswith(f) or f.startswith(head) for f in CALL_FENCES)


TOOL_PARSERS = {
    "hermes": ToolParser(parse_hermes, (HERMES,), JSON_STARTS, partial=hermes_partial),
    "llama3_json": ToolParser(parse_llama3_json, (PYTHON_TAG,), ("{",), special=True, partial=llama3_partial),
    "mistral": ToolParser(parse_mistral, (MISTRAL,), JSON_STARTS, special=True, partial=mistral_partial),
    "pythonic": ToolParser(parse_pythonic, (PYTHON_START,), ("[",), special=True),
    "qwen3_coder": ToolParser(parse_qwen3_coder, (HERMES,), (), partial=qwen3_coder_partial),
    "openai": ToolParser(parse_openai, HARMONY_STARTS[:2], (), special=True),
}
# vLLM's other names for the same formats
TOOL_PARSERS.update(llama4_json=TOOL_PARSERS["llama3_json"], llama4_pythonic=TOOL_PARSERS["pythonic"],
                    qwen3_xml=TOOL_PARSERS["qwen3_coder"])
PARSERS = tuple(TOOL_PARSERS)

"""Tool calls (OpenAI's ``tools`` and ``tool_choice``), as vLLM serves them.

* ``tool_choice: "required"`` and a named function constrain the output with a JSON schema
  (structured outputs, compact JSON): a list of ``{"name", "parameters"}`` calls, or the
  named function's arguments. No parser is needed; the calls are read from that JSON.
* ``tool_choice: "auto"`` lets the model answer freely; a parser finds the calls in its
  text. ``hermes`` (vLLM's name; Qwen2.5, Hermes and other templates that write
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is the one here: text
  before the first call is the message's content, a call that is not valid JSON stays text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)


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


def parse_hermes(text: str, names: frozenset[str] = frozenset()) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a Hermes-style answer: the text before the first call (None
    when blank) and each ``<tool_call>`` block's ``{"name", "arguments"}`` (a last block
    without its end tag counts). An answer without the tags that is nothing but such a call
    (or a list of them) to functions in ``names``, perhaps in a ```json fence, is read too
    (Qwen2.5-Coder answers so). No valid call: the whole text is the content."""
    start = text.find(START)
    if start < 0:
        calls = _bare_calls(text, names)
        return (None, calls) if calls else (text, [])
    try:
        calls = [_call(json.loads(m.group(1))) for m in _CALL.finditer(text, start)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def _call(obj: dict) -> ToolCall:
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _bare_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    try:
        obj = json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(isinstance(c, dict) and c.get("name") in names and "arguments" in c for c in items):
        return []
    return [_call(c) for c in items]


def could_be_call(text: str) -> bool:
    """Whether an answer that begins with ``text`` may still turn out to be a bare JSON call
    (a stream holds its content back until it knows)."""
    return text.lstrip()[:1] in ("", "{", "[", "`")

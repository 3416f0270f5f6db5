"""A chat answer's text split into reasoning, content and tool calls, whole or as it streams
(the server's chat responses; usable on ``LLM.chat`` outputs too).

``view`` is a pure function of the text so far: a stream sends, for each part, what the
view shows beyond what it sent before. A partial view shows only what the rest of the
answer cannot change (it holds back a tail that could begin ``</think>`` or a tool call),
so each part's streamed text is a prefix of the final view's part. Tool calls likewise: a
partial view shows a call once its name is complete, with its arguments so far (raw JSON
text, which the final call carries too), for tool choices "required" and a named function,
and for "auto" with parsers that can read a call in progress (``ToolParser.partial``:
hermes, llama3_json, mistral, bare JSON calls included); pythonic calls arrive whole at
the end. (A call whose JSON turns out broken at
the end leaves the answer as content, after its beginning was streamed, as in vLLM.)

Reasoning parsers (vLLM's names), for models that think between ``<think>`` and
``</think>`` before answering:

* ``qwen3``: the answer may begin with ``<think>``; the text up to ``</think>`` is the
  reasoning. Without that start tag there is no reasoning.
* ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the answer starts inside
  the reasoning (a leading ``<think>`` is dropped); without ``</think>`` it is all reasoning.
* ``openai_gptoss``: GPT-OSS's harmony messages (``harmony_messages``): the ``analysis``
  channel's are the reasoning, the ``final`` channel's the content, and those addressed
  ``to=functions.NAME`` the tool calls (whatever ``--tool-call-parser`` says). The answer is
  decoded with its special tokens, which spell the messages' frames.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from .sequence import held_back, ids_to_hold
from .tools import (HARMONY_ENDS, MESSAGE, TOOL_PARSERS, ToolCall, Tools, harmony_messages, parse_required,
                    required_partial)

HARMONY = "openai_gptoss"
REASONING_PARSERS = ("qwen3", "deepseek_r1", HARMONY)
THINK, END_THINK = "<think>", "</think>"
# the final channel's frame, perhaps with a format (<|channel|>final <|constrain|>json<|message|>): what a
# structured output starts after (a gate of at most structured.GATE_SPAN characters)
FINAL_GATE = re.compile(r"<\|channel\|>final[^<]{0,32}(?:<\|constrain\|>[^<]{0,32})?<\|message\|>")


def grammar_gate(tokenizer, prompt_ids: list[int], parser: str = "qwen3") -> "str | re.Pattern":
    """The text after which a thinking model's structured output starts (vLLM leaves the
    reasoning free): ``</think>``, or "" (from the start) when the prompt already closed its
    last ``<think>`` (Qwen3 with thinking turned off); GPT-OSS's: the final channel's frame
    (``FINAL_GATE``), so that tool choices "required" and a named function write their calls
    as the final message (``AnswerParser`` reads them there)."""
    if parser == HARMONY:
        return FINAL_GATE
    start, end = _think_ids(tokenizer)
    return "" if _last(prompt_ids, end) > _last(prompt_ids, start) else END_THINK


def opens_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt leaves a ``<think>`` open, so that the answer starts in its
    reasoning (a template that opens it for the model, as Qwen3's thinking-only ones do, or
    an assistant message continued from within it)."""
    start, end = _think_ids(tokenizer)
    return _last(prompt_ids, start) > _last(prompt_ids, end)


def reasoning_tokens(tokenizer, parser: "AnswerParser", ids: list[int]) -> int:
    """How many of an answer's output ``ids`` are its reasoning, the tokens that spell
    ``</think>`` included: none where ``parser`` finds no reasoning, all where it never ends."""
    if parser.reasoning is None:
        return 0
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    text = decode(ids)
    if parser.reasoning == HARMONY:  # through the last analysis message's end marker
        analysis = [m for m in harmony_messages(text) or [] if m.channel == "analysis"]
        if not analysis:
            return 0
        end = analysis[-1].end and ids_to_hold(decode, ids, text[:analysis[-1].end])
        return len(ids) if end is None else end
    if parser.split_reasoning(text, final=True)[0] is None:
        return 0
    end = ids_to_hold(decode, ids, END_THINK)
    return len(ids) if end is None else end


def _think_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of ``<think>`` and of ``</think>``."""
    return tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in (THINK, END_THINK))


def _last(ids: list[int], pattern: tuple[int, ...]) -> int:
    """Where ``pattern`` last begins in ``ids`` (-1: nowhere)."""
    n = len(pattern)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i:i + n]) == pattern), -1)


@dataclass
class Answer:
    reasoning: str | None = None
    content: str | None = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class AnswerParser:
    """``reasoning``: a reasoning parser's name or None; ``tool_mode``: the request's (None,
    auto, required, function); ``tool_names``: the functions auto may call (their names, or
    their names mapped to their parameters' JSON schemas, which typed formats read:
    ``tools.Tools``); ``function``: the named function's name; ``tool_parser``: how auto's
    calls are written (``TOOL_PARSERS``); ``parallel``: more than one call may stand (the
    request's ``parallel_tool_calls``; false keeps auto's first, as vLLM); ``opened``: the
    prompt opened ``<think>`` (``opens_reasoning``), so a qwen3 answer starts in its reasoning
    as a deepseek_r1 one does."""

    reasoning: str | None = None
    tool_mode: str | None = None
    tool_names: Tools = field(default=frozenset(), hash=False)
    function: str | None = None
    tool_parser: str = "hermes"
    parallel: bool = True
    opened: bool = False

    def split_reasoning(self, text: str, final: bool) -> tuple[str | None, str]:
        """``(reasoning, the rest)``; a partial view holds back what could still change."""
        if self.reasoning is None:
            return None, text
        body = text.lstrip()
        if not final and len(body) < len(THINK) and THINK.startswith(body):  # the start tag may be on its way
            return None, ""
        if body.startswith(THINK):
            body = body[len(THINK):]
        elif self.reasoning == "qwen3" and not self.opened:
            return None, text
        end = body.find(END_THINK)
        if end >= 0:
            return body[:end], body[end + len(END_THINK):].lstrip("\n")
        if final:
            return body, ""
        return body[:len(body) - held_back(body, (END_THINK,))], ""

    def view(self, text: str, final: bool = False) -> Answer:
        """The parts of an answer whose text so far is ``text`` (all of it when ``final``)."""
        if self.reasoning == HARMONY:
            return self._harmony_view(text, final)
        reasoning, rest = self.split_reasoning(text, final)
        mode = self.tool_mode
        if final:
            if mode == "auto":
                content, calls = TOOL_PARSERS[self.tool_parser].parse(rest, self.tool_names)
                calls = calls if self.parallel else calls[:1]
            elif mode == "required":
                calls = parse_required(rest)
                content = None if calls else rest
            elif mode == "function":
                content, calls = None, [ToolCall(self.function, rest)]
            else:
                content, calls = rest, []
            if reasoning is not None:  # nothing after the reasoning: no content (vLLM's parsers)
                content = content or None
            return Answer(reasoning, content, calls)
        if mode == "required":  # JSON calls, shown as they are written
            return Answer(reasoning, "", required_partial(rest))
        if mode == "function":  # the text is the arguments
            return Answer(reasoning, "", [ToolCall(self.function, rest)])
        calls = []
        if mode == "auto":
            parser = TOOL_PARSERS[self.tool_parser]
            starts = [i for i in (rest.find(m) for m in parser.markers) if i >= 0]
            answer = rest
            rest = rest[:min(starts)] if starts else rest[:len(rest) - held_back(rest, parser.markers)]
            if parser.could_be_call(rest):  # a call without a marker, perhaps: wait
                rest = ""
            if parser.partial and (starts or not rest):  # calls from the first marker (or the start)
                calls = parser.partial(answer[min(starts, default=0):], self.tool_names)
                calls = calls if self.parallel else calls[:1]
        return Answer(reasoning, rest, calls)

    def _harmony_view(self, text: str, final: bool) -> Answer:
        """GPT-OSS's answer: reasoning from the analysis channel, content from the final one,
        calls from the messages to ``functions.*`` (for any tool mode; a named function's
        only) and, for tool choices "required" and a named function, from the final message
        (where their grammar puts them: ``grammar_gate``); text that is no harmony message is
        content. A partial view holds back what could begin an end marker."""
        messages = harmony_messages(text)
        if messages is None or (final and not messages):  # no frame (a final one that only began like one)
            return Answer(None, text if final else text[:len(text) - held_back(text, (MESSAGE,))])
        forced = self.tool_mode in ("required", "function")  # the final message is the calls
        reasoning, content, calls, final_text = [], [], [], []
        for m in messages:
            body = m.body if final or m.end is not None else m.body[:len(m.body) - held_back(m.body, HARMONY_ENDS)]
            name = (m.recipient or "").removeprefix("functions.")
            if m.recipient and m.recipient.startswith("functions.") and self.tool_mode and \
                    (self.tool_mode != "function" or name == self.function):
                calls.append(ToolCall(name, body))
            elif m.channel == "analysis":
                reasoning.append(body)
            elif m.channel == "final" and forced:
                final_text.append(body)
            elif m.channel == "final" or (m.channel == "commentary" and not m.recipient):  # a preamble
                content.append(body)
        if final_text:
            written = "\n".join(final_text)
            if self.tool_mode == "function":
                calls.append(ToolCall(self.function, written))
            elif not final:
                calls += required_partial(written)
            else:
                parsed = parse_required(written)
                calls += parsed
                content += [] if parsed else [written]  # not calls after all: content
        joined = "\n".join(content)
        if final and (reasoning or calls):  # nothing but reasoning and calls: no content
            joined = joined or None
        return Answer("\n".join(reasoning) if reasoning else None, joined, calls if self.parallel else calls[:1])

    def finish_reason(self, answer: Answer, finish_reason: str) -> str:
        """OpenAI's finish reason after tool calls is "tool_calls", except for a named function."""
        if answer.calls and self.tool_mode != "function" and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

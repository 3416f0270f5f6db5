"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery.

A request becomes a chat completion request: ``instructions`` and the ``input`` items become
messages (text parts; earlier function calls and their outputs as an assistant's tool calls
and tool messages), function tools and ``tool_choice`` keep their meaning, ``text.format``
becomes ``response_format``, and ``reasoning.effort`` goes to the chat template as
``reasoning_effort``. The chat's answer becomes a response object (output items: reasoning,
message, function calls), and its stream becomes Responses' stream events. Nothing is stored:
``previous_response_id`` and ``background`` are refused.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Literal

from pydantic import Field

from .protocol import _Strict, bad_request

# sampling fields a request may add, as on chat completions (vLLM's extensions among them)
PASSED_TO_CHAT = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias",
                  "skip_special_tokens", "num_draft_tokens", "structured_outputs", "chat_template_kwargs",
                  "parallel_tool_calls")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# a chat field an error names -> the request's own field it came from
CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    repetition_penalty: float | None = None  # extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None  # extension (vLLM)
    stop: str | list[str] | None = None  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    min_tokens: int | None = None  # extension (vLLM)
    ignore_eos: bool | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # extension
    skip_special_tokens: bool | None = None  # extension (vLLM)
    num_draft_tokens: int | None = None  # extension: cap this request's k (0 = no speculation)
    structured_outputs: dict | None = None  # extension (vLLM)
    chat_template_kwargs: dict[str, object] | None = None  # extension (vLLM)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None  # {"effort": ..., "summary": ...}
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True  # OpenAI's default; nothing is stored here either way
    truncation: Literal["disabled"] = "disabled"
    previous_response_id: str | None = None
    conversation: str | dict | None = None  # stored conversations: refused, as previous_response_id
    prompt: dict | None = None  # a stored prompt template: refused
    background: bool = False

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise bad_request("this server stores no responses: send the whole conversation in input "
                              "instead of previous_response_id", "previous_response_id")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise bad_request(f"this server stores no {name}s: send the whole conversation in input", name)
        if self.background:
            raise bad_request("background responses are not supported", "background")
        unknown = [i for i in self.include or [] if i != LOGPROBS_INCLUDE]
        if unknown:
            raise bad_request(f"include: only {LOGPROBS_INCLUDE!r} is served, not {unknown[0]!r}", "include")
        for tool in self.tools or []:
            if tool.get("type") != "function":
                raise bad_request(f"only function tools are served, not {tool.get('type')!r}", "tools")

    def chat_body(self) -> dict:
        """The chat completion request this one is."""
        body = {"model": self.model, "messages": self.messages(), "stream": self.stream,
                "max_completion_tokens": self.max_output_tokens}
        body.update({k: getattr(self, k) for k in PASSED_TO_CHAT if getattr(self, k) is not None})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict):
            raise bad_request("text.format must be an object", "text")
        if fmt.get("type") == "json_schema":
            schema = {k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt.get("type") is not None:
            body["response_format"] = {"type": fmt["type"]}
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return body

    def messages(self) -> list[dict]:
        """``instructions`` (a system message) and the ``input`` items as chat messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for n, item in enumerate(items):
            kind = item.get("type", "message")
            strings = {"message": (), "function_call": ("call_id", "name", "arguments"),
                       "function_call_output": ("call_id",)}.get(kind, ())
            missing = [k for k in strings if not isinstance(item.get(k), str)]
            if missing:
                raise bad_request(f"input[{n}]: a {kind} item needs {missing[0]} (a string)", "input")
            if kind == "message":
                if item.get("role") not in ("user", "assistant", "system", "developer"):
                    raise bad_request(f"input[{n}].role must be user, assistant, system or developer, "
                                      f"got {item.get('role')!r}", "input")
                out.append({"role": item["role"], "content": _text(item.get("content"), n)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                last = out[-1] if out else {}
                if last.get("role") == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # one turn's text and calls: one message
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": _text(item.get("output"), n)})
            elif kind != "reasoning":  # an earlier answer's reasoning: templates leave it out
                raise bad_request(f"input[{n}]: items of type {kind!r} are not served (message, function_call, "
                                  "function_call_output and reasoning are)", "input")
        return out


def _text(content, n: int) -> str | list[dict]:
    """A message's content as chat content: text as is, text parts as chat's text parts."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{n}].content must be text or a list of parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"input[{n}]: only text content parts are served (this is a text model), "
                              f"not {kind!r}", "input")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _usage(chat: dict | None) -> dict | None:
    if chat is None:
        return None
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": chat.get("completion_tokens_details", {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


class ResponseShaper:
    """One response's object and stream events, from its chat completion or chunks."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.numbers = itertools.count()  # stream events' sequence_number

    def response(self, output: list[dict], status: str, usage: dict | None) -> dict:
        req = self.req
        aborted = {"code": "server_error", "message": "the request was aborted (the server is shutting down)"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": aborted if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": {"effort": (req.reasoning or {}).get("effort"),
                                                            "summary": None},
                "store": False, "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
                "truncation": req.truncation, "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return {"length": "incomplete", "abort": "failed"}.get(finish_reason, "completed")

    @staticmethod
    def message_status(finish_reason: str | None) -> str:
        """The answer's message item, or a streamed call open at its end: incomplete where the
        token budget cut it."""
        return "incomplete" if finish_reason == "length" else "completed"

    def from_chat(self, chat: dict) -> dict:
        """The response of a whole chat completion."""
        choice = chat["choices"][0]
        message, output = choice["message"], []
        if message.get("reasoning_content"):
            output.append(self._reasoning(message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not (calls or message.get("reasoning_content")):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(self._message(message.get("content") or "", logprobs or [],
                                        status=self.message_status(choice["finish_reason"])))
        output += [self._call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return self.response(output, self.status(choice["finish_reason"]), _usage(chat.get("usage")))

    def _reasoning(self, text: str, item_id: str | None = None) -> dict:
        return {"type": "reasoning", "id": item_id or "rs_" + uuid.uuid4().hex, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str, logprobs: list, item_id: str | None = None, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex, "status": status,
                "role": "assistant", "content": [part]}

    def _call(self, call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict:
        return {"type": "function_call", "id": item_id or "fc_" + uuid.uuid4().hex, "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events(self, chunks):
        """Responses' stream events (SSE lines) from a chat completion's stream chunks: the
        response created and in progress; per output item (reasoning, message, each function
        call) its addition, deltas and completion; the response completed (or incomplete,
        when max_output_tokens cut it) with its usage."""
        yield self.event("response.created", response=self.response([], "in_progress", None))
        yield self.event("response.in_progress", response=self.response([], "in_progress", None))
        done: list[dict] = []  # finished output items
        open_: dict | None = None  # the item being streamed: {"kind", "id", "text", ...}
        finish_reason, usage = None, None
        held: list = []  # logprobs of text not sent yet

        def close():
            nonlocal open_
            if open_ is None:
                return
            index, item = len(done), None
            if open_["kind"] == "reasoning":
                yield self.event("response.reasoning_text.done", item_id=open_["id"], output_index=index,
                                 content_index=0, text=open_["text"])
                item = self._reasoning(open_["text"], open_["id"])
            elif open_["kind"] == "message":
                item = self._message(open_["text"], open_["logprobs"], open_["id"], self.message_status(finish_reason))
                yield self.event("response.output_text.done", item_id=open_["id"], output_index=index,
                                 content_index=0, text=open_["text"], logprobs=open_["logprobs"])
                yield self.event("response.content_part.done", item_id=open_["id"], output_index=index,
                                 content_index=0, part=item["content"][0])
            else:
                yield self.event("response.function_call_arguments.done", item_id=open_["id"], output_index=index,
                                 arguments=open_["text"])
                item = self._call(open_["call_id"], open_["name"], open_["text"], open_["id"],
                                  self.message_status(finish_reason))
            yield self.event("response.output_item.done", output_index=index, item=item)
            done.append(item)
            open_ = None

        def start(kind: str, **more):
            nonlocal open_
            yield from close()
            prefix = {"reasoning": "rs_", "message": "msg_", "call": "fc_"}[kind]
            open_ = {"kind": kind, "id": prefix + uuid.uuid4().hex, "text": "", "logprobs": [], **more}
            index = len(done)
            if kind == "reasoning":
                item = {"type": "reasoning", "id": open_["id"], "summary": [], "content": []}
            elif kind == "message":
                item = {**self._message("", [], open_["id"], "in_progress"), "content": []}
            else:
                item = self._call(more["call_id"], more["name"], "", open_["id"], "in_progress")
            yield self.event("response.output_item.added", output_index=index, item=item)
            if kind == "message":
                yield self.event("response.content_part.added", item_id=open_["id"], output_index=index,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})

        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield self.event("error", code=error.get("code"), message=error.get("message"), param=None)
                failed = {**self.response(done, "failed", None), "error": {"code": "server_error",
                                                                           "message": error.get("message")}}
                yield self.event("response.failed", response=failed)
                return
            if not chunk["choices"]:  # the last: usage
                usage = _usage(chunk.get("usage"))
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content") or delta.get("tool_calls"):
                held = []  # tokens of the reasoning or a call, not of the message's text
            elif not delta.get("content"):
                held += logprobs  # tokens whose text is held back (a stop string, a marker): wait
                logprobs = []
            else:
                logprobs, held = held + logprobs, []
            if delta.get("reasoning_content"):
                if open_ is None or open_["kind"] != "reasoning":
                    for line in start("reasoning"):
                        yield line
                open_["text"] += delta["reasoning_content"]
                yield self.event("response.reasoning_text.delta", item_id=open_["id"], output_index=len(done),
                                 content_index=0, delta=delta["reasoning_content"])
            if delta.get("content"):
                if open_ is None or open_["kind"] != "message":
                    for line in start("message"):
                        yield line
                open_["text"] += delta["content"]
                open_["logprobs"] += logprobs
                yield self.event("response.output_text.delta", item_id=open_["id"], output_index=len(done),
                                 content_index=0, delta=delta["content"], logprobs=logprobs)
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a new call
                    for line in start("call", call_id=call["id"], name=function.get("name")):
                        yield line
                if function.get("arguments"):
                    open_["text"] += function["arguments"]
                    yield self.event("response.function_call_arguments.delta", item_id=open_["id"],
                                     output_index=len(done), delta=function["arguments"])
            finish_reason = choice.get("finish_reason") or finish_reason
        if not done and open_ is None:  # an empty answer is still a message
            for line in start("message"):
                yield line
        if held and open_["kind"] == "message":  # the last tokens' (an EOS's): their text never came
            open_["logprobs"] += held
            yield self.event("response.output_text.delta", item_id=open_["id"], output_index=len(done),
                             content_index=0, delta="", logprobs=held)
        for line in close():
            yield line
        status = self.status(finish_reason)
        yield self.event(f"response.{status}", response=self.response(done, status, usage))

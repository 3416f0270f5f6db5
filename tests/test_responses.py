"""OpenAI's Responses API (``/v1/responses``), driven by the real ``openai`` client: the same
answers as chat completions, as output items (reasoning, message, function calls), whole and
as Responses' stream events."""
import json

import httpx
import openai
import pytest
from openai.types.responses import Response

from specdec import LLM, SpecConfig
from specdec.server import BackgroundServer, create_app

MODEL = "tiny"
WORDS = {"structured_outputs": {"regex": "[a-z ]{3,12}"}}  # ends (EOS) within a few tokens
CLOSED = "Hello there <think></think>"  # no reasoning to wait for: a constraint applies from the first token
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Rome"]}}}}
THINK_THEN_CALL = (r'<think>\n[a-z]{2,6}\n</think>\n\nOk\n<tool_call>\n\{"name": "get_weather", '
                   r'"arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server(loaded):
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3), max_batch_size=2)
    with BackgroundServer(create_app(llm, served_model_name=MODEL, reasoning_parser="qwen3",
                                     enable_auto_tool_choice=True, tool_call_parser="hermes")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def events(client, **kw) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kw))


def test_text_as_chat_gives_it(client):
    """A response's text, usage and cut are the chat completion's for the same conversation
    (``instructions`` as its system message, text parts as its parts); ``max_output_tokens``
    cutting it makes the response incomplete. Streamed: created, in progress, the message
    item's events with text deltas that add up, then the response completed (or incomplete)
    as the whole one, sequence numbers counting up."""
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=10, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}])
    r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=10, instructions="be brief",
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                                metadata={"run": "1"}, reasoning={"effort": "low"}, store=False)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.metadata == {"run": "1"} and r.reasoning.effort == "low" and r.instructions == "be brief"
    raw = httpx.post(str(client.base_url) + "responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4}).json()
    Response.model_validate(raw, strict=True)  # every field the openai package requires, of its type
    assert r.output_text == chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"  # cut by max_output_tokens
    streamed = events(client, temperature=0, max_output_tokens=10, instructions="be brief", input="Hello there")
    kinds = [e.type for e in streamed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == r.output_text
    last = streamed[-1].response
    assert last.output_text == r.output_text and last.usage.output_tokens == r.usage.output_tokens
    done = dict(temperature=0, max_output_tokens=40, input=CLOSED, extra_body=WORDS)
    whole = client.responses.create(model=MODEL, **done)
    assert whole.status == "completed" and whole.incomplete_details is None
    with client.responses.stream(model=MODEL, **done) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"


def test_reasoning_and_function_calls(client):
    """With a reasoning parser and tools, the answer's parts are output items: the reasoning,
    the message, the function call (its call_id and JSON arguments), as the chat's
    reasoning_content, content and tool_calls; streamed, each item's deltas add up to the
    whole response's. A call and its output sent back as input items go through the chat
    template as the chat's assistant tool call and tool message do."""
    messages = [{"role": "user", "content": "weather in Paris? <think></think>"}]
    kw = dict(temperature=0, max_output_tokens=120, tools=[WEATHER], extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        extra_body=kw["extra_body"]).choices[0].message
    r = client.responses.create(model=MODEL, input=messages, **kw)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
    reasoning, message, call = r.output
    assert reasoning.content[0].text == chat.model_extra["reasoning_content"]
    assert message.content[0].text == chat.content
    assert (call.name, call.arguments) == (chat.tool_calls[0].function.name, chat.tool_calls[0].function.arguments)
    assert call.call_id.startswith("call_") and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    thought = len(f"<think>\n{reasoning.content[0].text.strip()}\n</think>")  # byte tokens: one per character
    assert r.usage.output_tokens_details.reasoning_tokens == thought < r.usage.output_tokens
    with client.responses.stream(model=MODEL, input=messages, **kw) as stream:
        streamed = list(stream)
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == call.arguments
    assert final.output[2].name == "get_weather" and final.output[2].arguments == call.arguments
    assert final.usage.output_tokens_details.reasoning_tokens == thought
    with client.responses.stream(model=MODEL, input=messages, include=["message.output_text.logprobs"], **kw) as stream:
        final = stream.get_final_response()  # logprobs of the reasoning's and the call's tokens open no message
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == \
        [("reasoning", None), ("message", None), ("function_call", "get_weather")]
    assert final.output[1].content[0].text == message.content[0].text and final.output[2].arguments == call.arguments
    # cut in the call's arguments: the whole answer has the text as its message (no complete call); the
    # stream keeps the call it started, incomplete, as the chat stream does
    cut = r.usage.output_tokens - 10
    whole = client.responses.create(model=MODEL, input=messages, **{**kw, "max_output_tokens": cut})
    assert whole.status == "incomplete" and [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[1].content[0].text.startswith(message.content[0].text + "<tool_call>")
    last = events(client, input=messages, **{**kw, "max_output_tokens": cut})[-1]
    assert last.type == "response.incomplete" and [o.type for o in last.response.output] == [o.type for o in r.output]
    assert last.response.output[1].content[0].text == message.content[0].text
    assert last.response.output[2].status == "incomplete" and call.arguments.startswith(last.response.output[2].arguments)
    # the next turn: the answer's items and the call's output, as the openai client's loop sends them;
    # the answer's text and call are one assistant turn, as the model wrote them (one prompt prefix)
    turn = r.output + [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    nxt = client.responses.create(model=MODEL, input=messages + [o if isinstance(o, dict) else o.model_dump()
                                                                 for o in turn], tools=[WEATHER], max_output_tokens=4)
    tokenized = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json={"model": MODEL, "messages": [
        *messages, {"role": "assistant", "content": chat.content, "tool_calls": [t.model_dump() for t in chat.tool_calls]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]}).json()
    assert nxt.usage.input_tokens == tokenized["count"]
    history = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'}]
    chat_history = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                       "content": '{"sky": "sunny"}'}]
    after = client.responses.create(model=MODEL, input=messages + history, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages + chat_history, tool_choice="none", tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=8, temperature=0)
    assert after.output_text == (chat.choices[0].message.content or "")
    assert after.usage.input_tokens == chat.usage.prompt_tokens


def test_structured_text_and_logprobs(client):
    """``text.format`` json_schema constrains the output as the chat's response_format does;
    ``include`` output_text logprobs with ``top_logprobs`` gives the chat's logprobs."""
    schema = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}
    r = client.responses.create(model=MODEL, input=CLOSED, temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"a"}
    r = client.responses.create(model=MODEL, input="Hello", temperature=0, max_output_tokens=6, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=2)
    ours = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in r.output[0].content[0].logprobs]
    theirs = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in chat.choices[0].logprobs.content]
    assert ours == theirs and len(ours) == 6


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stores no prompts"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "only text"),
    ({"input": [{"type": "file_search_call"}]}, "input", "not served"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text.logprobs'"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "input", "exceeds the context window"),  # as chat names it: the prompt
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role must be"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "needs call_id"),
    ({"text": {"format": {"type": "json_schema"}}}, "text", "schema"),
    ({"model": "other"}, "model", "does not exist"),
])
def test_refused_requests(server, body, param, words):
    """What this server does not do is a 400 naming the field (an unknown model: 404)."""
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", **body})
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400) and error["param"] == param, error
    assert words in error["message"], error


def test_streamed_logprobs_end_with_the_eos(loaded):
    """A stream whose EOS comes alone (one token per step) gives its logprobs (its text never
    comes) as the whole response does: in a last, empty text delta, and in the message's done
    event and item."""
    kw = dict(input=CLOSED, temperature=0, max_output_tokens=40, top_logprobs=1,
              include=["message.output_text.logprobs"], extra_body=WORDS)
    with BackgroundServer(create_app(LLM(loaded("llama")), served_model_name=MODEL, reasoning_parser="qwen3")) as srv:
        plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = plain.responses.create(model=MODEL, **kw)
        evs = events(plain, **kw)
    want = [lp.token for lp in whole.output[0].content[0].logprobs]
    assert whole.status == "completed" and want[-1] == "</s>"  # the EOS
    deltas = [lp.token for e in evs if e.type == "response.output_text.delta" for lp in e.logprobs]
    [done] = [e for e in evs if e.type == "response.output_text.done"]
    assert deltas == want and [lp.token for lp in done.logprobs] == want
    assert [lp.token for lp in evs[-1].response.output[0].content[0].logprobs] == want


def test_harmony_reasoning_and_message(loaded, monkeypatch):
    """A GPT-OSS model's answer (harmony messages, forced by a regex here from the first
    token: its gate is taken away) comes back as a reasoning item and a message, the same
    streamed, its reasoning tokens through the analysis message's <|end|>."""
    import re

    import specdec.api

    monkeypatch.setattr(specdec.api, "grammar_gate", lambda *a: "")
    regex = re.escape("<|channel|>analysis<|message|>") + "[a-z]{2,6}" + \
        re.escape("<|end|><|start|>assistant<|channel|>final<|message|>") + "Hi [a-z]{1,4}"
    kw = dict(input="hello", temperature=0, max_output_tokens=200, extra_body={"structured_outputs": {"regex": regex}})
    with BackgroundServer(create_app(LLM(loaded("gptoss")), served_model_name=MODEL)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.responses.create(model=MODEL, **kw)
        evs = events(client, **kw)
    reasoning, message = r.output
    thought = reasoning.content[0].text
    assert reasoning.type == "reasoning" and 2 <= len(thought) <= 6 and message.content[0].text.startswith("Hi ")
    assert r.usage.output_tokens_details.reasoning_tokens == len(f"<|channel|>analysis<|message|>{thought}<|end|>")
    streamed = "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert (streamed, text) == (thought, message.content[0].text)

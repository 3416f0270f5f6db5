"""Tool calls: the Hermes parser, and the server's tools / tool_choice (auto through the
parser, required and named through structured outputs), streamed and not."""
import json
import re
from contextlib import contextmanager

import httpx
import openai
import pytest

from specdec import LLM, SpecConfig
from specdec.server import BackgroundServer, create_app
from specdec.tools import (TOOL_PARSERS, ToolCall, parse_hermes, parse_llama3_json, parse_mistral, parse_pythonic,
                           parse_required, required_partial, required_schema)

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "additionalProperties": False, "required": ["q"],
                                     "properties": {"q": {"type": "string", "maxLength": 8}}}}}
TOOLS = [WEATHER, SEARCH]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMES = frozenset({"get_weather", "search"})


def test_parse_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "search", "arguments": {"q": "é"}}'  # the last one without its end tag
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("search", {"q": "é"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None
    bad = 'x <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse_hermes(bad) == (bad, [])  # not JSON: text
    bare = '```json\n{"name": "search", "arguments": {"q": "x"}}\n```'
    assert [c.name for c in parse_hermes(bare, NAMES)[1]] == ["search"] and parse_hermes(bare, NAMES)[0] is None
    both = '[{"name": "search", "arguments": {"q": "x"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert [c.name for c in parse_hermes(both, NAMES)[1]] == ["search", "get_weather"]
    for text in ('{"name": "unknown", "arguments": {}}', '{"a": 1}', "plain words", bare, '{"name": ["x"], "arguments": {}}'):
        assert parse_hermes(text) == (text, [])  # unknown names (none given here) stay text
    lines = '{"name": "search", "arguments": {"q": "x"}}\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert parse_hermes(lines, NAMES)[0] is None and [c.name for c in parse_hermes(lines, NAMES)[1]] == ["search", "get_weather"]
    content, calls = parse_hermes(bare + "\nThat looks x up.", NAMES)  # bare calls, then words: the content
    assert content == "\nThat looks x up." and [c.name for c in calls] == ["search"]
    content, calls = parse_hermes(lines + '\n{"a": 1}', NAMES)
    assert content == '{"a": 1}' and len(calls) == 2
    assert parse_hermes(lines[:-2], NAMES) == (lines[:-2], [])  # a call cut short: all text
    assert parse_required('[{"name": "search", "parameters": {"q": "x"}}]')[0].arguments == '{"q": "x"}'
    assert parse_required('[{"name": "search", "param') == []
    assert ToolCall("f", "{}", "call_1").to_openai(0) == {
        "index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert TOOL_PARSERS["llama4_json"] is TOOL_PARSERS["llama3_json"] and TOOL_PARSERS["qwen3_xml"] is TOOL_PARSERS["qwen3_coder"]
    assert TOOL_PARSERS["llama4_pythonic"] is TOOL_PARSERS["pythonic"]  # vLLM's aliases
    hermes = TOOL_PARSERS["hermes"]
    assert hermes.could_be_call(" \n{") and hermes.could_be_call("```") and hermes.could_be_call("")
    assert not hermes.could_be_call("Sure")
    assert not hermes.could_be_call("```python\ndef f") and hermes.could_be_call("```js")  # ```json may follow
    assert hermes.could_be_call("```json\n{") and not hermes.could_be_call("```jsx")
    schema = required_schema([WEATHER["function"]], parallel=False)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]


def named(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parse_llama3_json():
    """Llama 3's JSON calls: one object, or several separated by ';', perhaps after
    <|python_tag|>; "parameters" (or "arguments"). Text first, broken JSON, a JSON answer that is
    no call, or a function not among the tools: the whole answer is content."""
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_llama3_json(one, NAMES)[0] is None and named(parse_llama3_json(one, NAMES)[1]) == [
        ("get_weather", {"city": "Paris"})]
    two = '<|python_tag|>{"name": "search", "parameters": {"q": "a;b"}}; {"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert named(parse_llama3_json(two, NAMES)[1]) == [("search", {"q": "a;b"}), ("get_weather", {"city": "Rome"})]
    for text in ("Sure. " + one, one[:-1], '{"answer": 42}', '{"name": "nope", "parameters": {}}', "", "[1]"):
        assert parse_llama3_json(text, NAMES) == (text, []), text
    assert named(parse_llama3_json('{"name": "nope", "parameters": {}}')[1]) == [("nope", {})]  # no tools known


def test_parse_mistral():
    """Mistral's calls after [TOOL_CALLS]: a JSON list (v3 tokenizers) or name[ARGS]{...} per
    call (v11+); text before is the content; ids are 9 letters and digits. Without the tag
    (special tokens skipped), a bare JSON list of calls is still read."""
    v3 = 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
         '{"name": "search", "arguments": {"q": "x"}}]'
    content, calls = parse_mistral(v3, NAMES)
    assert content == "Checking. " and named(calls) == [("get_weather", {"city": "Paris"}), ("search", {"q": "x"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]search[ARGS]{"q": "é"}'
    assert parse_mistral(v11, NAMES)[0] is None
    assert named(parse_mistral(v11, NAMES)[1]) == [("get_weather", {"city": "Rome"}), ("search", {"q": "é"})]
    bare = '[{"name": "search", "arguments": {"q": "y"}}]'
    assert named(parse_mistral(bare, NAMES)[1]) == [("search", {"q": "y"})] and len(parse_mistral(bare, NAMES)[1][0].id) == 9
    for text in ("[TOOL_CALLS][{broken", "[TOOL_CALLS]get_weather[ARGS]{", "plain text", "[TOOL_CALLS]"):
        assert parse_mistral(text, NAMES) == (text, []), text


def test_parse_pythonic():
    """A Python list of calls with literal keyword arguments (JSON's true/false/null too),
    perhaps between <|python_start|> and <|python_end|>. Positional arguments, expressions,
    text around the list or an unknown function: the whole answer is content."""
    text = "[get_weather(city='Paris'), search(q=\"x\", n=[1, -2.5], opts={'a': None, 'b': True}, f=false)]"
    assert parse_pythonic(text, NAMES)[0] is None
    assert named(parse_pythonic(text, NAMES)[1]) == [
        ("get_weather", {"city": "Paris"}), ("search", {"q": "x", "n": [1, -2.5], "opts": {"a": None, "b": True}, "f": False})]
    wrapped = "<|python_start|>[search(q='z')]<|python_end|>"
    assert named(parse_pythonic(wrapped, NAMES)[1]) == [("search", {"q": "z"})]
    for bad in ("[search('z')]", "[search(q=1+1)]", "Sure: [search(q='z')]", "[nope(q='z')]", "[]",
                "[search(q='z')", "[search(**kw)]", "[1, 2]", "[__import__('os')]"):
        assert parse_pythonic(bad, NAMES) == (bad, []), bad


@pytest.mark.parametrize("parser, text, content, calls", [
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}', None, ["search"]),
    ("mistral", 'Let me see.[TOOL_CALLS]search[ARGS]{"q": "x"}', "Let me see.", ["search"]),
    ("pythonic", "[get_weather(city='Rome')]", None, ["get_weather"]),
    ("pythonic", "[not a call, just text", "[not a call, just text", []),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
])
def test_answer_views_of_each_parser(parser, text, content, calls):
    """Through AnswerParser: the final view's content and calls, and a stream that never sends
    text it must take back (a marker's or a call's beginning is held until it is known)."""
    from specdec.answer import AnswerParser

    answer = AnswerParser(tool_mode="auto", tool_names=NAMES, tool_parser=parser)
    final = answer.view(text, final=True)
    assert (final.content, [c.name for c in final.calls]) == (content, calls)
    for n in range(len(text) + 1):
        assert (final.content or "").startswith(answer.view(text[:n]).content), (text, n)


@pytest.fixture(scope="module")
def tool_server(loaded):
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3), max_batch_size=2)
    with BackgroundServer(create_app(llm, served_model_name=MODEL, enable_auto_tool_choice=True,
                                     tool_call_parser="hermes")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(tool_server):
    return client_of(tool_server)


def client_of(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@contextmanager
def ngram_server(loaded, **app_options):
    """A client of a server (``create_app(..., **app_options)``) over the tiny llama with
    n-gram drafting, for a test's own parsers."""
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="ngram"), max_batch_size=2)
    with BackgroundServer(create_app(llm, served_model_name=MODEL, **app_options)) as srv:
        yield client_of(srv)


def streamed(client, **kw) -> tuple[str, list, str]:
    """(content, tool calls as (index, name, arguments), finish reason) of a streamed answer."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:  # a call's first delta names it, later ones add arguments
            if c.index == len(calls):
                assert c.id and c.function.name, c
                calls.append((c.index, c.function.name, ""))
            assert not c.function.name or c.function.name == calls[c.index][1]
            calls[c.index] = (c.index, calls[c.index][1], calls[c.index][2] + (c.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_required_and_named_tool_choice(client, choice):
    """The answer is constrained to calls: "required" returns one call or more to the given
    functions, with arguments that follow their schemas and finish reason tool_calls; a
    named function, its arguments (finish reason stop, as OpenAI's). Streamed: the same."""
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60)
    r = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert r.message.content is None and r.message.tool_calls
    for call in r.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "search") and call.type == "function"
        assert args in ({"city": "Paris"}, {"city": "Rome"}) if call.function.name == "get_weather" else set(args) == {"q"}
    assert r.finish_reason == ("tool_calls" if choice == "required" else "stop")
    if choice != "required":
        assert [c.function.name for c in r.message.tool_calls] == ["search"]
    content, calls, finish = streamed(client, **kw)
    assert content == "" and finish == r.finish_reason
    assert calls == [(j, c.function.name, c.function.arguments) for j, c in enumerate(r.message.tool_calls)]
    pieces = sum(bool(chunk.choices and chunk.choices[0].delta.tool_calls)
                 for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw))
    assert pieces > 1  # the arguments stream as they are written


def test_auto_tool_choice_parses_hermes_calls(client):
    """With "auto" the model's own text is parsed: here a regex makes the tiny model write
    some words and then a Hermes call. The words are the content, the call a tool call
    (finish reason tool_calls); streamed, the content arrives without any of the call's text."""
    regex = r'Sure[a-z]{0,3}\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    kw = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120, extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert r.message.content.startswith("Sure") and "<tool_call>" not in r.message.content
    assert [c.function.name for c in r.message.tool_calls] == ["get_weather"] and r.finish_reason == "tool_calls"
    content, calls, finish = streamed(client, **kw)
    assert content == r.message.content and finish == "tool_calls"
    assert calls == [(0, "get_weather", r.message.tool_calls[0].function.arguments)]
    plain = dict(kw, extra_body={"structured_outputs": {"regex": "[a-z ]{3,12}"}})  # no call: text as usual
    r = client.chat.completions.create(model=MODEL, **plain).choices[0]
    assert r.message.tool_calls is None and r.finish_reason == "stop" and r.message.content
    assert streamed(client, **plain) == (r.message.content, [], "stop")


def test_streamed_call_cut_short_stays_a_call(client):
    """A call that max_tokens cuts in its arguments: streamed, it stays the call it was
    streamed as, with the arguments written (finish reason length), and none of its text
    arrives as content; whole, the text is content (no complete call), as vLLM's."""
    regex = r'Sure[a-z]{0,3}\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    kw = dict(messages=MESSAGES, tools=TOOLS, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    text = client.chat.completions.create(model=MODEL, max_tokens=120, **kw).choices[0].message
    cut = len(text.content + '<tool_call>\n{"name": "get_weather", "arguments": {"ci')  # the tiny model's tokens are bytes
    r = client.chat.completions.create(model=MODEL, max_tokens=cut, **kw).choices[0]
    assert r.finish_reason == "length" and r.message.tool_calls is None and r.message.content.endswith('{"ci')
    content, calls, finish = streamed(client, max_tokens=cut, **kw)
    assert content == text.content and finish == "length"
    assert calls == [(0, "get_weather", '{"ci')]


def test_tool_conversation_and_none(client):
    """A conversation with an earlier call and its result goes through the chat template;
    tool_choice "none" shows the tools to the template (as vLLM does by default) but reads no
    calls from the answer."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    from specdec.server.protocol import ChatCompletionRequest, parse

    req = parse(ChatCompletionRequest, {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none"})
    assert req.tool_mode is None and req.chat_options()["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("body, server, match", [
    ({"tools": TOOLS}, "plain", "--enable-auto-tool-choice"),  # auto is the default with tools
    ({"tool_choice": "required"}, "tools", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "constrains"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tools", "tool_choice"),
])
def test_tool_request_errors(loaded, tool_server, body, server, match):
    url = tool_server.url
    if server == "plain":  # a server without auto tool choice
        llm = LLM(loaded("llama"), max_batch_size=1)
        with BackgroundServer(create_app(llm, served_model_name=MODEL)) as srv:
            r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    else:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


def test_auto_tool_choice_needs_a_parser(loaded):
    with pytest.raises(ValueError, match="tool_call_parser"):
        create_app(LLM(loaded("llama")), enable_auto_tool_choice=True)


ANSWERS = [
    "<think>\nThe user wants weather.\n</think>\n\nSure.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>short</think>plain answer with <thin and </thi in it",
    '```json\n{"name": "search", "arguments": {"q": "x"}}\n```',
    "I reason here</think>then answer",
    "no tags at all <tool_call> {broken",
    "<thi",
    '{"name": "search", "arguments": {"q": "x"}}; {"name": "search", "arguments": {}}\n\nThat finds x.',
    # GPT-OSS's harmony: analysis, a preamble, a call; analysis, then the final answer
    '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.'
    '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    '{"city": "Paris"}<|call|>',
    "<|channel|>analysis<|message|>Two <|e|> parts.<|end|><|start|>assistant<|channel|>final<|message|>It is 3.<|return|>",
    ' to=functions.search<|channel|>commentary json<|message|>{"q": "x"}',  # the recipient first, no <|call|> (EOS)
]


@pytest.mark.parametrize("reasoning, opened", [(None, False), ("qwen3", False), ("qwen3", True), ("deepseek_r1", False),
                                               ("openai_gptoss", False)])
@pytest.mark.parametrize("tool_mode", [None, "auto"])
def test_answer_views_only_grow(reasoning, opened, tool_mode):
    """For every prefix of an answer, each part of the partial view (reasoning, content) is a
    prefix of the whole answer's part: a stream never sends text it must take back."""
    from specdec.answer import AnswerParser

    parser = AnswerParser(reasoning, tool_mode, NAMES, opened=opened)
    for text in ANSWERS:
        final = parser.view(text, final=True)
        for n in range(len(text) + 1):
            part = parser.view(text[:n])
            assert (final.reasoning or "").startswith(part.reasoning or ""), (text, n)
            assert (final.content or "").startswith(part.content), (text, n)
            assert len(part.calls) <= len(final.calls) and all(
                f.name == c.name and f.arguments.startswith(c.arguments) for c, f in zip(part.calls, final.calls))


def test_harmony_answers():
    """openai_gptoss: GPT-OSS's harmony messages as reasoning (analysis), content (final, and
    a commentary preamble) and calls (messages to functions.*, in any tool mode; a named
    function's only); a frame's markers never leak into the parts; text without frames is
    content; the reasoning tokens run through the analysis message's <|end|>."""
    from specdec.answer import AnswerParser, reasoning_tokens

    parse = AnswerParser("openai_gptoss", "auto", NAMES)
    a = parse.view(ANSWERS[-3], final=True)
    assert (a.reasoning, a.content) == ("Need weather.", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in a.calls] == [("get_weather", {"city": "Paris"})]
    assert parse.finish_reason(a, "stop") == "tool_calls"
    assert AnswerParser("openai_gptoss").view(ANSWERS[-3], final=True).calls == []  # no tools asked for
    named = AnswerParser("openai_gptoss", "function", NAMES, "search")
    assert named.view(ANSWERS[-3], final=True).calls == []
    c = parse.view(ANSWERS[-1], final=True)  # the recipient in the role section
    assert [(x.name, x.arguments) for x in c.calls] == [("search", '{"q": "x"}')] and c.content is None
    # required and named tool choices: their grammar writes the calls as the final message
    final = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>"
    d = AnswerParser("openai_gptoss", "required", NAMES).view(final + '[{"name": "search", "parameters": {"q": "y"}}]', True)
    assert [(x.name, json.loads(x.arguments)) for x in d.calls] == [("search", {"q": "y"})] and d.content is None
    e = named.view(final + '{"q": "z"}', final=True)
    assert [(x.name, x.arguments) for x in e.calls] == [("search", '{"q": "z"}')] and e.content is None
    assert AnswerParser("openai_gptoss", "required", NAMES).view(final + "no calls", final=True).content == "no calls"
    b = AnswerParser("openai_gptoss").view(ANSWERS[-2], final=True)
    assert (b.reasoning, b.content, b.calls) == ("Two <|e|> parts.", "It is 3.", [])
    assert AnswerParser("openai_gptoss").view("<|channel|>analysis<|message|>only", final=True).content is None
    assert AnswerParser("openai_gptoss").view("plain text", final=True).content == "plain text"
    part = AnswerParser("openai_gptoss").view(ANSWERS[-2][:ANSWERS[-2].index("3.") + 4])  # "It is 3.<|"
    assert part.content == "It is 3." and part.reasoning == "Two <|e|> parts."
    tok = __import__("tiny").byte_tokenizer()  # a token per character
    ids = tok.encode(ANSWERS[-2], add_special_tokens=False)
    assert reasoning_tokens(tok, parse, ids) == ANSWERS[-2].index("<|end|>") + len("<|end|>")
    assert reasoning_tokens(tok, parse, tok.encode("plain", add_special_tokens=False)) == 0
    assert TOOL_PARSERS["openai"].parse(ANSWERS[-3], NAMES)[0] == "Checking."  # vLLM's name, the same reading


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def test_harmony_gate_opens_after_the_final_frame(tmp_path):
    """A structured output under openai_gptoss starts after the final channel's frame, with
    or without a format (``final <|constrain|>json``), its markers special tokens as GPT-OSS's
    tokenizer has them; not after the analysis frame."""
    from specdec.answer import grammar_gate
    from specdec.config import StructuredOutputs
    from specdec.runtime import load_model

    from tiny import MOE, VOCAB, byte_tokenizer, make_tiny

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    llm = LLM(load_model(str(make_tiny(tmp_path / "gptoss", "gpt_oss", vocab=VOCAB + 8, tokenizer=tok,
                                       **MOE["gpt_oss"]))))
    gate = grammar_gate(llm.tokenizer, [], "openai_gptoss")
    analysis = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>"
    for header, opens in (("final<|message|>", True), ("final <|constrain|>json<|message|>", True),
                          ("commentary<|message|>", False)):
        ids = llm.tokenizer.encode(analysis + header, add_special_tokens=False)
        assert len(ids) < len(analysis + header)  # the frames are single tokens
        m = llm.grammars.matcher(StructuredOutputs(regex="[0-9]{4}"), gate)
        assert (m.opens_after(ids) == len(ids)) is opens, header
        assert m.allowed([ids])[0].sum().item() == (10 if opens else llm.target.runtime.vocab_size), header


CALL_ANSWERS = [  # (tool mode, answer), or (tool mode and parser, answer)
    ("auto", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"x": 2}]}}\n'
             '</tool_call>\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'),
    ("auto", '<tool_call>{"arguments": {"q": "y"}, "name": "search"}</tool_call>'),
    ("auto", '<tool_call>\n{"name": "search", "parameters": {"q": 12}}'),
    ("required", '[{"name":"search","parameters":{"q":"a,b"}},{"name":"get_weather","parameters":{"city":"Rome"}}]'),
    ("function", '{"q":"x y"}'),
    ("auto llama3_json", '{"name": "search", "parameters": {"q": "a;b"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("auto llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'),
    ("auto mistral", 'Checking.[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("auto mistral", '[TOOL_CALLS]search[ARGS]{"q": "y z"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'),
    ("auto", '```json\n{"name": "search", "arguments": {"q": "bare"}}\n```'),  # bare JSON (Qwen2.5-Coder)
    ("auto", '{"name": "search", "arguments": {"q": "a"}}\n{"name": "get_weather", "arguments": {"city": "Rome"}}\nDone.'),
    ("auto mistral", ' [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "search", "arguments": {}}]'),
    ("auto qwen3_coder", 'Sure.\n<tool_call>\n<function=search>\n<parameter=q>\nx <b>\n</parameter>\n<parameter=n>\n2\n'
                         '</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>'),
]


@pytest.mark.parametrize("tool_mode, text", CALL_ANSWERS)
def test_streamed_calls_only_grow(tool_mode, text):
    """Every partial view's calls are the final view's, in order, each with a prefix of its
    arguments (the raw JSON the model wrote); a call shows once its name is complete, and
    the final calls' arguments are valid JSON."""
    from specdec.answer import AnswerParser

    tool_mode, _, tool_parser = tool_mode.partition(" ")
    parser = AnswerParser(None, tool_mode, NAMES, "search" if tool_mode == "function" else None, tool_parser or "hermes")
    final = parser.view(text, final=True)
    assert final.calls and all(isinstance(json.loads(c.arguments), dict) for c in final.calls)
    grew = set()
    for n in range(len(text) + 1):
        calls = parser.view(text[:n]).calls
        assert len(calls) <= len(final.calls), (text, n)
        for c, f in zip(calls, final.calls):
            assert c.name == f.name and f.arguments.startswith(c.arguments), (text[:n], c, f)
            grew.add((c.name, len(c.arguments)))
    if tool_parser == "mistral":
        assert all(len(c.id) == 9 for c in parser.view(text[:-3]).calls + final.calls)  # Mistral's ids
    first = {n for name, n in grew if name == final.calls[0].name}
    # the first call's arguments streamed in pieces, unless written before its name
    assert len(first) > 2 or text.startswith('<tool_call>{"arguments"'), first


def test_parse_qwen3_coder_types_values_by_schema():
    """qwen3_coder: each value as its parameter's type in the tool's schema (vLLM's rules),
    text where the schema does not say; streamed parameter by parameter in the same JSON."""
    from specdec.answer import AnswerParser
    from specdec.tools import parse_qwen3_coder

    schema = {"find": {"properties": {"n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
                                      "opt": {"type": "object"}, "tags": {"type": "array"}, "s": {"type": "string"}}}}
    params = {"n": "3", "x": "2.5", "ok": "True", "opt": '{"a": [1]}', "tags": "['a', 'b']", "s": "007",
              "free": "12", "none": "null"}
    text = "<tool_call>\n<function=find>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) \
        + "</function>\n</tool_call>"
    content, calls = parse_qwen3_coder(text, schema)
    assert content is None and [c.name for c in calls] == ["find"]
    assert json.loads(calls[0].arguments) == {"n": 3, "x": 2.5, "ok": True, "opt": {"a": [1]}, "tags": ["a", "b"],
                                              "s": "007", "free": "12", "none": None}
    assert json.loads(parse_qwen3_coder(text)[1][0].arguments)["n"] == "3"  # no schemas: text
    assert parse_qwen3_coder("no call here") == ("no call here", [])
    parser = AnswerParser(None, "auto", schema, None, "qwen3_coder")
    shown = [parser.view(text[:n]).calls for n in range(len(text) + 1)]
    assert all(calls[0].arguments.startswith(c[0].arguments) for c in shown if c)
    assert len({c[0].arguments for c in shown if c}) == len(params) + 2  # "{", each parameter, then "}"


def test_json_members():
    from specdec.tools import json_members

    text = '{"a": "x}\\"", "b" : [1, {"c": "]"}], "c": 12'
    members, end = json_members(text)
    assert {k: text[s:e] if e else None for k, (s, e) in members.items()} == {"a": '"x}\\""', "b": '[1, {"c": "]"}]', "c": None}
    assert end is None  # 12 may go on
    assert json_members(text + "}")[1] == len(text) + 1 and json_members("{}") == ({}, 2)
    with pytest.raises(ValueError):
        json_members('{"a" 1}')
    for bad in ("[1]", '{"a": :}', '{"a": 1 "b"'):
        with pytest.raises(ValueError):
            json_members(bad)
    assert required_partial('[: ') == [] and [c.name for c in required_partial('[{"name": "f"} {')] == ["f"]  # ends


def test_answer_parts():
    from specdec.answer import AnswerParser

    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' \
          '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    for final in (True, False):  # parallel_tool_calls false: auto keeps the first call, as vLLM
        assert len(AnswerParser(None, "auto", NAMES).view(two, final=final).calls) == 2
        assert [c.arguments for c in AnswerParser(None, "auto", NAMES, parallel=False).view(two, final=final).calls] \
            == ['{"city": "A"}']

    a = AnswerParser("qwen3", "auto", NAMES).view(ANSWERS[0], final=True)
    assert (a.reasoning, a.content, [c.name for c in a.calls]) == ("\nThe user wants weather.\n", "Sure.\n", ["get_weather"])
    a = AnswerParser("deepseek_r1").view(ANSWERS[3], final=True)
    assert (a.reasoning, a.content) == ("I reason here", "then answer")
    a = AnswerParser("deepseek_r1").view("still thinking", final=True)
    assert (a.reasoning, a.content) == ("still thinking", None)  # no end tag: all reasoning, content null (vLLM)
    assert AnswerParser("qwen3").view("<think>x</think>\n", final=True).content is None
    assert AnswerParser("qwen3").view(ANSWERS[3], final=True).content == ANSWERS[3]  # qwen3 needs <think> first
    opened = AnswerParser("qwen3", opened=True)  # ... unless the prompt opened it (Qwen3 thinking-only templates)
    assert (opened.view(ANSWERS[3], final=True).reasoning, opened.view(ANSWERS[3], final=True).content) == \
        ("I reason here", "then answer")
    assert opened.view("I reason", final=False).reasoning == "I reason" and opened.view("I reason").content == ""
    assert AnswerParser("qwen3", "auto", NAMES).view("<think>a</think>Hello <tool_c").content == "Hello "
    assert AnswerParser("qwen3").view("<think>a</thi").reasoning == "a"  # held: may be the end tag


def test_opens_reasoning(loaded):
    from specdec.answer import opens_reasoning

    tok = loaded("llama").tokenizer
    for text, opened in [("user: hi\nassistant: <think>\n", True), ("a <think> b </think> c", False),
                         ("<think>x</think> then <think>partly", True), ("no tags", False)]:
        assert opens_reasoning(tok, tok.encode(text, add_special_tokens=False)) is opened, text


def test_reasoning_parser_on_the_server(loaded):
    """--reasoning-parser qwen3: a thinking answer (forced by a regex here) comes back as
    reasoning_content and content, the same streamed, with a tool call after the thinking. (A
    regex applies from the first token only where the prompt closed its <think>, as here;
    else it would wait for the reasoning's end.)"""
    messages = [{"role": "user", "content": "weather in Paris? <think></think>"}]
    regex = r'<think>\n[a-z]{2,6}\n</think>\n\n(Hi [a-z]{1,4}|Ok\n<tool_call>\n\{"name": "search", "arguments": \{"q": "x"\}\}\n</tool_call>)'
    with ngram_server(loaded, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes") as client:
        for tools in (None, TOOLS):
            kw = dict(messages=messages, temperature=0, max_tokens=120, extra_body={"structured_outputs": {"regex": regex}},
                      **({"tools": tools} if tools else {}))
            r = client.chat.completions.create(model=MODEL, **kw).choices[0]
            reasoning = r.message.model_extra["reasoning_content"]
            assert 2 <= len(reasoning.strip()) <= 6 and "<think>" not in (r.message.content or "")
            whole = client.chat.completions.create(model=MODEL, **kw)  # byte tokens: one per character
            assert whole.usage.completion_tokens_details.reasoning_tokens == len(f"<think>\n{reasoning.strip()}\n</think>")
            text, rc, calls, finish = "", "", [], None
            for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    text += delta.content or ""
                    rc += (delta.model_extra or {}).get("reasoning_content") or ""
                    calls += [c.function.name for c in delta.tool_calls or [] if c.function.name]  # first deltas
                    finish = chunk.choices[0].finish_reason or finish
            assert (rc, text or None, finish) == (reasoning, r.message.content, r.finish_reason)
            assert calls == [c.function.name for c in r.message.tool_calls or []]
    with pytest.raises(ValueError, match="reasoning_parser"):
        create_app(LLM(loaded("llama")), reasoning_parser="o1")


def test_harmony_reasoning_parser_on_the_server(loaded, monkeypatch):
    """--reasoning-parser openai_gptoss: a harmony answer (forced by a regex here, from the
    first token: its gate is taken away) comes back as reasoning_content, content and a tool
    call, the same streamed, its reasoning tokens counted through the analysis message's end;
    a structured output waits for the final channel's frame, which the tiny model never
    writes."""
    import specdec.api

    gate = specdec.api.grammar_gate
    monkeypatch.setattr(specdec.api, "grammar_gate", lambda *a: "")
    frame = re.escape("<|channel|>analysis<|message|>") + "[a-z]{2,6}" + re.escape("<|end|><|start|>assistant<|channel|>")
    answer, call = r"final<\|message\|>Hi [a-z]{1,4}", r'commentary to=functions\.search <\|constrain\|>json<\|message\|>\{"q": "x"\}'
    with ngram_server(loaded, reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
                      tool_call_parser="hermes") as client:
        for tools in (None, TOOLS):
            regex = frame + (call if tools else answer)
            kw = dict(messages=MESSAGES, temperature=0, max_tokens=200, extra_body={"structured_outputs": {"regex": regex}},
                      **({"tools": tools} if tools else {}))
            whole = client.chat.completions.create(model=MODEL, **kw)
            r = whole.choices[0]
            reasoning = r.message.model_extra["reasoning_content"]
            assert 2 <= len(reasoning) <= 6 and "<|" not in (r.message.content or "")
            assert whole.usage.completion_tokens_details.reasoning_tokens == \
                len(f"<|channel|>analysis<|message|>{reasoning}<|end|>")
            if tools:
                assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
                    [("search", {"q": "x"})] and r.finish_reason == "tool_calls" and r.message.content is None
            else:
                assert r.message.content.startswith("Hi ") and not r.message.tool_calls
            rc, text, calls = "", "", []
            for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    text += delta.content or ""
                    rc += (delta.model_extra or {}).get("reasoning_content") or ""
                    calls += [c.function.name for c in delta.tool_calls or [] if c.function.name]
            assert (rc, text or None) == (reasoning, r.message.content)
            assert calls == [c.function.name for c in r.message.tool_calls or []]
        monkeypatch.setattr(specdec.api, "grammar_gate", gate)
        fmt = {"structured_outputs": {"regex": "[0-9]{4}"}}  # gated: the tiny model never writes the final frame
        free = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
        gated = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, extra_body=fmt)
        assert gated.choices[0].message.content == free.choices[0].message.content
    # harmony is read without the flag for a GPT-OSS model and with vLLM's tool parser "openai"
    monkeypatch.setattr(specdec.api, "grammar_gate", lambda *a: "")
    for llm, options in ((LLM(loaded("gptoss")), {}), (LLM(loaded("llama")), dict(enable_auto_tool_choice=True,
                                                                                    tool_call_parser="openai"))):
        with BackgroundServer(create_app(llm, served_model_name=MODEL, **options)) as srv:
            r = client_of(srv).chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, max_tokens=200,
                extra_body={"structured_outputs": {"regex": frame + answer}}).choices[0].message
            assert 2 <= len(r.model_extra["reasoning_content"]) <= 6 and r.content.startswith("Hi "), options


@pytest.mark.parametrize("parser, regex", [
    ("pythonic", r"\[get_weather\(city='(Paris|Rome)'\)\]"),
    ("mistral", r'[A-Z][a-z]{1,3}\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Paris|Rome)"\}'),
    ("llama3_json", r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)"\}\}'),
    ("qwen3_coder", r'<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n</function>\n</tool_call>'),
])
def test_auto_tool_choice_with_other_parsers(loaded, parser, regex):
    """--tool-call-parser pythonic / mistral / llama3_json / qwen3_coder on the server: an answer in the
    family's format (forced by a regex) comes back as a tool call, streamed alike; Mistral's
    call ids are 9 letters and digits."""
    with ngram_server(loaded, enable_auto_tool_choice=True, tool_call_parser=parser) as client:
        kw = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": regex}})
        r = client.chat.completions.create(model=MODEL, **kw).choices[0]
        call = r.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1
        assert (r.message.content is None) == (parser != "mistral")
        if parser == "mistral":
            assert len(call.id) == 9 and call.id.isalnum() and "[TOOL_CALLS]" not in r.message.content
        content, calls, finish = streamed(client, **kw)
        assert content == (r.message.content or "") and finish == "tool_calls"
        assert [(i, n, json.loads(a)) for i, n, a in calls] == [(0, "get_weather", json.loads(call.function.arguments))]


def test_structured_output_after_reasoning_on_the_server(loaded):
    """With --reasoning-parser, a structured request leaves a thinking model's reasoning free
    (vLLM's rule): the grammar starts after </think>. The tiny model never writes it, so its
    answer is the free one; a prompt that already closed its <think> (as Qwen3's template does
    with thinking off) gets the grammar from the first token."""
    with ngram_server(loaded, reasoning_parser="qwen3") as client:
        kw = dict(model=MODEL, temperature=0, max_tokens=12)
        fmt = {"structured_outputs": {"regex": "[0-9]{4}"}}
        asked = [{"role": "user", "content": "a number?"}]
        free = client.chat.completions.create(messages=asked, **kw).choices[0].message.content
        assert client.chat.completions.create(messages=asked, extra_body=fmt, **kw).choices[0].message.content == free
        assert not re.fullmatch("[0-9]{4}", free)
        closed = [{"role": "user", "content": "a number? <think>no</think>"}]
        r = client.chat.completions.create(messages=closed, extra_body=fmt, **kw).choices[0]
        assert re.fullmatch("[0-9]{4}", r.message.content) and r.finish_reason == "stop"


def test_reasoning_parser_warns_without_think_tokens(loaded, caplog):
    """A model whose tokenizer has no <think> / </think> token likely never thinks in them
    (vLLM refuses its parser): the server says so at startup, since a structured request's
    grammar would stay off until a </think>."""
    llm = LLM(loaded("llama"))
    with caplog.at_level("WARNING", logger="specdec.server"):
        create_app(llm, reasoning_parser="qwen3")
    assert "has no <think> or </think> token" in caplog.text and "grammar starts after a </think>" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.server"):
        create_app(llm, enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert "<think>" not in caplog.text


def test_partial_calls_need_a_complete_known_name():
    """A call in progress shows only once its name is complete, and for llama3_json (no tag of
    its own) only when the name is among the request's tools; pythonic calls wait for the end."""
    from specdec.answer import AnswerParser

    def calls(parser, text):
        return [(c.name, c.arguments) for c in AnswerParser(None, "auto", NAMES, None, parser).view(text).calls]

    assert calls("llama3_json", '{"name": "other", "parameters": {"q"') == []
    assert calls("llama3_json", '{"name": "sear') == []
    assert calls("llama3_json", '{"name": "search", "parameters": {"q"') == [("search", '{"q"')]
    assert calls("hermes", '<tool_call>{"name": "search"') == [("search", "")]
    assert calls("mistral", "[TOOL_CALLS]sear") == [] and calls("mistral", "[TOOL_CALLS]search[ARGS]") == [("search", "")]
    assert calls("pythonic", "[search(q='x'), get_weather(") == []
    assert calls("hermes", '{"name": "other", "arguments": {"q"') == [] and calls("hermes", "``") == []
    assert calls("hermes", "```json\n[{\"name\": \"search\", \"arguments\": {\"q\"") == [("search", "{\"q\"")]


def test_required_tool_choice_with_nested_definitions(client):
    """Tools whose parameters name parts of ``$defs`` (pydantic's nested models, as
    ``openai.pydantic_function_tool`` writes them): "required" moves the definitions to the
    root, where the references point (a 400 before); two tools defining one name differently
    are a 400 naming ``tools``."""
    pet = {"type": "object", "properties": {"name": {"type": "string", "enum": ["Tom"]}}, "required": ["name"]}
    params = {"type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"],
              "additionalProperties": False, "$defs": {"Pet": pet}}
    tools = [{"type": "function", "function": {"name": "record", "parameters": params}}]
    schema = required_schema([tools[0]["function"]], parallel=False)
    assert schema["$defs"] == {"Pet": pet} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                       temperature=0, max_tokens=80).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
        [("record", {"pet": {"name": "Tom"}})]
    other = {"type": "function", "function": {"name": "other", "parameters": {**params, "$defs": {"Pet": {"type": "string"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[*tools, other], tool_choice="required")
    assert e.value.body["param"] == "tools" and "Pet" in e.value.body["message"]

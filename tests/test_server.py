"""The OpenAI-compatible server, live on loopback, driven by the real ``openai`` client and httpx.

Tiny random models where speed matters (concurrency, equality, aborts, metrics, bad input);
the embedded SmolLM2 with n-gram drafting end to end (``real``).
"""
import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec import LLM, SamplingParams, SpecConfig
from specdec.server import BackgroundServer, create_app
from specdec.sequence import settled_text
from specdec.server.text import TextStream

MODEL = "tiny"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def llm(loaded):
    """Self-drafting (every draft accepted: several tokens per verify step), 4 KV slots."""
    return LLM(loaded("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3), max_batch_size=4)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, served_model_name=MODEL, max_queue=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict:
    """``{(name, labels minus model_name): value}`` from /metrics, via prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[s.name, labels] = s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m[("specdec_kv_slots_used", ())] == 0 and m[("specdec_num_requests_running", ())] == 0
                and m[("specdec_num_requests_waiting", ())] == 0 and m[("specdec_kv_cache_tokens", ())] == 0):
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "kv" in k[0] or "num_requests" in k[0]}
        time.sleep(0.05)


# --- the basics: both endpoints, streaming and not ---------------------------------------------


def test_health_and_models(llm, server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    from specdec import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    one = client.models.retrieve(MODEL)  # OpenAI's GET /v1/models/{model}
    assert (one.id, one.object, one.owned_by) == (MODEL, "model", "specdec") and one == models.data[0]
    card = httpx.get(server.url + "/v1/models/" + MODEL).json()  # vLLM's fields too
    assert card["root"] == llm.target.name and card["parent"] is None and card["max_model_len"] > 0
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_cors(loaded, server):
    """vLLM's CORS flags and defaults: any origin may call the API from a browser (a preflight
    answered, ``Access-Control-Allow-Origin`` on replies, errors included); restricted, others
    are refused and get no header."""
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.text
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(server.url + "/v1/completions", headers={"Origin": "http://page.example"},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.post(server.url + "/v1/completions", headers={"Origin": "http://page.example"},
                   json={"model": MODEL, "prompt": "hi", "temperature": -1})
    assert r.status_code == 400 and r.headers["access-control-allow-origin"] == "*"
    with BackgroundServer(create_app(LLM(loaded("llama")), served_model_name=MODEL, allowed_origins=["http://ok.example"],
                                     allowed_methods=["POST"])) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.options(srv.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://ok.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://page.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_served_model_name_with_slashes(loaded):
    """A served name may hold '/' (a hub id, a file path): /v1/models/{name} and requests find it;
    any other name is OpenAI's 404 ``model_not_found``."""
    for name in ("org/tiny-1.5", "/models/tiny.gguf"):
        with BackgroundServer(create_app(LLM(loaded("llama")), served_model_name=name)) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            assert c.models.retrieve(name).id == name
            assert c.completions.create(model=name, prompt="hi", max_tokens=2).model == name
            for other in ("org/tiny", "org/tiny-1.5/x", "tiny-1.5"):
                with pytest.raises(openai.NotFoundError) as e:
                    c.models.retrieve(other)
                assert e.value.body["code"] == "model_not_found", other
            with pytest.raises(openai.NotFoundError):
                c.chat.completions.create(model="org", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            r = httpx.get(srv.url + "/v1/models/")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_several_served_names(loaded):
    """vLLM's ``--served-model-name a b``: /v1/models lists each, requests may name any, and
    responses carry the first."""
    with BackgroundServer(create_app(LLM(loaded("llama")), served_model_name=["first", "second"])) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["first", "second"]
        assert c.models.retrieve("second").id == "second"
        assert c.completions.create(model="second", prompt="hi", max_tokens=2).model == "first"
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="third", prompt="hi", max_tokens=2)
        assert "'first', 'second'" in e.value.body["message"]


def test_the_startup_thread_is_joined_at_shutdown(loaded, monkeypatch):
    """The grammars' warm-up thread runs llguidance's native code: a process that exits
    under it (``specdec serve`` on a port in use) died with a segfault. The server's shutdown
    waits for it, and it is no daemon."""
    import threading
    import time

    llm = LLM(loaded("llama"))
    started = threading.Event()

    def slow_warm():
        started.set()
        time.sleep(1.0)

    monkeypatch.setattr(llm.grammars, "warm", slow_warm)
    with BackgroundServer(create_app(llm, served_model_name=MODEL)):
        assert started.wait(10)
    assert not [t for t in threading.enumerate() if t.name == "specdec-grammars"]


def test_a_served_llm_refuses_generate(loaded):
    """While a server steps an LLM's engine, that LLM's generate would step it too (the two
    sides retired each other's requests: wrong tokens, AssertionErrors): it is refused, and
    works again once the server stops."""
    llm = LLM(loaded("llama"))
    want = llm.generate("hi", SamplingParams(max_tokens=4))[0].token_ids
    with BackgroundServer(create_app(llm, served_model_name=MODEL)) as srv:
        with pytest.raises(ValueError, match="this LLM is being served"):
            llm.generate("hi", SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="served already"):  # nor by a second server
            llm.serve(True)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0).choices[0].text
    assert llm.generate("hi", SamplingParams(max_tokens=4))[0].token_ids == want


def test_engine_error_fails_its_requests_and_counts_once(loaded):
    """A step that raises fails the requests in it (a 500, or an error chunk when streaming),
    counted once, by finish reason "error" (not also as a request refused before
    generation), and the server goes on serving."""
    llm = LLM(loaded("llama"))
    forward, fail = llm.engine.runtime.forward, [False]

    def failing(*a, **kw):
        if fail[0] and not kw.get("prefill"):
            fail[0] = False
            raise RuntimeError("injected")
        return forward(*a, **kw)

    llm.engine.runtime.forward = failing
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 10}
    error = ("specdec_request_success_total", (("finished_reason", "error"),))
    try:
        with BackgroundServer(create_app(llm, served_model_name=MODEL)) as srv:
            for stream in (False, True):
                before, fail[0] = metrics(srv.url), True
                r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
                assert (r.status_code, "injected" in r.text) == (200 if stream else 500, True)
                after = wait_idle(srv.url)
                assert after[error] - before.get(error, 0) == 1
                assert not any(k[0] == "specdec_http_requests_rejected_total" for k in after), after
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        llm.engine.runtime.forward = forward


def test_deep_grammars_and_odd_words_are_answered(server):
    """A schema whose $refs chain 1000 deep overflowed the stack that compiled it and killed
    the server (a segfault); it compiles on a big stack now. A bad word with a lone
    surrogate (JSON carries one) is a 400, not a 500."""
    n = 1000
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    schema = {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "%s", "prompt": "hi", "max_tokens": 2, '
                   b'"bad_words": ["\\ud800"]}' % MODEL.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "bad_words" in r.json()["error"]["message"], r.text


def test_null_fields_take_their_defaults(server):
    """OpenAI's optional fields are nullable: a client generated from its spec sends
    ``"n": null``; such a field takes its default (a 400 before)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    nulls = dict.fromkeys(["n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
                           "parallel_tool_calls", "min_tokens", "ignore_eos", "stop", "seed", "tools"])
    want = httpx.post(server.url + "/v1/chat/completions", json=chat).json()["choices"]
    got = httpx.post(server.url + "/v1/chat/completions", json={**chat, **nulls})
    assert got.status_code == 200 and got.json()["choices"] == want, got.text
    rest = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": None,
                                                             "ignore_eos": True}).json()["usage"]
    assert rest["total_tokens"] == 512  # max_tokens null: the rest of the window (vLLM's), not the default 16
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
    got = httpx.post(server.url + "/v1/completions", json={**completion, "echo": None, "logprobs": None, "n": None})
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == \
        httpx.post(server.url + "/v1/completions", json=completion).json()["choices"][0]["text"]


def test_streamed_usage_and_logprob_offsets(llm, client):
    """``include_usage``: usage null in every chunk but the last (OpenAI's); vLLM's
    ``continuous_usage_stats``: each chunk's usage so far. Streamed logprobs equal the whole
    response's, ``text_offset`` inside the text, when a stop string cuts the verify step
    that reached it (self-drafting commits 4 tokens a step)."""
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 24
    chunks = list(client.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 24 and len(set(counts)) > 2
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    text = client.completions.create(**kw).choices[0].text
    cut = 0
    for start in range(4, 20):
        stop = text[start:start + 3]
        whole = client.completions.create(**kw, stop=[stop], logprobs=1).choices[0]
        parts = list(client.completions.create(**kw, stop=[stop], logprobs=1, stream=True))
        offsets = [o for c in parts if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        tokens = [t for c in parts if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert "".join(c.choices[0].text for c in parts if c.choices) == whole.text
        assert (offsets, tokens) == (whole.logprobs.text_offset, whole.logprobs.tokens), stop
        assert max(offsets) <= len(whole.text)
        cut += whole.logprobs.text_offset.count(len(whole.text)) > 1  # the stop's tokens sit at the end
    assert cut  # some stop strings left tokens past the text


def test_completion_stream_equals_non_stream(llm, client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 40
    assert whole.usage.prompt_tokens == len(llm.encode("The quick brown fox"))
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2  # sent as verified, not all at the end
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    # the same text as the library's own generate (no server involved)
    ref = LLM(llm.target).generate("The quick brown fox", SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert whole.choices[0].text == ref.text
    penalised = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.3}},
                                          presence_penalty=0.5, frequency_penalty=0.2)
    ref = LLM(llm.target).generate("The quick brown fox", SamplingParams(
        max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2))[0]
    assert penalised.choices[0].text == ref.text != whole.choices[0].text
    # vLLM's stop_token_ids (the token's text left out, streamed or not), min_tokens and min_p
    out = ref.token_ids
    j = next(j for j in range(3, 40) if out[j] not in out[:j])
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "stop_token_ids": [out[j], out[1]], "min_tokens": 2}
    stopped = client.completions.create(**{**kw, "extra_body": extra}, presence_penalty=0.5, frequency_penalty=0.2)
    streamed = list(client.completions.create(**{**kw, "extra_body": extra, "stream": True},
                                              presence_penalty=0.5, frequency_penalty=0.2))
    ref = LLM(llm.target).generate("The quick brown fox", SamplingParams(
        max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
        stop_token_ids=[out[j], out[1]], min_tokens=2))[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in (out[j], out[1]) and len(ref.token_ids) > 2
    assert stopped.choices[0].text == "".join(c.choices[0].text for c in streamed) == ref.text
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == len(ref.token_ids)
    # vLLM's stop_reason: the stop token, in the response and the stream's last chunk
    assert stopped.choices[0].model_extra["stop_reason"] == streamed[-1].choices[0].model_extra["stop_reason"] \
        == ref.token_ids[-1] == ref.outputs[0].stop_reason
    kept = client.completions.create(**{**kw, "extra_body": {**extra, "include_stop_str_in_output": True}},
                                     presence_penalty=0.5, frequency_penalty=0.2).choices[0].text
    assert kept == settled_text(llm.tokenizer, ref.token_ids, SamplingParams())  # the stop token's text, once whole
    special = dict(model=MODEL, prompt="hi", max_tokens=3, temperature=0, logit_bias={"257": 100},
                   extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})  # </s> kept
    assert client.completions.create(**special).choices[0].text == "</s>"
    assert "".join(c.choices[0].text for c in client.completions.create(**special, stream=True)) == "</s>"
    sampled = dict(model=MODEL, prompt="The quick brown fox", max_tokens=20, temperature=1.0, seed=4)
    same = LLM(llm.target, speculative=llm.spec)  # the server's speculation, its own engine
    assert client.completions.create(**sampled, extra_body={"min_p": 0.2}).choices[0].text == same.generate(
        "The quick brown fox", SamplingParams(max_tokens=20, temperature=1.0, seed=4, min_p=0.2))[0].text


def test_chat_stream_equals_non_stream(llm, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant"
    assert whole.usage.prompt_tokens == len(llm.encode(messages))
    deltas = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                 temperature=0, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    ref = LLM(llm.target).generate([messages], SamplingParams(max_tokens=30))[0]
    assert msg.content == ref.text and whole.choices[0].finish_reason == ref.finish_reason


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert payloads[-1]["choices"][0]["stop_reason"] is None and "stop_reason" not in payloads[0]["choices"][0]


def test_logprobs_from_verify_rows(llm, client):
    """Logprobs come from the target's logits for each committed token: the same whether the
    token was committed by prefill, as an accepted draft or as a bonus token."""
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and tok in top and len(top) <= 4
        assert val == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the top token
    # the reference: one full forward of the target over prompt + output
    import torch

    ids = llm.encode("Hello")
    out = LLM(llm.target).generate("Hello", SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    rt = llm.target.runtime
    logits = rt.forward(rt.new_cache(1), [0], [ids + out])[0]
    ref = torch.log_softmax(logits.float(), -1)[len(ids) - 1:len(ids) - 1 + 12]
    ref_chosen = ref[torch.arange(12), torch.tensor(out)].tolist()
    assert lp.token_logprobs == pytest.approx(ref_chosen, abs=1e-4)
    # chat form: logprobs=true + top_logprobs, streamed
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    content = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)


# --- continuous batching ---------------------------------------------------------------------------


def _requests():
    """16 requests: different prompts, lengths, stops, streaming or not, chat or completion,
    some under a regex (structured outputs beside free requests in the same verify batch)."""
    reqs = []
    for i in range(16):
        prompt = f"Request {i}: " + "abcdefghij"[: i % 7 + 1] * (1 + i % 3)
        reqs.append({"chat": i % 4 == 3, "stream": i % 2 == 1, "prompt": prompt,
                     "max_tokens": 6 + 5 * i, "stop": None,
                     "regex": "[a-z]{2,8}( [a-z]{2,8}){1,9}" if i % 5 == 2 else None})
    return reqs


async def _send(aclient, r: dict) -> tuple[str, str]:
    extra = {"ignore_eos": True, **({"structured_outputs": {"regex": r["regex"]}} if r["regex"] else {})}
    common = dict(model=MODEL, max_tokens=r["max_tokens"], temperature=0, stop=r["stop"], extra_body=extra)
    if r["chat"]:
        kw = dict(messages=[{"role": "user", "content": r["prompt"]}], **common)
        if r["stream"]:
            stream = await aclient.chat.completions.create(**kw, stream=True)
            parts, reason = [], None
            async for c in stream:
                parts.append(c.choices[0].delta.content or "")
                reason = c.choices[0].finish_reason or reason
            return "".join(parts), reason
        out = await aclient.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    kw = dict(prompt=r["prompt"], **common)
    if r["stream"]:
        stream = await aclient.completions.create(**kw, stream=True)
        parts, reason = [], None
        async for c in stream:
            parts.append(c.choices[0].text)
            reason = c.choices[0].finish_reason or reason
        return "".join(parts), reason
    out = await aclient.completions.create(**kw)
    return out.choices[0].text, out.choices[0].finish_reason


def test_16_concurrent_equal_to_alone(server, aclient, llm):
    reqs = _requests()

    async def alone():
        c = aclient()
        return [await _send(c, r) for r in reqs]

    refs = asyncio.run(alone())
    # stops taken from each reference's own text, so they fire mid-output
    for i, (r, (text, _)) in enumerate(zip(reqs, refs)):
        if i % 3 == 0:
            cut = next((j for j in range(len(text) // 3, len(text) - 1)
                        if text[j:j + 2].isascii() and text[j:j + 2].isprintable()), None)
            if cut is not None:
                r["stop"] = [text[cut:cut + 2], "\x00never"]
    assert sum(r["stop"] is not None for r in reqs) >= 3
    refs = asyncio.run(alone())
    for r, (text, reason) in zip(reqs, refs):
        if r["stop"]:
            assert reason == "stop" and r["stop"][0] not in text

    async def together():
        c = aclient()
        return await asyncio.gather(*[_send(c, r) for r in reqs])

    before = metrics(server.url)
    outs = asyncio.run(together())
    assert outs == refs
    after = wait_idle(server.url)
    # 16 requests on 4 KV slots: they queued, and joined the batch as others left
    assert after[("specdec_request_queue_time_seconds_count", ())] - \
        before[("specdec_request_queue_time_seconds_count", ())] == 16
    # the library agrees (completions; chat prompts go through the template)
    plain = LLM(llm.target)
    for r, (text, reason) in zip(reqs, outs):
        prompt = [{"role": "user", "content": r["prompt"]}] if r["chat"] else r["prompt"]
        ref = plain.generate([prompt], SamplingParams(max_tokens=r["max_tokens"], stop=r["stop"] or (), ignore_eos=True,
                                                      structured_outputs=r["regex"] and {"regex": r["regex"]}))[0]
        assert (text, reason) == (ref.text, ref.finish_reason)


def test_seeded_sampling_reproducible(aclient):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})

    async def run():
        c = aclient()
        alone = (await c.completions.create(seed=1234, **kw)).choices[0].text
        # the same seed amid other sampling requests (different batch composition)
        batch = await asyncio.gather(*[c.completions.create(seed=s, **kw) for s in (1234, 99, 1234, 7)])
        return alone, [b.choices[0].text for b in batch]

    alone, batch = asyncio.run(run())
    assert batch[0] == alone and batch[2] == alone
    assert batch[1] != alone or batch[3] != alone  # other seeds draw other text


def test_n_completions(client):
    """``n``: one choice per completion (index i), completion i seeded with seed + i (so
    choice 0 is the n=1 request's), usage summed over them; streamed, each index's chunks
    give that choice's text, and each ends with its own finish reason."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9,
              extra_body={"ignore_eos": True})
    many = client.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    assert texts[0] == client.completions.create(seed=5, **kw).choices[0].text
    assert texts[1] == client.completions.create(seed=6, **kw).choices[0].text
    assert len(set(texts)) > 1 and many.usage.completion_tokens == 48
    assert many.usage.prompt_tokens == client.completions.create(seed=5, **kw).usage.prompt_tokens
    chunks = list(client.completions.create(n=3, seed=5, stream=True, stream_options={"include_usage": True}, **kw))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == texts[i] and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 48
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=8, temperature=0.9, seed=3, logprobs=True,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert len(chat.choices[1].logprobs.content) == chat.usage.completion_tokens // 2 == 8
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):  # vLLM's
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, temperature=0)


def test_batch_of_prompts(llm, client):
    """A completions request with several prompts (texts or token-id lists): choice i * n + j is
    prompt i's completion j, the same as that prompt's own request with seed + j; usage counts
    each prompt once; streamed, each index's chunks give that choice's text."""
    prompts = ["Once upon a time", "The quick brown fox", "abc"]
    kw = dict(model=MODEL, max_tokens=10, temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, n=2, **kw) for p in prompts]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 60
    as_ids = client.completions.create(prompt=[llm.encode(p) for p in prompts], n=2, **kw)
    assert [c.text for c in as_ids.choices] == [c.text for c in batch.choices]
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, **kw))
    for c in batch.choices:
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == c.index) == c.text


# --- aborts ------------------------------------------------------------------------------------------


def test_abort_mid_stream_frees_kv(server, client):
    before = wait_idle(server.url)
    long = dict(model=MODEL, max_tokens=480, temperature=0, extra_body={"ignore_eos": True, "num_draft_tokens": 0})
    running = [client.completions.create(prompt=f"stream {i}", stream=True, **long) for i in range(4)]
    for s in running:  # all four are generating
        next(iter(s))
    m = metrics(server.url)
    assert m[("specdec_kv_slots_used", ())] == 4 and m[("specdec_kv_cache_tokens", ())] > 0
    # a fifth waits for a slot (its headers and role chunk come at once); cancel it while queued
    queued = client.chat.completions.create(messages=[{"role": "user", "content": "q"}], stream=True, **long)
    next(iter(queued))
    queued.close()
    for s in running:
        next(iter(s))
        s.close()
    # a non-streaming client that gives up (its connection closes) aborts its request too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.2, json={
            "model": MODEL, "prompt": "patience", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "num_draft_tokens": 0})
    after = wait_idle(server.url)
    aborted = after[("specdec_request_success_total", (("finished_reason", "abort"),))] - \
        before[("specdec_request_success_total", (("finished_reason", "abort"),))]
    assert aborted == 6
    generated = after[("specdec_generation_tokens_total", ())] - before[("specdec_generation_tokens_total", ())]
    assert generated < 5 * 480
    # the server carries on
    ok = client.completions.create(model=MODEL, prompt="after", max_tokens=5, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_client_gone_mid_body(server):
    """A client that closes its connection halfway through its request body is counted as
    a 499 (no traceback logged as an unhandled error), and the server carries on."""
    import socket
    from urllib.parse import urlparse

    before = metrics(server.url)
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"")
    key = ("specdec_http_requests_rejected_total", (("status", "499"),))
    deadline = time.time() + 10
    while metrics(server.url).get(key, 0) == before.get(key, 0) and time.time() < deadline:
        time.sleep(0.05)
    assert metrics(server.url).get(key, 0) == before.get(key, 0) + 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_loadtest_against_the_server(server, monkeypatch):
    """``specdec loadtest``'s run: concurrent streamed requests each equal to their prompt's
    reference sent alone, usage included; a usage that differs from the reference's fails."""
    from specdec.server import loadtest

    report = asyncio.run(loadtest.run(server.url, clients=3, duration=2.0, max_tokens=8, pool_size=4, api_key=None))
    assert report["requests"] >= 3 and report["ok"] == report["requests"] and report["output_tokens_per_s"] > 0
    real = loadtest.one

    async def inflated(*a, **kw):  # the reference goes through as sent; later answers claim more tokens
        text, tokens, ttft, problem = await real(*a, **kw)
        inflated.calls += 1
        return text, tokens + (inflated.calls > 4), ttft, problem

    inflated.calls = 0
    monkeypatch.setattr(loadtest, "one", inflated)
    report = asyncio.run(loadtest.run(server.url, clients=2, duration=1.0, max_tokens=8, pool_size=4, api_key=None))
    assert report["ok"] == 0 and any("usage says" in p for p in report["problems"])


# --- metrics -----------------------------------------------------------------------------------------


def test_metrics_add_up(server, client, llm):
    before = wait_idle(server.url)
    usages, reasons = [], []
    for i in range(5):
        r = client.completions.create(model=MODEL, prompt=f"metrics {i} " * (i + 1), max_tokens=7 + i,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    usages.append(chat.usage)
    reasons.append(chat.choices[0].finish_reason)
    after = wait_idle(server.url)

    def d(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert reasons == ["length"] * 6
    assert d("specdec_request_success_total", (("finished_reason", "length"),)) == 6
    assert d("specdec_request_success_total", (("finished_reason", "stop"),)) == 0
    assert d("specdec_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert d("specdec_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 7 + 8 + 9 + 10 + 11 + 9
    for hist in ("specdec_time_to_first_token_seconds", "specdec_e2e_request_latency_seconds"):
        assert d(hist + "_count") == 6
    assert d("specdec_inter_token_latency_seconds_count") > 0
    # self-drafting with k=3: every draft accepted; per-position counts add up
    drafted, accepted = d("specdec_spec_decode_num_draft_tokens_total"), d("specdec_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and accepted == drafted
    per_pos = [d("specdec_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)) for i in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] == d("specdec_spec_decode_num_drafts_total")
    # the same requests through the library: the same per-request speculation counters
    lib = LLM(llm.target, speculative=SpecConfig(method="self", num_draft_tokens=3))
    prompts = [f"metrics {i} " * (i + 1) for i in range(5)] + [[{"role": "user", "content": "hi"}]]
    outs = lib.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 8, 9, 10, 11, 9)])
    assert drafted == sum(o.metrics["drafted_tokens"] for o in outs)
    assert accepted == sum(o.metrics["accepted_tokens"] for o in outs)
    assert per_pos == [sum(o.metrics["accepted_per_position"][i] for o in outs) for i in range(3)]


# --- bad input ---------------------------------------------------------------------------------------

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict_server(tiny_dirs):
    """An API key, one KV slot and no queue (a second concurrent request gets 429), small bodies."""
    from specdec.runtime import load_model

    llm = LLM(load_model(str(tiny_dirs["qwen2"])), max_batch_size=1)
    with BackgroundServer(create_app(llm, served_model_name=MODEL, max_queue=0, api_key=KEY,
                                     max_request_bytes=4096)) as srv:
        yield srv


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("path, body, headers, status", [
    (C, OK_C, {}, 401),
    (C, OK_C, {"Authorization": "Bearer wrong"}, 401),
    (C, OK_C, {"Authorization": KEY}, 401),
    (CHAT, OK_CHAT, {}, 401),
    (C, b'{"prompt": "hi",', AUTH, 400),
    (C, b"\xff\xfe", AUTH, 400),
    (C, [1, 2], AUTH, 400),
    (C, {"model": MODEL}, AUTH, 400),
    (C, {**OK_C, "prompt": 5}, AUTH, 400),
    (C, {**OK_C, "prompt": ""}, AUTH, 400),
    (C, {**OK_C, "prompt": [1, "a"]}, AUTH, 400),
    (C, {**OK_C, "prompt": [999999]}, AUTH, 400),
    (C, {**OK_C, "prompt": ["a", "b"]}, AUTH, 400),  # 2 completions: more than 1 slot + 0 queued
    (C, {**OK_C, "max_tokens": "5"}, AUTH, 400),
    (C, {**OK_C, "max_tokens": 0}, AUTH, 400),
    (C, {**OK_C, "max_tokens": -3}, AUTH, 400),
    (C, {**OK_C, "max_tokens": 2.5}, AUTH, 400),
    (C, {**OK_C, "max_tokens": 600}, AUTH, 400),
    (C, {**OK_C, "prompt": "x" * 500, "max_tokens": 20}, AUTH, 400),
    (C, {**OK_C, "model": "gpt-4"}, AUTH, 404),
    (CHAT, {**OK_CHAT, "model": "gpt-4"}, AUTH, 404),
    (C, {**OK_C, "logprobs": True}, AUTH, 200),  # vLLM's int field takes a bool (1)
    (C, {**OK_C, "temperature": "hot"}, AUTH, 400),
    (C, {**OK_C, "temperature": -1}, AUTH, 400),
    (C, {**OK_C, "top_p": 0}, AUTH, 400),
    (C, {**OK_C, "top_k": -5}, AUTH, 400),
    (C, {**OK_C, "stop": 3}, AUTH, 400),
    (C, {**OK_C, "stop": [""]}, AUTH, 400),
    (C, {**OK_C, "stream": "yes"}, AUTH, 400),
    (C, {**OK_C, "seed": 2 ** 70}, AUTH, 400),
    (C, {**OK_C, "logprobs": 21}, AUTH, 400),
    (C, {**OK_C, "logprobs": -2}, AUTH, 400),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, AUTH, 400),  # vLLM's max_logprobs (20)
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": -1}, AUTH, 400),  # the whole vocabulary
    (C, {**OK_C, "n": 0}, AUTH, 400),
    (C, {**OK_C, "n": 17}, AUTH, 400),
    (CHAT, {**OK_CHAT, "n": 2}, AUTH, 400),  # more than its 1 slot + 0 queued
    (C, {**OK_C, "presence_penalty": 2.5}, AUTH, 400),
    (C, {**OK_C, "repetition_penalty": 0}, AUTH, 400),
    (C, {**OK_C, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2}, AUTH, 200),
    (C, {**OK_C, "logit_bias": {"abc": 1}}, AUTH, 400),
    (C, {**OK_C, "logit_bias": {"999999": 1}}, AUTH, 400),
    (C, {**OK_C, "logit_bias": {"5": 101}}, AUTH, 200),  # clamped to 100, as vLLM's server does
    (CHAT, {**OK_CHAT, "logit_bias": {"5": -100, "6": 2.5}}, AUTH, 200),
    (C, {**OK_C, "num_draft_tokens": -1}, AUTH, 400),
    (C, {**OK_C, "min_p": 1.5}, AUTH, 400),
    (C, {**OK_C, "max_tokens": 0, "echo": True, "logprobs": 2}, AUTH, 200),
    (C, {**OK_C, "prompt": [[1, 2], []]}, AUTH, 400),
    (C, {**OK_C, "prompt": ["a", ""]}, AUTH, 400),
    (C, {**OK_C, "prompt": ["a"] * 65}, AUTH, 400),
    (C, {**OK_C, "stop_token_ids": [-1]}, AUTH, 400),
    (C, {**OK_C, "stop_token_ids": [999999]}, AUTH, 400),
    (C, {**OK_C, "min_tokens": 1000}, AUTH, 400),  # more than max_tokens
    (CHAT, {**OK_CHAT, "min_p": 0.1, "stop_token_ids": [5], "min_tokens": 1}, AUTH, 200),
    (CHAT, {**OK_CHAT, "messages": "hi"}, AUTH, 400),
    (CHAT, {**OK_CHAT, "messages": []}, AUTH, 400),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, AUTH, 400),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, AUTH, 400),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, AUTH, 400),
    (CHAT, {**OK_CHAT, "max_completion_tokens": 0}, AUTH, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "xml"}}, AUTH, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, AUTH, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, AUTH, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, AUTH, 400),
    (C, {**OK_C, "structured_outputs": {"regex": "(ab"}}, AUTH, 400),
    (C, {**OK_C, "structured_outputs": {"choice": "ab"}}, AUTH, 400),
    (C, {**OK_C, "structured_outputs": {"regex": "a", "choice": ["b"]}}, AUTH, 400),
    (C, {**OK_C, "structured_outputs": {"structural_tag": "x"}}, AUTH, 400),
    (C, {**OK_C, "structured_outputs": {"choice": ["yes", "no"]}}, AUTH, 200),
    (C, {**OK_C, "guided_choice": ["yes", "no"]}, AUTH, 200),  # vLLM's older names
    (C, {**OK_C, "allowed_token_ids": []}, AUTH, 400),
    (C, {**OK_C, "allowed_token_ids": [999999]}, AUTH, 400),
    (C, {**OK_C, "bad_words": [" "]}, AUTH, 400),
    (C, {**OK_C, "allowed_token_ids": [5, 6], "bad_words": ["ab"]}, AUTH, 200),
    (C, {**OK_C, "guided_regex": "(ab"}, AUTH, 400),
    (C, {**OK_C, "guided_regex": "a", "structured_outputs": {"regex": "b"}}, AUTH, 400),
    (CHAT, {**OK_CHAT, "response_format": {"type": "text"}}, AUTH, 200),
    (C, {**OK_C, "prompt": "x" * 5000}, AUTH, 413),
    (C, OK_C, AUTH, 200),
    (CHAT, OK_CHAT, AUTH, 200),
])
def test_bad_input(strict_server, path, body, headers, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(strict_server.url + path, content=content,
                   headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {**OK_CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {**OK_CHAT, "max_completion_tokens": -2, "max_tokens": 5}, "max_completion_tokens"),
    (CHAT, {**OK_CHAT, "max_tokens": 0}, "max_tokens"),
    (C, {**OK_C, "prompt": "x" * 500, "max_tokens": 20}, "prompt"),
    (C, {**OK_C, "prompt": "x" * 600}, "prompt"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    (C, {**OK_C, "prompt": [999999]}, "prompt"),
    (C, {**OK_C, "logit_bias": {"999999": 1}}, "logit_bias"),
    (C, {**OK_C, "stop_token_ids": [999999]}, "stop_token_ids"),
    (C, {**OK_C, "allowed_token_ids": [999999]}, "allowed_token_ids"),
    (C, {**OK_C, "structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    (C, {**OK_C, "guided_regex": "(ab"}, "guided_regex"),
    (C, {**OK_C, "logprobs": 21}, "logprobs"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {**OK_CHAT, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
])
def test_error_names_its_field(strict_server, path, body, param):
    """A 400 names the field to blame in ``param`` (and in its message), as the user sent it."""
    r = httpx.post(strict_server.url + path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if param.startswith("max_"):
        assert err["message"].startswith(param + " "), err


def test_oversized_chunked_body_and_other_routes(strict_server):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(strict_server.url + C, content=chunks(), headers=AUTH)  # no content-length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(strict_server.url + "/v1/models").status_code == 401
    assert httpx.get(strict_server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    r = httpx.get(strict_server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"] == {"message": "Invalid URL (GET /nope)",  # OpenAI's
                                                          "type": "invalid_request_error", "param": None, "code": None}
    r = httpx.post(strict_server.url + CHAT, headers=AUTH, json={**OK_CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "messages.0.content: only text content parts are served (this is a text model), not 'image_url'", r.text
    assert httpx.get(strict_server.url + "/health").status_code == 200  # open, like /metrics


def test_full_queue_429_and_openai_errors(strict_server):
    rejected = ("specdec_http_requests_rejected_total", (("status", "429"),))
    before = metrics(strict_server.url).get(rejected, 0)
    client = openai.OpenAI(base_url=strict_server.url + "/v1", api_key=KEY, max_retries=0)
    busy = client.completions.create(model=MODEL, prompt="busy", max_tokens=400, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(busy))  # it holds the only slot
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="more", max_tokens=3)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    busy.close()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict_server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI's and vLLM's 404
        client.completions.create(model="other", prompt="x", max_tokens=3)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    assert e.value.body["code"] == "model_not_found" and "other" in e.value.body["message"]
    assert httpx.get(strict_server.url + "/v1/models/" + MODEL).status_code == 401
    assert client.models.retrieve(MODEL).id == MODEL
    # nothing above hurt the server: once the slot is free, requests run
    deadline = time.monotonic() + 20
    while True:
        try:
            out = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert out.usage.completion_tokens <= 4
    assert metrics(strict_server.url)[rejected] - before == 1


def slowed(llm, monkeypatch, seconds: float = 0.02):
    """``llm``'s engine steps made slow, so that a request stays running."""
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(seconds) or step())


def test_refused_completions_hold_no_room(loaded, monkeypatch):
    """A request whose ``n`` completions do not all fit is refused (429) whole: none of them
    is queued, nor counted as aborted, and a request that fits is taken right after."""
    llm = LLM(loaded("llama"), max_batch_size=1)
    slowed(llm, monkeypatch)
    with BackgroundServer(create_app(llm, served_model_name=MODEL, max_queue=1)) as srv:  # room for 2
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        busy = c.completions.create(model=MODEL, prompt="busy", max_tokens=300, stream=True, extra_body={"ignore_eos": True})
        next(iter(busy))
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=MODEL, prompt="two", max_tokens=2, n=2)
        one = c.completions.create(model=MODEL, prompt="one", max_tokens=2, stream=True)  # queued (was a 429)
        busy.close()
        assert [x.choices[0].finish_reason for x in one][-1] == "length"
        aborted = ("specdec_request_success_total", (("finished_reason", "abort"),))
        wait_idle(srv.url)
        assert metrics(srv.url).get(aborted, 0) == 1  # the stream closed above, only


def test_shutdown_ends_running_requests(loaded, monkeypatch):
    """On its exit signal the server refuses new requests (503) and ends running ones at
    once with finish reason ``abort``: a stream gets its last chunk and ``[DONE]`` instead of
    being cut when the grace period ends (vLLM's)."""
    llm = LLM(loaded("llama"), max_batch_size=2)
    slowed(llm, monkeypatch)
    srv = BackgroundServer(create_app(llm, served_model_name=MODEL)).start()
    lines = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "long", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
        it = r.iter_lines()
        lines.append(next(it))
        srv.app.state.scheduler.close()
        refused = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        lines += list(it)
    srv.stop()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and [x for x in lines if x][-1] == "data: [DONE]"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) < 200  # cut short, not run to the end
    assert not srv.thread.is_alive()


# --- the text streamer -------------------------------------------------------------------------------


class ByteTok:
    """Token = one byte; decodes like a byte-level tokenizer (invalid UTF-8 -> U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text, stops, step", [
    ("hello world, goodbye", ("bye",), 1),
    ("hello world, goodbye", ("bye",), 2),
    ("caf\u00e9 \u2603 snow", ("\u2603",), 1),
    ("caf\u00e9 \u2603 snow", ("now",), 3),
    ("aaab and more", ("aab", "xyz"), 1),
    ("plain text", (), 1),
    ("plain text", (), 4),
])
def test_text_stream_never_sends_past_a_stop(text, stops, step):
    """Fed ``step`` bytes per engine step until the step that completes a stop string (where
    the engine finishes the request, its text cut before the stop): nothing sent is ever
    past the cut, no broken character is sent, and the pieces add up to the final text."""
    data = text.encode()
    cut = min([i for i in (text.find(s) for s in stops) if i >= 0], default=None)
    if cut is None:
        end, final = len(data), None
    else:
        stop = next(s for s in stops if text.find(s) == cut)
        end, final = len(text[:cut + len(stop)].encode()), text[:cut]
    chunks = [list(data[i:min(i + step, end)]) for i in range(0, end, step)]
    stream, sent = TextStream(ByteTok(), SamplingParams(stop=stops)), ""
    for chunk in chunks[:-1]:
        sent += stream.add(chunk)
        assert (final or text).startswith(sent), (sent, final)
        assert "\ufffd" not in sent
    sent += stream.finish(chunks[-1], final)
    assert sent == (final if final is not None else text)


# --- the real model ------------------------------------------------------------------------------


@pytest.mark.real
def test_smollm2_ngram_end_to_end():
    """The embedded SmolLM2 with n-gram drafting: both endpoints, streamed and not, at once;
    each text equals the library's own greedy output, and the drafter's work shows in /metrics."""
    llm = LLM(speculative=SpecConfig(method="ngram", num_draft_tokens=4), max_batch_size=4)
    chat = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]
    code = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    ref_chat, ref_code = llm.generate([chat, code], SamplingParams(max_tokens=32))
    with BackgroundServer(create_app(llm)) as srv:
        name = openai.OpenAI(base_url=srv.url + "/v1", api_key="x").models.list().data[0].id
        assert name == llm.target.name  # served under the model's own name by default

        async def run():
            c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            kw = dict(model=name, max_tokens=32, temperature=0)

            async def chat_stream():
                s = await c.chat.completions.create(messages=chat, stream=True, **kw)
                return "".join([ch.choices[0].delta.content or "" async for ch in s])

            async def code_stream():
                s = await c.completions.create(prompt=code, stream=True, **kw)
                return "".join([ch.choices[0].text async for ch in s])

            whole_chat = c.chat.completions.create(messages=chat, **kw)
            whole_code = c.completions.create(prompt=code, **kw)
            return await asyncio.gather(chat_stream(), code_stream(), whole_chat, whole_code)

        chat_s, code_s, chat_w, code_w = asyncio.run(run())
        assert chat_s == chat_w.choices[0].message.content == ref_chat.text
        assert code_s == code_w.choices[0].text == ref_code.text
        assert chat_w.usage.completion_tokens == len(ref_chat.token_ids)
        m = wait_idle(srv.url)
        assert m[("specdec_spec_decode_num_accepted_tokens_total", ())] > 0
        assert m[("specdec_request_success_total", (("finished_reason", "length"),))] + \
            m[("specdec_request_success_total", (("finished_reason", "stop"),))] == 4


def test_echo_scores_the_prompt(llm, client):
    """Completions' ``echo`` (lm-eval's loglikelihood requests): the prompt's text comes first,
    and with ``logprobs`` its tokens' log-probabilities (null for the first); ``max_tokens=0``
    returns the prompt alone. Streamed the same; token-id prompts echo their text."""
    import torch

    prompt = "The quick brown fox jumps over"
    ids = llm.encode(prompt)
    rt = llm.target.runtime
    ref = torch.log_softmax(rt.forward(rt.new_cache(1), [0], [ids])[0].float(), -1)  # [prompt, vocab]
    ref = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    kw = dict(model=MODEL, temperature=0, logprobs=1, echo=True)
    only = client.completions.create(prompt=prompt, max_tokens=0, **kw)
    c = only.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None and c.logprobs.text_offset[0] == 0
    assert c.logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
    more = client.completions.create(prompt=prompt, max_tokens=5, **kw)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    assert more.choices[0].text == prompt + plain.choices[0].text and more.usage.completion_tokens == 5
    # equal but for rounding: a request still leaving the batch (an earlier test's) changes the products' shapes
    assert more.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    for body in (dict(max_tokens=0), dict(max_tokens=5)):
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw, **body))
        whole = client.completions.create(prompt=prompt, **kw, **body).choices[0]
        assert "".join(ch.choices[0].text for ch in chunks) == whole.text
        assert [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs] \
            == whole.logprobs.token_logprobs
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    batch = client.completions.create(prompt=[ids, llm.encode("abc")], max_tokens=0, **kw)
    assert batch.choices[0].text == llm.tokenizer.decode(ids, skip_special_tokens=True)
    assert batch.choices[0].logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)


def test_truncate_prompt_tokens(llm, client):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens are the prompt (usage,
    output, echo); -1 keeps what the context window holds; more than the window is a 400."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = llm.encode(prompt)
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 5}, echo=True, **kw)
    tail = client.completions.create(prompt=ids[-5:], **kw)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == llm.tokenizer.decode(ids[-5:]) + tail.choices[0].text
    whole = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw,
                                           extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(llm.encode([{"role": "user", "content": prompt}], chat={}))
    r = httpx.post(str(client.base_url) + "completions", json={**kw, "prompt": prompt, "truncate_prompt_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_vllm_prompt_logprobs_and_token_ids(llm, client):
    """vLLM's ``prompt_logprobs``: per prompt token after the first, ``{id: {logprob, rank,
    decoded_token}}`` (the token itself first), per choice for completions and once for a
    chat; not streamed. ``return_tokens_as_token_ids`` names logprobs' tokens "token_id:<id>".
    Beam search and a chat's ``echo`` are refused."""
    prompt = "The quick brown fox"
    ids = llm.encode(prompt)
    kw = dict(model=MODEL, max_tokens=2, temperature=0)
    r = httpx.post(str(client.base_url) + "completions", json={**kw, "prompt": prompt, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    echo = client.completions.create(prompt=prompt, echo=True, logprobs=2, **{**kw, "max_tokens": 0}).choices[0]
    assert plp[0] is None and len(plp) == len(ids)
    for t, entry, lp in zip(ids[1:], plp[1:], echo.logprobs.token_logprobs[1:]):
        first = next(iter(entry))
        assert first == str(t) and entry[first]["logprob"] == pytest.approx(lp, abs=1e-5)
        assert entry[first]["decoded_token"] == llm.tokenizer.decode([t]) and len(entry) in (2, 3)
        assert sorted(e["rank"] for k, e in entry.items() if k != first)[:2] == [1, 2]
    chat = httpx.post(str(client.base_url) + "chat/completions",
                      json={**kw, "messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    named = httpx.post(str(client.base_url) + "completions", json={**kw, "prompt": prompt, "logprobs": 1,
                                                                  "return_tokens_as_token_ids": True}).json()
    lps = named["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lps["tokens"]) and all(
        k.startswith("token_id:") for top in lps["top_logprobs"] for k in top)
    for body, param in (({"prompt": prompt, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": prompt, "use_beam_search": True}, "use_beam_search"),
                        ({"prompt": prompt, "echo": True, "logprobs": 1, "prompt_logprobs": 3}, "prompt_logprobs")):
        bad = httpx.post(str(client.base_url) + "completions", json={**kw, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    bad = httpx.post(str(client.base_url) + "chat/completions",
                     json={**kw, "messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"


def test_chat_templates(loaded):
    """vLLM's ``--chat-template`` replaces the tokenizer's for every chat; a request's own
    ``chat_template`` needs ``--trust-request-chat-template`` (else 400), and then wins."""
    mine = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    theirs = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(loaded("llama"))
    count = lambda text: len(llm.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    with BackgroundServer(create_app(llm, served_model_name=MODEL, chat_template=mine)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == count("[hi]")
        r = httpx.post(srv.url + "/tokenize", json={"messages": messages})
        assert r.json()["count"] == count("[hi]")
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "chat_template": theirs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        for path in ("/v1/chat/completions", "/tokenize"):  # nor one put in chat_template_kwargs (vLLM's)
            r = httpx.post(srv.url + path, json={"messages": messages, "chat_template_kwargs": {"chat_template": theirs}})
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], path
    with BackgroundServer(create_app(llm, served_model_name=MODEL, chat_template=mine,
                                     trust_request_chat_template=True)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 1, "chat_template": theirs})
        assert r.json()["usage"]["prompt_tokens"] == count("<<hi>>")
        r = httpx.post(srv.url + "/v1/chat/completions",  # in chat_template_kwargs (vLLM's): also the request's
                       json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"chat_template": theirs}})
        assert r.json()["usage"]["prompt_tokens"] == count("<<hi>>")


def _pieces(text: str, offsets: list[int]) -> list[str]:
    """Each token's part of ``text``, by its ``text_offset``."""
    return [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]


def test_echo_text_offsets(llm, client):
    """``text_offset`` indexes the returned text: ``text[offset_i:offset_i+1]`` is token i's
    text, for an echoed prompt that writes special tokens, a token-id prompt (its text decoded
    as the output's, by ``skip_special_tokens``) and an output with special tokens kept or not."""
    tok = llm.tokenizer
    a = tok.convert_tokens_to_ids("a")
    prompt = "<s>hi</s> x"  # <s> and </s> are special tokens, written in the text
    ids = llm.encode(prompt)
    assert tok.convert_ids_to_tokens(ids)[0] == "<s>" and 257 in ids
    kw = dict(model=MODEL, temperature=0, logprobs=1, echo=True, max_tokens=3)
    out = client.completions.create(prompt=prompt, logit_bias={str(a): 100}, **kw).choices[0]
    assert out.text == prompt + "aaa"
    assert out.logprobs.text_offset == [0, 3, 4, 5, 9, 10, 11, 12, 13]
    assert _pieces(out.text, out.logprobs.text_offset) == out.logprobs.tokens
    streamed = list(client.completions.create(prompt=prompt, logit_bias={str(a): 100}, stream=True, **kw))
    assert [o for ch in streamed if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset] \
        == out.logprobs.text_offset
    # the output's special tokens: in the text and the offsets only when kept
    eos = dict(logit_bias={"257": 100}, extra_body={"ignore_eos": True})
    kept = client.completions.create(prompt=prompt, **{**eos, "extra_body": {
        "ignore_eos": True, "skip_special_tokens": False}}, **kw).choices[0]
    assert kept.text == prompt + "</s>" * 3
    assert _pieces(kept.text, kept.logprobs.text_offset) == kept.logprobs.tokens
    skipped = client.completions.create(prompt=prompt, **eos, **kw).choices[0]
    assert skipped.text == prompt and skipped.logprobs.text_offset[-3:] == [len(prompt)] * 3
    # a token-id prompt echoes its text as the output's: special tokens left out, or kept
    plain = client.completions.create(prompt=ids, logit_bias={str(a): 100}, **kw).choices[0]
    assert plain.text == "hi xaaa"
    assert _pieces(plain.text, plain.logprobs.text_offset) == ["", "h", "i", "", " ", "x", "a", "a", "a"]
    raw = client.completions.create(prompt=ids, logit_bias={str(a): 100}, **kw,
                                    extra_body={"skip_special_tokens": False}).choices[0]
    assert raw.text == prompt + "aaa" and raw.logprobs.text_offset == out.logprobs.text_offset
    # logprobs=true, as vLLM's int field takes it: 1
    plain_kw = dict(model=MODEL, prompt=prompt, temperature=0, echo=True, max_tokens=3)
    one = client.completions.create(**plain_kw, extra_body={"logprobs": True}).choices[0]
    assert one.logprobs == client.completions.create(**plain_kw, logprobs=1).choices[0].logprobs


def test_chat_template_options(llm, client):
    """vLLM's chat extensions: ``continue_final_message`` continues the assistant's message,
    as ``LLM.chat`` does; ``chat_template_kwargs`` are accepted (the template may ignore them)."""
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general ken"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"continue_final_message": True, "ignore_eos": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    ref = LLM(llm.target).chat(messages, SamplingParams(max_tokens=8, ignore_eos=True),
                               continue_final_message=True)[0]
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    for path in ("/v1/chat/completions", "/tokenize"):  # both asked for: a 400, as vLLM's
        e = httpx.post(str(client.base_url).removesuffix("/v1/") + path, json={"model": MODEL, **both})
        assert e.status_code == 400 and e.json()["error"]["param"] == "continue_final_message", path


def test_prefix_reuse_in_usage(loaded):
    """A follow-up chat turn reuses the first turn's prompt KV: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` counts it, the answer is the same as from
    scratch, and /metrics shows the tokens free slots keep."""
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="ngram"), chunked_prefill_size=4, max_batch_size=2)
    turn = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    with BackgroundServer(create_app(llm, served_model_name=MODEL)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = c.chat.completions.create(messages=turn, **kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        follow = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "again"}]
        second = c.chat.completions.create(messages=follow, **kw)
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 4 * 4 > 0
        assert metrics(srv.url)[("specdec_prefix_cache_tokens", ())] > 0
    ref = LLM(loaded("llama"), speculative=SpecConfig(method="ngram")).chat(
        follow, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert second.choices[0].message.content == ref.text


def test_structured_outputs(llm, client):
    """``response_format`` (json_schema, json_object) and vLLM's ``structured_outputs``: the
    text follows the constraint, equal to the library's constrained output, streamed or not."""
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
              "x-guidance": {"whitespace_flexible": False}}
    messages = [{"role": "user", "content": "a JSON object please"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "ab", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"a", "b"} and r.choices[0].finish_reason == "stop"
    ref = LLM(llm.target).chat(messages, SamplingParams(max_tokens=30, structured_outputs={"json": schema}))[0]
    assert r.choices[0].message.content == ref.text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    body = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                extra_body={"structured_outputs": {"regex": "[ab]{3}-[0-9]{2}"}})
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
    assert re.fullmatch("[ab]{3}-[0-9]{2}", whole) and streamed == whole
    guided = dict(body, extra_body={"guided_regex": "[ab]{3}-[0-9]{2}"})  # vLLM's older name
    assert client.completions.create(**guided).choices[0].text == whole


def test_tokenize_and_detokenize(llm, server):
    """vLLM's /tokenize (a prompt, or messages through the chat template, as the chat endpoint
    encodes them) and /detokenize."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    ids = llm.encode("Hello world")
    assert r == {"count": len(ids), "max_model_len": llm.context_window, "tokens": ids, "token_strs": None}
    bare = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == llm.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == llm.encode(messages)
    text = httpx.post(server.url + "/detokenize", json={"tokens": bare["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    strs = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == llm.tokenizer.convert_ids_to_tokens(ids)  # vLLM's
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    joined = httpx.post(server.url + "/tokenize", json={"messages": parts}).json()["tokens"]
    assert joined == llm.encode([{"role": "user", "content": "hi\nthere"}])  # vLLM's: a part per line
    for path, body in [("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"messages": []}),
                       ("/detokenize", {"tokens": [10 ** 9]}), ("/detokenize", {"tokens": "abc"})]:
        assert httpx.post(server.url + path, json=body).status_code == 400, (path, body)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a", "model": "gpt"}).status_code == 404


def test_generation_config_defaults(tiny_dirs, loaded, tmp_path):
    """A model's generation_config.json sets its default sampling (vLLM's ``--generation-config
    auto``): ``LLM.get_default_sampling_params()``, ``generate`` without params, and the server's
    fields a request leaves out; a request's own values, and ``"vllm"``, override it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, max_new_tokens=9, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model), device="cpu")
    want = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, max_tokens=9)
    assert llm.get_default_sampling_params() == want
    assert LLM(loaded("llama"), generation_config=str(model)).get_default_sampling_params() == want
    assert LLM(llm.target, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    assert LLM(loaded("llama")).get_default_sampling_params() == SamplingParams()  # no sampling fields
    with pytest.raises(ValueError, match="generation_config"):
        LLM(loaded("llama"), generation_config=str(tmp_path / "nowhere"))
    assert len(llm.generate("abc")[0].token_ids) <= 9
    # the model's max_new_tokens (and, offline, a request's own) is cut to what the context leaves
    short = LLM(llm.target, max_model_len=24, generation_config="vllm")
    short.sampling_defaults = {"max_tokens": 100, "ignore_eos": True}
    ids = short.encode("The quick brown fox")
    assert len(short.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].token_ids) == 24 - len(ids)
    own = short.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(own.token_ids) == 24 - len(ids) and own.finish_reason == "length"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json in .*top_p"):  # at load, not at generate
        LLM(loaded("llama"), generation_config=str(bad))
    ref = {seed: llm.generate("The quick brown fox", replace_sp(want, seed=seed, max_tokens=12))[0].text
           for seed in (1, 2)}
    assert ref[1] != ref[2]  # sampled
    greedy = llm.generate("The quick brown fox", replace_sp(want, temperature=0.0, max_tokens=12))[0].text
    with BackgroundServer(create_app(llm, served_model_name=MODEL)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in (1, 2):
            out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, seed=seed)
            assert out.choices[0].text == ref[seed]
        out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
        assert out.choices[0].text == greedy
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert chat.usage.completion_tokens <= 9  # the model's max_new_tokens
    # the CLI: flags left out take the model's defaults; --generation-config vllm, specdec's own
    cli = [sys.executable, "-m", "specdec.cli", "generate", "--model", str(model), "--device", "cpu",
           "--prompt", "The quick brown fox", "--max-tokens", "12", "--json"]
    runs = [subprocess.run(cli + extra, capture_output=True, text=True, check=True)
            for extra in (["--seed", "1"], ["--generation-config", "vllm"])]
    plain = llm.generate("The quick brown fox", SamplingParams(max_tokens=12))[0].text
    assert [json.loads(r.stdout)["text"] for r in runs] == [ref[1], plain]


def replace_sp(sp: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, **changes)

"""LoRA adapters (``specdec.lora``): the torch runtime's logits equal PEFT's model's, bit for
bit, each batch row through its own adapter; generation through the engine, with and without
speculation, equals PEFT's model decoding greedily; prefix reuse never crosses adapters;
adapters that are not plain LoRA of this model are refused."""
import pytest
import torch
from transformers import AutoConfig

from specdec import LLM, LoRARequest, SamplingParams, SpecConfig
from specdec.lora import read_adapter
from specdec.runtime.loading import Weights
from specdec.runtime.torch_llama import TorchLlama

from tiny import MOE, greedy_by_whole_forwards, lora_reference, make_lora, make_tiny, through

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dirs):
    """Two adapters of the tiny Llama: ``a`` on every product; ``b`` of rank 8 with rsLoRA's
    scale on q, v and down alone."""
    root, base = tmp_path_factory.mktemp("lora"), tiny_dirs["llama"]
    return {"base": base, "a": make_lora(base, root / "a", seed=1),
            "b": make_lora(base, root / "b", seed=2, r=8, alpha=4, targets=("q_proj", "v_proj", "down_proj"),
                           use_rslora=True)}


def runtime(path, dtype=torch.float32, max_loras=2):
    """The torch runtime of ``path`` with plain ``F.linear`` products (transformers' own), LoRA enabled."""
    rt = TorchLlama(AutoConfig.from_pretrained(path), Weights(path), torch.device("cpu"), dtype, linear="dense")
    rt.enable_lora(max_loras)
    return rt


def adapter(path, i=1):
    return read_adapter(LoRARequest(f"lora{i}", i, str(path)))


@pytest.mark.parametrize("arch, extra, lora", [
    ("llama", {}, dict(rank_pattern={"v_proj": 2}, alpha_pattern={r"layers\.1\.mlp\.down_proj": 3})),
    ("qwen2", {}, dict(use_rslora=True)),  # biases
    ("phi3", dict(pad_token_id=0), dict(targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))),  # fused
    ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=24), {}),  # q/k norms, norms after too
    ("qwen3_moe", MOE["qwen3_moe"], dict(targets=("q_proj", "k_proj", "v_proj", "o_proj"))),  # attention beside experts
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_equal_peft(tmp_path, arch, extra, lora, dtype):
    """PEFT's unmerged update, in float32 where the model is bfloat16 (its autocast), added to
    each product's columns: the same logits bit for bit; a slot without the adapter, the base's."""
    base = make_tiny(tmp_path / arch, arch, seed=3, **extra)
    path = make_lora(base, tmp_path / "lora", seed=4, **{"targets": ALL, **lora})
    ref = lora_reference(base, path, dtype=dtype)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids).logits[0].float()
        with ref.disable_adapter():
            plain = ref(input_ids=ids).logits[0].float()
    rt = runtime(base, dtype)
    a = adapter(path)
    rt.lora.check(a)
    assert rt.lora.acquire(a)
    cache = rt.new_cache(2)
    cache.adapters[0] = a.id
    assert torch.equal(rt.forward(cache, [0], [ids[0].tolist()])[0], want)
    assert torch.equal(rt.forward(cache, [1], [ids[0].tolist()])[0], plain)


def test_mixed_batch_rows_take_their_own_adapter(adapters):
    """One forward of three slots (adapter a, none, adapter b) and prompts of three lengths: each
    row's logits are PEFT's for its own adapter; and then a chunk after each (decoding)."""
    ref = lora_reference(adapters["base"], adapters["a"], adapters["b"])
    rt = runtime(adapters["base"])
    a, b = adapter(adapters["a"], 1), adapter(adapters["b"], 2)
    for x in (a, b):
        rt.lora.check(x)
        assert rt.lora.acquire(x)
    cache = rt.new_cache(3)
    cache.adapters[:] = [1, 0, 2]
    prompts = [list(range(5, 17)), list(range(40, 47)), list(range(90, 99))]
    got = rt.forward(cache, [0, 1, 2], prompts)  # [3, 12, vocab]
    more = rt.forward(cache, [0, 1, 2], [[3, 4], [5], [6, 7]])
    for row, (name, ids, extra) in enumerate(zip(("default", None, "a1"), prompts, ([3, 4], [5], [6, 7]))):
        with torch.no_grad(), through(ref, name):
            want = ref(input_ids=torch.tensor([ids + extra])).logits[0]
        torch.testing.assert_close(got[row, :len(ids)], want[:len(ids)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(more[row, :len(extra)], want[len(ids):], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, max_loras", [("none", 2), ("self", 1), ("ngram", 2)])
def test_generate_equals_peft_greedy(adapters, method, max_loras):
    """``LLM.generate`` with a LoRA request per prompt (a, none, b, a) in one call: each output is
    PEFT's model's greedy decoding with that adapter, with speculation too (the drafts come from
    the base model: "self" drafts with the target without its adapter). With ``max_loras`` 1 the
    requests for b wait until no request holds a."""
    ref = lora_reference(adapters["base"], adapters["a"], adapters["b"])
    ra, rb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    prompts = [list(range(5, 17)), list(range(40, 47)), list(range(90, 99)), list(range(5, 14))]
    loras = [ra, None, rb, ra]
    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True, max_loras=max_loras,
              speculative=SpecConfig(method=method, num_draft_tokens=3) if method != "none" else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    for out, p, lora in zip(outs, prompts, loras):
        with through(ref, None if lora is None else "default" if lora is ra else "a1"):
            want = greedy_by_whole_forwards(ref, [p], 16)[0]
        assert out.outputs[0].token_ids == want, lora
        assert out.lora_request is lora
    assert not llm.target.runtime.lora.active and set(llm.target.runtime.lora.holders.values()) == {0}


def test_prefix_reuse_stays_within_an_adapter(adapters):
    """A prompt's KV computed through adapter a is reused by the next request with a (whole
    chunks of 8), never by one with no adapter or with b, whose outputs stay their models'."""
    ref = lora_reference(adapters["base"], adapters["a"], adapters["b"])
    ra, rb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True, max_loras=2, chunked_prefill_size=8,
              max_batch_size=3)
    prompt = {"prompt_token_ids": list(range(30, 60))}
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = [(ra, "default"), (None, None), (rb, "a1"), (ra, "default")]
    cached = []
    for lora, name in runs:
        out = llm.generate(prompt, sp, lora_request=lora, use_tqdm=False)[0]
        with through(ref, name):
            want = greedy_by_whole_forwards(ref, [prompt["prompt_token_ids"]], 8)[0]
        assert out.outputs[0].token_ids == want, name
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 24]


def test_lora_errors(tmp_path, adapters, tiny_dirs):
    base = adapters["base"]
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, str(adapters["a"]))
    with pytest.raises(ValueError, match="lora_path must name"):
        LoRARequest("a", 1)
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        LLM(str(base), device="cpu", enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="LoRA adapters run on the torch runtime"):
        LLM(str(base), device="cpu", backend="hf", enable_lora=True)
    prompt, sp = {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="without enable_lora=True"):
        LLM(str(base), device="cpu").generate(prompt, sp, lora_request=LoRARequest("a", 1, str(adapters["a"])))
    llm = LLM(str(base), device="cpu", enable_lora=True)
    refused = {
        "DoRA": make_lora(base, tmp_path / "dora", use_dora=True),
        "lm_head": make_lora(base, tmp_path / "head", targets=("lm_head",)),
        "not an adapter of this model": make_lora(make_tiny(tmp_path / "wide", "llama", hidden_size=32),
                                                  tmp_path / "other"),
        "no adapter_config.json": tmp_path,
    }
    moe = make_tiny(tmp_path / "moe", "qwen3_moe", **MOE["qwen3_moe"])  # its experts are not adapted
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts's .* not a rank-4 update of one linear product"):
        LLM(str(moe), device="cpu", enable_lora=True).generate(
            prompt, sp, lora_request=LoRARequest("e", 1, str(make_lora(moe, tmp_path / "experts",
                                                                        targets=("gate_proj", "up_proj")))))
    for i, (match, path) in enumerate(refused.items(), 3):
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, sp, lora_request=LoRARequest(f"x{i}", i, str(path)))
    with pytest.raises(ValueError, match="no such directory"):
        llm.generate(prompt, sp, lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))
    llm.generate(prompt, sp, lora_request=LoRARequest("a", 1, str(adapters["a"])), use_tqdm=False)
    with pytest.raises(ValueError, match="has rank 8, more than max_lora_rank 4"):
        LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=4).generate(
            prompt, sp, lora_request=LoRARequest("b", 2, str(adapters["b"])))
    with pytest.raises(ValueError, match="lora_int_id 1 is LoRA 'a'"):
        llm.generate(prompt, sp, lora_request=LoRARequest("b", 1, str(adapters["b"])))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompt, sp, lora_request=[None, None])


def test_server_serves_lora_modules(adapters):
    """``create_app(lora_modules=...)`` (``serve --lora-modules``): /v1/models lists each adapter
    with the model as its parent; a request naming one runs through it (the text
    ``LLM.generate`` gives with it; responses name it), streamed or not, beside base requests;
    an unknown name is a 404 that lists the adapters too."""
    import httpx
    import openai

    from specdec.server import BackgroundServer, create_app

    loras = [LoRARequest("sql", 1, str(adapters["a"])), LoRARequest("chat", 2, str(adapters["b"]))]
    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True, max_loras=2,
              speculative=SpecConfig(method="self", num_draft_tokens=3))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = {r.lora_name: llm.generate("SELECT", sp, lora_request=r, use_tqdm=False)[0].text for r in loras}
    want["tiny"] = llm.generate("SELECT", sp, use_tqdm=False)[0].text
    assert len(set(want.values())) == 3
    with BackgroundServer(create_app(llm, served_model_name="tiny", lora_modules=loras)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny", "sql", "chat"]
        card = httpx.get(srv.url + "/v1/models/sql").json()
        assert card["parent"] == "tiny" and card["root"] == str(adapters["a"])
        for name in ("sql", "tiny", "chat"):
            out = c.completions.create(model=name, prompt="SELECT", max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert (out.model, out.choices[0].text) == (name, want[name])
            chunks = list(c.completions.create(model=name, prompt="SELECT", max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want[name]
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="sql2", prompt="hi", max_tokens=2)
        assert "'tiny', 'sql', 'chat'" in e.value.body["message"]
    with pytest.raises(ValueError, match="LoRA name 'tiny' is taken"):
        create_app(llm, served_model_name="tiny", lora_modules=[LoRARequest("tiny", 3, str(adapters["a"]))])
    with pytest.raises(ValueError, match="without enable_lora"):
        create_app(LLM(str(adapters["base"]), device="cpu"), lora_modules=loras)


def test_cli_lora_flags(adapters):
    """``generate --lora PATH`` runs every prompt through the adapter (as ``LLM.generate`` with
    it); ``--lora-modules`` takes vLLM's forms."""
    import json
    import subprocess
    import sys

    from specdec.cli import parse_lora_modules

    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True)
    want = llm.generate("SELECT", SamplingParams(max_tokens=6, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, str(adapters["a"])), use_tqdm=False)[0].token_ids
    run = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(adapters["base"]),
                          "--device", "cpu", "--prompt", "SELECT", "--max-tokens", "6", "--ignore-eos", "--json",
                          "--lora", str(adapters["a"])], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["token_ids"] == want
    assert parse_lora_modules(["sql=/a", '{"name": "chat", "path": "/b", "base_model_name": "m"}']) == \
        [LoRARequest("sql", 1, "/a"), LoRARequest("chat", 2, "/b", "m")]
    for bad in ("sql", "=/a", '{"name": "x"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_async_llm_streams_through_an_adapter(adapters):
    """``AsyncLLM.generate(..., lora_request=)``: the stream's outputs name the adapter and end
    as ``LLM.generate``'s with it, beside a base request running at once."""
    import asyncio

    from specdec import AsyncLLM

    ra = LoRARequest("a", 1, str(adapters["a"]))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True)
    want = [llm.generate("SELECT", sp, lora_request=r, use_tqdm=False)[0].token_ids for r in (ra, None)]
    with AsyncLLM(llm) as engine:

        async def both():
            async def last(lora):
                outs = [o async for o in engine.generate("SELECT", sp, lora_request=lora)]
                assert all(o.lora_request is lora for o in outs)
                return outs[-1].outputs[0].token_ids
            return await asyncio.gather(last(ra), last(None))

        assert asyncio.run(both()) == want


def test_server_loads_and_unloads_adapters_at_runtime(adapters):
    """vLLM's runtime LoRA updating: ``/v1/load_lora_adapter`` serves another adapter (listed,
    requests naming it run through it), an adapter of another model or a taken name is a 400;
    ``/v1/unload_lora_adapter`` stops serving it (then a 404); without the option the routes
    are not there."""
    import httpx

    from specdec.server import BackgroundServer, create_app

    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True, max_loras=2)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = llm.generate("SELECT", sp, lora_request=LoRARequest("b", 9, str(adapters["b"])), use_tqdm=False)[0].text
    body = {"prompt": "SELECT", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with BackgroundServer(create_app(llm, served_model_name="tiny", allow_runtime_lora_updating=True,
                                     lora_modules=[LoRARequest("a", 1, str(adapters["a"]))])) as srv:
        load = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])})
        assert load.status_code == 200 and load.text == "Success: LoRA adapter 'b' added successfully."
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["tiny", "a", "b"]
        out = httpx.post(srv.url + "/v1/completions", json={**body, "model": "b"}, timeout=60).json()
        assert (out["model"], out["choices"][0]["text"]) == ("b", want)
        again = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["b"])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/no/such/dir"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        gone = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'b' removed successfully."
        assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "b"}).status_code == 404
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        assert httpx.post(srv.url + "/v1/load_lora_adapter",  # the name again, a new id
                          json={"lora_name": "b", "lora_path": str(adapters["a"])}).status_code == 200
        out = httpx.post(srv.url + "/v1/completions", json={**body, "model": "b"}, timeout=60).json()
        assert out["choices"][0]["text"] == httpx.post(srv.url + "/v1/completions", json={**body, "model": "a"},
                                                       timeout=60).json()["choices"][0]["text"]
    with BackgroundServer(create_app(llm)) as srv:
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "x"}).status_code \
            == 404


def test_requests_without_an_adapter_go_past_one_waiting_for_room(adapters):
    """``max_loras`` 1, three slots, requests for a, b, a, none in that order: a's two run; b waits
    for a's to finish, and so does the a after it (the adapter held drains); the request
    without an adapter goes past them into the free slot."""
    llm = LLM(str(adapters["base"]), device="cpu", enable_lora=True, max_loras=1, max_batch_size=3)
    ra, rb = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [llm.make_sequences({"prompt_token_ids": [5, 6, 7]}, sp, lora_request=r)[0] for r in (ra, rb, ra, None)]
    for s in seqs:
        llm.engine.add(s)
    llm.engine.step()
    assert [s.slot >= 0 for s in seqs] == [True, False, False, True]
    while llm.engine.has_work:
        llm.engine.step()
    assert seqs[1].admitted.step == seqs[0].retired.step + 1 and seqs[2].admitted.step == seqs[1].retired.step + 1
    assert seqs[0].ids == seqs[2].ids != seqs[1].ids

"""Bad input: one-line ValueError from the API, exit code 2 and no traceback from the CLI."""
import json
import re
import socket
import subprocess
import sys

import pytest
import torch

from specdec import LLM, EngineConfig, SamplingParams, SpecConfig


@pytest.mark.parametrize("make, match", [
    (lambda: SpecConfig(method="draft", num_draft_tokens=0), "num_draft_tokens"),
    (lambda: SpecConfig(method="medusa"), "unknown method"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(top_k=-2), "top_k must be"),
    (lambda: SamplingParams(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (lambda: SamplingParams(top_p=None), "top_p must be a number, got None"),
    (lambda: SamplingParams(max_tokens=True), "max_tokens must be an integer or None, got True"),
    (lambda: SamplingParams(n=2.0), "n must be an integer, got 2.0"),
    (lambda: SamplingParams(n=2), "n must be 1 when using greedy sampling, got 2"),  # vLLM's
    (lambda: SamplingParams(n=16385, temperature=1.0), r"n must be an integer in \[1, 16384\], got 16385"),
    (lambda: SamplingParams(ignore_eos=1), "ignore_eos must be true or false, got 1"),
    (lambda: SamplingParams(logprobs="3"), "logprobs must be an integer or None"),
    (lambda: SpecConfig(method="ngram", num_draft_tokens="4"), "num_draft_tokens must be an integer, got '4'"),
    (lambda: SpecConfig(cost_model=None), "cost_model must be true or false"),
    (lambda: EngineConfig(max_batch_size=None), "max_batch_size must be an integer, got None"),
    (lambda: EngineConfig(enforce_eager="no"), "enforce_eager must be true or false"),
    (lambda: EngineConfig(seed=1.5), "seed must be an integer or None"),
    (lambda: EngineConfig(device="bogus"), "unknown device 'bogus'; use cpu, cuda or cuda:N"),
    (lambda: EngineConfig(device="cuda:x"), "unknown device"),
    (lambda: EngineConfig(device=0), "unknown device 0"),
    (lambda: EngineConfig(load_format="zeros"), "unknown load_format"),
    (lambda: EngineConfig(draft_backend="llamacpp", load_format="dummy"), "GGUF's own weights"),
    (lambda: EngineConfig(chunked_prefill_size=-1), "chunked_prefill_size"),
    (lambda: EngineConfig(max_model_len=0), "max_model_len"),
    (lambda: SamplingParams(repetition_penalty=0), "repetition_penalty"),
    (lambda: SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (lambda: SamplingParams(frequency_penalty=-3), "frequency_penalty"),
    (lambda: SamplingParams(n=0), "n must be"),
    (lambda: SamplingParams(logprobs=-2), "logprobs"),
    (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
    (lambda: SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
    (lambda: SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
    (lambda: SpecConfig.from_vllm({"method": "medusa", "model": "x"}), "method 'medusa' is not supported"),
    (lambda: SpecConfig.from_vllm({"num_speculative_tokens": 3}), "needs a method"),
    (lambda: SpecConfig.from_vllm({"method": "ngram", "lookahead": 2}), "unknown key 'lookahead'"),
    (lambda: SpecConfig.from_vllm({"model": "x", "draft_tensor_parallel_size": 2}), "draft on one device"),
    (lambda: SpecConfig.from_vllm([1]), "JSON object"),
    (lambda: SpecConfig.from_vllm({"model": "x", "revision": "a", "code_revision": "b"}), "code_revision 'b'"),
    (lambda: SpecConfig.from_vllm({"model": "x", "quantization": "fp8"}), "draft_quantization takes"),
])
def test_config_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_config_types_and_vllm_values():
    """An int is a number (float fields take it), a bool is not; vLLM's top_k -1 (all tokens)
    is off, as 0; a device takes vLLM's forms (a torch.device too)."""
    sp = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, presence_penalty=1)
    assert (sp.temperature, sp.top_p) == (1, 1)
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams(top_k=0).top_k and SamplingParams(top_k=5).top_k == 5
    assert [EngineConfig(device=d).device for d in ("cpu", "cuda", "cuda:1", None)] == ["cpu", "cuda", "cuda:1", None]
    assert EngineConfig(device=torch.device("cpu")).device == "cpu"
    from specdec.runtime.loading import pick_device

    with pytest.raises(ValueError, match="unknown device 'bogus'"):
        pick_device("bogus")
    assert pick_device("cpu") == torch.device("cpu")


def test_model_errors(tmp_path, tiny_dirs, loaded):
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        LLM(loaded("llama"), device="gpu")
    with pytest.raises(ValueError, match="^model path .* does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="^tokenizer path .* does not exist"):
        LLM(str(tiny_dirs["llama"]), tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(loaded("llama"), speculative=SpecConfig(method="draft"))
    with pytest.raises(ValueError, match="draft_backend is for a draft model; method 'ngram' has none"):
        LLM(loaded("llama"), speculative=SpecConfig(method="ngram"), draft_backend="llamacpp")
    llm = LLM(loaded("llama"))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="context window"):
        llm.generate("x" * 600, SamplingParams(max_tokens=4))
    long = llm.generate("x", SamplingParams(max_tokens=600, ignore_eos=True))[0]  # vLLM's offline: capped
    assert len(long.prompt_token_ids) + len(long.token_ids) == 512 and long.finish_reason == "length"
    short = LLM(loaded("llama"), max_model_len=40)  # vLLM's max_model_len caps prompt + output
    assert short.context_window == 40 and len(short.generate("x", SamplingParams(max_tokens=30))[0].token_ids) <= 30
    assert len(short.generate("x" * 20, SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids) == 20
    out = short.generate("x" * 20, SamplingParams(max_tokens=None, ignore_eos=True))[0]  # vLLM's None: the rest
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room"):
        short.generate("x" * 40, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        LLM(loaded("llama"), max_model_len=513)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, match", [
    (["--model", "/no/such/model", "--prompt", "hi"], "does not exist"),
    (["--prompt", "hi", "-k", "0", "--method", "ngram"], "num_draft_tokens"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--method", "draft"], "needs a draft model"),
    (["--prompt", "hi", "--speculative-config", "{method: ngram}"], "not valid JSON"),
    (["--prompt", "hi", "--speculative-config", '{"method": "draft_model"}'], '"model" in a speculative config'),
    (["--prompt", "hi", "--method", "ngram", "--speculative-config", '{"method": "ngram"}'], "drop --method"),
    (["--prompt", "hi", "--device", "bogus"], "unknown device 'bogus'"),
    (["--prompt", "hi", "--top-k", "-2"], "top_k"),
    (["--prompt", "hi", "--method", "foo"], "invalid choice: 'foo'"),  # argparse's own errors: one line too
    (["--prompt", "hi", "-k", "abc"], "invalid int value"),
    (["--max-tokens", "3"], "one of the arguments --prompt --prompts-file is required"),
    (["--prompt", "hi", "--threads", "0"], "threads must be >= 1"),
])
def test_cli_errors_exit_2_one_line(args, match):
    r = run_cli("generate", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in r.stderr


def test_vllm_engine_names_and_threads(loaded):
    """``max_num_seqs`` (vLLM's name for ``max_batch_size``) and ``threads`` (CPU threads, as
    ``torch.set_num_threads``)."""
    import torch

    assert LLM(loaded("llama"), max_num_seqs=3).engine_config.max_batch_size == 3
    with pytest.raises(ValueError, match="not both"):
        LLM(loaded("llama"), max_batch_size=2, max_num_seqs=3)
    before = torch.get_num_threads()
    try:
        assert LLM(loaded("llama"), threads=1).engine_config.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_vllm_speculative_config(loaded, tiny_dirs):
    """vLLM's speculative_config maps onto SpecConfig and the draft model: the same output as
    specdec's own arguments, through the library and the CLI; and ``serve MODEL`` (vLLM's
    positional target) takes no second, different --model."""
    spec, draft = SpecConfig.from_vllm({"method": "draft_model", "model": "D", "num_speculative_tokens": 5})
    assert (spec.method, spec.num_draft_tokens, draft) == ("draft", 5, "D")
    spec, draft = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (spec.method, spec.num_draft_tokens, spec.ngram_max, spec.ngram_min, draft) == ("ngram", 3, 5, 5, None)
    assert SpecConfig.from_vllm({"model": "D", "prompt_lookup_min": 4, "tree_topk": 2})[0] == SpecConfig(
        method="draft", ngram_min=4, ngram_max=4, tree_topk=2)  # draft inferred from the model, as vLLM
    assert SpecConfig.from_vllm({"method": "self"}, cost_model=True, num_draft_tokens=6)[0] == SpecConfig(
        method="self", cost_model=True, num_draft_tokens=6)  # over the other flags
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = LLM(loaded("llama"), draft=loaded("draft"), speculative=SpecConfig(method="draft", num_draft_tokens=3))
    theirs = LLM(loaded("llama"), speculative_config={"method": "draft_model", "model": loaded("draft"),
                                                      "num_speculative_tokens": 3})
    assert theirs.spec == ours.spec and theirs.generate("abc", sp)[0].token_ids == ours.generate("abc", sp)[0].token_ids
    with pytest.raises(ValueError, match="not both"):
        LLM(loaded("llama"), speculative=SpecConfig(), speculative_config={"method": "ngram"})
    # a method's name, or SpecConfig's fields as a dict (an AttributeError on 'str' before)
    assert LLM(loaded("llama"), speculative="ngram").spec == SpecConfig(method="ngram")
    assert LLM(loaded("llama"), speculative={"method": "self", "num_draft_tokens": 2}).spec == \
        SpecConfig(method="self", num_draft_tokens=2)
    with pytest.raises(ValueError, match="method"):
        LLM(loaded("llama"), speculative="medusa")
    with pytest.raises(TypeError, match="speculative must be"):
        LLM(loaded("llama"), speculative=4)
    common = ("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "abc abc abc", "--max-new-tokens", "12",
              "--ignore-eos", "--json")
    runs = [run_cli(*common, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
            run_cli(*common, "--method", "ngram", "-k", "2")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert first["token_ids"] == second["token_ids"]
    assert first["metrics"]["target_forwards"] == second["metrics"]["target_forwards"]
    r = run_cli("serve", str(tiny_dirs["llama"]), "--chat-template", "no/such/template.jinja")
    assert r.returncode == 2 and "neither a file nor a Jinja template" in r.stderr
    r = run_cli("serve", str(tiny_dirs["llama"]), "--model", str(tiny_dirs["draft"]))
    assert r.returncode == 2 and "two targets" in r.stderr
    r = run_cli("serve", str(tiny_dirs["llama"]), "--allowed-origins", "*")
    assert r.returncode == 2 and "need a JSON list of strings" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--prompt", "x", "--bogus", "1")  # the subcommand's own usage line
    assert r.returncode == 2 and r.stderr.startswith("specdec generate: error: unrecognized arguments: --bogus 1")
    with socket.socket() as busy:  # a port in use: refused before the model loads (here: could not)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("serve", "/no/such/model", "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr


def test_vllm_prompt_dtype_and_tokenizer(loaded, tiny_dirs):
    """vLLM's other names: ``{"prompt": text}`` prompts, dtype ``auto`` / ``half`` / ``float``,
    ``use_tqdm`` and ``LLM.get_tokenizer()``."""
    llm = LLM(loaded("llama"))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate({"prompt": "abc"}, sp)[0].token_ids == llm.generate("abc", sp, use_tqdm=False)[0].token_ids
    assert llm.chat([{"role": "user", "content": "abc"}], sampling_params=sp, use_tqdm=False)[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer
    assert [EngineConfig(dtype=d).dtype for d in ("auto", "half", "float", "bfloat16")] == \
        [None, "float16", "float32", "bfloat16"]
    assert LLM(str(tiny_dirs["llama"]), device="cpu", dtype="float").target.runtime.dtype == torch.float32


def test_vllm_porting_names(loaded):
    """What vLLM's offline scripts use: ``sp.clone()``, ``StructuredOutputsParams`` /
    ``GuidedDecodingParams``, ``TextPrompt`` / ``TokensPrompt``, ``CompletionOutput.finished()``,
    request ids "0", "1", ... per prompt, ``tensor_parallel_size=1`` /
    ``gpu_memory_utilization`` (checked; a size other than 1 is refused), ``detokenize=False``
    (ids only) and ``guided_decoding`` (structured_outputs' older name)."""
    import dataclasses

    import specdec

    sp = SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=3)
    assert sp.clone() == sp and sp.clone() is not sp
    assert SamplingParams(seed=-1).seed is None  # vLLM's: a fresh seed
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_tokens = 8
    assert specdec.StructuredOutputsParams is specdec.GuidedDecodingParams is specdec.StructuredOutputs
    assert SpecConfig.from_vllm({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}) == \
        (SpecConfig(method="draft", num_draft_tokens=3), "d")
    assert SpecConfig.from_vllm({"model": "d", "revision": "v2", "code_revision": "v2", "quantization": None}) == \
        (SpecConfig(method="draft", draft_revision="v2"), "d")
    llm = LLM(loaded("llama"), tensor_parallel_size=1, gpu_memory_utilization=0.5)
    outs = llm.generate([specdec.TextPrompt(prompt="abc"), specdec.TokensPrompt(prompt_token_ids=[5, 6, 7])], sp)
    outs += llm.generate("abc", sp)
    assert [o.request_id for o in outs] == ["0", "1", "2"] and outs[2].token_ids == outs[0].token_ids
    assert all(c.finished() for o in outs for c in o.outputs)
    with pytest.raises(ValueError, match="no tensor parallelism"):
        LLM(loaded("llama"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    ids = dataclasses.replace(sp, n=1, detokenize=False, logprobs=1, prompt_logprobs=0)
    bare, full = llm.generate("abc", ids)[0], llm.generate("abc", dataclasses.replace(ids, detokenize=True))[0]
    assert bare.outputs[0].text == "" and bare.token_ids == full.token_ids and full.outputs[0].text
    assert {lp.decoded_token for e in bare.outputs[0].logprobs + bare.prompt_logprobs[1:] for lp in e.values()} == {None}
    assert [[lp.logprob for lp in e.values()] for e in bare.outputs[0].logprobs] == \
        [[lp.logprob for lp in e.values()] for e in full.outputs[0].logprobs]
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    guided = SamplingParams(guided_decoding=specdec.GuidedDecodingParams(choice=["yes", "no"]), max_tokens=8)
    assert guided.structured_outputs == specdec.StructuredOutputs(choice=["yes", "no"])
    assert llm.generate("abc", guided)[0].outputs[0].text in ("yes", "no")
    assert dataclasses.replace(guided, max_tokens=9).structured_outputs == guided.structured_outputs
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"choice": ["a"]}, structured_outputs={"choice": ["b"]})


def test_cli_top_k_minus_one_is_off(tiny_dirs):
    """vLLM's --top-k -1 (all tokens) samples as 0 (off)."""
    common = ("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "The quick brown fox", "--json",
              "--max-new-tokens", "8", "--ignore-eos", "--temperature", "1.5", "--seed", "5")
    off, minus_one = (run_cli(*common, "--top-k", k) for k in ("0", "-1"))
    assert minus_one.returncode == 0, minus_one.stderr
    assert json.loads(minus_one.stdout)["token_ids"] == json.loads(off.stdout)["token_ids"]


def test_cli_unknown_method_and_empty_prompt(tiny_dirs):
    r = run_cli("generate", "--prompt", "hi", "--method", "medusa")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = run_cli("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "")
    assert r.returncode == 2 and r.stderr.strip() == "specdec: error: the prompt is empty"


def test_cli_generate_json_prompts_file(tmp_path, tiny_dirs):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in [
        {"id": "a", "kind": "chat", "messages": [{"role": "user", "content": "hi there"}]},
        {"id": "b", "kind": "completion", "prompt": "The quick brown fox"},
    ]) + "\n")
    r = run_cli("generate", "--model", str(tiny_dirs["llama"]), "--method", "self", "-k", "3",
                "--max-new-tokens", "9", "--ignore-eos", "--json", "--prompts-file", str(f))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["a", "b"]
    for row in rows:
        assert len(row["token_ids"]) == 9 and row["finish_reason"] == "length"
        assert set(row["metrics"]) >= {"target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens",
                                       "acceptance_rate", "mean_accepted_length", "accepted_per_position",
                                       "tokens_per_s", "wall_s"}
    piped = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tiny_dirs["llama"]),
                            "--max-new-tokens", "3", "--json", "--prompts-file", "-"],
                           input=f.read_text(), capture_output=True, text=True)  # '-': standard input
    assert piped.returncode == 0 and [json.loads(x)["id"] for x in piped.stdout.splitlines()] == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    for line in ('{"id": 1, "kind": "chat"}', "[1, 2]", '"just a string"'):
        bad.write_text(line + "\n")
        r = run_cli("generate", "--model", str(tiny_dirs["llama"]), "--prompts-file", str(bad))
        assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("generate", "--model", str(tiny_dirs["llama"]), "--prompts-file", str(f), "--chat")
    assert r.returncode == 2 and "--chat applies to --prompt" in r.stderr


def test_cli_generate_n_and_logprobs(tiny_dirs):
    common = ("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "The quick brown fox",
              "--max-new-tokens", "6", "--ignore-eos", "--temperature", "0.8", "--seed", "3")
    r = run_cli(*common, "-n", "2", "--logprobs", "1", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert [c["index"] for c in row["outputs"]] == [0, 1] and row["token_ids"] == row["outputs"][0]["token_ids"]
    for c in row["outputs"]:
        assert len(c["logprobs"]) == 6 and all(1 <= len(e) <= 2 for e in c["logprobs"])
        assert all(next(iter(e)) == str(t) for t, e in zip(c["token_ids"], c["logprobs"]))  # chosen first
        assert c["cumulative_logprob"] == pytest.approx(sum(e[str(t)] for t, e in zip(c["token_ids"], c["logprobs"])))
    seed4 = json.loads(run_cli(*common[:-1], "4", "--json").stdout)
    assert seed4["token_ids"] == row["outputs"][1]["token_ids"]  # completion i draws from seed + i
    text = run_cli(*common, "-n", "2")
    assert text.returncode == 0 and text.stdout.count("--- 0 #") == 2
    r = run_cli(*common, "--logprobs", "2")
    assert r.returncode == 2 and "need --json" in r.stderr
    row = json.loads(run_cli(*common, "--prompt-logprobs", "1", "--json").stdout)
    assert row["prompt_logprobs"][0] is None and len(row["prompt_logprobs"]) > 2
    assert all(1 <= len(e) <= 2 and all(v <= 0 for v in e.values()) for e in row["prompt_logprobs"][1:])


def test_incompatible_draft_refused(loaded, tiny_dirs):
    with pytest.raises(ValueError, match="draft tokenizer is incompatible"):
        LLM(loaded("llama"), draft=str(tiny_dirs["alien"]))


def test_cli_check_vocab(tiny_dirs):
    ok = run_cli("check-vocab", str(tiny_dirs["llama"]), str(tiny_dirs["draft"]))
    assert ok.returncode == 0 and ok.stdout.startswith("compatible")
    bad = run_cli("check-vocab", str(tiny_dirs["llama"]), str(tiny_dirs["alien"]))
    assert bad.returncode == 1 and bad.stdout.startswith("incompatible")
    assert "'a'" in bad.stdout and "'b'" in bad.stdout  # names the first disagreement
    r = run_cli("generate", "--model", str(tiny_dirs["llama"]), "--draft", str(tiny_dirs["alien"]),
                "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "incompatible" in r.stderr


def test_cli_structured_outputs(tmp_path, tiny_dirs):
    """``--structured-*`` flags: the output follows the constraint, ``@FILE`` reads it from a
    file, and a bad constraint is a one-line error."""
    common = ("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "The quick brown fox",
              "--max-new-tokens", "12", "--method", "ngram", "--json")
    row = json.loads(run_cli(*common, "--structured-regex", "[ab]{3}-[0-9]{2}").stdout)
    assert re.fullmatch("[ab]{3}-[0-9]{2}", row["text"]) and row["finish_reason"] == "stop"
    row = json.loads(run_cli(*common, "--structured-choice", "yes", "--structured-choice", "no").stdout)
    assert row["text"] in ("yes", "no")
    (tmp_path / "yes.txt").write_text("yes\n")
    row = json.loads(run_cli(*common, "--structured-choice", f"@{tmp_path / 'yes.txt'}").stdout)
    assert row["text"] == "yes"  # the file's text (its final newline dropped), not its path
    (tmp_path / "g.lark").write_text('start: "(" /[0-9]{1,2}/ ")"')
    row = json.loads(run_cli(*common, "--structured-grammar", f"@{tmp_path / 'g.lark'}").stdout)
    assert re.fullmatch(r"\([0-9]{1,2}\)", row["text"])
    for args, match in [(["--structured-regex", "(a"], "structured_outputs.regex"),
                        (["--structured-regex", "a", "--structured-json-object"], "exactly one"),
                        (["--structured-json", "@/no/such/file"], "cannot read")]:
        r = run_cli(*common, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and match in lines[0], r.stderr


def test_unwritable_cache(tmp_path, tiny_dirs, monkeypatch, caplog):
    """specdec's cache only spares measuring again: a model loads though it cannot be written
    (a warning), a GGUF that must be dequantized into it is a ValueError naming
    SPECDEC_CACHE, and an empty SPECDEC_CACHE is the default directory (it was the current one)."""
    from pathlib import Path

    from specdec.runtime.loading import cache_root, gguf_to_hf_dir

    blocked = tmp_path / "a-file"
    blocked.touch()
    monkeypatch.setenv("SPECDEC_CACHE", str(blocked / "cache"))
    with caplog.at_level("WARNING", logger="specdec"):
        LLM(str(tiny_dirs["llama"]))
    assert "SPECDEC_CACHE" in caplog.text
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr("transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint",
                        lambda *a, **k: {"config": {"model_type": "llama"}})
    monkeypatch.setattr("specdec.runtime.loading.gguf_rope", lambda path: {})
    monkeypatch.setattr("specdec.runtime.loading.gguf_tokenizer",
                        lambda path: __import__("tiny").byte_tokenizer())
    with pytest.raises(ValueError, match="set SPECDEC_CACHE to a writable directory"):
        gguf_to_hf_dir(gguf, weights=False)
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "specdec"


def test_quantization_is_the_checkpoints(loaded):
    """vLLM's ``quantization``: checked against the checkpoint's (gguf, or its
    quantization_config's method); specdec quantizes nothing at load."""
    import dataclasses
    from types import SimpleNamespace

    from specdec.runtime.loading import quantization_of

    tiny = loaded("llama")
    assert quantization_of(tiny) is None and LLM(tiny, quantization=None).generate("abc")[0].token_ids
    with pytest.raises(ValueError, match="quantization 'fp8': this checkpoint is not quantized"):
        LLM(tiny, quantization="fp8")
    gptq = dataclasses.replace(tiny, config=SimpleNamespace(quantization_config={"quant_method": "gptq"}))
    assert quantization_of(gptq) == "gptq"
    assert quantization_of(dataclasses.replace(tiny, path=tiny.path / "model.gguf")) == "gguf"


def test_cli_flags_wait_for_the_generation_config(tmp_path, tiny_dirs):
    """The flags are checked before the model loads, but the fields its generation config may
    give wait for it: ``-n 2`` with the config's temperature, ``--min-tokens`` beyond specdec's
    default length within the config's; without a config both are refused. A temperature below
    the floor is warned of once."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 140}))
    common = ("generate", "--model", str(tiny_dirs["llama"]), "--prompt", "The quick brown fox", "--seed", "1",
              "--json", "--ignore-eos")
    r = run_cli(*common, "--generation-config", str(tmp_path), "-n", "2", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert [len(c["token_ids"]) for c in json.loads(r.stdout)["outputs"]] == [4, 4]
    r = run_cli(*common, "--generation-config", str(tmp_path), "--min-tokens", "130")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 140
    for flags, match in ((("-n", "2"), "greedy"), (("--min-tokens", "130"), "min_tokens")):
        r = run_cli(*common, "--generation-config", "vllm", *flags)
        assert r.returncode == 2 and match in r.stderr, r.stderr
    r = run_cli(*common, "--temperature", "0.005", "--max-tokens", "2")
    assert r.returncode == 0 and r.stderr.count("raised to") == 1, r.stderr


def test_every_engine_and_spec_field_has_its_flag():
    """The CLI's flags map one-to-one onto ``EngineConfig``'s and ``SpecConfig``'s fields: each
    field has a ``--field-name`` flag on ``generate`` and ``serve``."""
    from dataclasses import fields

    from specdec.cli import build_parser

    commands = build_parser().commands
    for command in ("generate", "serve"):
        flags = {s for a in commands[command]._actions for s in a.option_strings}
        for config in (EngineConfig, SpecConfig):
            missing = [f.name for f in fields(config) if "--" + f.name.replace("_", "-") not in flags]
            assert not missing, (command, config.__name__, missing)

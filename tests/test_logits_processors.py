"""Per-request logits processors (vLLM's ``SamplingParams.logits_processors``): functions of
the ids so far, applied to every row a request draws from or verifies against, each row with
the drafts before it as output, so speculation stays lossless against the processed target."""
import pytest
import torch
from joint import exact_joint, joint_pvalue

from specdec import LLM, SamplingParams, SpecConfig

ALPHA = 1e-3
PROMPT = [40, 41, 42, 43, 44]


def step_up(output, logits):
    """Every third token is the one 7 past the last (changes the row in place): which token a
    row gets depends on the drafts before it."""
    if len(output) % 3 == 2:
        logits[(output[-1] + 7) % 256] = logits.max() + 1.0
    return logits


def after_prompt(prompt, output, logits):
    """The prompt's form: bans the prompt's last token and the one after it (a new tensor)."""
    return logits.index_fill(0, torch.tensor([prompt[-1], prompt[-1] + 1]), float("-inf"))


def reference(tiny_dir, n: int) -> list[int]:
    """transformers' model alone, greedy on the processed logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = list(PROMPT)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        out = ids[len(PROMPT):]
        ids.append(int(step_up(out, after_prompt(PROMPT, out, logits)).argmax()))
    return ids[len(PROMPT):]


@pytest.mark.parametrize("method, draft, topk", [("none", None, 1), ("self", None, 1), ("draft", "draft", 1),
                                                 ("draft", "noisy", 1), ("ngram", None, 1), ("self", None, 2),
                                                 ("draft", "noisy", 2)])
def test_greedy_equals_the_processed_target_alone(loaded, tiny_dirs, method, draft, topk):
    n = 24
    want = reference(tiny_dirs["llama"], n)
    spec = SpecConfig(method=method, num_draft_tokens=4, tree_topk=topk)
    llm = LLM(loaded("llama"), draft=draft and loaded(draft), speculative=spec)
    sp = SamplingParams(max_tokens=n, ignore_eos=True, logits_processors=[after_prompt, step_up])
    out = llm.generate({"prompt_token_ids": PROMPT}, sp)[0]
    assert out.token_ids == want
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=n, ignore_eos=True))[0]
    assert sum(a != b for a, b in zip(plain.token_ids, want)) > n // 3  # the processors matter
    if method != "none":
        m = out.metrics
        assert m["accepted_tokens"] > 0 and m["target_forwards"] < n


def test_sampled_output_follows_the_processed_target(loaded, tiny_dirs):
    """Chains and trees drafted by a draft resembling the target, with ``step_up`` in the
    loop: the first four tokens follow the processed target's exact joint distribution
    (chi-square at alpha 0.001 over 4096 completions each)."""
    from transformers import AutoModelForCausalLM

    top_k, temperature, n = 3, 1.5, 4096
    expected = exact_joint(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval(), PROMPT, 4, top_k,
                           temperature, step_up)
    for spec in (SpecConfig(method="draft", num_draft_tokens=3),
                 SpecConfig(method="draft", num_draft_tokens=2, tree_topk=2, tree_nodes=3)):
        llm = LLM(loaded("llama"), draft=loaded("noisy"), speculative=spec, max_batch_size=64)
        sps = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, seed=10**6 + j * n // 64, n=n // 64,
                              ignore_eos=True, logits_processors=[step_up]) for j in range(64)]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 64, sps)
        seen = [tuple(c.token_ids) for o in outs for c in o.outputs]
        assert len(seen) == n and set(seen) <= set(expected)
        drafted = sum(o.metrics["drafted_tokens"] for o in outs)
        accepted = sum(o.metrics["accepted_tokens"] for o in outs)
        assert 0.2 * drafted < accepted < 0.9 * drafted  # drafts accepted and rejected
        assert joint_pvalue(seen, expected) > ALPHA, spec


def test_processor_calls_and_logprobs(loaded, tmp_path):
    """A processor sees lists of ids (its own copies) and rows of the target's width only (a
    narrower draft's rows skip it); changing a row in place leaves the logprobs (the raw
    logits', as vLLM's) alone; a wrong return is a clear error."""
    from tiny import make_tiny

    from specdec.runtime import load_model

    width = loaded("llama").runtime.vocab_size
    seen = []

    def spy(output, logits):
        assert isinstance(output, list) and logits.shape == (width,) and logits.dtype == torch.float32
        seen.append(len(output))
        output.append(0)  # its own copy
        logits[65] = float("-inf")
        return logits

    narrow = load_model(str(make_tiny(tmp_path / "narrow", "llama", seed=31, layers=1, vocab=258)), device="cpu")
    llm = LLM(loaded("llama"), draft=narrow, speculative=SpecConfig(method="draft", num_draft_tokens=3))
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, logit_bias={65: 50.0})
    raw = llm.generate({"prompt_token_ids": PROMPT}, sp)[0]
    assert all(t == 65 for t in raw.token_ids)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**{**sp.__dict__, "logits_processors": [spy]}))[0]
    assert 65 not in out.token_ids and len(out.token_ids) == 12 and max(seen) <= 12
    assert out.outputs[0].logprobs[0][out.token_ids[0]].logprob == raw.outputs[0].logprobs[0][out.token_ids[0]].logprob
    with pytest.raises(ValueError, match="must return the logits"):
        llm.generate("abc", SamplingParams(max_tokens=2, logits_processors=[lambda output, logits: logits[:5]]))


@pytest.mark.parametrize("processors, match", [([1], "must be functions"), ([lambda logits: logits], "must be functions"),
                                               ([lambda a, b, c, d: d], "must be functions")])
def test_processor_errors(processors, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logits_processors=processors)
    assert SamplingParams(logits_processors=[max]).logits_processors == (max,)  # no signature: two arguments


def test_rows_past_a_rejected_draft_do_not_fail_the_request(loaded, tmp_path):
    """A processor that bans a token and checks that its output never holds it is handed, on
    the verify rows after an n-gram (or narrow draft's) draft of that token, an output it
    never allowed, and raises there; those rows are never reached (the draft is rejected), so
    the request goes on as plain decoding does, with plain decoding's tokens."""
    from tiny import make_tiny

    from specdec.runtime import load_model

    def no_a(output, logits):
        assert 65 not in output, "a token it banned"
        logits[65] = float("-inf")
        if len(output) == 3:  # 66, which the prompt follows with 65
            logits[66] = logits.max() + 1
        return logits

    prompt = {"prompt_token_ids": [65, 66] * 5 + [65]}
    sp = SamplingParams(max_tokens=24, ignore_eos=True, logits_processors=[no_a])
    want = LLM(loaded("llama")).generate(prompt, sp)[0].token_ids
    narrow = load_model(str(make_tiny(tmp_path / "narrow", "llama", seed=31, layers=1, vocab=258)), device="cpu")
    for method, draft in (("ngram", None), ("draft", narrow), ("hybrid", narrow)):
        out = LLM(loaded("llama"), draft=draft, speculative=SpecConfig(method=method, num_draft_tokens=4)).generate(
            prompt, sp)[0]
        assert out.token_ids == want and out.metrics["drafted_tokens"] > out.metrics["accepted_tokens"], method


def test_a_processor_leaving_no_token_fails_its_request(loaded):
    """A row of nan (or of -inf only) from a processor is that request's error, raised by
    ``generate`` at the step that draws from it (sampled or greedy)."""
    def nan_at_3(output, logits):
        return logits.fill_(float("nan")) if len(output) == 3 else logits

    def none_left_at_3(output, logits):
        return logits.fill_(float("-inf")) if len(output) == 3 else logits

    llm = LLM(loaded("llama"), speculative=SpecConfig(method="self", num_draft_tokens=3))
    for f in (nan_at_3, none_left_at_3):
        for temperature in (0.0, 1.0):
            with pytest.raises(ValueError, match="no token to draw"):
                llm.generate("abc", SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True,
                                                    logits_processors=[f]))
    assert len(llm.generate("abc", SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8

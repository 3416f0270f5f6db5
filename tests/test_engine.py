"""Greedy equality, forward counts, stops, rollback and batching on tiny random models."""
import math
import time

import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters import Draft, ModelDrafter
from specdec.engine import Engine, truncate
from specdec.sampling import make_generator
from specdec.sequence import Sequence, settled_text

PROMPTS = ["Hello world, this is a test of speculative decoding", "abc",
           "The quick brown fox jumps over the lazy dog. The quick brown"]
N = 64
GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)


def plain(loaded, arch, prompts=PROMPTS, sp=GREEDY):
    return LLM(loaded(arch)).generate(prompts, sp)


def spec(loaded, arch, method, k=4, draft=None, **kw):
    return LLM(loaded(arch), draft=loaded(draft) if draft else None,
               speculative=SpecConfig(method=method, num_draft_tokens=k), **kw)


def transformers_greedy(path, prompts: list[list[int]], n: int = 40) -> list[list[int]]:
    """The ``n`` tokens greedy decoding gives after each of ``prompts`` (token ids) by
    transformers' model of ``path``, a whole forward per token (generate's min_new_tokens
    would hide the eos)."""
    from transformers import AutoModelForCausalLM

    from tiny import greedy_by_whole_forwards

    return greedy_by_whole_forwards(AutoModelForCausalLM.from_pretrained(path).eval(), prompts, n)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_self_draft_equal_and_forward_count(loaded, arch, batch):
    base = plain(loaded, arch)
    k = 4
    llm = spec(loaded, arch, "self", k=k)
    outs = llm.generate(PROMPTS, GREEDY) if batch == 3 else [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    for o, b in zip(outs, base):
        assert o.token_ids == b.token_ids
        assert len(o.token_ids) == N
        m = o.metrics
        assert m["acceptance_rate"] == 1.0
        # prefill commits the first token, then every round commits k+1
        assert m["target_forwards"] == 1 + math.ceil((N - 1) / (k + 1))
        assert m["mean_accepted_length"] == pytest.approx((N - 1) / math.ceil((N - 1) / (k + 1)))
        assert m["accepted_per_position"][0] == m["target_forwards"] - 1  # every verify step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_draft_model_rejected_but_equal(loaded, arch):
    base = plain(loaded, arch)
    outs = spec(loaded, arch, "draft", k=3, draft="draft").generate(PROMPTS, GREEDY)
    for o, b in zip(outs, base):
        assert o.token_ids == b.token_ids
    drafted = sum(o.metrics["drafted_tokens"] for o in outs)
    accepted = sum(o.metrics["accepted_tokens"] for o in outs)
    assert drafted > 100 and accepted / drafted < 0.2
    assert all(o.metrics["draft_forwards"] > 0 for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_ngram_equal(loaded, arch, batch):
    base = plain(loaded, arch)
    llm = spec(loaded, arch, "ngram", k=5)
    outs = llm.generate(PROMPTS, GREEDY) if batch == 3 else [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert all(o.metrics["draft_forwards"] == 0 for o in outs)
    for m in (o.metrics for o in outs):  # a step whose lookup found no match drafted with k = 0
        assert sum(m["chosen_k"][1:]) == sum(m["drafter_steps"].values()) == m["drafted_per_position"][0]


def test_ragged_batch_different_budgets(loaded):
    """Sequences of different prompt lengths and budgets finish at different steps."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 33, 17)]
    base = [plain(loaded, "llama", [p], sp)[0] for p, sp in zip(PROMPTS, params)]
    outs = spec(loaded, "llama", "self", k=3).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert [len(o.token_ids) for o in outs] == [5, 33, 17]
    assert all(o.finish_reason == "length" for o in outs)


def test_more_prompts_than_batch_slots(loaded):
    prompts = PROMPTS * 3
    base = plain(loaded, "llama", prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    outs = spec(loaded, "llama", "self", k=2, max_batch_size=2).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_budget_respected(loaded, max_new):
    sp = SamplingParams(max_tokens=max_new, ignore_eos=True)
    base = plain(loaded, "llama", sp=sp)
    outs = spec(loaded, "llama", "self", k=4).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert all(len(o.token_ids) == max_new and o.finish_reason == "length" for o in outs)
    if max_new == 1:  # prefill alone: no verify step, no draft
        assert all(o.metrics["target_forwards"] == 1 and o.metrics["draft_forwards"] == 0 for o in outs)


def test_truncate_worked_cases():
    eos = frozenset({9})
    assert truncate([1, 2, 3, 4, 5], 2, eos) == ([1, 2], False)  # budget runs out mid-round
    assert truncate([1, 9, 3], 5, eos) == ([1, 9], True)  # nothing past EOS
    assert truncate([1, 2, 9], 5, eos) == ([1, 2, 9], True)  # EOS as the bonus token
    assert truncate([1, 2, 9], 2, eos) == ([1, 2], False)
    assert truncate([4], 0, eos) == ([], False)


class ScriptedDrafter:
    """Proposes a fixed function of the sequence; records nothing."""

    def __init__(self, fn):
        self.fn = fn

    def propose(self, seqs, ks):
        return [Draft(self.fn(s)[:k]) for s, k in zip(seqs, ks)]

    def observe(self, seq, num_accepted):
        pass

    def release(self, seq):
        pass


def run_engine(loaded, drafter, prompt_ids, max_new, eos_ids, k=4):
    target = loaded("llama")
    eng = Engine(target, drafter, SpecConfig(method="ngram", num_draft_tokens=k), max_batch_size=2)
    sp = SamplingParams(max_tokens=max_new)
    s = Sequence(1, list(prompt_ids), len(prompt_ids), sp, make_generator(0, "cpu"), frozenset(eos_ids))
    eng.add(s)
    while eng.has_work:
        eng.step()
    return s


def test_eos_as_bonus_and_rejected_eos_draft(loaded):
    tok = loaded("llama").tokenizer
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = run_engine(loaded, None, prompt, 20, []).output_ids  # plain reference, no EOS
    # EOS as the bonus token: the 6th output token is declared EOS; a perfect drafter
    # proposes outputs 1..4 in the first round, so output 5 arrives as the bonus.
    eos = ref[5]
    first = ref.index(eos)
    perfect = ScriptedDrafter(lambda s: ref[s.num_output:])
    s = run_engine(loaded, perfect, prompt, 20, [eos])
    assert s.output_ids == ref[: first + 1] and s.finish_reason == "stop"
    # a drafter that always proposes EOS first: the target rejects it (ref never has it
    # at that step) and commits its own token; the request goes on to the same output
    wrong_eos = ScriptedDrafter(lambda s: [eos, eos])
    s2 = run_engine(loaded, wrong_eos, prompt, 20, [eos])
    assert s2.output_ids == s.output_ids and s2.finish_reason == "stop"
    assert s2.metrics.drafted_tokens > 0


def test_draft_one_one_one_target_one_two(loaded):
    """Tutorial case: draft [x, x, x], target picks x then y: the round commits [x, y]."""
    tok = loaded("llama").tokenizer
    prompt = tok(PROMPTS[2])["input_ids"]
    ref = run_engine(loaded, None, prompt, 6, []).output_ids
    x = ref[1]
    drafter = ScriptedDrafter(lambda s: [x, x, x] if s.num_output == 1 else [])
    s = run_engine(loaded, drafter, prompt, 6, [])
    assert s.output_ids == ref
    if ref[2] != x:
        assert s.metrics.accepted_tokens == 1 and s.metrics.verify_committed >= 2
        assert s.metrics.accepted_per_position[:2] == [1, 0]


def test_rollback_invariant(loaded):
    """After every round the cache holds all committed ids but the last, and feeding that
    last token through it gives the logits of a fresh full-prefix forward (atol 1e-4)."""
    target = loaded("llama")
    rt = target.runtime
    drafter = ModelDrafter(loaded("draft").runtime, 3, rt.vocab_size)
    eng = Engine(target, drafter, SpecConfig(method="draft", num_draft_tokens=4), 3)
    tok = target.tokenizer
    seqs = [Sequence(i, tok(p)["input_ids"], len(tok(p)["input_ids"]),
                     SamplingParams(max_tokens=40, ignore_eos=True), make_generator(0, "cpu"),
                     frozenset()) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        eng.add(s)
    fresh = rt.new_cache(1)
    checked = 0
    while eng.has_work:
        eng.step()
        for s in eng.running:
            assert eng.cache.lengths[s.slot] == len(s.ids) - 1
            via_cache = rt.forward(eng.cache, [s.slot], [[s.ids[-1]]], last_only=True)[0]
            eng.cache.rewind(s.slot, len(s.ids) - 1)
            fresh.rewind(0, 0)
            full = rt.forward(fresh, [0], [s.ids], last_only=True)[0]
            torch.testing.assert_close(via_cache, full, atol=1e-4, rtol=0)
            checked += 1
    assert checked > 10


def test_stop_string_cuts_text(loaded):
    base = plain(loaded, "llama", [PROMPTS[0]])[0]
    stop = base.text[20:23]
    cut = base.text.find(stop)
    for method in ("none", "ngram", "self"):
        sp = SamplingParams(max_tokens=N, ignore_eos=True, stop=(stop,))
        o = spec(loaded, "llama", method).generate(PROMPTS[0], sp)[0] if method != "none" \
            else plain(loaded, "llama", [PROMPTS[0]], sp)[0]
        assert o.finish_reason == "stop" and o.outputs[0].stop_reason == stop
        assert o.text == base.text[:cut]
        # nothing past the token that completed the stop string
        assert o.token_ids == base.token_ids[: len(o.token_ids)]
        tok = loaded("llama").tokenizer
        assert stop in tok.decode(o.token_ids) and stop not in tok.decode(o.token_ids[:-1])
        kept = SamplingParams(max_tokens=N, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)
        o = spec(loaded, "llama", method).generate(PROMPTS[0], kept)[0] if method != "none" \
            else plain(loaded, "llama", [PROMPTS[0]], kept)[0]
        assert o.text == base.text[:cut + len(stop)] and o.finish_reason == "stop"


def test_stop_strings_met_as_plain_decoding_meets_them(loaded):
    """A round commits several tokens; each must end the output where plain decoding, one
    token a step, would: a stop string before a stop token later in the round; of two stop
    strings in one round, the one whose text comes first (the short one inside the long
    one completes first); a stop string seen only while a character is incomplete (U+FFFD)."""
    tok = loaded("llama").tokenizer
    out = plain(loaded, "llama", [PROMPTS[0]])[0]
    chars = [tok.decode([t]) for t in out.token_ids]
    i = next(i for i in range(1, N - 3) if all(len(c) == 1 and c.isascii() and c.isprintable() for c in chars[i:i + 3])
             and chars[i + 1] not in "".join(chars[:i + 1]) and out.token_ids[i + 2] not in out.token_ids[:i + 2])
    cases = [SamplingParams(max_tokens=N, ignore_eos=True, stop=[chars[i + 1]], stop_token_ids=[out.token_ids[i + 2]]),
             SamplingParams(max_tokens=N, ignore_eos=True, stop=["".join(chars[i:i + 3]), chars[i + 1]]),
             SamplingParams(max_tokens=N, ignore_eos=True, stop=["\ufffd\ufffd"]),
             SamplingParams(max_tokens=N, ignore_eos=True, stop=["\ufffd"], min_tokens=6)]
    self_draft = spec(loaded, "llama", "self", k=6)  # accepts every draft: rounds of 7 tokens
    for sp in cases:
        want = plain(loaded, "llama", PROMPTS, sp)
        got = self_draft.generate(PROMPTS, sp)
        assert [(o.token_ids, o.text, o.outputs[0].stop_reason) for o in got] == \
               [(o.token_ids, o.text, o.outputs[0].stop_reason) for o in want], sp.stop
    assert want[0].finish_reason == "stop"
    first = plain(loaded, "llama", [PROMPTS[0]], cases[1])[0].outputs[0]
    assert first.stop_reason == chars[i + 1] and first.text == out.text[: out.text.find(chars[i + 1])]


@pytest.mark.parametrize("method", ["none", "self"])
def test_text_as_an_incremental_detokenizer_has_it(loaded, method):
    """A regex makes the byte-level tiny model write known bytes; as vLLM's incremental
    detokenizer: an output cut inside a character leaves that character out (no U+FFFD); of
    two stop strings met at one token, the first listed wins; ``min_tokens`` ending inside a
    character counts only the complete ones as seen (self-drafting commits 4 tokens a step)."""
    from specdec import StructuredOutputs

    llm = spec(loaded, "llama", method, k=3)
    emoji = StructuredOutputs(regex="😀{5}")  # 4 byte tokens each

    def run(**kw):
        o = llm.generate("x", SamplingParams(**{"max_tokens": N, "ignore_eos": True, **kw}))[0].outputs[0]
        return o.text, len(o.token_ids), o.stop_reason

    assert run(structured_outputs=emoji, max_tokens=7) == ("😀", 7, None)  # was "😀\ufffd"
    abc = StructuredOutputs(regex="abcdef")
    assert run(structured_outputs=abc, stop=["bc", "c"]) == ("a", 3, "bc")
    assert run(structured_outputs=abc, stop=["c", "bc"]) == ("ab", 3, "c")
    # 6 tokens: one emoji and half of the next; the next completes at token 8
    assert run(structured_outputs=emoji, stop=["😀"], min_tokens=6) == ("😀", 8, "😀")
    assert run(structured_outputs=emoji, stop_token_ids=[llm.tokenizer.convert_tokens_to_ids("ð")],
               include_stop_str_in_output=True) == ("", 1, llm.tokenizer.convert_tokens_to_ids("ð"))


def test_generate_from_threads_and_chat_input(loaded):
    """``generate`` from several threads runs the calls one at a time, each as it would alone
    (they share the engine); ``chat`` takes conversations only, OpenAI's assistant tool-call
    history included (no content, arguments as JSON text, as objects in the template); a
    prompt dict's unknown keys (``multi_modal_data``) are refused; a refused call draws no
    seeds from ``LLM(seed=)``."""
    import threading

    llm = LLM(loaded("llama"), max_batch_size=2)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want = {p: llm.generate(p, sp)[0].token_ids for p in PROMPTS}
    got = {}
    threads = [threading.Thread(target=lambda p=p: got.update({p: llm.generate(p, sp)[0].token_ids})) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    for bad in ("hello", ["hello"]):
        with pytest.raises(ValueError, match="chat takes a conversation"):
            llm.chat(bad)
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "42"}]
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{{ m.content }}|{% endfor %}"
    assert llm.chat(history, SamplingParams(max_tokens=1), chat_template=template)[0].prompt == 'x|{"a": 1}|42|'
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": "x.png"}})
    sampled = SamplingParams(max_tokens=6, temperature=1.0)
    fresh = [o.token_ids for o in LLM(loaded("llama"), seed=0).generate(["x", "y"], sampled)]
    seeded = LLM(loaded("llama"), seed=0)
    with pytest.raises(ValueError, match="leaves no room"):
        seeded.generate(["x", {"prompt_token_ids": [5] * 600}], sampled)
    assert [o.token_ids for o in seeded.generate(["x", "y"], sampled)] == fresh


def test_stop_strings_sought_in_the_new_text_only(loaded, monkeypatch):
    """The stop check decodes each token's window once, not the whole output each step
    (vLLM's incremental detokenization): the tokens decoded stay linear in the output."""
    import specdec.sequence

    decoded = []
    real = specdec.sequence.output_text
    monkeypatch.setattr(specdec.sequence, "output_text",
                        lambda tok, ids, sp, context=(): decoded.append(len(ids)) or real(tok, ids, sp, context))
    n = 200
    o = spec(loaded, "llama", "self", k=4).generate("abc", SamplingParams(max_tokens=n, ignore_eos=True, stop=["@@@"]))[0]
    assert len(o.token_ids) == n and sum(decoded) < 10 * n  # the whole output each step: 37 n


def test_chat_content_parts(loaded):
    """``LLM.chat`` takes OpenAI's text content parts, a part per line (vLLM's); other
    parts are a ValueError."""
    llm = LLM(loaded("llama"))
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert llm.encode(parts) == llm.encode([{"role": "user", "content": "hi\nthere"}])
    with pytest.raises(ValueError, match="content parts must be text"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_draft_narrower_than_the_target(loaded, tmp_path):
    """A draft whose embedding lacks the target's last ids (added tokens, padded rows) drafts
    past them in the prompt and the output (fed as id 0) instead of failing."""
    from tiny import make_tiny

    from specdec.runtime import load_model

    narrow = load_model(str(make_tiny(tmp_path / "narrow", "llama", seed=31, layers=1, vocab=258)), device="cpu")
    prompt = {"prompt_token_ids": [65, 66, 260, 67, 261]}
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={262: 100.0})  # the output holds 262 too
    want = LLM(loaded("llama")).generate(prompt, sp)[0].token_ids
    got = LLM(loaded("llama"), draft=narrow, speculative=SpecConfig(method="draft", num_draft_tokens=3)).generate(prompt, sp)[0]
    assert list(got.token_ids) == list(want) and 262 in want


@pytest.mark.parametrize("method", ["none", "self"])
def test_text_read_after_the_prompt(tmp_path, method):
    """With a tokenizer that strips the text's first space (SentencePiece's, Llama 2's), the
    output's text is what it adds to the prompt's last tokens, as vLLM's primed detokenizer
    has it: the first token's space stays, a stop string can be met at the first token, and a
    stream's pieces, text offsets and an echo add up to the same text."""
    from tiny import make_tiny, metaspace_tokenizer

    from specdec.runtime import load_model
    from specdec.server.text import TextStream, TokenOffsets

    tok = metaspace_tokenizer()
    model = load_model(str(make_tiny(tmp_path / "m", "llama", seed=3, vocab=len(tok), tokenizer=tok)), device="cpu")
    llm = LLM(model, speculative=SpecConfig(method=method, num_draft_tokens=3))
    word = tok.convert_tokens_to_ids("▁world")
    sp = dict(max_tokens=4, allowed_token_ids=[word, tok.convert_tokens_to_ids("▁cat")])
    out = llm.generate("Hello world", SamplingParams(**sp))[0]
    prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=True)
    assert out.text.startswith(" ") and prompt + out.text == tok.decode(out.prompt_token_ids + out.token_ids,
                                                                     skip_special_tokens=True)
    first = tok.decode(out.token_ids[:1])  # " world" or " cat" as decoded alone: without its space
    stopped = llm.generate("Hello world", SamplingParams(**sp, stop=[" " + first]))[0].outputs[0]
    assert (stopped.text, len(stopped.token_ids), stopped.stop_reason) == ("", 1, " " + first)
    context = llm.make_sequences(out.prompt, SamplingParams())[0].text_context
    stream = TextStream(tok, SamplingParams(), context)
    assert "".join(stream.add([t]) for t in out.token_ids) == out.text
    offsets = TokenOffsets(tok, SamplingParams(), 0, context).add(out.token_ids)
    assert [out.text[a:b] for a, b in zip(offsets, offsets[1:] + [len(out.text)])] == \
        [tok.convert_ids_to_tokens(t).replace("▁", " ") for t in out.token_ids]


def test_text_after_a_prompt_that_ends_inside_a_character():
    """A prompt whose ids end inside a character (2 of the 3 bytes of 中): the output's text
    starts where the prompt's last whole character ends, as vLLM's detokenizer (primed with
    the whole prompt then) has it: an output completing the character begins with it, in the
    final text and in a stream's pieces alike; one that does not, with U+FFFD."""
    from tiny import byte_tokenizer

    from specdec.sequence import IncrementalText, text_context
    from specdec.server.text import TextStream

    tok, sp = byte_tokenizer(), SamplingParams()
    han = tok.encode("中", add_special_tokens=False)
    prompt = tok.encode("hello world ", add_special_tokens=False) + han[:2]
    context = text_context(tok, prompt)
    assert list(context) == prompt  # no whole suffix of 4..23 tokens: all of it
    for out, want in ((han[2:] + tok.encode("xyz", add_special_tokens=False), "中xyz"),
                      (tok.encode("xyz", add_special_tokens=False), "\ufffdxyz")):
        assert settled_text(tok, out, sp, context) == want
        stream = TextStream(tok, sp, context)
        assert "".join(stream.add([t]) for t in out) + stream.finish([], None) == want
    text = IncrementalText(tok, sp, context)  # the stop-string search's text: 中 at the first token
    assert text.add(han[2:]) == "中"


def test_special_tokens_in_text(loaded):
    """The EOS or stop token that ends a request is not in its text (vLLM's rule), unless
    ``include_stop_str_in_output``; EOS, a special token, then shows only with
    ``skip_special_tokens=False``."""
    eos = 257  # tiny.py: </s>
    forced = dict(max_tokens=4, logit_bias={eos: 100})  # EOS first
    for skip, include, text in ((True, False, ""), (False, False, ""), (True, True, ""), (False, True, "</s>")):
        sp = SamplingParams(**forced, skip_special_tokens=skip, include_stop_str_in_output=include)
        o = plain(loaded, "llama", [PROMPTS[0]], sp)[0]
        assert o.text == text and o.token_ids == [eos] and o.finish_reason == "stop", (skip, include)
        assert o.outputs[0].stop_reason is None  # the model's EOS (vLLM's rule)
    base = plain(loaded, "llama", [PROMPTS[0]])[0]
    t = base.token_ids[5]
    j = base.token_ids.index(t)
    for include in (False, True):
        sp = SamplingParams(max_tokens=N, ignore_eos=True, stop_token_ids=[t], include_stop_str_in_output=include)
        o = spec(loaded, "llama", "self").generate(PROMPTS[0], sp)[0]
        tok = loaded("llama").tokenizer
        assert o.token_ids == base.token_ids[:j + 1] and o.text == settled_text(tok, base.token_ids[:j + include], sp)
        assert o.outputs[0].stop_reason == t
    assert base.outputs[0].stop_reason is None and base.finish_reason == "length"


def test_spaces_between_special_tokens():
    """vLLM's ``spaces_between_special_tokens``: a slow tokenizer's added tokens get a space
    each side (default) or none; a fast tokenizer decodes as it does, either way."""
    from specdec.sequence import output_text
    from tiny import byte_tokenizer, char_tokenizer

    slow = char_tokenizer("abcdefghijklmnopqrstuvwxyz .", eos_token="</s>")
    slow.add_tokens(["<t>"])  # an added token, not a special one
    ids = slow("ab<t>cd</s>", add_special_tokens=False)["input_ids"]
    texts = {(spaces, skip): output_text(slow, ids, SamplingParams(spaces_between_special_tokens=spaces,
                                                                   skip_special_tokens=skip))
             for spaces in (True, False) for skip in (True, False)}
    assert texts == {(True, False): "ab <t> cd </s>", (False, False): "ab<t>cd</s>",
                     (True, True): "ab <t> cd", (False, True): "ab<t>cd"}
    fast = byte_tokenizer()
    ids = fast("ab</s>cd", add_special_tokens=False)["input_ids"]
    assert {output_text(fast, ids, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces))
            for spaces in (True, False)} == {"ab</s>cd"}
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be true or false"):
        SamplingParams(spaces_between_special_tokens="no")


def test_seeded_sampling_reproducible_and_self_draft_accepts_all(loaded):
    sp = SamplingParams(max_tokens=30, temperature=0.9, top_k=50, top_p=0.95, seed=123, ignore_eos=True)
    a = plain(loaded, "llama", PROMPTS, sp)
    b = plain(loaded, "llama", PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    llm = spec(loaded, "llama", "self", k=4)
    s1, s2 = llm.generate(PROMPTS, sp), llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in s1] == [o.token_ids for o in s2]
    # draft = target means q == p on every row: min(1, p/q) = 1, every draft accepted
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in s1)
    d = spec(loaded, "llama", "draft", k=3, draft="draft").generate(PROMPTS, sp)
    assert all(len(o.token_ids) == 30 for o in d)


def test_hf_fallback_backend_equal(loaded):
    base = plain(loaded, "llama")
    for method in ("none", "self", "ngram"):
        llm = LLM(loaded("llama", backend="hf"), speculative=SpecConfig(method=method, num_draft_tokens=3))
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], method


LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
# 12 and 20 tokens: before and past the switch (16); 25, with a repeat for n-gram drafts
LONGROPE_PROMPTS = [list(range(70, 82)), list(range(70, 90)), list(range(70, 85)) + [71, 72, 73, 74, 75] * 2]


def test_longrope_equal_to_transformers(tmp_path):
    """transformers' longrope takes its short or long factors for a whole forward, by its
    last position. On a model that keeps each key's factors (longrope on Llama's config:
    transformers' runtime) a verify forward crossing the switch is cut there, and prompts go
    whole, so every drafter decodes as transformers' own ``generate`` does, on both sides of
    the switch (16)."""
    from tiny import make_tiny
    from transformers import AutoModelForCausalLM

    target = make_tiny(tmp_path / "target", "llama", seed=3, rope_parameters=LONGROPE)
    draft = make_tiny(tmp_path / "draft", "llama", seed=7, layers=1)
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    prompts = LONGROPE_PROMPTS[:2]
    want = [hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    for method, k in [("none", 1), ("self", 4), ("ngram", 4), ("draft", 4)]:
        llm = LLM(str(target), draft=str(draft) if method == "draft" else None,
                  speculative=SpecConfig(method=method, num_draft_tokens=k))
        assert llm.target.runtime.whole_prompts and llm.engine_config.chunked_prefill_size == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [o.token_ids for o in outs] == want, method
        if method == "self":  # the draft takes the prompt whole too (its long factors), so it agrees
            assert [o.metrics["acceptance_rate"] for o in outs] == [1, 1]
    with pytest.raises(ValueError, match="prompts go whole"):
        LLM(str(target), chunked_prefill_size=8)


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_phi3_longrope_equal_to_transformers(tmp_path, backend):
    """Phi-3's model (Phi-3.5-mini, Phi-4-mini) drops its cache where a sequence first passes
    its longrope switch (16 here) and computes it all again with the long factors, so each
    output token follows the factors of the sequence's length then. specdec decodes the same
    with every drafter, chains and trees, prompts whole or in chunks, in one batch: the torch
    runtime computes a slot's rows again where its length crosses the switch (and back, for a
    slot reused by a shorter prompt), a prompt past it takes the long factors from its first
    chunk, and no round's rows straddle it; transformers' runtime cuts its forwards there."""
    from tiny import make_tiny
    from transformers import AutoModelForCausalLM

    target = make_tiny(tmp_path / "target", "phi3", seed=3, rope_parameters=LONGROPE,
                       original_max_position_embeddings=16, pad_token_id=0)
    draft = make_tiny(tmp_path / "draft", "llama", seed=7, layers=1)
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    prompts = LONGROPE_PROMPTS
    want = [hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    trees = [("self", 2), ("ngram", 2), ("draft", 2)] if backend == "torch" else []
    for method, topk in [("none", 1), ("self", 1), ("ngram", 1), ("draft", 1), *trees]:
        for chunk in (0, 8) if backend == "torch" else (0,):
            llm = LLM(str(target), draft=str(draft) if method == "draft" else None, chunked_prefill_size=chunk,
                      backend=backend, speculative=SpecConfig(method=method, num_draft_tokens=4, tree_topk=topk))
            assert llm.target.runtime.switch == 16
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            assert [o.token_ids for o in outs] == want, (method, topk, chunk)
            if method == "self" and topk == 1:  # the draft's rows follow the same factors, so it agrees
                assert [o.metrics["acceptance_rate"] for o in outs] == [1, 1, 1]
    if backend == "hf":
        return
    # prompt logprobs of a prompt past the switch, in chunks: the long factors on every row, as
    # transformers' forward of the whole prompt has them
    ids = prompts[2]
    rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [25, vocab]
    llm = LLM(str(target), chunked_prefill_size=8, max_batch_size=1)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    got = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])])
    assert torch.allclose(got, rows[torch.arange(24), torch.tensor(ids[1:])], atol=1e-4)
    # one slot, reused: a long prompt's rows (long factors) by a shorter one that starts the same
    # (its 8 rows computed again, short), then by the long one again
    for p in (ids, ids[:14], ids):
        out = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert out.token_ids == hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)[0, len(p):].tolist()
    assert out.metrics["cached_prompt_tokens"] == 8


@pytest.mark.parametrize("backend", ["hf", "torch"])
def test_conv_state_rewinds(tmp_path, backend):
    """LFM2's short convolutions keep a state per layer that a rewind takes back: on
    transformers' fallback cut with the rows, on the torch runtime from the states kept for
    the last tokens and a few prompt chunks' ends (``recurrent.ShortConv``). A prompt reusing
    fewer kept chunks than the one before it, and drafts rolled back, give what the prompt
    gives alone (on transformers' the conv states are sliced, not cropped to the kernel,
    which left nothing below the crop for the next rewind)."""
    from tiny import make_tiny

    path = make_tiny(tmp_path / "lfm2", "lfm2", layer_types=["conv", "full_attention"])
    shared = list(range(40, 120))
    a, b, c = shared + [5, 6, 7], shared + [9, 9], shared[:40] + [3, 4, 5, 6]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [LLM(str(path), device="cpu", chunked_prefill_size=16, backend=backend).generate(
        {"prompt_token_ids": p}, sp)[0].token_ids for p in (b, c)]
    assert alone == transformers_greedy(path, [b, c], 24)
    llm = LLM(str(path), device="cpu", chunked_prefill_size=16, max_batch_size=1, backend=backend)
    outs = [llm.generate({"prompt_token_ids": p}, sp)[0] for p in (a, b, c)]
    assert [o.token_ids for o in outs[1:]] == alone and [o.metrics["cached_prompt_tokens"] for o in outs] == [0, 80, 32]
    drafted = LLM(str(path), device="cpu", chunked_prefill_size=16, max_batch_size=1, backend=backend,
                  speculative=SpecConfig(method="ngram", num_draft_tokens=4))
    outs = [drafted.generate({"prompt_token_ids": p}, sp)[0] for p in (a, b, c)]
    assert [o.token_ids for o in outs[1:]] == alone


@pytest.mark.parametrize("name,backend", [("windowed", "torch"), ("windowed", "hf"), ("gemma3", "torch"),
                                          ("olmo3", "torch"), ("cohere2", "torch"), ("mixtral", "torch"),
                                          ("gptoss", "torch"), ("deepseek", "torch"), ("pythia", "torch"),
                                          ("llama4", "torch"), ("llama4", "hf"), ("bloom", "torch"),
                                          ("gemma4", "torch"), ("gemma4", "hf"), ("gemma4moe", "torch"),
                                          ("cohere2moe", "torch"), ("mimo", "torch"), ("deepseekv32", "torch"),
                                          ("glm5", "torch"), ("hy4", "torch"), ("gemma3n", "torch"),
                                          ("gemma3n", "hf"), ("jetmoe", "torch")])
def test_windows_and_latents_equal_to_transformers(loaded, tiny_dirs, name, backend):
    """A sliding-window model (Mistral's and Mixtral's, 6 tokens on every layer; Gemma 3's and GPT-OSS's on one of two,
    OLMo 3's and Command R7B's on three of four)
    decodes as transformers' model does, far past the window, plain and under speculation
    (chains; trees on the torch runtime), with prompt chunks kept for the next request
    (rewinds past the window: transformers' own ``crop`` of a window layer keeps only the
    window). So does latent attention (DeepSeek-V3's), whose cache rows are latents: rewound,
    gathered along a tree's accepted path and shared between slots as K and V rows are; and
    Pythia's layers (GPT-NeoX's: no window, a quarter of each head rotated); and Llama 4's chunks of 8
    on three layers of four (a window of the position within its chunk), its queries' temperature on
    the fourth; and BLOOM's ALiBi biases (of each key's position: a tree node's is its depth's); and
    Gemma 4's layers of two head widths, whose last two attend over earlier layers' rows (``tiny.GEMMA4``), with
    experts beside their MLPs too; and Cohere2-MoE's windows on every other layer after a dense first one; and
    MiMo-V2-Flash's windows with sinks and twice the key/value heads, its values narrower than its keys; and
    DeepSeek-V3.2's and GLM-5's sparse attention (each token's best 6 keys by its indexer: its own index rows
    rewound, gathered and shared with the latents, a tree node choosing among the keys it sees), and Hy4's (with
    sinks, under hyper-connections); and Gemma 3n's streams (alternating updates), windows and shared keys; and
    JetMoE's attention experts (each token's queries its chosen experts')."""
    want = transformers_greedy(tiny_dirs[name], [LLM(loaded(name)).encode(p) for p in PROMPTS])
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    # trees: 3 deep, and 8 deep, past the window (a node's row is past its position there)
    methods = [("none", 1, 3), ("self", 1, 3), ("ngram", 1, 3)] + [("self", 2, 3), ("self", 2, 8)] * (backend == "torch")
    for method, topk, k in methods:
        llm = LLM(loaded(name, backend=backend), chunked_prefill_size=4, max_batch_size=3,
                  speculative=SpecConfig(method=method, num_draft_tokens=k, tree_topk=topk))
        for _ in range(2):  # the second time from the prompt chunks the first left
            outs = llm.generate(PROMPTS, sp)
            assert [o.token_ids for o in outs] == want, (method, topk, k)
        assert max(o.metrics["cached_prompt_tokens"] for o in outs) > 0


@pytest.mark.parametrize("name", ["qwen35", "granite4h", "nemotronh", "lfm2", "lfm3", "falconh1", "mamba", "jamba",
                                  "olmohybrid", "kimilinear", "ling", "lara", "zamba2", "recurrentgemma",
                                  "minimax"])
def test_recurrent_model_speculates_as_transformers_decodes(loaded, tiny_dirs, name):
    """Qwen3.5's and OLMo-Hybrid's DeltaNet layers (Kimi Linear's and Ling's, a decay per key channel), Granite 4.0's, Nemotron-H's and Falcon-H1's Mamba-2 layers,
    LFM2's and LFM3's short convolutions (LFM3's beside windowed attention), Falcon-Mamba's and
    Jamba's Mamba layers (a recurrent state per slot,
    rewound through the states kept for its last tokens) decode as transformers' model does,
    plain and under speculation:
    drafts always right (self, 3 and 8 deep; under the cost model, which times forwards and
    rewinds), mostly wrong (a random draft model: most drafts rolled back), the n-gram lookup,
    in batches of 3 with chunked prompts, twice over. Trees (n-gram's, a Llama draft model's) go
    through the states in one forward, their accepted paths kept; the model drafting a tree itself
    is refused, and says why. As a
    draft model (for a Llama target) its own rewinds span several one-token forwards."""
    from specdec.runtime.base import NO_TREES

    want = transformers_greedy(tiny_dirs[name], [LLM(loaded(name)).encode(p) for p in PROMPTS])
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    for method, k, extra in [("none", 1, {}), ("self", 3, {}), ("self", 8, {}), ("self", 4, {"cost_model": True}),
                             ("draft", 4, {}), ("ngram", 3, {})]:
        llm = LLM(loaded(name), draft=loaded("draft") if method == "draft" else None, chunked_prefill_size=4,
                  max_batch_size=3, speculative=SpecConfig(method=method, num_draft_tokens=k, **extra))
        for _ in range(2):
            outs = llm.generate(PROMPTS, sp)
            assert [o.token_ids for o in outs] == want, (method, k)
        if method == "self" and not extra:
            assert min(o.metrics["acceptance_rate"] for o in outs) == 1
    for method in ("ngram", "draft"):
        llm = LLM(loaded(name), draft=loaded("draft") if method == "draft" else None, chunked_prefill_size=4,
                  max_batch_size=3, speculative=SpecConfig(method=method, num_draft_tokens=3, tree_topk=2))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == want, method
        assert sum(o.metrics["drafted_tokens"] for o in outs) > 0, method
    with pytest.raises(ValueError, match="draft-model " + NO_TREES.split(":")[0]):
        LLM(loaded(name), speculative=SpecConfig(method="self", tree_topk=2))
    want = [o.token_ids for o in plain(loaded, "llama", sp=sp)]
    drafted = LLM(loaded("llama"), draft=loaded(name), max_batch_size=3, speculative=SpecConfig(method="draft"))
    assert [o.token_ids for o in drafted.generate(PROMPTS, sp)] == want


@pytest.mark.parametrize("name", ["qwen35", "granite4h", "lfm2", "jamba"])
def test_recurrent_prefix_reuse(loaded, name):
    """Recurrent states are kept at a few of a prompt's chunk ends (the first 3 and the last):
    a new prompt that starts as the slot's last one resumes from the longest whole chunk they
    share that the slot keeps (a conversation's next turn: the last one), with the same output
    as from scratch, plain and under speculation; n completions of one prompt prefill it once
    (the states copied between slots)."""
    size, sp = 4, SamplingParams(max_tokens=10, ignore_eos=True)
    first = PROMPTS[2]
    longer = [first + " and then some more words", first[:30] + " xyz", first]
    for method in ("none", "self"):
        llm = spec(loaded, name, method, k=3, chunked_prefill_size=size, max_batch_size=1)
        n = len(llm.generate(first, sp)[0].prompt_token_ids)
        outs = [llm.generate(p, sp)[0] for p in longer]
        ref = [spec(loaded, name, method, k=3, chunked_prefill_size=size).generate(p, sp)[0] for p in longer]
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], method
        assert [o.metrics["cached_prompt_tokens"] for o in outs] == [n // size * size, 12, 12], method
        shared = spec(loaded, name, method, k=3, chunked_prefill_size=size, max_batch_size=3).generate([longer[0]] * 3, sp)
        assert all(o.token_ids == ref[0].token_ids for o in shared)
        assert sum(o.metrics["cached_prompt_tokens"] for o in shared) > 0


def test_engine_usable_after_a_step_raised(loaded, monkeypatch):
    """An exception (or Ctrl-C) inside ``generate`` drops that call's requests; the next call
    runs from clean slots and drafter state, with the same output as a fresh engine."""
    want = [o.token_ids for o in plain(loaded, "llama")]
    for fail_at in (9, 18, 21):  # in a prefill, a drafting and a verify forward
        llm = spec(loaded, "llama", "self", k=3, chunked_prefill_size=4, max_batch_size=2)
        forward, calls = llm.engine.runtime.forward, [0]

        def failing(*a, **kw):
            calls[0] += 1
            if calls[0] == fail_at:
                raise KeyboardInterrupt
            return forward(*a, **kw)

        monkeypatch.setattr(llm.engine.runtime, "forward", failing)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
        assert not llm.engine.has_work and sorted(llm.engine.free_slots) == [0, 1] and not llm.engine.retained
        drafter = llm.engine.drafters["self"]
        assert not drafter.drafted and not drafter.tail, fail_at  # nothing of the failed round stays
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        monkeypatch.undo()


@pytest.mark.parametrize("how", ["chain", "tree", "hybrid+cost"])
def test_draft_with_a_shorter_context_drafts_while_a_round_fits(loaded, tmp_path, how):
    """A draft model whose context (48) is shorter than the target's (512) leaves the target's
    window alone: it drafts while a round's rows fit in its own context, then the target goes
    on alone. The draft here is the target's weights, so every draft is accepted."""
    from tiny import make_tiny

    from specdec.runtime import load_model

    short = load_model(str(make_tiny(tmp_path / "short", "llama", seed=0, max_position_embeddings=48)), device="cpu")
    spec = SpecConfig(method="hybrid" if how == "hybrid+cost" else "draft", num_draft_tokens=4,
                      tree_topk=2 if how == "tree" else 1, cost_model=how == "hybrid+cost")
    llm = LLM(loaded("llama"), draft=short, speculative=spec)
    assert llm.context_window == 512 and llm.engine.drafters["draft"].max_context == 48
    prompt = {"prompt_token_ids": [40 + i for i in range(20)]}
    want = LLM(loaded("llama")).generate(prompt, GREEDY)[0].token_ids
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == want and len(out.token_ids) == N  # 84 tokens in all, past the draft's 48
    assert llm.engine.drafters["draft"].cache.capacity <= 48 + 32
    if how == "chain":  # rounds at 21, 26, ..., 41 ids; at 46 a round of 4 no longer fits
        assert out.metrics["drafted_tokens"] == out.metrics["accepted_tokens"] == 5 * 4
    sampled = llm.generate(prompt, SamplingParams(max_tokens=N, ignore_eos=True, temperature=1.0, seed=3))[0]
    assert len(sampled.token_ids) == N


def test_kv_cache_stops_growing_at_the_context_window(loaded):
    """A verify forward at the window's end needs a few rows past it (its drafts, a shorter
    chunk's padding): the cache grows by those, not to twice the window."""
    llm = spec(loaded, "llama", "self", k=8, max_batch_size=2, max_model_len=300)
    outs = llm.generate([{"prompt_token_ids": [40 + i % 200 for i in range(260)]}, "abc"], SamplingParams(max_tokens=None, ignore_eos=True))
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in outs] == [300, 300]
    assert 300 <= llm.engine.cache.capacity <= 300 + 32 and llm.engine.drafters["self"].cache.capacity <= 300 + 32
    assert llm.engine.cache.k.shape[1] == 2  # the two slots used, not max_batch_size's 8
    alone = LLM(loaded("llama"))
    alone.generate({"prompt_token_ids": [40 + i % 200 for i in range(300)]}, SamplingParams(max_tokens=4))
    assert alone.engine.cache.k.shape[1] == 1 and alone.engine.cache.capacity >= 300  # one long request: one slot


def test_run_metrics(loaded):
    """Counters add up over a run; times count each engine step once, whatever ran beside it
    (a batch's step was counted once per request, so a run's split summed to several times its
    wall time), and a request's n completions span from the first's admission to the last's
    end (queued ones too: wall_s was the longest completion's own). draft_forwards counts the
    draft model's catch-up forwards too (a forward feeding a long prompt, drafting nothing)."""
    llm = spec(loaded, "llama", "self", k=4)
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, GREEDY)
    took = time.perf_counter() - start
    run = llm.last_run_metrics.to_dict()
    for key in ("target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens"):
        assert run[key] == sum(o.metrics[key] for o in outs)
    for key in ("acceptance_rate", "mean_accepted_length", "accepted_per_position", "tokens_per_s", "wall_s"):
        assert key in run and key in outs[0].metrics
    assert run["tokens_per_s"] > 0
    assert sum(run["time_split_s"].values()) <= run["wall_s"] <= took
    for o in outs:
        assert sum(o.metrics["time_split_s"].values()) <= o.metrics["wall_s"] <= run["wall_s"]
    queued = spec(loaded, "llama", "ngram", k=4, max_batch_size=1)
    start = time.perf_counter()
    four = queued.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True, n=4, temperature=1.0))[0].metrics
    took = time.perf_counter() - start
    assert 0.7 * took <= four["wall_s"] <= took and sum(four["time_split_s"].values()) <= four["wall_s"]
    catching = LLM(loaded("llama"), draft=loaded("draft"), chunked_prefill_size=8,
                   speculative=SpecConfig(method="draft", num_draft_tokens=4))
    drafter, forwards = catching.engine.drafters["draft"], [0]
    forward = drafter.runtime.forward

    def counted(cache, slots, *args, **kw):
        forwards[0] += len(slots) if cache is drafter.cache else 0
        return forward(cache, slots, *args, **kw)

    drafter.runtime.forward = counted
    try:
        out = catching.generate("x" * 50 + "hello", SamplingParams(max_tokens=40, ignore_eos=True))[0]
    finally:
        drafter.runtime.forward = forward
    assert out.metrics["draft_forwards"] == forwards[0]


def test_chunked_prefill_interleaves_with_decoding(loaded):
    """A prompt goes in chunks of ``chunked_prefill_size`` tokens, cut at multiples of that
    size, at most that many prompt tokens per step over all requests, oldest first, while
    running requests decode every step; outputs equal whole-prompt prefill (plain and
    self-drafted, more prompts than slots, hf fallback too), and a request aborted mid-prefill
    frees its slot."""
    long = [PROMPTS[2] * 2, PROMPTS[0] + PROMPTS[2], PROMPTS[1]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    base = LLM(loaded("llama"), chunked_prefill_size=0).generate(long, sp)
    for size, method, backend in [(1, "none", "auto"), (7, "self", "auto"), (16, "none", "auto"),
                                  (7, "ngram", "hf")]:
        llm = LLM(loaded("llama", backend=backend), speculative=SpecConfig(method=method, num_draft_tokens=3),
                  max_batch_size=2, chunked_prefill_size=size)
        outs = llm.generate(long, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], (size, method, backend)
        assert all(o.metrics["time_split_s"]["prefill"] > 0 for o in outs)

    target = loaded("llama")
    eng = Engine(target, None, SpecConfig(), 3, chunked_prefill_size=8)
    tok = target.tokenizer

    def seq(i, text):
        ids = tok(text)["input_ids"]
        return Sequence(i, ids, len(ids), SamplingParams(max_tokens=50, ignore_eos=True),
                        make_generator(0, "cpu"), frozenset())

    a = seq(0, PROMPTS[1])  # 3 tokens: prefilled in one step
    eng.add(a)
    eng.step()
    assert a.num_output == 1
    b, c = seq(1, PROMPTS[2]), seq(2, "x" * 10)  # 60 and 10 tokens
    assert (b.prompt_len, c.prompt_len) == (60, 10)
    eng.add(b)
    eng.add(c)
    seen = []
    while not c.num_output:
        before = a.num_output
        eng.step()
        assert a.num_output == before + 1  # a decodes every step
        seen.append((min(eng.cache.lengths[b.slot], 60), eng.cache.lengths[c.slot]))
    # b's chunks end at multiples of 8; c waits for room in a step's 8 tokens, its chunks too
    assert seen == [(8, 0), (16, 0), (24, 0), (32, 0), (40, 0), (48, 0), (56, 0), (60, 0), (60, 8), (60, 10)]
    assert b.num_output == 3 and b.metrics.target_forwards == 8 + 2
    eng.abort(a)
    d = seq(3, "z" * 30)
    eng.add(d)
    assert eng.step() == [a] and d.slot == -1  # a's slot is freed at the end of the step
    eng.step()  # d takes it, and its first chunk
    assert eng.cache.lengths[d.slot] == 8
    eng.abort(d)
    assert eng.step() == [d] and d.slot in eng.free_slots
    assert eng.cache.lengths[d.slot] == 8 and eng.retained[d.slot] == d.ids[:8]  # its whole chunk stays, for reuse

    # a draft model catches up on a prompt in chunks too, drafting nothing until it has it all
    drafter = ModelDrafter(target.runtime, 1, target.runtime.vocab_size, max_catch_up=8)
    e = seq(4, "y" * 20)
    e.slot = 0
    drafts = [drafter.propose([e], [3])[0].tokens for _ in range(3)]  # feeding 8, 8, then 4 + 2 drafts
    assert [len(d) for d in drafts] == [0, 0, 3] and drafter.cached_ids[0] == e.ids + drafts[2][:2]


def test_penalties_stay_lossless(loaded, tiny_dirs):
    """Repetition, presence and frequency penalties under speculation: greedy output equals
    plain decoding with the same penalties (self-draft, n-gram, a random draft model, token
    trees, a batch), the self-draft accepts every draft (its drafts are picked under the same
    penalised history as the verify rows that check them), the penalties change the output,
    a logit bias of -100 bans a token, and repetition_penalty alone matches transformers'
    generate. Seeded sampling with penalties is reproducible."""
    from transformers import AutoModelForCausalLM

    sp = SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                        frequency_penalty=0.3)
    base = plain(loaded, "llama", PROMPTS, sp)
    assert [o.token_ids for o in base] != [o.token_ids for o in plain(loaded, "llama", PROMPTS, GREEDY)]
    for method, draft, topk in [("self", None, 1), ("ngram", None, 1), ("draft", "draft", 1), ("self", None, 2),
                                ("ngram", None, 2)]:
        llm = LLM(loaded("llama"), draft=loaded(draft) if draft else None,
                  speculative=SpecConfig(method=method, num_draft_tokens=3, tree_topk=topk))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], (method, topk)
        if method == "self" and topk == 1:
            assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)

    top = max(set(base[0].token_ids), key=base[0].token_ids.count)  # banned below
    banned = SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=0.3, logit_bias={top: -100})
    ref = plain(loaded, "llama", PROMPTS, banned)
    assert all(top not in o.token_ids for o in ref)
    for method in ("self", "ngram"):
        outs = spec(loaded, "llama", method, k=3).generate(PROMPTS, banned)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], method

    rep = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.5)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    tok = loaded("llama").tokenizer
    for p, o in zip(PROMPTS, spec(loaded, "llama", "self", k=3).generate(PROMPTS, rep)):
        ids = torch.tensor([tok(p)["input_ids"]])
        ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, repetition_penalty=1.5,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert o.token_ids == ref

    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True, presence_penalty=1.0,
                             repetition_penalty=1.2)
    llm = spec(loaded, "llama", "draft", k=3, draft="draft")
    assert [o.token_ids for o in llm.generate(PROMPTS, sampled)] == [o.token_ids for o in llm.generate(PROMPTS, sampled)]


def test_n_completions_and_logprobs(loaded):
    """``SamplingParams(n=...)``: completion i of a seeded request is the n=1 request with
    seed + i (under speculation too); greedy ones are refused (vLLM's: they would all be the same).
    ``logprobs=N``: the target's log-probability and rank of each output token (the same
    as one full forward over prompt + output), the N most likely tokens, and their sum."""
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    for method in ("none", "self"):
        llm = spec(loaded, "llama", method, k=3)
        many = llm.generate(PROMPTS[:2], SamplingParams(**{**vars(sp), "n": 3}))
        for prompt, o in zip(PROMPTS[:2], many):
            assert [c.index for c in o.outputs] == [0, 1, 2] and o.text == o.outputs[0].text
            for i, c in enumerate(o.outputs):
                alone = llm.generate(prompt, SamplingParams(**{**vars(sp), "seed": 5 + i}))[0]
                assert c.token_ids == alone.token_ids and c.text == alone.text, (method, i)
            assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # the seeds differ
            assert o.metrics["generated_tokens"] == 36 and o.prompt_token_ids == llm.encode(prompt)
    base = plain(loaded, "llama", PROMPTS[:1])[0]
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(max_tokens=N, n=2)
    greedy = spec(loaded, "llama", "ngram").generate(PROMPTS[0], SamplingParams(max_tokens=N, ignore_eos=True,
                                                                                logprobs=3))[0]
    assert greedy.outputs[0].token_ids == base.token_ids
    llm = LLM(loaded("llama"))
    ids = llm.encode(PROMPTS[0])
    rt = llm.target.runtime
    ref = torch.log_softmax(rt.forward(rt.new_cache(1), [0], [ids + base.token_ids])[0].float(), -1)
    ref = ref[len(ids) - 1:len(ids) - 1 + N]  # [N, vocab]: row j predicts output token j
    for c in (greedy.outputs[0], llm.generate(PROMPTS[0], SamplingParams(max_tokens=N, ignore_eos=True,
                                                                        logprobs=3))[0].outputs[0]):
        assert len(c.logprobs) == N
        for j, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert list(entry)[0] == t and entry[t].rank == 1  # greedy: the chosen token is the top one
            assert len(entry) == 3 and [e.rank for e in entry.values()] == [1, 2, 3]
            top = ref[j].topk(3)
            assert [e.logprob for e in entry.values()] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert list(entry) == top.indices.tolist()
            assert entry[t].decoded_token == llm.tokenizer.decode([t])
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    sampled = llm.generate(PROMPTS[0], SamplingParams(max_tokens=N, ignore_eos=True, temperature=1.5,
                                                      seed=1, logprobs=0))[0].outputs[0]
    sampled_ref = torch.log_softmax(rt.forward(rt.new_cache(1), [0], [ids + sampled.token_ids])[0].float(), -1)
    for j, (t, entry) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        row = sampled_ref[len(ids) - 1 + j]
        assert list(entry) == [t] and entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert entry[t].rank == int((row > row[t]).sum()) + 1
    assert any(e[t].rank > 1 for t, e in zip(sampled.token_ids, sampled.logprobs))  # hot sampling leaves the top


def test_max_logprobs_caps_the_alternatives(loaded):
    """vLLM's ``max_logprobs`` (20): ``logprobs`` or ``prompt_logprobs`` asking for more is a
    ValueError; -1 asks for the whole vocabulary, which ``max_logprobs=-1`` allows."""
    llm = LLM(loaded("llama"))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} of 21 is more than the 20 alternatives allowed"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{field: 21}))
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{field: -1}))
    vocab = llm.target.runtime.vocab_size
    wide = LLM(loaded("llama"), max_logprobs=-1).generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=-1,
                                                                                   prompt_logprobs=-1))[0]
    assert [len(e) for e in wide.outputs[0].logprobs] == [vocab] * 2
    assert [len(e) for e in wide.prompt_logprobs[1:]] == [vocab] * (len(wide.prompt_token_ids) - 1)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        LLM(loaded("llama"), max_logprobs=-2)


def test_extreme_sampling_values_draw_real_tokens(loaded):
    """A temperature in (0, 0.01) is raised to 0.01 (vLLM's): 1e-40 overflowed the logits into
    nan, and the draw past the vocabulary crashed the next forward (on the server, every
    request beside it). Logits a tiny repetition penalty blows up stay finite, so every
    drafter draws real tokens from them."""
    assert SamplingParams(temperature=1e-40).temperature == 0.01
    vocab = LLM(loaded("llama")).target.runtime.vocab_size
    for kw in (dict(temperature=1e-40), dict(temperature=1.0, repetition_penalty=1e-39)):
        for method in ("none", "self", "ngram"):
            out = spec(loaded, "llama", method, k=3).generate(PROMPTS[0], SamplingParams(
                max_tokens=12, seed=0, ignore_eos=True, **kw))[0]
            assert len(out.token_ids) == 12 and max(out.token_ids) < vocab, (kw, method)


def test_nan_draft_and_tiny_top_p_draw_real_tokens(loaded, tiny_dirs, tmp_path):
    """A draft model whose logits are nan (an fp16 draft overflowing) drafts nothing, so a
    sampled request decodes as without it (it drew an id past the vocabulary and crashed);
    a top_p below float32's least keeps the top token, as greedy (it kept none)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-draft"
    shutil.copytree(tiny_dirs["draft"], broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"][:] = float("nan")  # every logit nan
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    want = LLM(loaded("llama")).generate(PROMPTS[0], sp)[0].token_ids
    nan = LLM(loaded("llama"), draft=str(broken), speculative=SpecConfig(method="draft", num_draft_tokens=3,
                                                                        draft_quantization="none"))
    out = nan.generate(PROMPTS[0], sp)[0]
    assert out.token_ids == want and out.metrics["acceptance_rate"] in (0.0, None)
    greedy = plain(loaded, "llama", PROMPTS[:1])[0].token_ids
    for method in ("none", "ngram"):
        tiny = spec(loaded, "llama", method, k=3).generate(PROMPTS[0], SamplingParams(
            max_tokens=N, temperature=1.0, top_p=1e-300, seed=0, ignore_eos=True))[0]
        assert tiny.token_ids == greedy, method


def test_stop_token_ids_min_tokens_and_min_p(loaded):
    """``stop_token_ids`` end the output like an EOS (ignore_eos too; the token is kept in
    token_ids, its text left out); ``min_tokens`` keeps EOS, stop tokens and stop strings from
    ending it earlier (greedy: the same as banning the stop token for those steps), and with
    ignore_eos an EOS is not drawn before it either;
    ``min_p`` under speculation: the self-draft accepts every draft. All equal to plain
    decoding under self-drafting and n-gram speculation."""
    base = plain(loaded, "llama", PROMPTS[:1])[0]
    out = base.token_ids
    j = next(j for j in range(4, N) if out[j] not in out[:j])  # the first occurrence of out[j]
    tok = loaded("llama").tokenizer
    stop_tok = SamplingParams(max_tokens=N, ignore_eos=True, stop_token_ids=[out[j]])
    later = next(i for i in range(j + 1, N) if out[i] not in out[:i])  # a token first seen after j
    late = SamplingParams(max_tokens=N, ignore_eos=True, stop_token_ids=[out[4], out[later]], min_tokens=later)
    banned = plain(loaded, "llama", PROMPTS[:1], SamplingParams(max_tokens=later, ignore_eos=True,
                                                                logit_bias={out[4]: -100, out[later]: -100}))[0]
    stop_str = SamplingParams(max_tokens=N, ignore_eos=True, stop=[base.text[2:5]], min_tokens=N)
    text = base.text
    for m in range(2, N):  # a character in the first m tokens' text that comes again after it
        head = tok.decode(out[:m], skip_special_tokens=True)
        again = [c for c in head if c != "\ufffd" and text.find(c, len(head)) > 0] if text.startswith(head) else []
        if again:
            break
    second = SamplingParams(max_tokens=N, ignore_eos=True, stop=[again[0]], min_tokens=m)
    for method in ("none", "self", "ngram"):
        llm = spec(loaded, "llama", method, k=3)
        o = llm.generate(PROMPTS[0], stop_tok)[0]
        assert o.token_ids == out[:j + 1] and o.finish_reason == "stop", method
        assert o.text == settled_text(tok, out[:j], SamplingParams())  # a last incomplete character waits
        o = llm.generate(PROMPTS[0], late)[0]
        assert o.token_ids[:later] == banned.token_ids, method  # no stop before min_tokens
        assert o.finish_reason == "length" or o.token_ids[-1] in late.stop_token_ids
        o = llm.generate(PROMPTS[0], stop_str)[0]  # the stop string is in the first min_tokens' text only
        assert o.token_ids == out and o.finish_reason == "length" and o.text == base.text, method
        o = llm.generate(PROMPTS[0], second)[0]  # the stop string's first occurrence after min_tokens
        assert o.finish_reason == "stop" and o.text == text[:text.find(again[0], len(head))], method
        assert o.token_ids == out[:len(o.token_ids)] and len(o.token_ids) > m
        eos = tok.eos_token_id  # ignore_eos lets an EOS through, but not before min_tokens (vLLM)
        o = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, min_tokens=4, ignore_eos=True, logit_bias={eos: 100}))[0]
        assert eos not in o.token_ids[:4] and o.token_ids[4:] == [eos, eos], method
    sp = SamplingParams(max_tokens=30, temperature=1.0, min_p=0.3, seed=3, ignore_eos=True)
    s1 = spec(loaded, "llama", "self", k=4).generate(PROMPTS, sp)
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in s1)
    assert [o.token_ids for o in s1] != [o.token_ids for o in plain(loaded, "llama", PROMPTS, GREEDY)]


def test_allowed_token_ids_and_bad_words(loaded):
    """vLLM's ``allowed_token_ids`` (nothing else is drawn) and ``bad_words`` (a word's last
    token banned where the output would complete it; only that spot): greedy output equal to
    plain decoding under self, n-gram and random-draft speculation, the self-draft accepting
    every draft; the ids of a word as written and after a space."""
    from specdec.sequence import bad_words_ids

    tok = loaded("llama").tokenizer
    base = plain(loaded, "llama", PROMPTS)
    allowed = sorted(set(base[0].token_ids[:6]) | set(tok.encode("xyz", add_special_tokens=False)))
    def ascii_pair(ids):  # two printable ASCII bytes in a row in an output: a word of two tokens
        text = [tok.decode([t]) for t in ids]
        return next(text[j] + text[j + 1] for j in range(len(ids) - 1)
                    if all(len(c) == 1 and c.isascii() and c.isprintable() and not c.isspace() for c in text[j:j + 2]))

    words = [ascii_pair(b.token_ids) for b in base]  # banned where the output would complete them
    cases = [SamplingParams(max_tokens=N, ignore_eos=True, allowed_token_ids=allowed),
             SamplingParams(max_tokens=N, ignore_eos=True, bad_words=tuple(words))]
    for sp in cases:
        ref = plain(loaded, "llama", PROMPTS, sp)
        for o in ref:
            if sp.allowed_token_ids:
                assert set(o.token_ids) <= set(allowed)
            else:
                assert not any(w in o.text for w in words), (o.text, words)
        assert [o.token_ids for o in ref] != [b.token_ids for b in base]
        for method, draft in (("self", None), ("ngram", None), ("draft", "draft")):
            outs = spec(loaded, "llama", method, k=3, draft=draft).generate(PROMPTS, sp)
            assert [o.token_ids for o in outs] == [r.token_ids for r in ref], method
            if method == "self":
                assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)
    byte = tok.convert_tokens_to_ids
    # bytes here: " ab" is one token more than "ab", so only the word as written counts
    assert bad_words_ids(tok, (" ab",)) == ((byte("a"), byte("b")),)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        LLM(loaded("llama")).generate("abc", SamplingParams(allowed_token_ids=[10 ** 6]))


def test_prompt_logprobs(loaded):
    """``prompt_logprobs=N``: each prompt token's log-probability, rank and the N most likely
    tokens, from the prefill's rows (None for the first token), the same as one full forward
    whether the prompt goes whole or in chunks, and the output unchanged."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    llm = LLM(loaded("llama"))
    ids = llm.encode(PROMPTS[2])
    rt = llm.target.runtime
    ref = torch.log_softmax(rt.forward(rt.new_cache(1), [0], [ids])[0].float(), -1)  # [prompt, vocab]
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    for size, method in [(0, "none"), (5, "none"), (3, "self"), (0, "ngram")]:
        outs = spec(loaded, "llama", method, k=3, chunked_prefill_size=size).generate(PROMPTS, sp)
        o = outs[2]
        assert o.token_ids == base.token_ids and o.prompt_token_ids == ids
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
        for j, (t, entry) in enumerate(zip(ids[1:], o.prompt_logprobs[1:])):
            row = ref[j]
            assert list(entry)[0] == t and entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4), (size, j)
            assert entry[t].rank == int((row > row[t]).sum()) + 1
            assert {a for a, e in entry.items() if e.rank <= 2} == set(row.topk(2).indices.tolist())
        assert all(len(x.prompt_logprobs) == len(x.prompt_token_ids) for x in outs)
    assert LLM(loaded("llama")).generate(PROMPTS[0])[0].prompt_logprobs is None


def test_chat_api(loaded, monkeypatch):
    """``LLM.chat`` as vLLM's: one conversation or several, the same as ``generate`` on the
    messages; ``continue_final_message`` continues the last assistant message (no new turn);
    ``chat_template_kwargs`` reach the template."""
    llm = LLM(loaded("llama"))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ask = [{"role": "user", "content": "hello there"}]
    one = llm.chat(ask, sp)[0]
    templated = llm.tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
    assert one.token_ids == llm.generate(ask, sp)[0].token_ids and one.prompt == templated  # vLLM's: the text
    assert llm.generate(ask, sp)[0].prompt == templated
    assert [o.token_ids for o in llm.chat([ask, ask], sp)] == [one.token_ids] * 2
    started = ask + [{"role": "assistant", "content": "general ken"}]
    cont = llm.chat(started, sp, continue_final_message=True)[0]
    text = llm.tokenizer.decode(cont.prompt_token_ids)
    assert text.endswith("general ken") and text.startswith(llm.tokenizer.decode(llm.encode(ask))[:20])
    seen = []
    apply = llm.tokenizer.apply_chat_template
    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", lambda *a, **kw: seen.append(kw) or apply(*a, **kw))
    llm.chat(ask, sp, chat_template_kwargs={"enable_thinking": False})
    assert seen[-1]["enable_thinking"] is False and seen[-1]["add_generation_prompt"] is True


def test_chat_template_override(loaded):
    """``LLM.chat(chat_template=...)`` (vLLM's) renders with that Jinja template instead of the
    tokenizer's, also for a tokenizer without one."""
    llm = LLM(loaded("llama"))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    out = llm.chat([{"role": "user", "content": "hi"}], sp, chat_template=template)[0]
    assert out.prompt == "[user] hi>"
    assert out.prompt_token_ids == llm.tokenizer("[user] hi>", add_special_tokens=False)["input_ids"]
    assert out.token_ids == llm.generate({"prompt_token_ids": out.prompt_token_ids}, sp)[0].token_ids
    saved, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], sp)
        assert llm.chat([{"role": "user", "content": "hi"}], sp, chat_template=template)[0].prompt == "[user] hi>"
    finally:
        llm.tokenizer.chat_template = saved


def test_logprob_ranks_count_ties_as_vllm():
    """A token's rank counts the tokens at least as likely, itself included (vLLM's): of two
    tied tokens each ranks 2, as bfloat16 logits often tie."""
    from specdec.engine import token_logprobs

    rows = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    assert [e.rank for e in token_logprobs(rows, [0, 1], 0)] == [2, 2]
    assert [e.rank for e in token_logprobs(rows, [1, 2], 0)] == [2, 1]


def test_request_output_as_vllm(loaded):
    """``RequestOutput`` as vLLM's: ``request_id`` a distinct str per request, ``prompt`` the
    prompt's text (None for token ids); ``sampling_params`` any sequence of them, one per prompt."""
    llm = LLM(loaded("llama"))
    sp = SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1.0)
    outs = llm.generate(["abc", {"prompt": "def"}, {"prompt_token_ids": [100, 101]}], sp)
    assert [o.prompt for o in outs] == ["abc", "def", None]
    assert all(isinstance(o.request_id, str) for o in outs) and len({o.request_id for o in outs}) == 3
    params = (SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True))
    by_tuple = llm.generate(PROMPTS[:2], params)
    assert [len(o.token_ids) for o in by_tuple] == [3, 5]
    assert [o.token_ids for o in by_tuple] == [o.token_ids for o in llm.generate(PROMPTS[:2], list(params))]
    assert [o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS[:2]], params)] == \
        [o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS[:2]], list(params))]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=6))[0]
    assert cut.prompt_token_ids == llm.encode(PROMPTS[0])[-6:]  # vLLM's: the prompt's last tokens
    assert cut.token_ids == llm.generate({"prompt_token_ids": cut.prompt_token_ids}, params[1:2] * 1)[0].token_ids[:4]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)
    for bad in ("max_tokens", [params[0], {"max_tokens": 3}]):
        with pytest.raises(ValueError, match="sampling_params must be"):
            llm.generate(PROMPTS[:2], bad)
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate(PROMPTS[:2], params[:1])


def test_llm_seed(loaded):
    """``LLM(seed=S)`` (vLLM's global seed): requests without a seed of their own draw the same
    in every LLM made with S, in the same order; a request's own seed still rules."""
    sp = SamplingParams(max_tokens=24, temperature=50.0, ignore_eos=True)  # near uniform
    runs = [[o.token_ids for o in LLM(loaded("llama"), seed=seed).generate(PROMPTS, sp)]
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    llm = LLM(loaded("llama"), seed=7)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == runs[0]
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] != runs[0]  # the next draws
    own = SamplingParams(max_tokens=24, temperature=50.0, ignore_eos=True, seed=3)
    assert LLM(loaded("llama"), seed=7).generate(PROMPTS[0], own)[0].token_ids == \
        LLM(loaded("llama")).generate(PROMPTS[0], own)[0].token_ids
    assert LLM(loaded("llama"), seed=7).engine_config.seed == 7


def test_serve_seed_flag(tiny_dirs):
    """``specdec serve --seed`` is the LLM's global seed (vLLM's); ``generate --seed`` seeds
    its SamplingParams instead."""
    from specdec.cli import build_parser, make_llm

    args = build_parser().parse_args(["serve", "--model", str(tiny_dirs["llama"]), "--seed", "5"])
    assert make_llm(args).engine_config.seed == 5
    args = build_parser().parse_args(["generate", "--model", str(tiny_dirs["llama"]), "--seed", "5", "--prompt", "x"])
    assert make_llm(args).engine_config.seed is None and args.seed == 5


def test_prefix_reuse(loaded):
    """A finished request's prompt KV stays in its slot, in whole prefill chunks; a new prompt
    that starts the same prefills only the rest (``cached_prompt_tokens``), with the same
    output as from scratch (plain and speculative, more prompts than slots); a draft model
    keeps its prompt KV as well. Not with whole prompts (size 0), nor when prompt logprobs need
    every prompt row, nor on a bare slot, nor with ``enable_prefix_caching=False`` (vLLM's)."""
    size, sp = 4, SamplingParams(max_tokens=10, ignore_eos=True)
    first = PROMPTS[2]
    longer = [first + " and then some more words", first + " xyz", "unrelated prompt here", first]
    for method in ("none", "self", "ngram"):
        llm = spec(loaded, "llama", method, k=3, chunked_prefill_size=size, max_batch_size=2)
        a = llm.generate(first, sp)[0]
        n = len(a.prompt_token_ids)
        assert llm.engine.retained and max(map(len, llm.engine.retained.values())) == n // size * size
        outs = llm.generate(longer, sp)
        ref = [spec(loaded, "llama", method, k=3, chunked_prefill_size=size).generate(p, sp)[0] for p in longer]
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], method
        assert all(r.metrics["cached_prompt_tokens"] == 0 for r in ref)
        cached = [o.metrics["cached_prompt_tokens"] for o in outs]
        assert [o.num_cached_tokens for o in outs] == cached  # vLLM's name
        assert cached[0] == n // size * size and cached[2] == 0  # the unrelated prompt: a bare slot
        assert cached[3] == (n - 1) // size * size  # the same prompt: its last token is prefilled again
        assert outs[0].metrics["target_forwards"] < ref[0].metrics["target_forwards"]
    # the draft model's slot keeps the prompt too: it computes only the rest, but drafts from
    # the round a fresh one would, so that a seeded request draws the same either way
    for sp in (SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40, temperature=1, seed=3)):
        llm = spec(loaded, "llama", "self", k=3, chunked_prefill_size=size, max_batch_size=1)
        llm.generate(first, sp)
        drafter = llm.engine.drafters["self"]
        assert drafter.cached_ids[0] == llm.encode(first)
        fed, forward = [], drafter.runtime.forward
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(drafter.runtime, "forward", lambda cache, slots, tokens, **kw:
                       fed.append(sum(map(len, tokens)) * (cache is drafter.cache)) or forward(cache, slots, tokens, **kw))
            again = llm.generate(longer[0], sp)[0]
        fresh = spec(loaded, "llama", "self", k=3, chunked_prefill_size=size)
        with pytest.MonkeyPatch.context() as mp:
            fresh_fed = []
            mp.setattr(fresh.engine.drafters["self"].runtime, "forward", lambda cache, slots, tokens, **kw:
                       fresh_fed.append(sum(map(len, tokens)) * (cache is fresh.engine.drafters["self"].cache))
                       or forward(cache, slots, tokens, **kw))
            alone = fresh.generate(longer[0], sp)[0]
        assert again.token_ids == alone.token_ids
        assert again.metrics["drafted_tokens"] == alone.metrics["drafted_tokens"]
        assert sum(fed) < sum(fresh_fed)  # the kept prompt rows are not computed again
        assert again.metrics["target_forwards"] < alone.metrics["target_forwards"]
    whole = LLM(loaded("llama"), chunked_prefill_size=0)
    whole.generate(first, sp)
    assert not whole.engine.retained and whole.generate(first, sp)[0].metrics["cached_prompt_tokens"] == 0
    llm = LLM(loaded("llama"), chunked_prefill_size=size)
    llm.generate(first, sp)
    scored = llm.generate(first, SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert scored.metrics["cached_prompt_tokens"] == 0 and len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    off, on = (spec(loaded, "llama", "self", k=3, chunked_prefill_size=size, max_batch_size=2, enable_prefix_caching=c)
               for c in (False, None))  # None: vLLM's default, on
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    for llm in (off, on):
        llm.generate([first] * 2, greedy)  # both slots
    drafter = off.engine.drafters["self"]
    assert not off.engine.retained and not off.engine.shares_chunks
    assert drafter.cached_ids == [[], []] and not drafter.can_copy
    a, b = (llm.generate([longer[0]] * 2, greedy) for llm in (off, on))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.metrics["cached_prompt_tokens"] for o in a) == 0 < sum(o.metrics["cached_prompt_tokens"] for o in b)


def test_n_completions_share_the_draft_prefill(loaded, monkeypatch):
    """``n`` completions of one prompt: the draft model catches up on the prompt once (one
    computes it, the others copy its rows), with the same outputs as when each catches up
    alone."""
    sp = SamplingParams(max_tokens=10, n=3, temperature=0.9, seed=5, ignore_eos=True)
    runtime = loaded("draft").runtime
    forward = runtime.forward

    def run(share: bool, chunk: int | None = None, copies: int = 1):
        llm = LLM(loaded("llama"), draft=loaded("draft"), speculative=SpecConfig(method="draft", num_draft_tokens=3),
                  chunked_prefill_size=chunk)
        drafter, fed = llm.engine.drafters["draft"], []
        if not share:
            monkeypatch.setattr(drafter, "_leaders", lambda seqs, feed: (list(range(len(seqs))), [0] * len(seqs)))
            monkeypatch.setattr(drafter, "_copy_longest", lambda seq: None)

        def counting(cache, slots, tokens, **kw):  # draft tokens fed per forward
            fed.append(sum(map(len, tokens)))
            return forward(cache, slots, tokens, **kw)

        monkeypatch.setattr(runtime, "forward", counting)
        outs = llm.generate([PROMPTS[2]] * copies, sp)  # n completions, or the prompt in several requests
        return [c.token_ids for o in outs for c in o.outputs], fed, len(outs[0].prompt_token_ids)

    shared, fed, n = run(True)
    alone, fed_alone, _ = run(False)
    assert shared == alone and len({tuple(t) for t in shared}) == 3  # the same three different answers
    # the prompt once, then the other two their first tokens, instead of the prompt 3 times
    assert fed_alone[0] == 3 * (n + 1) and fed[:2] == [n + 1, 2]
    assert sum(fed_alone) - sum(fed) == 3 * (n + 1) - (n + 1) - 2
    # in chunks of 16 the 2nd and 3rd completion run a step behind the 1st and copy what it
    # fed; they then draft sooner, which changes which rounds draw what (a sampled answer is
    # the same only in distribution), so greedy here (3 requests: greedy n > 1 is refused, as
    # vLLM's): every answer is the target's own
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    shared, fed, n = run(True, 16, copies=3)
    alone, fed_alone, _ = run(False, 16, copies=3)
    target = LLM(loaded("llama")).generate(PROMPTS[2], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    assert shared == alone == [target] * 3
    assert sum(fed_alone) - sum(fed) > n  # most of two prompts


def test_running_requests_share_prompt_chunks(loaded):
    """Requests running together whose prompts start alike (``n`` completions, a shared
    system prompt) prefill each whole shared chunk once: one computes it, the others copy
    its KV (the torch runtime and the hf fallback), with the same outputs as alone."""
    size = 4
    p = PROMPTS[2]
    sp = SamplingParams(max_tokens=8, n=3, temperature=0.9, seed=5, ignore_eos=True)
    shared = [p + " one", p + " two two", "unrelated"]
    for backend, method in [("auto", "none"), ("auto", "self"), ("hf", "none")]:
        model = loaded("llama", backend=backend)
        llm = LLM(model, speculative=SpecConfig(method=method, num_draft_tokens=3), chunked_prefill_size=size,
                  max_batch_size=4)
        o = llm.generate(p, sp)[0]
        alone = [LLM(model, speculative=SpecConfig(method=method, num_draft_tokens=3), chunked_prefill_size=size)
                 .generate(p, SamplingParams(**{**vars(sp), "n": 1, "seed": 5 + i}))[0] for i in range(3)]
        assert [c.token_ids for c in o.outputs] == [a.token_ids for a in alone], (backend, method)
        n = len(o.prompt_token_ids)
        assert o.metrics["cached_prompt_tokens"] == 2 * ((n - 1) // size * size)  # the 2nd and 3rd copy
        assert o.metrics["target_forwards"] < sum(a.metrics["target_forwards"] for a in alone)
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        outs = LLM(model, chunked_prefill_size=size, max_batch_size=4).generate(shared, greedy)
        ref = [LLM(model, chunked_prefill_size=size).generate(q, greedy)[0] for q in shared]
        assert [x.token_ids for x in outs] == [r.token_ids for r in ref], backend
        assert outs[1].metrics["cached_prompt_tokens"] > 0 and outs[2].metrics["cached_prompt_tokens"] == 0

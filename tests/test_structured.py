"""Structured outputs: a grammar mask on every row the target scores, so speculation stays
lossless against the constrained target (greedy equality with every drafter, the
constrained distribution by chi-square)."""
import json
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec import LLM, SamplingParams, SpecConfig, StructuredOutputs
from specdec.structured import chain_masks

PROMPTS = ["Hello world, this is a test of speculative decoding", "abc",
           "The quick brown fox jumps over the lazy dog. The quick brown"]
REGEX = r"[ab]{3}-[0-9]{2}(x|yz)"
CHOICE = ["aa", "ab", "ba", "bbb", "c"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
          "x-guidance": {"whitespace_flexible": False}}  # llguidance's option: no free whitespace
LARK = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
CASES = {"regex": StructuredOutputs(regex=REGEX), "choice": StructuredOutputs(choice=CHOICE),
         "json": StructuredOutputs(json=SCHEMA), "grammar": StructuredOutputs(grammar=LARK)}


def follows(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICE
    if kind == "json":
        obj = json.loads(text)
        return set(obj) == {"a", "b"} and 0 <= obj["a"] <= 99 and obj["b"] in ("x", "y")
    return re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text) is not None


def test_structured_outputs_config():
    assert StructuredOutputs(json={"type": "object"}).json == '{"type": "object"}'
    assert StructuredOutputs(json_object=True).kind == "json_object"
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sp.structured_outputs == StructuredOutputs(choice=("a", "b"))
    hash(sp)
    for kw, msg in [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                    ({"json": "{not json"}, "not a JSON schema"), ({"json": "[1]"}, "JSON object"),
                    ({"choice": "ab"}, "list of strings"), ({"choice": []}, "at least one"),
                    ({"regex": ""}, "non-empty")]:
        with pytest.raises(ValueError, match=msg):
            StructuredOutputs(**kw)
    with pytest.raises(ValueError, match="StructuredOutputs"):
        SamplingParams(structured_outputs="json")


def test_invalid_constraint_is_a_value_error(loaded):
    llm = LLM(loaded("llama"))
    for so, field in [(StructuredOutputs(regex="(ab"), "regex"), (StructuredOutputs(grammar="start: nowhere"), "grammar"),
                      (StructuredOutputs(json={"type": "nonsense"}), "json")]:
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            llm.generate("abc", SamplingParams(structured_outputs=so))


def test_schema_objects_take_only_their_properties(loaded):
    """An object schema that lists its properties takes no others unless it says so (vLLM's
    default backend and OpenAI's strict mode): sampled answers to a random model hold only
    the declared keys; an object without properties, or one allowing more, stays open."""
    import json

    from specdec.structured import closed_objects

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "properties": {"type": "object"},
                                               "b": {"type": "object", "properties": {"c": {"enum": [{"x": 1}]}}}},
              "$defs": {"d": {"type": "object", "properties": {"e": {"type": "string"}}, "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["b"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]  # no properties: free-form
    assert closed["properties"]["b"]["properties"]["c"] == {"enum": [{"x": 1}]}  # values left alone
    assert closed["$defs"]["d"]["additionalProperties"] is True and "additionalProperties" not in closed["properties"]
    # properties that add up with others' stay open: allOf branches, an object beside its
    # combinators and their branches; alternatives alone are closed each
    parts = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert "additionalProperties" not in json.dumps(closed_objects(parts))
    beside = {"type": "object", "properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]}
    assert "additionalProperties" not in json.dumps(closed_objects(beside))
    alone = closed_objects({"anyOf": [{"type": "object", "properties": {"a": {}}}]})
    assert alone["anyOf"][0]["additionalProperties"] is False
    person = {"allOf": [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                        {"type": "object", "properties": {"m": {"type": "integer"}}, "required": ["m"]}]}
    based = {"$defs": {"Base": person["allOf"][0]}, "allOf": [{"$ref": "#/$defs/Base"}, person["allOf"][1]]}
    nested = {"type": "object", "properties": {"x": {"$defs": {"Base": person["allOf"][0]},  # definitions below the root
                                                   "allOf": [{"$ref": "#/properties/x/$defs/Base"}, person["allOf"][1]]}}}
    from specdec.structured import extended_refs
    x = closed_objects(nested, opened=extended_refs(nested))["properties"]["x"]
    assert "additionalProperties" not in json.dumps(x)
    for schema in (person, based):  # the extended part in place, or a definition
        out = LLM(loaded("llama")).generate("abc", SamplingParams(max_tokens=40, structured_outputs={"json": schema}))[0]
        assert out.finish_reason == "length" or {"n", "m"} <= set(json.loads(out.text))  # was "unsatisfiable"
    so = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    sp = SamplingParams(max_tokens=60, temperature=1.5, n=8, seed=3, structured_outputs=so)
    texts = [c.text for c in LLM(loaded("llama")).generate("abc", sp)[0].outputs]
    assert all(set(json.loads(t)) <= {"a"} for t in texts if t.rstrip().endswith("}")), texts


@pytest.mark.parametrize("kind", list(CASES))
def test_greedy_constrained_output_equal_under_speculation(loaded, kind):
    """The text follows the constraint, and every drafter (self, n-gram and a random draft
    model, chains and trees) gives plain decoding's constrained output; the self-draft,
    drafting under the same grammar, has every draft accepted."""
    sp = SamplingParams(max_tokens=40, structured_outputs=CASES[kind])
    base = LLM(loaded("llama")).generate(PROMPTS, sp)
    for o in base:
        assert o.finish_reason == "stop" and follows(kind, o.text), o.text
    assert [o.text for o in base] != [o.text for o in LLM(loaded("llama")).generate(PROMPTS, SamplingParams(max_tokens=40))]
    for method, draft, topk in [("self", None, 1), ("ngram", None, 1), ("draft", "draft", 1), ("self", None, 2),
                                ("ngram", None, 2), ("draft", "draft", 2), ("hybrid", "draft", 1)]:
        llm = LLM(loaded("llama"), draft=loaded(draft) if draft else None,
                  speculative=SpecConfig(method=method, num_draft_tokens=3, tree_topk=topk))
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], (method, topk)
        if method == "self" and topk == 1:
            assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs if o.metrics["drafted_tokens"])


def test_long_choice_lists_and_odd_strings(loaded):
    """A choice of thousands of strings (llguidance's own choice format fails past 2000: its
    matcher errs, which ended the output with EOS and "stop"), and strings that need escaping."""
    odd = ['say "hi"', "back\\slash", "line\nbreak", "été ✓", "del\x7f"]
    choices = [f"item{i:05d}" for i in range(3000)] + odd
    llm = LLM(loaded("llama"), speculative=SpecConfig(method="ngram"))
    for extra in ({}, {"logit_bias": {ord('"') if ord('"') < 256 else 0: 5.0}}):
        out = llm.generate("abc", SamplingParams(max_tokens=30, structured_outputs={"choice": choices}, **extra))[0]
        assert out.text in choices and out.finish_reason == "stop", out.text
    texts = {o.text for o in llm.generate(["abc", "xyz", "q"], SamplingParams(
        max_tokens=20, temperature=1.0, seed=1, n=8, structured_outputs={"choice": odd}))[0].outputs}
    assert texts <= set(odd) and texts


def test_grammar_end_with_ignore_eos_under_trees(loaded):
    """With ``ignore_eos`` the output goes on past the grammar's end, with EOS only (the text
    stays the grammar's); a tree that drafts past the end gives plain decoding's tokens (its
    rows after a drafted EOS were left free)."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True, structured_outputs=StructuredOutputs(choice=["ab", "c"]))
    base = LLM(loaded("llama")).generate(PROMPTS, sp)
    for o in base:
        assert o.text in ("ab", "c") and set(o.token_ids[len(o.text):]) == {257}, o.token_ids
    for method, draft, topk in [("self", None, 2), ("draft", "draft", 2), ("self", None, 1), ("ngram", None, 2)]:
        llm = LLM(loaded("llama"), draft=loaded(draft) if draft else None,
                  speculative=SpecConfig(method=method, num_draft_tokens=4, tree_topk=topk))
        assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in base], (method, topk)


def test_matcher_masks_each_row_after_its_drafts(loaded):
    """Row i's mask follows the drafts before it; a row behind a forbidden draft allows
    everything (never reached), and the matcher is back at the committed output after."""
    llm = LLM(loaded("llama"))
    m = llm.grammars.matcher(StructuredOutputs(regex=REGEX))
    tok = llm.tokenizer
    a, b, dash, x = (tok.convert_tokens_to_ids(c) for c in "ab-x")
    before = m.allowed([[]])
    rows = m.allowed([[], [a], [a, b], [a, b, x], [a, b, x, dash]])  # x is forbidden third
    assert rows.shape == (5, llm.target.runtime.vocab_size)
    assert set(rows[0].nonzero()[:, 0].tolist()) == {a, b}
    assert rows[3].all() and rows[4].all()
    assert torch.equal(m.allowed([[]]), before)
    assert m.valid_prefix([a, b, x, dash]) == 2 and m.valid_prefix([a, b, a, dash]) == 4
    other = llm.grammars.matcher(StructuredOutputs(choice=CHOICE))
    chains = [(m, [a, b, x, dash]), (other, []), (other.copy(), [a, b])]
    for (matcher, drafts), rows in zip(chains, chain_masks(chains)):  # all at once, llguidance's threads
        assert torch.equal(rows, matcher.allowed([drafts[:i] for i in range(len(drafts) + 1)]))
    m.advance([a, b, a])
    assert m.allowed([[]])[0].nonzero()[:, 0].tolist() == [dash]


def test_regex_classes_are_ascii(loaded):
    """``\\d`` and ``\\w`` in a regex are ASCII, as vLLM's default backend (xgrammar) reads them:
    llguidance's Rust syntax takes any Unicode digit, and a model pushed towards the Arabic-Indic
    three (bytes d9 a3 here) wrote it for ``\\d``."""
    from specdec.structured import ascii_classes

    cases = {r"\d{3}-\d": "[0-9]{3}-[0-9]", r"[\d_]+\W": "[0-9_]+[^0-9A-Za-z_]", r"[^\D]": r"[^\D]",
             r"\\d": r"\\d", r"[]\d]\d": "[]0-9][0-9]", r"[[a-z]\d]\w": "[[a-z]0-9][0-9A-Za-z_]",
             r"\p{L}\s\.": r"\p{L}\s\."}
    assert {r: ascii_classes(r) for r in cases} == cases
    llm = LLM(loaded("llama"))
    digits = {llm.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"}
    for regex in (r"\d{2}", r"[\d]{2}", r"\w"):
        first = set(llm.grammars.matcher(StructuredOutputs(regex=regex)).allowed([[]])[0].nonzero()[:, 0].tolist())
        assert digits <= first, regex
        assert all(llm.tokenizer.decode([t]).isascii() for t in first), regex
    out = llm.generate("x", SamplingParams(max_tokens=4, logit_bias={llm.tokenizer.encode("\u0663")[0]: 100},
                                           structured_outputs=StructuredOutputs(regex=r"\d{2}")))[0]
    assert re.fullmatch("[0-9]{2}", out.text), out.text


def test_gated_matcher_leaves_the_reasoning_free(loaded):
    """With a gate (a reasoning's end), rows before it allow everything and the grammar
    starts right after it, in committed output and in drafts alike, across commits that split
    the gate; chain_masks agree with allowed; a copy keeps the state."""
    llm = LLM(loaded("llama"))
    tok = llm.tokenizer
    a, b, x, dash, lt, gt = (tok.convert_tokens_to_ids(c) for c in "abx-<>")
    m = llm.grammars.matcher(StructuredOutputs(regex=REGEX), "<x>")
    plain = llm.grammars.matcher(StructuredOutputs(regex=REGEX))
    first = set(plain.allowed([[]])[0].nonzero()[:, 0].tolist())  # {a, b}
    rows = m.allowed([[], [x], [lt, x], [lt, x, gt], [lt, x, gt, a], [b, lt, x, gt, x]])
    assert rows[0].all() and rows[1].all() and rows[2].all()
    assert set(rows[3].nonzero()[:, 0].tolist()) == first and torch.equal(rows[4], plain.allowed([[a]])[0])
    assert rows[5].all()  # behind a draft the grammar forbids (x after the gate): never reached
    assert m.opens_after([b, lt, x, gt, a]) == 4 and m.opens_after([lt, x]) is None
    assert m.valid_prefix([x, x, lt, x, gt, a, x]) == 6
    chains = [(m, [b, lt, x, gt, a, b]), (m.copy(), [x, x]), (plain, [a, b])]
    for (matcher, drafts), rows in zip(chains, chain_masks(chains)):
        assert torch.equal(rows, matcher.allowed([drafts[:i] for i in range(len(drafts) + 1)]))
    m.advance([b, b, lt, x])  # the gate split across two commits
    twin = m.copy()
    assert m.allowed([[]])[0].all() and m.opens_after([gt]) == 1
    m.advance([gt, a])
    assert m.gate == "" and torch.equal(m.allowed([[]]), plain.allowed([[a]]))
    assert twin.opens_after([gt]) == 1 and twin.allowed([[gt]])[0].nonzero()[:, 0].tolist() == sorted(first)


def test_reasoning_then_grammar_under_speculation(loaded, monkeypatch):
    """A request whose grammar waits for its reasoning's end (here a character plain
    decoding writes stands in for ``</think>``): the output up to that token is the free
    output's, the rest follows the regex, and every drafter gives plain decoding's tokens."""
    import specdec.api

    sp = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex=REGEX))
    free = LLM(loaded("llama")).generate(PROMPTS[0], SamplingParams(max_tokens=30))[0].token_ids
    tok = loaded("llama").tokenizer
    at = next(i for i in range(3, len(free)) if (t := tok.decode([free[i]])).isascii() and t.isprintable()
              and t not in tok.decode(free[:i]))  # a character the free output writes first there
    monkeypatch.setattr(specdec.api, "grammar_gate", lambda tokenizer, ids, parser: tok.decode([free[at]]))

    def run(llm):
        seqs = llm.make_sequences(PROMPTS[0], sp, reasoning="qwen3")
        for s in seqs:
            llm.engine.add(s)
        while llm.engine.has_work:
            llm.engine.step()
        return seqs[0].output_ids

    base = run(LLM(loaded("llama")))
    cut = at + 1
    assert base[:cut] == free[:cut] and re.fullmatch(REGEX, tok.decode(base[cut:-1]))
    for method, draft, topk in [("self", None, 1), ("ngram", None, 1), ("draft", "draft", 1), ("self", None, 2)]:
        llm = LLM(loaded("llama"), draft=loaded(draft) if draft else None,
                  speculative=SpecConfig(method=method, num_draft_tokens=3, tree_topk=topk))
        assert run(llm) == base, (method, topk)


def test_ngram_match_the_grammar_forbids_is_no_match(loaded):
    """An n-gram match whose first draft the grammar forbids counts as no match, so hybrid
    drafts with the model on that step instead of verifying nothing."""
    from specdec.drafters.ngram import NgramDrafter

    llm = LLM(loaded("llama"))
    for regex, ready in (("[0-9]+", False), ("z[0-9]*", True)):
        seq = llm.make_sequences("xyzxy", SamplingParams(structured_outputs={"regex": regex}))[0]
        assert (NgramDrafter().context(seq) is not None) == ready, regex  # the lookup drafts "z"
    assert NgramDrafter().context(llm.make_sequences("xyzxy", SamplingParams())[0]) is not None
    # a tree's branches stop before their first forbidden draft: "xyzxyq...xyw...": after "xy",
    # the matches continue with z, q and w; the regex allows only branches that start with q
    seq = llm.make_sequences("xyzxyqxywxy", SamplingParams(structured_outputs={"regex": "q[a-z]*"}))[0]
    free = llm.make_sequences("xyzxyqxywxy", SamplingParams())[0]
    trees = [NgramDrafter(branches=3).propose([s], [3])[0] for s in (free, seq)]
    tok = llm.tokenizer
    firsts = [{tok.decode([d.tree.tokens[c]]) if d.tree else tok.decode(d.tokens[:1])
               for c in (d.tree.children[0] if d.tree else [0])} for d in trees]
    assert firsts[0] == {"z", "q", "w"} and firsts[1] == {"q"}


def test_grammar_wins_over_an_empty_allowed_set(loaded):
    """allowed_token_ids that the grammar forbids everywhere would leave no token: those rows
    follow the grammar alone (the same under speculation)."""
    tok = LLM(loaded("llama")).tokenizer
    sp = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(choice=["ab"]),
                        allowed_token_ids=tok.encode("xyz", add_special_tokens=False))
    for method in ("none", "ngram", "self"):
        o = LLM(loaded("llama"), speculative=SpecConfig(method=method)).generate("abc", sp)[0]
        assert o.text == "ab" and o.finish_reason == "stop", method
        assert method != "self" or o.metrics["acceptance_rate"] == 1.0


def test_grammar_wins_over_min_tokens(loaded):
    """A complete grammar allows only EOS; min_tokens does not ban it then (the row would be
    empty), so the output ends."""
    sp = SamplingParams(max_tokens=20, min_tokens=10, structured_outputs=StructuredOutputs(choice=["ab"]))
    for method in ("none", "ngram", "self"):
        o = LLM(loaded("llama"), speculative=SpecConfig(method=method)).generate("abc", sp)[0]
        assert o.text == "ab" and o.finish_reason == "stop", method


def constrained_probs(model, prompt_ids: list[int], choices: list[list[int]], eos: int, temperature: float) -> np.ndarray:
    """Exact probability of each choice (token ids, then EOS) under the target with the
    choice grammar's masks at every step, by teacher forcing."""
    out = []
    for c in choices:
        logp = 0.0
        seq = c + [eos]
        for i, t in enumerate(seq):
            allowed = {d[i] for d in choices if d[:i] == c[:i] and len(d) > i} | ({eos} if i == len(c) else set())
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + c[:i]])).logits[0, -1] / temperature
            mask = torch.full_like(logits, float("-inf"))
            mask[sorted(allowed)] = 0
            logp += float((logits + mask).log_softmax(-1)[t])
        out.append(np.exp(logp))
    return np.array(out)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_constrained_distribution_is_exact(loaded, tiny_dirs, method):
    """Sampling under a choice grammar with speculation (a random draft model's q, or the
    n-gram's one-hot drafts) draws each choice with its exact constrained probability:
    chi-square goodness of fit at alpha = 0.001 over 768 samples."""
    from transformers import AutoModelForCausalLM

    temperature, n = 2.0, 768
    llm = LLM(loaded("llama"), draft=loaded("draft") if method == "draft" else None,
              speculative=SpecConfig(method=method, num_draft_tokens=3), max_batch_size=32)
    tok = llm.tokenizer
    prompt = tok("aabbbabaacbbbab")["input_ids"]  # the n-gram finds drafts here
    choices = [tok(c, add_special_tokens=False)["input_ids"] for c in CHOICE]
    expected = constrained_probs(AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval(), prompt, choices,
                                 tok.eos_token_id, temperature)
    assert expected.sum() == pytest.approx(1.0, abs=1e-4) and expected.min() * n > 5
    sps = [SamplingParams(max_tokens=8, temperature=temperature, seed=j * n // 16, n=n // 16,
                          structured_outputs=StructuredOutputs(choice=CHOICE)) for j in range(16)]  # n seeds
    outs = llm.generate([{"prompt_token_ids": prompt}] * 16, sps)
    texts = [c.text for o in outs for c in o.outputs]
    counts = np.array([texts.count(c) for c in CHOICE])
    assert counts.sum() == n
    print(f"{method}: observed {counts / n}, expected {expected}")
    drafted = sum(o.metrics["drafted_tokens"] for o in outs)
    assert drafted > 0 and sum(o.metrics["accepted_tokens"] for o in outs) < drafted  # rejections happened
    assert chisquare(counts, expected / expected.sum() * n).pvalue > 1e-3, (counts / n, expected)


def test_structured_outputs_on_the_hf_fallback(loaded):
    """transformers' own model (the hf backend): the same constrained output as the torch
    runtime, plain and with n-gram drafts."""
    sp = SamplingParams(max_tokens=40, structured_outputs=CASES["grammar"])
    ref = [o.token_ids for o in LLM(loaded("llama")).generate(PROMPTS, sp)]
    for method in ("none", "ngram"):
        outs = LLM(loaded("llama", "hf"), speculative=SpecConfig(method=method, num_draft_tokens=3)).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == ref, method


def think_tokenizer():
    """The tiny models' byte tokenizer with merges that spell ``</think>`` in 4 tokens ("</",
    "th", "ink", ">", ids 258-261 in the models' padded rows) as well as in 8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257, "</": 258, "th": 259, "in": 260, "ink": 261})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("<", "/"), ("t", "h"), ("i", "n"), ("in", "k")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("method", ["none", "self", "ngram"])
def test_reasoning_end_spelled_any_way_opens_the_grammar(tiny_dirs, tmp_path, method):
    """However the model spells ``</think>`` (its 4 merged tokens or its 8 bytes: the
    reasoning parser splits the text at either), the grammar starts right after it."""
    from specdec.answer import grammar_gate
    from specdec.runtime import load_model

    tok = think_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    llm = LLM(load_model(str(tiny_dirs["llama"]), device="cpu", tokenizer=str(tmp_path / "tok")),
              speculative=SpecConfig(method=method, num_draft_tokens=3))
    merged = tok.encode("</think>", add_special_tokens=False)
    spelled = [tok.convert_tokens_to_ids(c) for c in "</think>"]
    assert len(merged) == 4 and len(spelled) == 8 and tok.decode(spelled) == tok.decode(merged) == "</think>"
    assert grammar_gate(tok, tok.encode("hi")) == "</think>"
    def writing(spelling):  # a logits processor: the reasoning's end first, then the model's choice
        def write(output, logits):
            if len(output) < len(spelling):
                logits = torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([spelling[len(output)]]), 0)
            return logits
        return write

    for spelling in (merged, spelled):
        sp = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputs(regex="[0-9]{4}"),
                            logits_processors=[writing(spelling)])
        seqs = llm.make_sequences("a number?", sp, reasoning="qwen3")
        llm.engine.add(seqs[0])
        while llm.engine.has_work:
            llm.engine.step()
        out = seqs[0].output_ids
        assert out[:len(spelling)] == spelling and re.fullmatch("[0-9]{4}", tok.decode(out[len(spelling):-1])), out


def test_head_narrower_than_the_tokenizer(tmp_path):
    """Apertus 1.5's head is pruned to the text tokens, narrower than its tokenizer (which holds its
    image tokens too): the grammar's token table is the tokenizer's, its masks the head's width. The
    constrained output follows the grammar, equal under speculation."""
    from tiny import VOCAB, byte_tokenizer, make_tiny

    tok = byte_tokenizer()
    tok.add_tokens([f"<image_{i}>" for i in range(VOCAB - len(tok))], special_tokens=True)  # ids past the head
    head = VOCAB - 6
    assert len(tok) == VOCAB > head
    path = make_tiny(tmp_path / "apertus15", "apertus1p5_text", seed=5, head_dim=16, output_vocab_size=head,
                     tokenizer=tok)
    sp = SamplingParams(max_tokens=40, structured_outputs=CASES["regex"])
    base = LLM(str(path)).generate(PROMPTS, sp)
    assert all(o.finish_reason == "stop" and follows("regex", o.text) for o in base), [o.text for o in base]
    outs = LLM(str(path), speculative=SpecConfig(method="ngram", num_draft_tokens=3)).generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]

"""Drafters in isolation: n-gram lookup rules, EOS and budget limits."""
import torch

from specdec.config import SamplingParams
from specdec.drafters import ModelDrafter, NgramDrafter, lookup
from specdec.sampling import make_generator
from specdec.sequence import Sequence


def seq(ids, eos=(), slot=0, sp=SamplingParams()):
    return Sequence(1, list(ids), 1, sp, make_generator(0, "cpu"), frozenset(eos), slot=slot)


def test_lookup_prefers_longest_ngram_then_most_recent():
    #        0  1  2  3  4  5  6  7  8  9
    ids = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3]
    # suffix [2, 3] (n=2) occurs at 1 -> continuation [9, 1, 2]; n=3 suffix [8?] absent
    assert lookup(ids, 3, n_max=3, n_min=1) == [9, 1, 2]
    # with only n=1, suffix [3] occurs at 2 -> [9, 1]
    assert lookup(ids, 2, n_max=1, n_min=1) == [9, 1]
    # most recent earlier occurrence of [2] is index 3 (index 6 is the suffix) -> [4, 7]
    assert lookup([5, 2, 6, 2, 4, 7, 2], 2, n_max=1, n_min=1) == [4, 7]
    assert lookup([1, 2, 3], 4, n_max=3, n_min=1) == []  # no earlier occurrence
    assert lookup([4], 4, n_max=3, n_min=1) == []


def test_lookup_prefers_a_full_continuation():
    ids = [7, 8, 9, 10, 11, 7, 8, 7]  # [7] occurs at 5 (continuation [8, 7]) and 0 (full)
    assert lookup(ids, 4, n_max=1, n_min=1) == [8, 9, 10, 11]
    assert lookup(ids, 2, n_max=1, n_min=1) == [8, 7]  # the most recent already has k


def test_lookup_equals_a_scan_of_every_position():
    """The vectorized lookups against the rule spelled out as a loop over every earlier start,
    most recent first, on short random texts of small vocabularies (many overlapping matches)."""
    import random

    from specdec.drafters.ngram import lookup_branches

    def scan(ids, k, n_max, n_min):  # -> per n (longest first): continuations, most recent first
        L = len(ids)
        return [[ids[s + n: s + n + k] for s in range(L - n - 1, -1, -1) if ids[s: s + n] == ids[L - n:]]
                for n in range(min(n_max, L - 1), n_min - 1, -1)]

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randrange(40))]
        k, n_min = rng.randrange(1, 9), rng.randrange(1, 4)
        n_max, branches = rng.randrange(n_min, 6), rng.randrange(1, 5)
        found = [conts for conts in scan(ids, k, n_max, n_min) if conts]
        # the first n with a match: its most recent full continuation, else its longest
        want = next((c for c in found[0] if len(c) == k), max(found[0], key=len)) if found else []
        assert lookup(ids, k, n_max, n_min) == want, (ids, k, n_max, n_min)
        distinct = []
        for c in (c for conts in found for c in conts):
            if c not in distinct:
                distinct.append(c)
        assert lookup_branches(ids, k, n_max, n_min, branches) == distinct[:branches]


def test_id_array_follows_the_ids():
    """The n-gram drafter's numpy view of a sequence's ids: grown by each commit (past its
    buffer too), and after a cut (``Sequence.cut``) by what follows it, a cut by 2 then 3 more
    included; the drafter's lookups through it equal the lookups on the list."""
    import random

    from specdec.drafters.ngram import longest_match
    rng = random.Random(0)
    s, d = seq([rng.randrange(5) for _ in range(3)]), NgramDrafter(n_max=3, n_min=1)
    for step in range(300):
        if step % 50 == 49:
            s.cut(rng.randrange(1, len(s.ids)) if step % 100 == 49 else len(s.ids) - 2)  # a stop string's
            # cut, far back or by 2 (then 3 or more ids come: past the buffer's old length)
        s.ids.extend(rng.randrange(5) for _ in range(rng.randrange(3 if step % 50 == 49 else 1, 9)))
        assert s.id_array().tolist() == s.ids
        assert d.propose([s], [4])[0].tokens == lookup(s.ids, 4, 3, 1)
        assert d.context(s) == (longest_match(s.ids) or None)  # None: no match


def test_ngram_drafter_budget_and_eos():
    d = NgramDrafter(n_max=2, n_min=1)
    s = seq([1, 2, 3, 4, 5, 1, 2])
    assert d.propose([s], [2])[0].tokens == [3, 4]
    assert d.propose([s], [0])[0].tokens == []
    s_eos = seq([1, 2, 3, 4, 5, 1, 2], eos=[4])
    draft = d.propose([s_eos], [5])[0]
    assert draft.tokens == [3, 4] and draft.q is None  # stops after the EOS draft


def test_model_drafter_catch_up_rewind_and_q(loaded):
    rt = loaded("llama").runtime
    d = ModelDrafter(rt, num_slots=2, target_vocab=rt.vocab_size + 3, max_catch_up=4)
    s = seq([5, 6, 7, 8], slot=1, sp=SamplingParams(temperature=1.0, seed=1))
    draft = d.propose([s], [3])[0]
    assert len(draft.tokens) == 3 and draft.forwards == 3
    assert draft.q.shape == (3, rt.vocab_size + 3)  # padded to the target's width
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert d.cache.lengths[1] == 4 + 2  # the prompt and all drafts but the last were fed
    s.ids += [draft.tokens[0], (draft.tokens[1] + 1) % 256]  # one accepted, then a recovered token
    d.observe(s, 1)
    assert d.cache.lengths[1] == 5 and d.cached_ids[1] == s.ids[:5]
    s.prompt_len = 4
    d.release(s)  # the prompt's KV stays for the slot's next request (the torch runtime reuses prefixes)
    assert d.cache.lengths[1] == 4 and d.cached_ids[1] == [5, 6, 7, 8]
    other = Sequence(2, [5, 6, 7, 8, 9, 9], 6, SamplingParams(), make_generator(0, "cpu"), frozenset(), slot=1)
    assert d.cache.lengths[1] == 4 and d.behind(other) == 6  # the catch-up as from scratch (the rounds
    assert d.cache.lengths[1] == 4  # do not depend on reused rows), though the slot keeps the shared chunk
    third = Sequence(3, [5, 6, 7, 9, 9], 5, SamplingParams(), make_generator(0, "cpu"), frozenset(), slot=1)
    assert d.behind(third) == 5 and d.cache.lengths[1] == 0  # less than a whole chunk (4) is not kept


def test_rows_kept_for_a_later_request_cut_its_feeds_as_a_fresh_draft(loaded, monkeypatch):
    """A draft decodes each catch-up chunk whole, and some runtimes round a row by its chunk
    (llama.cpp's repacked quantized products): rows kept from an earlier request are kept in
    whole catch-up chunks, and the next request feeds the rest in the chunks, and rounds, a
    fresh draft would, so its q is the fresh q exactly."""
    rt = loaded("llama").runtime
    ids = [40 + i % 90 for i in range(170)]
    sp = SamplingParams(temperature=1.0)

    def first_q(drafter, request_id, prompt):
        feeds, forward = [], rt.forward
        monkeypatch.setattr(rt, "forward", lambda cache, slots, tokens, **kw:
                            feeds.append(tokens[0]) or forward(cache, slots, tokens, **kw))
        seq = seq_of(request_id, prompt, sp)
        rounds = 1
        while not (draft := drafter.propose([seq], [2])[0]).tokens:  # catch-up rounds draft nothing
            rounds += 1
        monkeypatch.setattr(rt, "forward", forward)
        drafter.observe(seq, 0)
        drafter.release(seq)
        return draft.q, feeds, rounds

    kept = ModelDrafter(rt, 1, rt.vocab_size, max_catch_up=80)
    first_q(kept, 1, ids[:-3])  # leaves its prompt's rows; the next prompt starts the same
    q, feeds, rounds = first_q(kept, 2, ids)
    fresh_q, fresh_feeds, fresh_rounds = first_q(ModelDrafter(rt, 1, rt.vocab_size, max_catch_up=80), 3, ids)
    assert [len(f) for f in fresh_feeds[:3]] == [80, 80, 10] and feeds[0] == fresh_feeds[2] == ids[160:]
    assert rounds == fresh_rounds == 3 and torch.equal(q, fresh_q)


def seq_of(request_id, ids, sp):
    return Sequence(request_id, list(ids), len(ids), sp, make_generator(0, "cpu"), frozenset(), slot=0)


def test_corpus_lookup_equals_a_scan_of_every_text():
    """Lookups across requests (``OtherTexts``: running requests' ids, then ``NgramCorpus``'s
    finished texts) against their rule spelled out as loops: per n (the longest match in the
    other texts first, where it is longer than ``n_max`` and than any in the text), the text's
    own continuations most recent first, then each running text's, then the finished ones,
    newest text first and most recent first within it, never past a text's end; finished
    texts past the capacity dropped oldest first."""
    import random

    import numpy as np

    from specdec.drafters.ngram import BRANCH_SCAN, NgramCorpus, OtherTexts, lookup_branches

    def found_in(hay, suffix):  # whether suffix occurs in hay
        return any(hay[s:s + len(suffix)] == suffix for s in range(len(hay) - len(suffix) + 1))

    def scan(ids, live, texts, k, n_max, n_min):
        L = len(ids)
        own_m = max([m for m in range(1, L) if found_in(ids[:L - 1], ids[L - m:])], default=0)
        other_m = max([m for m in range(1, min(L, 32) + 1) if any(found_in(t, ids[L - m:]) for t in live + texts)],
                      default=0)
        ns = list(range(min(n_max, L), n_min - 1, -1))
        if other_m > n_max and other_m > own_m:
            ns.insert(0, other_m)
        out = []
        for n in ns:
            def conts(t):  # the continuations after each occurrence, most recent first
                return [t[s + n:s + n + k] for s in range(len(t) - n - 1, -1, -1) if t[s:s + n] == ids[L - n:]]
            lists = [conts(ids)] + [conts(t) for t in live] + [[c for t in reversed(texts) for c in conts(t)]]
            out.append([c for cs in lists for c in cs[:BRANCH_SCAN]])
        return out, other_m

    rng = random.Random(1)
    for trial in range(1500):
        vocab = rng.choice([2, 3, 8])
        capacity = rng.choice([10, 40, 1000])
        corpus, texts = NgramCorpus(capacity), []
        for _ in range(rng.randrange(4)):
            t = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            corpus.add(t)
            texts.append(t[max(0, len(t) - (capacity - 1)):])
            while sum(len(x) + 1 for x in texts) > capacity:
                texts.pop(0)
        live = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randrange(3))]
        others = OtherTexts([np.array(t) for t in live], corpus)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        k, n_min = rng.randrange(1, 7), rng.randrange(1, 3)
        n_max, branches = rng.randrange(n_min, 5), rng.randrange(1, 5)
        lists, other_m = scan(ids, live, texts, k, n_max, n_min)
        lists = [c for c in lists if c]
        want = next((c for c in lists[0] if len(c) == k), max(lists[0], key=len)) if lists else []
        assert lookup(ids, k, n_max, n_min, others) == want, (trial, ids, live, texts, k, n_max, n_min)
        distinct = []
        for c in (c for cs in lists for c in cs):
            if c not in distinct:
                distinct.append(c)
        assert lookup_branches(ids, k, n_max, n_min, branches, others) == distinct[:branches], trial
        assert [len(x) for x in corpus.texts] == [len(t) + 1 for t in texts]
        assert max((len(p.ends) for p in others.places(np.array(ids), 32)), default=0) == other_m


def test_ngram_drafter_reads_finished_requests(loaded):
    """``ngram_capacity``: a request asked again drafts from the first one's text, and every
    draft is accepted (the outputs equal); each request alone (capacity 0) drafts from its own
    text only. A request that failed is not kept."""
    import pytest

    from specdec import LLM, SpecConfig

    model = loaded("llama")
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 41, 8]}
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for cap in (0, 10_000):
        llm = LLM(model, speculative=SpecConfig(method="ngram", ngram_capacity=cap, num_draft_tokens=4))
        outs[cap] = [llm.generate(prompt, sp, use_tqdm=False)[0] for _ in range(2)]
        corpus = llm.engine.drafters["ngram"].corpus
        assert (corpus is None) == (cap == 0)
        if corpus is not None:
            assert len(corpus) == 2 and corpus.texts[0][:-1].tolist() == prompt["prompt_token_ids"] + list(
                outs[cap][0].outputs[0].token_ids)
    assert len({tuple(o.outputs[0].token_ids) for os in outs.values() for o in os}) == 1
    again = outs[10_000][1].metrics
    # 39 tokens after the prefill's, 5 a step (4 drafts and the bonus): 8 steps, the last one cut short
    assert again["drafted_tokens"] >= 7 * 4 and again["accepted_tokens"] == again["drafted_tokens"]
    assert again["target_forwards"] == 1 + 8
    alone = outs[0][1].metrics
    assert alone["drafted_tokens"] == outs[0][0].metrics["drafted_tokens"]  # nothing carried over
    with pytest.raises(ValueError, match="ngram_capacity is the n-gram drafter's"):
        SpecConfig(method="draft", ngram_capacity=100)
    with pytest.raises(ValueError, match="ngram_capacity must be >= 0"):
        SpecConfig(method="ngram", ngram_capacity=-1)


def test_ngram_drafter_reads_running_requests(loaded):
    """``ngram_capacity``: a running request's lookups read the others running beside it. B's
    prompt is A's prompt and A's whole output, so B's text is ahead of A's from the start; A
    drafts from it and every one of its drafts is accepted (alone, from its own text, not)."""
    from specdec import LLM, SpecConfig

    model = loaded("llama")
    prompt = [5, 17, 99, 3, 41, 8]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    longer = LLM(model).generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=80, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
    both = [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt + list(longer[:40])}]
    rates = {}
    for cap in (0, 10_000):
        llm = LLM(model, speculative=SpecConfig(method="ngram", ngram_capacity=cap, num_draft_tokens=4))
        a, b = llm.generate(both, sp, use_tqdm=False)
        assert list(a.outputs[0].token_ids) == list(longer[:40]) and list(b.outputs[0].token_ids) == list(longer[40:])
        rates[cap] = a.metrics["acceptance_rate"]
        if cap:
            assert a.metrics["drafted_tokens"] >= 7 * 4 and rates[cap] == 1.0
    assert rates[0] < 1.0, rates


def test_the_planners_lookups_see_the_whole_batch():
    """With the cost model the planner reads each sequence's ``context`` before ``propose``;
    on a batch's first step the lookups found then must not hide a text registered after them:
    A's draft follows B, which runs ahead of it."""
    from specdec.drafters.ngram import NgramCorpus

    a = seq([7, 3, 9, 12, 40, 41], slot=0)
    b = seq([7, 3, 9, 12, 40, 41, 50, 51, 52, 53, 54], slot=1)
    d = NgramDrafter(n_max=3, n_min=1, corpus=NgramCorpus(1000))
    assert d.context(a) is None and d.context(b) is None  # neither text has a match of its own
    assert d.propose([a, b], [4, 4])[0].tokens == [50, 51, 52, 53]

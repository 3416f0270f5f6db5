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
    d = ModelDrafter(rt, num_slots=2, target_vocab=rt.vocab_size + 3)
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
    other = Sequence(2, [5, 6, 9, 9, 9], 5, SamplingParams(), make_generator(0, "cpu"), frozenset(), slot=1)
    assert d.cache.lengths[1] == 4 and d.behind(other) == 5  # the catch-up as from scratch (the rounds
    assert d.cache.lengths[1] == 2  # do not depend on reused rows), though the slot keeps what the request shares

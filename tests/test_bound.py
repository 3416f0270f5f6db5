"""The n-gram chain bound: exact dynamic programming over a fixed greedy output."""
import random

import pytest

from specdec.bound import ngram_chain_bound
from specdec.cost import ForwardCosts
from specdec.drafters.ngram import lookup

CHEAP = ForwardCosts(tuple(1.0 + 0.1 * n for n in range(9)))  # n + 1 tokens cost 1 + 0.1 n
DEAR = ForwardCosts(tuple(float(n) for n in range(1, 10)))  # n tokens cost n: drafts cannot pay


def replay(prompt, output, costs, policy):
    """Target seconds of decoding ``output`` with ``policy(t) -> k`` (the engine's loop)."""
    t, seconds = 1, 0.0
    while t < len(output):
        k = min(policy(t), len(output) - t)
        draft = lookup(list(prompt) + output[:t], k, 3, 1) if k else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[t + accepted]:
            accepted += 1
        seconds += costs(len(draft) + 1)
        t = min(t + accepted + 1, len(output))
    return seconds


def test_a_copy_of_the_prompt_takes_full_chains():
    prompt = list(range(100, 200))  # no token repeats: every match is the copy's source
    output = prompt[10:51]  # 41 tokens: the first comes from the prefill, 40 to decode
    bound = ngram_chain_bound(prompt, output, CHEAP, k_max=4)
    assert bound.ks == (4,) * 8  # 8 steps of 5 tokens
    assert bound.seconds == pytest.approx(8 * CHEAP(5))
    assert bound.plain_seconds == pytest.approx(40 * CHEAP(1))
    assert bound.speedup == pytest.approx(40 / (8 * 1.4))


def test_unseen_text_and_dear_verification_leave_plain_decoding():
    prompt = list(range(100, 200))
    fresh = list(range(300, 340))
    assert ngram_chain_bound(prompt, fresh, CHEAP, 4).ks == (0,) * 39
    copy = prompt[10:51]
    bound = ngram_chain_bound(prompt, copy, DEAR, 4)  # perfect drafts only break even
    assert bound.speedup == pytest.approx(1.0) and set(bound.ks) == {0}


@pytest.mark.parametrize("seed", range(5))
def test_no_policy_beats_the_bound(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(60)]  # a small vocabulary: many partial matches
    output = [rng.randrange(6) for _ in range(50)]
    for costs in (CHEAP, ForwardCosts((1.0, 1.55, 1.98, 2.48, 3.0))):
        bound = ngram_chain_bound(prompt, output, costs, k_max=4)
        schedule = iter(bound.ks)
        assert replay(prompt, output, costs, lambda t: next(schedule)) == pytest.approx(bound.seconds)
        policies = [lambda t, k=k: k for k in range(5)] + [lambda t: rng.randrange(5) for _ in range(20)]
        for policy in policies:
            assert bound.seconds <= replay(prompt, output, costs, policy) + 1e-9

"""The tutorial's worked verification cases, with hand-built logits.

Row ``i`` of the target logits verifies draft ``i``; row ``k`` gives the bonus token.
Stop/commit handling (EOS as bonus, budget running out, max_tokens=1) is the engine's
job and is tested with the engine, not here.
"""
from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.verify import Verdict, verify

GREEDY = SamplingParams()  # temperature 0
EOS = 7


def rows(*argmax_ids: int, vocab: int = 8) -> torch.Tensor:
    """Target logits ``[len(argmax_ids), vocab]`` whose row ``i`` has its argmax at ``argmax_ids[i]``.

    The runner-up is not uniform (a small ramp), so nothing hinges on tie-breaking.
    """
    base = torch.linspace(0.0, 1.0, vocab)
    out = base.repeat(len(argmax_ids), 1)
    for i, a in enumerate(argmax_ids):
        out[i, a] = 10.0
    return out


def test_rows_helper():
    assert rows(1, 2, 5).argmax(-1).tolist() == [1, 2, 5]
    assert rows(3, vocab=16).shape == (1, 16)


def test_first_match_then_mismatch_recovers_target_argmax():
    """draft [1, 1, 1]; target argmax 1, then 2: accept one draft, commit the recovered 2."""
    v = verify([1, 1, 1], None, rows(1, 2, 4, 6), GREEDY)
    assert isinstance(v, Verdict)
    assert v.tokens == [1, 2]
    assert v.num_accepted == 1  # of 3: no bonus


def test_all_drafts_accepted_appends_bonus():
    drafts = [4, 0, 6]
    v = verify(drafts, None, rows(4, 0, 6, 2), GREEDY)
    assert v.tokens == drafts + [2]  # bonus = argmax of row k
    assert v.num_accepted == 3  # all 3: tokens[3] is the bonus


def test_greedy_ignores_draft_probs():
    """Greedy verification only compares ids; q (if given) changes nothing."""
    q = torch.full((2, 8), 1 / 8)
    assert verify([5, 5], q, rows(5, 1, 3), GREEDY).tokens == [5, 1]
    assert verify([5, 5], None, rows(5, 1, 3), GREEDY).tokens == [5, 1]


def test_draft_eos_rejected_at_position_zero():
    """The draft proposes EOS first but the target wants 3: EOS is not committed."""
    v = verify([EOS, 2, 2], None, rows(3, 2, 2, 2), GREEDY)
    assert v.tokens == [3]
    assert v.num_accepted == 0


def test_empty_draft_greedy_returns_argmax():
    v = verify([], None, rows(6), GREEDY)
    assert v.tokens == [6]
    assert v.num_accepted == 0


def test_empty_draft_sampling_draws_from_p():
    """k = 0 with sampling: one token from p of the single row; degenerate p -> that id."""
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 5] = 0.0  # all mass on id 5
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        v = verify([], None, logits, SamplingParams(temperature=0.8, seed=seed), g)
        assert v.tokens == [5] and v.num_accepted == 0
    # Same with a finite row whose processed p is one-hot through top_k=1.
    g = torch.Generator().manual_seed(0)
    v = verify([], None, rows(2), SamplingParams(temperature=1.5, top_k=1), g)
    assert v.tokens == [2]


def test_empty_draft_sampling_is_seed_deterministic():
    logits = torch.zeros(1, 8)  # uniform p
    draw = [verify([], None, logits, SamplingParams(temperature=1.0),
                   torch.Generator().manual_seed(42)).tokens for _ in range(3)]
    assert draw[0] == draw[1] == draw[2] and 0 <= draw[0][0] < 8


def test_penalties_worked_example():
    """Repetition 2 (prompt and output), presence 0.5 and frequency 0.25 (output only); row i
    of a verify step also counts the drafts before it (``extra[i]``) as output."""
    from specdec.sampling import process_logits

    sp = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0]] * 3)
    out = process_logits(logits, sp, prompt=[0], output=[1, 1], extra=[[], [2], [2, 4]])
    expected = torch.tensor([
        [1.0 / 2, -1.0 * 2 - 0.5 - 2 * 0.25, 2.0, 0.5, 3.0],  # 0: prompt only; 1: twice in the output
        [0.5, -3.0, 2.0 / 2 - 0.5 - 0.25, 0.5, 3.0],  # draft 2 before this row
        [0.5, -3.0, 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25],  # drafts 2 and 4
    ])
    torch.testing.assert_close(out, expected)
    assert process_logits(logits, SamplingParams(), [0], [1]) is logits  # no penalties: untouched
    biased = SamplingParams(repetition_penalty=2.0, logit_bias={4: -100, 1: 0.5, 99: 3})  # 99: past the vocab
    out = process_logits(logits, biased, prompt=[4], output=[])
    # vLLM's order: the bias first, so token 4 (in the prompt) is biased to -97, then doubled
    torch.testing.assert_close(out[0], torch.tensor([1.0, -0.5, 2.0, 0.5, (3.0 - 100) * 2]))
    assert logits[0, 4] == 3.0  # the raw logits (logprobs come from them) are left alone


def test_min_p_and_min_tokens_worked_example():
    """min_p 0.25 after temperature keeps the tokens at least a quarter as likely as the top
    one (p = .5 .3 .15 .05 -> .5 .3 .15 kept, renormalised); min_tokens 2 bans the stop ids on
    the rows with fewer than 2 tokens of output before them (output 1 token: row 0 with no
    draft before it, not row 1)."""
    import math

    from specdec.sampling import probs_from_logits, process_logits

    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.25))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    probs = probs_from_logits(logits * 2, SamplingParams(temperature=2.0, min_p=0.35))  # the same p after temperature
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.0, 0.0]]) / 0.8)
    sp = SamplingParams(min_tokens=2)
    rows = torch.zeros(3, 4)
    out = process_logits(rows, sp, prompt=[0], output=[1], extra=[[], [2], [2, 3]], stop_ids=frozenset({3, 9}))
    assert out[0].tolist() == [0, 0, 0, float("-inf")] and out[1:].eq(0).all()
    assert process_logits(rows, SamplingParams(min_tokens=2), [0], [1, 2], stop_ids=frozenset({3})).eq(0).all()


def test_top_p_worked_example_and_wide_nuclei():
    """top_p 0.8 keeps the most likely tokens up to the one that brings their mass to 0.8
    (p = .05 .5 .3 .15 -> .5 and .3 kept, the .3 reaching 0.8); and on rows whose nucleus
    holds thousands of tokens (past the first topk's candidates) the kept set is the one a
    full sort gives."""
    import math

    from specdec.sampling import TOP_P_CANDIDATES, probs_from_logits, top_p_keep

    logits = torch.tensor([[math.log(p) for p in (0.05, 0.5, 0.3, 0.15)]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.3, 0.0]]) / 0.8)
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(2, 20_000, generator=g) * 0.1, torch.randn(2, 20_000, generator=g) * 4])
    probs = rows.softmax(-1)  # [4, 20000]: two flat rows (wide nuclei), two peaked ones
    for top_p in (0.3, 0.9, 0.999):
        values, order = probs.sort(-1, descending=True)
        want = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, values.cumsum(-1) - values < top_p)
        keep = top_p_keep(probs, top_p)
        assert torch.equal(keep, want), top_p
    assert keep[:2].sum(-1).min() > 4 * TOP_P_CANDIDATES  # the flat rows needed more candidates


def test_acceptance_uniform_is_float64():
    """A float32 uniform is exactly 0 once in 2^24 draws, and u = 0 accepts any token with
    p > 0: here a token a -100 logit bias bans (p = 5.6e-45), drafted by an n-gram, at the
    generator state where the float32 draw is 0. vLLM draws these in float64 too."""
    x = 5
    sp = SamplingParams(temperature=1.0, logit_bias={x: -100})
    logits = torch.zeros(2, 8)
    logits[:, x] = -100.0  # the target's rows after the bias
    g = torch.Generator().manual_seed(0)
    assert torch.rand(41102972, generator=g)[-1].item() == 0.0  # the float32 draw there
    g = torch.Generator().manual_seed(0)
    torch.rand(41102971, generator=g)
    verdict = verify([x], None, logits, sp, g)
    assert verdict.num_accepted == 0 and verdict.tokens[0] != x

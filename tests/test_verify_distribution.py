"""Statistical tests: speculative sampling in ``specdec.verify.verify`` is lossless.

Every test draws the draft ``x ~ q`` itself, calls the *real* ``verify`` once per trial and
checks that the committed token(s) follow the target distribution ``p`` with a Pearson
chi-square goodness-of-fit test (``scipy.stats.chisquare``) at significance ``ALPHA``.
All randomness comes from seeded ``torch.Generator``s, so every run is deterministic.

A negative control (a verifier that resamples from ``p`` instead of the residual after a
rejection) shows the same test has the power to catch a lossy verifier.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.config import SamplingParams
from specdec.sampling import probs_from_logits, sample
from specdec.verify import Verdict, residual, verify

# Significance level of every chi-square test in this file: a correct verifier fails a
# given (seeded, hence fixed) test with probability 1e-3 over the choice of seed.
ALPHA = 1e-3
# Draws per goodness-of-fit case. One real ``verify`` call costs ~0.2-0.5 ms on CPU, so 50k
# draws cost 10-25 s: the headline textbook case gets 50k; the other cases get fewer to keep
# this file well under a minute (10k draws still detect a total-variation error of ~0.03).
N_MAIN = 50_000
N_CASE = 10_000
N_CONTROL = 5_000  # the negative control is rejected at p ~ 1e-100 already
MIN_EXPECTED = 5.0  # positive bins expected to hold fewer draws are pooled into one bin


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead to the 50k-call loops."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- helpers


def chi2_pvalue(counts: np.ndarray, p: torch.Tensor) -> float:
    """p-value of ``counts ~ Multinomial(n, p)``.

    Zero-probability bins must be empty (asserted: one draw there is an outright bug, not a
    statistical fluctuation) and are dropped; positive bins with expected count below
    ``MIN_EXPECTED`` are pooled so the chi-square approximation holds.
    """
    p = p.double().cpu().numpy().ravel()
    p = p / p.sum()
    counts = np.asarray(counts, dtype=np.float64).ravel()
    assert counts.shape == p.shape
    zero = p == 0
    assert counts[zero].sum() == 0, f"draws in zero-probability bins {np.flatnonzero(zero & (counts > 0))}"
    n = counts.sum()
    exp, obs = p[~zero] * n, counts[~zero]
    small = exp < MIN_EXPECTED
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if len(exp) < 2:  # a single bin: nothing to test beyond the zero-bin check
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def first_token_counts(verify_fn, target_row: torch.Tensor, q_row: torch.Tensor | None,
                       sp: SamplingParams, n: int, seed: int, fixed_draft: int = 0,
                       bonus_counts: np.ndarray | None = None, device: str = "cpu") -> np.ndarray:
    """Histogram of the first committed token over ``n`` single-draft (k=1) rounds.

    ``q_row`` [vocab] draft probs, or None: a one-hot draft of ``fixed_draft`` (n-gram style).
    Row 0 of the target logits is ``target_row``; the bonus row 1 is its reverse, so a
    verifier that read the wrong row would show up as a distribution mismatch. If given,
    ``bonus_counts`` accumulates the bonus tokens (second token of accepted rounds). Tensors
    and generator live on ``device``.
    """
    vocab = target_row.shape[-1]
    g = torch.Generator(device).manual_seed(seed)
    target_logits = torch.stack([target_row, target_row.flip(0)]).to(device)
    if q_row is None:
        q, drafts = None, [fixed_draft] * n
    else:
        q_row = q_row.to(device)
        q = q_row.reshape(1, vocab)
        drafts = torch.multinomial(q_row, n, replacement=True, generator=g).tolist()  # x ~ q
    counts = np.zeros(vocab, dtype=np.int64)
    for x in drafts:
        v = verify_fn([x], q, target_logits, sp, g)
        assert len(v.tokens) == v.num_accepted + 1 <= 2
        counts[v.tokens[0]] += 1
        if bonus_counts is not None and v.num_accepted == 1:  # the draft passed: tokens[1] is the bonus
            bonus_counts[v.tokens[1]] += 1
    return counts


def wrong_verify(draft_ids, q, target_logits, sp, generator=None):
    """Negative control: standard speculative sampling except that after a rejection it
    resamples from ``p`` instead of the residual ``normalize(max(p - q, 0))`` - lossy."""
    k = len(draft_ids)
    p = probs_from_logits(target_logits, sp)
    for i, x in enumerate(draft_ids):
        q_x = float(q[i, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if not u * q_x < float(p[i, x]):
            return Verdict(i, list(draft_ids[:i]) + [int(sample(p[i:i + 1], generator))])  # the bug
    return Verdict(k, list(draft_ids) + [int(sample(p[k:], generator))])


SP_PLAIN = SamplingParams(temperature=1.0)
P2 = torch.tensor([0.4, 0.6])
Q2 = torch.tensor([0.8, 0.2])


# ------------------------------------------------------------------------------- tests


def test_two_token_textbook_case_is_lossless():
    """p = [0.4, 0.6], q = [0.8, 0.2], k = 1: the first committed token follows p."""
    target_row = P2.log()
    p = probs_from_logits(target_row[None], SP_PLAIN)[0]
    torch.testing.assert_close(p, P2)
    bonus = np.zeros(2, dtype=np.int64)
    counts = first_token_counts(verify, target_row, Q2, SP_PLAIN, N_MAIN, seed=1234, bonus_counts=bonus)
    pval = chi2_pvalue(counts, p)
    assert pval > ALPHA, (counts / counts.sum(), pval)
    # Accepted rounds draw the bonus from the last row (here p reversed: [0.6, 0.4]).
    assert chi2_pvalue(bonus, p.flip(0)) > ALPHA, bonus / bonus.sum()


def test_negative_control_resampling_from_p_is_caught():
    """The same test rejects a verifier that resamples from p after a rejection.

    Analytically that verifier outputs token 0 with probability
    0.8 * 0.5 (accepted) + 0.4 (rejected) * 0.4 = 0.56 instead of 0.4.
    """
    target_row = P2.log()
    p = probs_from_logits(target_row[None], SP_PLAIN)[0]
    counts = first_token_counts(wrong_verify, target_row, Q2, SP_PLAIN, N_CONTROL, seed=1234)
    pval = chi2_pvalue(counts, p)
    print(f"negative control: n={counts.sum()} freq={counts / counts.sum()} chi2 p-value={pval:.3g}")
    assert pval < ALPHA, pval
    # ... and it is caught for the right reason: it matches its own (wrong) distribution.
    assert chi2_pvalue(counts, torch.tensor([0.56, 0.44])) > ALPHA


# Random p and q (vocab 12) from random logits, both processed with the same params.
SP_CASES = {
    "t1.3-topk5": SamplingParams(temperature=1.3, top_k=5),
    "t0.7-topk5-topp0.8": SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
    "t1.2-minp0.15": SamplingParams(temperature=1.2, min_p=0.15),
}


@pytest.mark.parametrize("name", list(SP_CASES))
def test_random_p_q_with_sampling_params_is_lossless(name):
    sp = SP_CASES[name]
    vocab = 12
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(1, vocab, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(1, vocab, generator=gen)  # related, not equal
    p = probs_from_logits(target_logits, sp)[0]
    q = probs_from_logits(draft_logits, sp)[0]
    # The case is not trivial: q differs from p, and filtering leaves supports that differ.
    assert (p - q).abs().sum() > 0.1
    if sp.top_k or sp.top_p < 1 or sp.min_p:
        assert ((p > 0) != (q > 0)).any() or (p == 0).any()
    bonus = np.zeros(vocab, dtype=np.int64)
    counts = first_token_counts(verify, target_logits[0], q, sp, N_CASE, seed=99, bonus_counts=bonus)
    pval = chi2_pvalue(counts, p)  # also asserts zero-probability tokens never appear
    assert pval > ALPHA, (name, counts / counts.sum(), p, pval)
    p_bonus = probs_from_logits(target_logits.flip(-1), sp)[0]  # the bonus row's processed p
    assert chi2_pvalue(bonus, p_bonus) > ALPHA, (name, bonus / bonus.sum(), p_bonus)


def test_one_hot_draft_without_q_is_lossless():
    """q=None (n-gram draft of a fixed token): accept with p[x], else draw from p without x."""
    sp = SamplingParams(temperature=1.3, top_p=0.8)
    vocab = 10
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(1, vocab, generator=gen) * 1.5
    p = probs_from_logits(target_logits, sp)[0]
    fixed = int(p.argmax())  # a draft that is often, but not always, accepted
    assert 0.2 < float(p[fixed]) < 0.9 and (p == 0).any()
    counts = first_token_counts(verify, target_logits[0], None, sp, N_CASE, seed=5, fixed_draft=fixed)
    pval = chi2_pvalue(counts, p)
    assert pval > ALPHA, (counts / counts.sum(), p, pval)


def test_one_hot_draft_outside_target_support_is_never_committed():
    """q=None drafting a token that top-k removed from p: always rejected, output ~ p."""
    sp = SamplingParams(temperature=1.0, top_k=3)
    target_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, -2.0]])
    p = probs_from_logits(target_logits, sp)[0]
    assert float(p[3]) == 0.0
    counts = first_token_counts(verify, target_logits[0], None, sp, 2_000, seed=8, fixed_draft=3)
    assert chi2_pvalue(counts, p) > ALPHA  # asserts counts[3] == 0 as well


def test_joint_of_first_two_committed_tokens_is_p_outer_p():
    """k = 2 drafts per round, target rows independent of the prefix (same logits on every
    row) and drafts x_i ~ q independently: the first two committed tokens are i.i.d. p.

    A round that commits only one token (rejection of draft 0) is followed by a fresh round,
    as the engine would, so the second token sometimes comes from a recovered token, a bonus
    token, an accepted draft, or the next round - all must combine to p x p.
    """
    sp = SamplingParams(temperature=1.0)
    k, vocab, n = 2, 4, 6_000
    target_row = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    q_row = torch.tensor([0.4, 0.3, 0.2, 0.1])
    target_logits = target_row.expand(k + 1, vocab).contiguous()
    q = q_row.expand(k, vocab).contiguous()
    p = probs_from_logits(target_logits, sp)[0]
    g = torch.Generator().manual_seed(2024)
    drafts = torch.multinomial(q_row, 2 * k * n, replacement=True, generator=g).view(2 * n, k).tolist()
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    rounds = 0
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            v = verify(drafts[rounds], q, target_logits, sp, g)
            rounds += 1
            assert len(v.tokens) == v.num_accepted + 1 <= k + 1
            out += v.tokens
        counts[out[0], out[1]] += 1
    pval = chi2_pvalue(counts, torch.outer(p, p))
    assert pval > ALPHA, (counts / counts.sum(), pval)
    # Also the conditional of the second token given the first is p, for every first token.
    for a in range(vocab):
        assert chi2_pvalue(counts[a], p) > ALPHA / vocab, a


# ------------------------------------------------------------------------- residual guard


def test_p_equal_q_never_rejects():
    sp = SamplingParams(temperature=0.9, top_k=6)
    vocab, k = 8, 3
    gen = torch.Generator().manual_seed(11)
    target_logits = torch.randn(k + 1, vocab, generator=gen)
    p = probs_from_logits(target_logits, sp)
    q = p[:k].clone()
    g = torch.Generator().manual_seed(12)
    for _ in range(2_000):
        drafts = torch.multinomial(q, 1, generator=g).squeeze(-1).tolist()  # one x_i ~ q_i per row
        v = verify(drafts, q, target_logits, sp, g)
        assert v.num_accepted == k and v.tokens[:k] == drafts
        assert p[k, v.tokens[k]] > 0


@pytest.mark.parametrize("q_kind", ["equal", "tiny-excess", "one-hot-none"])
def test_residual_without_positive_mass_falls_back_to_p(q_kind):
    if q_kind == "one-hot-none":  # q=None: one-hot at the draft, and p is one-hot there too
        p = torch.tensor([0.0, 0.0, 1.0, 0.0])
        q = None
    else:
        p = torch.softmax(torch.tensor([1.0, 0.5, -0.3, 2.0]), -1)
        q = p.clone() if q_kind == "equal" else p + 1e-13  # p - q <= 0 everywhere (fp noise)
    r = residual(p, q, 2)
    assert torch.isfinite(r).all()
    torch.testing.assert_close(r, p)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.4, 0.6])
    torch.testing.assert_close(residual(p, torch.tensor([0.8, 0.2]), 0), torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(residual(torch.tensor([0.5, 0.3, 0.2]), None, 0),
                               torch.tensor([0.0, 0.6, 0.4]))


def test_sample_draws_each_row_from_its_distribution():
    """``sample`` (the inverse-CDF draw every verifier and drafter uses): each row of a batch
    follows its own, possibly unnormalised, distribution, zero-probability tokens included
    (never drawn, also at the ends of the vocabulary)."""
    g = torch.Generator().manual_seed(11)
    rows = torch.rand(3, 40, generator=g) ** 4  # [rows, vocab], unnormalised
    rows[:, [0, 7, 39]] = 0.0
    rows[1, 20:] = 0.0
    rows[2] *= 1e-3
    counts = np.zeros(rows.shape, dtype=np.int64)
    for _ in range(N_CASE):
        for r, t in enumerate(sample(rows, g).tolist()):
            counts[r, t] += 1
    for r in range(rows.shape[0]):
        assert chi2_pvalue(counts[r], rows[r]) > ALPHA
    assert counts[1, 20:].sum() == 0 and counts[0, 20:].sum() > 0
    assert chi2_pvalue(counts[2], rows[0]) < ALPHA  # the criterion tells rows apart

"""Verification: pure maths over tensors, no model in sight.

Row alignment: the target is run on ``[last committed token] + drafts`` (k+1 tokens), so
logits row ``i`` is the target's prediction *for* draft ``i`` (its prefix ends just before
it) and row ``k`` predicts the token after the last draft (the bonus).

* Greedy: accept drafts while each equals the target's argmax on its row; the first
  mismatch is replaced by that argmax (the *recovered* token) and the round stops. If all
  k drafts pass, the argmax of row k is the *bonus* token.
* Sampling (Leviathan et al. / Chen et al.): accept draft x on row i with probability
  ``min(1, p[x] / q[x])``; at the first rejection draw the recovered token from
  ``normalize(max(p - q, 0))``; if all pass draw the bonus from ``p`` of row k.
  A draft without ``q`` (n-gram lookup) is a one-hot q: accept with probability p[x] and
  recover from p with x removed - still exactly the target's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .sampling import probs_from_logits, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verify step for one sequence."""

    num_accepted: int  # drafts that passed, 0..k (all k: the last token is the bonus)
    tokens: list[int]  # accepted drafts + one recovered or bonus token (len = num_accepted + 1)


def verify(
    draft_ids: list[int],
    q: torch.Tensor | None,  # [k, vocab] draft probs, or None (treated as one-hot)
    target_logits: torch.Tensor,  # [k+1, vocab]
    sp: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    k = len(draft_ids)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    if sp.greedy:
        choice = target_logits.argmax(-1).tolist()  # [k+1]
        n = 0
        while n < k and draft_ids[n] == choice[n]:
            n += 1
        return Verdict(n, list(draft_ids[:n]) + [choice[n]])

    p = probs_from_logits(target_logits, sp)  # [k+1, vocab]
    if k == 0:
        return Verdict(0, [int(sample(p, generator))])
    ids = torch.tensor(draft_ids, device=p.device)  # [k]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, ids].double()  # [k]
    q_x = q[rows, ids].double() if q is not None else torch.ones_like(p_x)  # [k]
    # float64, as vLLM's: a float32 uniform is exactly 0 once in 2^24 draws, and 0 accepts any
    # token with p > 0 (one a -100 logit bias bans, say)
    u = torch.rand(k, device=p.device, dtype=torch.float64, generator=generator)  # [k]
    accepted = (u * q_x < p_x).tolist()  # u < p/q, safe when q_x == 0
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return Verdict(k, list(draft_ids) + [int(sample(p[k:], generator))])
    return Verdict(n, list(draft_ids[:n]) + [recover(p[n], q[n] if q is not None else None,
                                                     draft_ids[n], generator)])


def residual(p: torch.Tensor, q: torch.Tensor | None, draft_id: int) -> torch.Tensor:
    """``normalize(max(p - q, 0))`` for one row ``[vocab]``; q None means one-hot at draft_id.

    Guard: a rejection implies p[x] < q[x], so the residual has positive mass in exact
    arithmetic; if rounding leaves none (p == q up to fp error), fall back to p.
    """
    if q is None:
        r = p.clone()
        r[draft_id] = 0.0
    else:
        r = (p - q.float()).clamp_min(0.0)
    mass = r.sum()
    if not torch.isfinite(mass) or mass <= 1e-12:
        return p
    return r / mass


def recover(p: torch.Tensor, q: torch.Tensor | None, draft_id: int,
            generator: torch.Generator | None) -> int:
    """Draw the recovered token after a rejection of ``draft_id``."""
    return int(sample(residual(p, q, draft_id)[None], generator))

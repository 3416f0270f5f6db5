"""The exact joint distribution of a model's first output tokens, and a chi-square test of
sampled outputs against it (end-to-end losslessness tests)."""
from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def exact_joint(model, prompt: list[int], steps: int, top_k: int, temperature: float,
                process=None) -> dict[tuple[int, ...], float]:
    """``{first steps tokens: probability}`` under transformers' ``model`` sampling at
    ``temperature`` from its ``top_k`` most likely tokens, its logits first passed through
    ``process(output_ids, logits)`` when given."""
    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        if process is not None:
            logits = process(ids[len(prompt):], logits)
        logits = logits / temperature
        keep = logits >= logits.topk(top_k).values[-1]
        return torch.where(keep, logits, float("-inf")).softmax(-1).double()

    joint = {(): 1.0}
    for _ in range(steps):
        joint = {path + (t,): w * float(pr[t]) for path, w in joint.items()
                 for pr in [probs(prompt + list(path))] for t in pr.nonzero().flatten().tolist()}
    return joint


def joint_pvalue(seen: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of the outputs ``seen`` against ``joint``, the least likely paths
    pooled into one cell of >= 40 expected."""
    n = len(seen)
    cells = sorted(joint, key=joint.get)
    obs = np.array([seen.count(c) for c in cells], dtype=float)
    exp = np.array([joint[c] for c in cells]) * n
    small = np.cumsum(exp) < 40
    obs, exp = np.append(obs[~small], obs[small].sum()), np.append(exp[~small], exp[small].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

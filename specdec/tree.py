"""Token trees: several draft candidates per depth, verified in one target forward.

Row 0 of a tree is its *root*: the last committed token (whose KV the verify forward
computes, as in a chain). Rows ``1..n`` are draft nodes in topological order (a parent's
row is smaller than its children's). A chain of k drafts is the tree whose row i has
parent i-1.

For the verify forward a tree provides, per row: its token, its position (the root's
position plus its depth), and the attention mask ``mask[i, j]`` = row j is row i itself or
one of its ancestors (every row also sees the whole committed prefix in the cache). After
verification, ``TreeVerdict.rows`` lists the accepted path's rows (SGLang's retrieve
indices, for the one path taken), whose KV the runtime keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .sampling import probs_from_logits, sample
from .verify import Verdict, residual as normalized_residual


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # [n+1] row 0 = root
    parents: list[int]  # [n+1] parent row, -1 for the root
    # q[r]: the draft distribution the children of row r were drawn from, without
    # replacement in row order (the first from q[r], each next from q[r] without the
    # earlier siblings, renormalized) (``[n+1, vocab]``; rows without children unused);
    # None when children were chosen deterministically (n-gram matches, top-k expansion,
    # greedy), which the verifier treats as one-hot proposals.
    q: torch.Tensor | None = None
    depths: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0 or len(self.parents) != n or self.parents[0] != -1:
            raise ValueError("a tree needs a root row 0 with parent -1 and one parent per row")
        depths, children = [0] * n, [[] for _ in range(n)]
        for r in range(1, n):
            p = self.parents[r]
            if not 0 <= p < r:
                raise ValueError(f"row {r}: parent {p} must be an earlier row")
            depths[r] = depths[p] + 1
            children[p].append(r)
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"q has {self.q.shape[0]} rows for {n} tree rows")
        for r, kids in enumerate(children):
            toks = [self.tokens[c] for c in kids]
            if len(set(toks)) != len(toks):
                raise ValueError(f"row {r}: siblings must be distinct tokens")
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "children", children)

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "DraftTree":
        """A trie of token paths under ``root`` (shared prefixes merge; first seen first)."""
        tokens, parents, index = [root], [-1], {}
        for path in paths:
            row = 0
            for t in path:
                if (row, t) not in index:
                    index[row, t] = len(tokens)
                    tokens.append(t)
                    parents.append(row)
                row = index[row, t]
        return cls(tokens, parents)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def mask(self) -> torch.Tensor:
        """``[n+1, n+1]`` bool: row i sees row j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        m = torch.zeros(n, n, dtype=torch.bool)
        for r in range(n):
            m[r, r] = True
            if r:
                m[r] |= m[self.parents[r]]
        return m

    def positions(self, root_position: int) -> list[int]:
        return [root_position + d for d in self.depths]

    def prefixes(self) -> list[list[int]]:
        """Per row, the draft tokens from the root (excluded) down to the row: what the
        target's prediction on that row follows, after the committed tokens."""
        out = [[]]
        for r in range(1, len(self.tokens)):
            out.append(out[self.parents[r]] + [self.tokens[r]])
        return out


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    rows: list[int] = ()  # rows of the accepted path: root, then one per accepted draft


def verify_tree(tree: DraftTree, target_logits: torch.Tensor, sp: SamplingParams,
                generator: torch.Generator | None = None) -> TreeVerdict:
    """Walk down from the root; ``target_logits [n+1, vocab]`` row r is the target's
    prediction for the children of row r.

    Greedy: follow the child equal to the target's argmax; stop at the first row where no
    child matches (commit the argmax: recovered) or at a leaf (commit its argmax: bonus).
    Sampling (multi-draft rejection; Jeon et al.'s recursive rule for siblings drawn without
    replacement): at row r start with ``R = p_r`` and ``Q = q_r`` and try each child x in
    order: accept with ``min(1, R[x] / Q[x])`` (``Q`` one-hot at x for deterministic
    children); on rejection ``R = normalize(max(R - Q, 0))`` and the next sibling's ``Q`` is
    ``Q`` without x, renormalized (what it was drawn from). If no child is accepted, draw
    the recovered token from R. Either way the committed token follows p.
    """
    rows, tokens = [0], []
    if sp.greedy:
        choice = target_logits.argmax(-1).tolist()  # [n+1]
        while True:
            r = rows[-1]
            nxt = next((c for c in tree.children[r] if tree.tokens[c] == choice[r]), None)
            if nxt is None:
                tokens.append(choice[r])
                break
            rows.append(nxt)
            tokens.append(tree.tokens[nxt])
    else:
        p = probs_from_logits(target_logits, sp)  # [n+1, vocab]
        while True:
            r = rows[-1]
            residual, nxt = p[r], None  # [vocab]
            q = tree.q[r].float() if tree.q is not None else None  # [vocab] the first child's
            for c in tree.children[r]:
                x = tree.tokens[c]
                q_x = float(q[x]) if q is not None else 1.0
                u = torch.rand((), device=p.device, dtype=torch.float64, generator=generator)  # as verify's
                if u * q_x < float(residual[x]):
                    nxt = c
                    break
                residual = normalized_residual(residual, q, x)
                if q is not None:  # the next sibling was drawn without this one
                    q = q.clone()
                    q[x] = 0.0
                    q /= q.sum().clamp_min(1e-30)
            if nxt is None:
                tokens.append(int(sample(residual[None], generator)))
                break
            rows.append(nxt)
            tokens.append(tree.tokens[nxt])
    accepted = len(rows) - 1
    return TreeVerdict(accepted, tokens, rows=rows)

"""``specdec demo``: the tutorial's forward-count comparison, on a real model.

Greedy decoding of a few chat prompts on the embedded SmolLM2-135M-Instruct, four ways:
plain (one target forward per token), n-gram prompt lookup, self-drafting (draft =
target, so every draft is accepted and a round commits k+1 tokens), and a token tree
drafted by an int8 copy of the target (top-2 children per node, EAGLE-2 style). It prints
the target forward counts side by side, checks that all four produce the same tokens, and
shows the first tree: its tokens, the accepted path and the attention mask.
"""
from __future__ import annotations

from .api import LLM
from .config import SamplingParams, SpecConfig
from .tree import DraftTree

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat this list exactly, one item per line: apple, banana, cherry, apple, banana, cherry.",
    "What is speculative decoding? Answer in two sentences.",
]
METHODS = ("plain", "ngram", "self", "tree")
TREE = SpecConfig(method="draft", tree_topk=2, tree_depth=3, tree_nodes=6)  # int8 draft on a CPU


class TreeRecorder:
    """Wraps a drafter; keeps the first of the first sequence's trees whose accepted path is
    at least ``want`` rows long (else the longest), with the ids committed after it."""

    def __init__(self, drafter, want: int = 3):
        self.drafter, self.want = drafter, want
        self.tree, self.committed, self.pending = None, None, None

    def propose(self, seqs, ks):
        drafts = self.drafter.propose(seqs, ks)
        self.pending = (seqs[0], drafts[0].tree, len(seqs[0].ids))
        return drafts

    def observe(self, seq, num_accepted):  # called every step, also where nothing was proposed
        first, tree, base = self.pending or (None, None, 0)
        if seq is first:
            self.pending = None
        if seq is first and tree is not None and (
                self.tree is None or len(accepted_rows(self.tree, self.committed)) < self.want):
            if self.tree is None or num_accepted + 1 > len(accepted_rows(self.tree, self.committed)):
                self.tree, self.committed = tree, seq.ids[base:]
        self.drafter.observe(seq, num_accepted)

    def release(self, seq):
        self.drafter.release(seq)


def accepted_rows(tree: DraftTree, committed: list[int]) -> list[int]:
    """Rows of the path the committed tokens took through ``tree`` (root first)."""
    rows = [0]
    for token in committed:
        nxt = next((c for c in tree.children[rows[-1]] if tree.tokens[c] == token), None)
        if nxt is None:
            break
        rows.append(nxt)
    return rows


def show_tree(tree: DraftTree, committed: list[int], decode) -> str:
    rows = accepted_rows(tree, committed)
    mask = tree.mask()
    n = len(tree.tokens)
    lines = [f"{'row':>3} {'token':<14} {'parent':>6} {'depth':>5}  mask (row sees column)",
             f"{'':>3} {'':<14} {'':>6} {'':>5}  " + " ".join(str(j % 10) for j in range(n))]
    for r in range(n):
        tok = repr(decode([tree.tokens[r]]))[:14]
        mark = "*" if r in rows else " "
        grid = " ".join("x" if mask[r, j] else "." for j in range(n))
        parent = "-" if tree.parents[r] < 0 else str(tree.parents[r])
        lines.append(f"{r:>3}{mark}{tok:<14} {parent:>6} {tree.depths[r]:>5}  {grid}")
    extra = committed[len(rows) - 1]
    kind = "bonus" if not tree.children[rows[-1]] else "recovered"
    lines.append(f"accepted path (*): rows {' -> '.join(map(str, rows))}, then the target's "
                 f"{kind} token {decode([extra])!r}: {len(rows)} tokens committed by one target forward")
    return "\n".join(lines)


def run_demo(max_tokens: int = 64, k: int = 4, device: str | None = None) -> int:
    sp = SamplingParams(max_tokens=max_tokens)
    plain = LLM(None, device=device, dtype="float32")  # a GPU's bfloat16 could flip near-ties
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    runs = {"plain": plain.generate(chats, sp)}
    for method in ("ngram", "self"):
        llm = LLM(plain.target, speculative=SpecConfig(method=method, num_draft_tokens=k), device=device)
        runs[method] = llm.generate(chats, sp)
    tree_llm = LLM(plain.target, draft=str(plain.target.path), speculative=TREE, device=device,
                   dtype="float32")
    recorder = tree_llm.engine.drafters["draft"] = TreeRecorder(tree_llm.engine.drafters["draft"])
    runs["tree"] = tree_llm.generate(chats, sp)
    print(f"specdec demo: SmolLM2-135M-Instruct, greedy, {max_tokens} new tokens, k={k}; "
          f"tree = {'int8 ' if plain.target.runtime.device.type == 'cpu' else ''}copy drafting "
          f"top-{TREE.tree_topk}, depth {TREE.depth}, {TREE.node_budget} nodes\n")
    print(f"{'target forwards for':<44} {'tokens':>6} " + " ".join(f"{m:>6}" for m in METHODS) + "  same")
    ok = True
    for i, prompt in enumerate(PROMPTS):
        same = all(runs[m][i].token_ids == runs["plain"][i].token_ids for m in runs)
        ok &= same
        counts = " ".join(f"{runs[m][i].metrics['target_forwards']:>6}" for m in METHODS)
        print(f"{prompt[:42] + '..':<44} {len(runs['plain'][i].token_ids):>6} {counts}  {'yes' if same else 'NO'}")
    for m in METHODS[1:]:
        r = [o.metrics for o in runs[m]]
        drafted = sum(x["drafted_tokens"] for x in r)
        accepted = sum(x["accepted_tokens"] for x in r)
        note = {"ngram": "", "self": " (draft = target: every draft is accepted)",
                "tree": " (tree nodes; at most one path per step is accepted)"}[m]
        print(f"{m}: acceptance {accepted}/{drafted} drafts{note}")
    if recorder.tree is not None and recorder.committed is not None:
        print("\na token tree of prompt 1 (the first accepting 2+ drafts), verified in one target forward:\n"
              + show_tree(recorder.tree, recorder.committed, plain.tokenizer.decode))
    print("\nfirst answer:\n" + runs["plain"][0].text.strip())
    if not ok:
        print("\nFAILED: speculative output differs from plain greedy decoding")
        return 1
    print("\nOK: n-gram, self-draft and tree outputs are token-for-token identical to plain decoding")
    return 0

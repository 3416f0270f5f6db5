"""``specdec demo``: the tutorial's forward-count comparison, on a real model.

Greedy decoding of a few chat prompts on the embedded SmolLM2-135M-Instruct, three ways:
plain (one target forward per token), n-gram prompt lookup, and self-drafting (draft =
target, so every draft is accepted and a round commits k+1 tokens). It prints the target
forward counts side by side and checks that all three produce the same tokens.
"""
from __future__ import annotations

from .api import LLM
from .config import SamplingParams, SpecConfig

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat this list exactly, one item per line: apple, banana, cherry, apple, banana, cherry.",
    "What is speculative decoding? Answer in two sentences.",
]


def run_demo(max_new_tokens: int = 64, k: int = 4, device: str | None = None) -> int:
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    plain = LLM(None, device=device)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    runs = {"plain": plain.generate(chats, sp)}
    for method in ("ngram", "self"):
        llm = LLM(plain.target, speculative=SpecConfig(method=method, num_draft_tokens=k), device=device)
        runs[method] = llm.generate(chats, sp)
    print(f"specdec demo: SmolLM2-135M-Instruct, greedy, {max_new_tokens} new tokens, k={k}\n")
    print(f"{'prompt':<44} {'tokens':>6} {'plain':>6} {'ngram':>6} {'self':>6}  same")
    ok = True
    for i, prompt in enumerate(PROMPTS):
        same = all(runs[m][i].token_ids == runs["plain"][i].token_ids for m in runs)
        ok &= same
        counts = [runs[m][i].metrics["target_forwards"] for m in ("plain", "ngram", "self")]
        print(f"{prompt[:42] + '..':<44} {len(runs['plain'][i].token_ids):>6} "
              f"{counts[0]:>6} {counts[1]:>6} {counts[2]:>6}  {'yes' if same else 'NO'}")
    for m in ("ngram", "self"):
        r = [o.metrics for o in runs[m]]
        drafted = sum(x["drafted_tokens"] for x in r)
        accepted = sum(x["accepted_tokens"] for x in r)
        print(f"\n{m}: acceptance {accepted}/{drafted} drafts"
              + ("" if m == "ngram" else " (draft = target: every draft is accepted)"))
    print("\nfirst answer:\n" + runs["plain"][0].text.strip())
    if not ok:
        print("\nFAILED: speculative output differs from plain greedy decoding")
        return 1
    print("\nOK: n-gram and self-draft outputs are token-for-token identical to plain decoding")
    return 0

"""Prefix reuse, side by side in one process: each case with the engine's prefix reuse on and
off, in turns, medians of ``--repeats``; the outputs must be the same tokens.

Cases (a chat whose first turn asks to review a piece of specdec's source, about 650 tokens):
  turn2        the second turn's time to first token, its first turn's prompt left in the slot
  turn2-draft  the same with ``--draft``, the whole ``--max-new-tokens`` answer (the draft
               model's slot keeps the prompt too); skipped without ``--draft``
  n4           ``n=4`` sampled answers of 16 tokens to the first turn (running requests share
               the prompt's whole chunks)

    python scripts/bench_prefix_reuse.py --model TARGET.gguf [--draft DRAFT.gguf] [--repeats 3]
        [--backend torch|llamacpp] [--cases turn2,turn2-draft,n4]

(On llama.cpp running requests do not share chunks, so ``n4`` measures nothing there.)
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specdec import LLM, SamplingParams

SOURCE = Path(__file__).resolve().parents[1] / "specdec" / "engine.py"


def timed(llm: LLM, reuse: bool, warm, run) -> tuple[float, list[list[int]]]:
    """``run(llm)``'s seconds and token ids on a new engine (made with ``enable_prefix_caching``
    as ``reuse`` says: off, neither a kept prompt nor running requests' shared chunks, the
    target's or a draft model's, are reused): with reuse, after ``warm(llm)`` (the first turn,
    which leaves its prompt in the slots); without, from scratch."""
    if warm and reuse:
        warm(llm)
    t = time.perf_counter()
    outs = run(llm)
    return time.perf_counter() - t, [c.token_ids for o in outs for c in o.outputs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
    p.add_argument("--cases", default="turn2,turn2-draft,n4", help="comma list (default %(default)s)")
    a = p.parse_args()
    base = LLM(a.model, draft=a.draft, backend=a.backend)
    turn = [{"role": "user", "content": "Review this code:\n" + SOURCE.read_text()[:2400]}]
    first = base.chat(turn, SamplingParams(max_tokens=16))[0]
    follow = turn + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "Rewrite the first function with type hints."}]
    cases = {
        "turn2": (lambda reuse: LLM(base.target, enable_prefix_caching=reuse),
                  lambda m: m.chat(turn, SamplingParams(max_tokens=16)),
                  lambda m: m.chat(follow, SamplingParams(max_tokens=1))),
        "n4": (lambda reuse: LLM(base.target, enable_prefix_caching=reuse), None,
               lambda m: m.chat(turn, SamplingParams(max_tokens=16, n=4, temperature=0.8, seed=1))),
    }
    if a.draft:
        cases["turn2-draft"] = (lambda reuse: LLM(base.target, draft=base.draft, enable_prefix_caching=reuse),
                                lambda m: m.chat(turn, SamplingParams(max_tokens=16)),
                                lambda m: m.chat(follow, SamplingParams(max_tokens=a.max_new_tokens)))
    cases = {name: case for name, case in cases.items() if name in a.cases.split(",")}
    print(f"first turn {len(first.prompt_token_ids)} prompt tokens, second {len(base.encode(follow))}")
    failed = 0
    for name, (make, warm, run) in cases.items():
        times, outs = {True: [], False: []}, {}
        for _ in range(a.repeats):
            for reuse in (False, True):
                seconds, outs[reuse] = timed(make(reuse), reuse, warm, run)
                times[reuse].append(seconds)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        same = outs[True] == outs[False]
        failed += not same
        print(f"{name:12s} reuse {on:6.2f} s   without {off:6.2f} s   {off / on:4.2f}x   same tokens: {same}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

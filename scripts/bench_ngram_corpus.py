"""The n-gram drafter reading other requests' texts (``ngram_capacity``), side by side in one
process: each case with the corpus on and off, in turns, on engines sharing one loaded target,
medians of ``--repeats``; greedy cases must give the same tokens both ways.

Cases (the prompts of ``--prompts-file``, one request at a time unless said):
  first    each prompt once, after the others before it: what a history of other tasks gives
  again    the prompts once (untimed), then all of them again, timed: a request asked again
  n8       one chat prompt drawn ``n=8`` times at temperature 0.7, one completion at a time
           (each reads the finished ones)
  n8-batch the same with the 8 completions side by side (each reads the running ones)

    python scripts/bench_ngram_corpus.py --model TARGET [--repeats 3] [--cost-model]
        [--backend torch|llamacpp] [--cases first,again,n8,n8-batch]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdec import LLM, SamplingParams, SpecConfig

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"
N8 = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, with a docstring."}]


def ask(llm: LLM, prompt: dict, sp: SamplingParams):
    return (llm.chat(prompt["messages"], sp, use_tqdm=False) if "messages" in prompt
            else llm.generate(prompt["prompt"], sp, use_tqdm=False))[0]


def run_case(case: str, llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[float, list, int, int]:
    """(seconds timed, token ids, drafted, accepted) of one case on a fresh engine."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    if case == "again":
        for p in prompts:
            ask(llm, p, greedy)
    if case in ("first", "again"):
        t, outs = time.perf_counter(), [ask(llm, p, greedy) for p in prompts]
    else:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.7, n=8, seed=1)
        t, outs = time.perf_counter(), [llm.chat(N8, sp, use_tqdm=False)[0]]
    seconds = time.perf_counter() - t
    ids = [list(c.token_ids) for o in outs for c in o.outputs]
    drafted = sum(o.metrics["drafted_tokens"] or 0 for o in outs)
    accepted = sum(o.metrics["accepted_tokens"] or 0 for o in outs)
    return seconds, ids, drafted, accepted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts-file", default=str(PROMPTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--capacity", type=int, default=1_000_000, help="ngram_capacity with the corpus on")
    p.add_argument("--cost-model", action="store_true", help="the cost model chooses k (default: k fixed)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    p.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
    p.add_argument("--cases", default="first,again,n8,n8-batch", help="comma list (default %(default)s)")
    a = p.parse_args()
    prompts = [json.loads(line) for line in open(a.prompts_file) if line.strip()]
    base = LLM(a.model, backend=a.backend)
    print(f"{a.model}: {len(prompts)} prompts, {a.max_new_tokens} tokens, k={a.num_draft_tokens}"
          f"{', cost model' if a.cost_model else ''}, medians of {a.repeats}")
    print("| case | tok/s, own text | tok/s, with the corpus | ratio | accepted / drafted, own | with the corpus |")
    print("|---|---:|---:|---:|---:|---:|")
    ok = True
    for case in a.cases.split(","):
        times, got = {0: [], a.capacity: []}, {}
        for _ in range(a.repeats):
            for cap in times:  # in turns
                spec = SpecConfig(method="ngram", ngram_capacity=cap, num_draft_tokens=a.num_draft_tokens,
                                  cost_model=a.cost_model)
                llm = LLM(base.target, speculative=spec, max_batch_size=8 if case == "n8-batch" else 1)
                seconds, ids, drafted, accepted = run_case(case, llm, prompts, a.max_new_tokens)
                times[cap].append(sum(map(len, ids)) / seconds)
                got[cap] = ids, drafted, accepted
        if case in ("first", "again") and got[0][0] != got[a.capacity][0]:
            ok = False
            print(f"{case}: the greedy tokens differ with the corpus")
        own, corpus = statistics.median(times[0]), statistics.median(times[a.capacity])
        print(f"| {case} | {own:.1f} | {corpus:.1f} | {corpus / own:.2f}x | {got[0][2]} / {got[0][1]} | "
              f"{got[a.capacity][2]} / {got[a.capacity][1]} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

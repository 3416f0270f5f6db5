"""Structured outputs under speculation: plain, n-gram, draft-model and hybrid decoding of one chat
answer, free and under a JSON schema, in turns in one process (Qwen2.5-Coder-1.5B target,
0.5B draft, torch runtime). Prints tokens per second per run, the medians, and whether each
method's tokens equal plain decoding's.

    python scripts/bench_structured.py [repeats]      # default 3; models from
    # ../shared/models/fetch-models.sh qwen-coder (in $SPECDEC_MODELS, default ~/.cache/specdec-models)
"""
import argparse
import json
import os
import statistics
import time

import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.runtime import load_model

MODELS = os.path.expanduser(os.environ.get("SPECDEC_MODELS", "~/.cache/specdec-models"))
TARGET = f"{MODELS}/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = f"{MODELS}/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TEST = {"type": "object", "additionalProperties": False, "required": ["input", "expected"],
        "properties": {"input": {"type": "string"}, "expected": {"type": "string"}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "signature", "complexity", "tests"],
          "properties": {"name": {"type": "string"}, "signature": {"type": "string"},
                         "complexity": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)"]},
                         "tests": {"type": "array", "items": TEST, "maxItems": 3}}}
MESSAGES = [{"role": "user", "content": "Describe a Python function that checks whether a string is a palindrome, "
                                        "as JSON with name, signature, complexity and up to 3 tests."}]


def main(repeats: int) -> None:
    torch.set_num_threads(2)
    target, draft = load_model(TARGET, backend="torch"), load_model(DRAFT, backend="torch")
    llms = {"plain": LLM(target), "ngram": LLM(target, speculative=SpecConfig(method="ngram")),
            "draft": LLM(target, draft=draft, speculative=SpecConfig(method="draft")),
            "hybrid": LLM(target, draft=draft, speculative=SpecConfig(method="hybrid"))}
    for llm in llms.values():  # llguidance's tokenizer, built once per LLM: not timed
        llm.grammars.lltokenizer()
    runs: dict[tuple[str, str], list] = {}
    for rep in range(repeats):
        for name, llm in llms.items():
            for mode, so in (("free", None), ("json", {"json": SCHEMA})):
                t = time.perf_counter()
                out = llm.chat(MESSAGES, SamplingParams(max_tokens=96, structured_outputs=so))[0]
                rate = len(out.token_ids) / (time.perf_counter() - t)
                runs.setdefault((name, mode), []).append((rate, out.token_ids))
                print(rep, name, mode, f"{rate:.2f} tok/s", len(out.token_ids), "tokens, acceptance",
                      out.metrics["acceptance_rate"], flush=True)
    for (name, mode), got in runs.items():
        same = got[0][1] == runs["plain", mode][0][1]
        print(f"{name} {mode}: median {statistics.median(r for r, _ in got):.2f} tok/s, tokens equal to plain: {same}")
    print("constrained answer:", json.dumps(llms["plain"].tokenizer.decode(runs["plain", "json"][0][1])))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repeats", type=int, nargs="?", default=3, help="runs per method and mode (default 3)")
    main(parser.parse_args().repeats)

"""``specdec bench``: specdec vs transformers' ``generate`` and llama-cpp-python, side by
side, in one run (llama-cpp-python's and specdec's methods in turns, run by run).

The methods, greedy (or sampled alike with ``--temperature``), batch size 1, on the prompts
of a JSONL file:

* ``specdec-plain`` / ``specdec-draft`` / ``specdec-ngram`` / ``specdec-hybrid`` -
  ``specdec.LLM`` with ``SpecConfig(method="none" | "draft" | "ngram" | "hybrid")``;
* ``specdec-ngram-tree`` - n-gram with ``tree_topk=3`` (several matches as tree branches);
* ``specdec-draft-tree`` - the draft model's top-k token tree (EAGLE-2 style), one method per
  ``--tree-shapes`` entry ``TOPKxDEPTHxNODES``, labelled e.g. ``specdec-draft-tree:2x4x8``;
* ``specdec-eagle`` / ``specdec-eagle-tree`` - the same with the EAGLE or EAGLE-3 head
  ``--eagle`` for the target as the draft (chains, and trees per ``--tree-shapes``);
* ``hf-plain`` / ``hf-assisted`` / ``hf-lookup`` - ``model.generate(do_sample=False)``, plain,
  with ``assistant_model=`` the draft, and with ``prompt_lookup_num_tokens=10``;
* ``llamacpp-plain`` / ``llamacpp-lookup`` - llama-cpp-python's ``Llama.create_completion``
  (temperature 0) on the target GGUF, plain and with ``LlamaPromptLookupDecoding(num_pred_tokens=10)``.

``--backend`` is the runtime of the specdec methods: ``torch`` (the GGUF dequantized to
float32, or an HF checkpoint) or ``llamacpp`` (the GGUF on llama.cpp). Every method gets the
same prompt token ids (``encode_prompt``, as ``LLM.encode``) and the same eos ids. Only the
generation call is timed (one untimed 8-token warm-up per method first), with its time to
the first token, so that decode speed (prefill left out) is reported too; every run prefills
its whole prompt (specdec's without prefix reuse). The transformers
models are freed before the others load (never both in memory); llama-cpp-python's and
specdec's methods are then timed in turns, prompt by prompt and repeat by repeat, so that a
drift in the machine's speed reaches every method alike.

Greedy outputs are checked within each numeric family: every method's tokens (up to and
including the first eos) must equal its family's reference - ``hf-plain`` for the
transformers methods and for specdec on torch on the CPU in float32 (the same weights, logits
equal to 1e-4), ``llamacpp-plain`` for llama-cpp-python's, ``specdec-plain`` for specdec on
llama.cpp (llama-cpp-python's F16 KV cache and whole products of several rows round unlike
specdec's exact settings), on a GPU or in 16-bit. Sampled (``--temperature`` > 0), every
method samples with the same top_p / top_k (each library's other sampling defaults off),
repeat r with seed + r, and outputs are draws, not compared. ``--load-format dummy`` runs
specdec and transformers on random weights of the models' shapes (their speed without the
weights). The exit
code is 1 when a specdec method diverges other than by near-tie flips (``near_ties_only``; a
peer's divergence is only reported, e.g.
llama-cpp-python's prompt lookup verifies with other kernels than its plain decoding). Writes ``<out>/bench.json``, ``<out>/bench.md`` and ``<out>/bench.png``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from .config import DRAFT_METHODS
from .bench_report import bound_table, median, ratio, tables, vs_key, write_plot
from .sequence import cut_after_eos

METHODS = ("specdec-plain", "specdec-draft", "specdec-ngram", "specdec-hybrid", "specdec-ngram-tree",
           "specdec-draft-tree", "specdec-eagle", "specdec-eagle-tree", "hf-plain", "hf-assisted", "hf-lookup",
           "llamacpp-plain", "llamacpp-lookup")
BASELINES = ("hf-plain", "llamacpp-plain")  # speed ratios are reported against each one present
GGUF_TYPES = " for torch and transformers (llama.cpp runs the GGUF's own types)"  # what the dtype applies to
# a greedy output may part from its reference where the top-2 logits are this near (relative to
# the top one): two steps of bfloat16 / float16 (tests/test_cuda.py's rule); float32: 1e-4, the
# runtimes' parity
NEAR_TIE = {"float32": 1e-4, "bfloat16": 2 ** -6, "float16": 2 ** -9}
SHAPED = ("specdec-draft-tree", "specdec-eagle-tree")  # one method per --tree-shapes entry
COST_SUFFIX = "+cost"  # e.g. specdec-ngram+cost: the same drafter with the cost model choosing k
DEFAULT_TREE_SHAPES = "2x4x8"
NGRAM_TREE_TOPK = 3  # specdec-ngram-tree: up to 3 matches' continuations as branches
HF_LOOKUP_TOKENS = 10
LLAMACPP_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8
COST_CURVE_TOKENS = 17  # the target's cost curve in the report: forwards of 1..17 tokens (the draft's: 1..16)
DEFAULT_MODEL = "~/.cache/specdec-models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DEFAULT_DRAFT = "~/.cache/specdec-models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_PROMPTS = os.path.join("..", "shared", "bench", "prompts.jsonl")


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    from .config import LOAD_FORMATS, EngineConfig

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: .gguf file, HF model dir or hub id (default %(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT,
                   help="draft model for specdec-draft, -hybrid, -draft-tree and hf-assisted (default %(default)s)")
    p.add_argument("--eagle", default=None,
                   help="EAGLE or EAGLE-3 head for --model (a directory or hub id), the draft of specdec-eagle and "
                        "specdec-eagle-tree (torch backend)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=4,
                   help="k, the most draft tokens per step, for every specdec method that drafts "
                        "(default %(default)s); hf-assisted keeps transformers' own assistant settings")
    p.add_argument("--draft-quantization", choices=["auto", "none", "int8"], default="auto",
                   help="every specdec method's draft weights (auto = int8 on CPU float32; lossless either way)")
    p.add_argument("--tree-topk", type=int, default=NGRAM_TREE_TOPK,
                   help="specdec-ngram-tree: matches as branches (default %(default)s)")
    p.add_argument("--tree-depth", type=int, help="specdec-ngram-tree depth (default: k)")
    p.add_argument("--tree-nodes", type=int, help="specdec-ngram-tree node budget (default: depth * topk)")
    p.add_argument("--tree-shapes", default=DEFAULT_TREE_SHAPES,
                   help="specdec-draft-tree and specdec-eagle-tree shapes, comma list of TOPKxDEPTHxNODES "
                        "(tree_topk, tree_depth, tree_nodes; default %(default)s)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, with the equality check (default); above 0 every method samples "
                        "(top_p, top_k below, nothing else: no min_p, no penalties) and outputs are "
                        "draws, not compared token by token")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0 (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature > 0; 0 = off (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature > 0: repeat r of every method draws with seed + r (default %(default)s)")
    p.add_argument("--prompts-file", default=DEFAULT_PROMPTS,
                   help="JSONL: {id, kind: chat|completion, messages|prompt} (default %(default)s)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per prompt and method; medians are reported (sampled: means of the "
                        "draws) (default %(default)s)")
    p.add_argument("--methods", default=None,
                   help="comma list, a subset of: " + ",".join(METHODS) + " (default all, the specdec-eagle ones "
                        "with --eagle only); a speculative specdec method with +cost (e.g. specdec-ngram+cost) "
                        "runs it with the cost model")
    p.add_argument("--backend", choices=["torch", "llamacpp"], default="torch",
                   help="runtime of the specdec methods: torch (float32 on cpu) or llamacpp "
                        "(the .gguf files as they are; needs llama-cpp-python) (default %(default)s)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="for both sides (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--repack", action=argparse.BooleanOptionalAction, default=EngineConfig.repack,
                   help="--backend llamacpp: llama.cpp's repacked CPU weights for specdec's models "
                        "(llama-cpp-python's runners always use them, its default) (default on)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=EngineConfig.load_format,
                   help="dummy: random weights of the models' shapes for specdec and transformers "
                        "(only config and tokenizer are read; not with llama.cpp), to measure speed "
                        "without the weights: acceptance then means nothing (default %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="specdec's torch runtime on cuda without CUDA graphs (transformers runs eagerly either way)")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads, also llama.cpp's threads (default: torch's)")
    p.add_argument("--out", default="bench-results", help="output directory (default %(default)s/)")


# ----------------------------------------------------------------------------- helpers


def _parse_methods(text: str) -> list[str]:
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    costed = [m + COST_SUFFIX for m in METHODS if m.startswith("specdec-") and m != "specdec-plain"]
    bad = [m for m in chosen if m not in METHODS and m not in costed]
    if bad or not chosen:
        raise ValueError(f"--methods: unknown method(s) {', '.join(bad) or '(none given)'}; "
                         f"choose from {','.join(METHODS)} (speculative specdec methods also with "
                         f"a {COST_SUFFIX} suffix)")
    return [x for m in METHODS for x in (m, m + COST_SUFFIX) if x in chosen]  # canonical order


def parse_tree_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"2x4x8,3x3x9"`` -> ``[(topk, depth, nodes), ...]``, each validated by ``SpecConfig``."""
    from .config import SpecConfig

    shapes = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        try:
            topk, depth, nodes = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--tree-shapes: {part!r} is not TOPKxDEPTHxNODES, e.g. 2x4x8") from None
        SpecConfig(method="draft", tree_topk=topk, tree_depth=depth, tree_nodes=nodes)
        shapes.append((topk, depth, nodes))
    if not shapes:
        raise ValueError("--tree-shapes: no shape given")
    return shapes


def _labels(methods: list[str], shapes) -> list[str]:
    """Method labels: ``specdec-draft-tree`` and ``specdec-eagle-tree`` become one label per
    tree shape."""
    out = []
    for m in methods:
        base, cost = m.removesuffix(COST_SUFFIX), m[len(m.removesuffix(COST_SUFFIX)):]
        out += [f"{base}:{t}x{d}x{n}{cost}" for t, d, n in shapes] if base in SHAPED else [m]
    return out


def _spec(label: str, args):
    """``SpecConfig`` for a specdec method label (``specdec-draft-tree:2x4x8+cost`` ...)."""
    from .config import SpecConfig

    name = label.removesuffix(COST_SUFFIX)
    common = dict(num_draft_tokens=args.num_draft_tokens, cost_model=label.endswith(COST_SUFFIX),
                  draft_quantization=args.draft_quantization)
    if name.split(":")[0] in SHAPED:
        topk, depth, nodes = (int(v) for v in name.split(":")[1].split("x"))
        return SpecConfig(method="draft", tree_topk=topk, tree_depth=depth, tree_nodes=nodes, **common)
    if name == "specdec-ngram-tree":
        return SpecConfig(method="ngram", tree_topk=args.tree_topk, tree_depth=args.tree_depth,
                          tree_nodes=args.tree_nodes, **common)
    if name == "specdec-eagle":  # a head as the draft: its kind, eagle or eagle3
        return SpecConfig(method="draft", **common)
    return SpecConfig(method=name.removeprefix("specdec-").replace("plain", "none"), **common)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_gb() -> str:
    try:
        kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
        return f"{kb / 2**20:.1f} GB"
    except (OSError, StopIteration, ValueError):
        return "?"


# ----------------------------------------------------------------------------- runners
# A runner is ``run(ids, max_new_tokens, seed) -> (token_ids, stats)``; timing happens outside.
# ``sampling`` is ``{}`` (greedy) or ``{"temperature": T, "top_p": P, "top_k": K}``, which
# each runner passes with every other sampling option of its library off; ``seed`` seeds a
# sampled run.


def _specdec_runner(llm, sampling: dict):
    from .config import SamplingParams

    def run(ids, max_new_tokens, seed):
        sp = SamplingParams(max_tokens=max_new_tokens, seed=seed if sampling else None, **sampling)
        out = llm.generate({"prompt_token_ids": list(ids)}, sp, use_tqdm=False)[0]
        m = out.metrics
        stats = {k: m.get(k) for k in (
            "target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens", "verify_steps",
            "acceptance_rate", "mean_accepted_length", "nodes_per_verify_step",
            "accepted_per_position", "drafted_per_position", "chosen_k", "drafter_steps", "time_split_s")}
        return list(out.token_ids), {**stats, "ttft_s": m["time_split_s"]["prefill"]}  # prefill commits token 1

    return run


class FirstToken:
    """A ``generate(streamer=...)`` that notes when the first new token arrives (its first
    ``put`` is the prompt, each later one new tokens), and how many came with it: assisted
    generation and prompt lookup verify their first drafts in the prompt's forward, so the
    first new tokens can be several."""

    def __init__(self):
        self.start, self.first, self.puts, self.tokens = time.perf_counter(), None, 0, 1

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first, self.tokens = time.perf_counter(), max(int(value.numel()), 1)

    def end(self) -> None:
        pass

    def seconds(self) -> float | None:
        return None if self.first is None else self.first - self.start


def _hf_runner(model, eos: list[int], device, sampling: dict, **extra):
    """``model.generate``, greedy or sampled (over the model's own generation config: no
    repetition penalty, top_k / top_p only as given); counts target forwards, and drafted /
    accepted tokens of the candidate generator (assisted and prompt-lookup) by wrapping the
    generator transformers builds."""
    import torch

    counts = {}

    def count_forward(_module, _args):
        counts["target_forwards"] += 1

    hook = model.register_forward_pre_hook(count_forward)
    original = model._get_candidate_generator

    def get_candidate_generator(*args, **kwargs):
        gen = original(*args, **kwargs)
        get_candidates, update = gen.get_candidates, gen.update_candidate_strategy

        def counted_get_candidates(input_ids, *a, **kw):
            cand, logits = get_candidates(input_ids, *a, **kw)
            counts["drafted_tokens"] += cand.shape[-1] - input_ids.shape[-1]
            return cand, logits

        def counted_update(input_ids, scores, num_matches, *a, **kw):
            counts["accepted_tokens"] += int(num_matches)
            counts["verify_steps"] += 1
            return update(input_ids, scores, num_matches, *a, **kw)

        gen.get_candidates, gen.update_candidate_strategy = counted_get_candidates, counted_update
        return gen

    if extra:  # instance attribute shadows GenerationMixin._get_candidate_generator
        model._get_candidate_generator = get_candidate_generator

    how = ({"do_sample": True, "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "top_k": sampling["top_k"]} if sampling else {"do_sample": False})

    def run(ids, max_new_tokens, seed):
        counts.update(target_forwards=0, drafted_tokens=0, accepted_tokens=0, verify_steps=0)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        first = FirstToken()
        if sampling:
            torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                                 repetition_penalty=1.0, streamer=first, **how, **extra)
        new = out[0, input_ids.shape[1]:].tolist()
        stats = {"target_forwards": counts["target_forwards"], "ttft_s": first.seconds(), "ttft_tokens": first.tokens}
        if extra:
            n = len(cut_after_eos(new, frozenset(eos)))
            drafted = counts["drafted_tokens"]
            stats.update(drafted_tokens=drafted, accepted_tokens=counts["accepted_tokens"],
                         verify_steps=counts["verify_steps"],
                         acceptance_rate=counts["accepted_tokens"] / drafted if drafted else None,
                         # every round is one target forward (the first one includes the prompt)
                         mean_accepted_length=n / counts["verify_steps"] if counts["verify_steps"] else None)
        return new, stats

    def close():
        hook.remove()
        model.__dict__.pop("_get_candidate_generator", None)

    run.close = close
    return run


def _llamacpp_runner(gguf: Path, context: int, threads: int, lookup: bool, sampling: dict):
    """llama-cpp-python's ``Llama.create_completion`` (temperature 0, or ``sampling`` with its
    top_k 40 and min_p 0.05 defaults off; its default settings otherwise), optionally with its
    ``LlamaPromptLookupDecoding``. The tokens come from the ``Llama.generate`` calls that
    ``create_completion`` makes (wrapped on the instance); ``reset()`` before each run, so
    every run prefills its whole prompt as specdec does."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    counts = {"target_forwards": 0, "drafted_tokens": 0}

    class CountedLookup(LlamaPromptLookupDecoding):
        def __call__(self, input_ids, *a, **kw):
            draft = super().__call__(input_ids, *a, **kw)
            counts["drafted_tokens"] += len(draft)
            return draft

    draft = CountedLookup(num_pred_tokens=LLAMACPP_LOOKUP_TOKENS) if lookup else None
    llm = Llama(str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                n_gpu_layers=0, draft_model=draft, verbose=False)
    got: list[int] = []
    first = {}  # when the run started and when its first token came
    generate, evaluate = llm.generate, llm.eval

    def recorded_generate(*a, **kw):
        for token in generate(*a, **kw):
            got.append(token)
            first.setdefault("token", time.perf_counter())
            yield token

    def counted_eval(tokens):
        counts["target_forwards"] += 1
        return evaluate(tokens)

    llm.generate, llm.eval = recorded_generate, counted_eval

    how = ({"temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": sampling["top_k"],
            "min_p": 0.0} if sampling else {"temperature": 0.0})

    def run(ids, max_new_tokens, seed):
        got.clear()
        counts.update(target_forwards=0, drafted_tokens=0)
        first.clear()
        first["start"] = time.perf_counter()
        llm.reset()
        llm.create_completion(list(ids), max_tokens=max_new_tokens, seed=seed, **how)
        stats = {"target_forwards": counts["target_forwards"],
                 "ttft_s": first["token"] - first["start"] if "token" in first else None}
        if lookup:  # the prefill commits one token, each later forward its accepted drafts + 1
            drafted, accepted = counts["drafted_tokens"], max(len(got) - counts["target_forwards"], 0)
            stats.update(drafted_tokens=drafted, accepted_tokens=accepted,
                         acceptance_rate=accepted / drafted if drafted else None)
        return list(got), stats

    run.close = llm.close
    return run


def _time_methods(runs: dict, prompts, args, device, eos, log) -> dict[str, list[dict]]:
    """Warm each method up once, then time every prompt ``args.repeats`` times, the methods
    taking turns run by run (so a drift in the machine's speed hits them all alike); one
    record per method and prompt."""
    for run in runs.values():
        run(prompts[0]["ids"], min(WARMUP_TOKENS, args.max_new_tokens), args.seed)  # untimed warm-up
    records: dict[str, list[dict]] = {m: [] for m in runs}
    for p in prompts:
        secs = {m: [] for m in runs}
        ttft = {m: [] for m in runs}
        ttft_tokens = {m: [] for m in runs}  # tokens that came with the first (several: hf-assisted)
        outs = {m: [] for m in runs}
        stats = {m: [] for m in runs}
        for r in range(args.repeats):
            for m, run in runs.items():
                _sync(device)
                t0 = time.perf_counter()
                ids, st = run(p["ids"], args.max_new_tokens, args.seed + r)
                _sync(device)
                secs[m].append(time.perf_counter() - t0)
                ttft[m].append(st.pop("ttft_s", None))
                ttft_tokens[m].append(st.pop("ttft_tokens", 1))
                outs[m].append(cut_after_eos(ids, eos))
                stats[m].append(st)
        for m in runs:
            # greedy: every repeat is the same output, so the median time; sampled: the draws
            # differ in length, so their mean length over their mean time (all tokens / all seconds)
            sampled = args.temperature > 0
            counters = pool_draws(stats[m])  # the mean repeat (a cost model's choices vary)
            first, n = outs[m][0], statistics.mean(len(o) for o in outs[m]) if sampled else len(outs[m][0])
            average = statistics.mean if sampled else statistics.median
            med = average(secs[m])
            decode = decode_s = None  # seconds after the first token, tokens after it per second
            if None not in ttft[m]:
                decode_s = average(t - f for t, f in zip(secs[m], ttft[m]))
                after = n - statistics.mean(min(f, len(o)) for f, o in zip(ttft_tokens[m], outs[m]))
                decode = after / decode_s if after > 0 and decode_s > 0 else None
            rec = {"id": p["id"], "prompt_tokens": len(p["ids"]), "generated_tokens": n,
                   "hit_eos": bool(first and first[-1] in eos), "seconds": secs[m], "median_s": med,
                   "tokens_per_s": n / med if med > 0 else None, "ttft_s": ttft[m],
                   "median_decode_s": decode_s, "decode_tokens_per_s": decode, **counters,
                   "token_ids": first,
                   "repeats_identical": all(r == first for r in outs[m]), "_all_ids": outs[m]}
            records[m].append(rec)
            log(f"  {m:<24} {p['id']:<16} {round(n, 1):>5} tok  {med:7.2f}s  {rec['tokens_per_s']:7.2f} tok/s")
    return records


# ----------------------------------------------------------------------------- main


class BenchRun:
    """One ``specdec bench`` run: its flags checked, the models' paths resolved, the prompts
    encoded (``__init__``); then ``time_transformers``, ``load_specdec``, ``time_in_turns``,
    ``summarize`` and ``write``, which fill ``results`` (per method: a record per prompt),
    ``load_s`` and ``cost_curve`` (seconds of one forward of n = 1.. tokens, per model)."""

    def __init__(self, args):
        import torch

        from .api import encode_prompt
        from .cli import read_prompts_file
        from .config import SpecConfig
        from .runtime.loading import eos_ids_of, gguf_file, gguf_to_hf_dir, pick_device, pick_dtype, resolve

        self.args = args
        self.shapes = parse_tree_shapes(args.tree_shapes)
        chosen = args.methods or ",".join(m for m in METHODS if args.eagle or not m.startswith("specdec-eagle"))
        self.methods = methods = _labels(_parse_methods(chosen), self.shapes)
        for flag, value in (("max-new-tokens", args.max_new_tokens), ("repeats", args.repeats),
                            ("limit", args.limit), ("threads", args.threads)):
            if value is not None and value < 1:
                raise ValueError(f"--{flag} must be >= 1, got {value}")
        SpecConfig(method="draft", num_draft_tokens=args.num_draft_tokens)  # validates k
        self.sampling = bench_sampling(args)
        self.needs_draft = any(m.startswith(("specdec-draft", "specdec-hybrid", "hf-assisted")) for m in methods)
        if self.needs_draft and not args.draft:
            raise ValueError("specdec-draft, specdec-hybrid, specdec-draft-tree and hf-assisted need --draft")
        self.on_llamacpp = on_llamacpp = args.backend == "llamacpp"
        self.needs_eagle = any(m.startswith("specdec-eagle") for m in methods)
        if self.needs_eagle and (not args.eagle or on_llamacpp):
            raise ValueError("specdec-eagle and specdec-eagle-tree need --eagle (an EAGLE head for --model) and "
                             "--backend torch")
        self.sd_methods = [m for m in methods if m.startswith("specdec-")]
        self.hf_methods = [m for m in methods if m.startswith("hf-")]
        self.peers = peers = [m for m in methods if m.startswith("llamacpp-")]
        self.dummy = args.load_format == "dummy"
        if self.dummy and (peers or (on_llamacpp and self.sd_methods)):
            raise ValueError("--load-format dummy: llama.cpp runs a GGUF's own weights; "
                             "use --backend torch and leave the llamacpp-* methods out")
        if (peers or on_llamacpp) and importlib.util.find_spec("llama_cpp") is None:
            raise ValueError(f"{', '.join(peers) or '--backend llamacpp'} need(s) llama-cpp-python: "
                             "pip install 'specdec[llamacpp]', or leave them out of --methods")
        self.gguf = gguf_file(args.model) if on_llamacpp or peers else None
        self.draft_gguf = gguf_file(args.draft) if on_llamacpp and self.needs_draft else None
        if on_llamacpp and self.sd_methods and (args.device not in (None, "cpu") or args.dtype not in (None, "float32")):
            raise ValueError("--backend llamacpp runs on cpu with the GGUF's own weight types: "
                             "drop --device / --dtype")
        self.items = read_prompts_file(args.prompts_file)[: args.limit]
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = pick_device(args.device)
        self.dtype = pick_dtype(args.dtype, self.device)

        # float32 weights only where transformers or specdec's torch runtime run them
        full = (bool(self.hf_methods) or (self.sd_methods and not on_llamacpp)) and not self.dummy
        self.target_path = resolve(args.model, full) if not on_llamacpp else gguf_to_hf_dir(self.gguf, weights=full)
        self.draft_path = (resolve(args.draft, full) if not on_llamacpp else
                           gguf_to_hf_dir(self.draft_gguf, weights=full)) if self.needs_draft else None
        self.eagle_path = resolve(args.eagle) if self.needs_eagle else None  # a head's weights, even with dummy ones
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.target_path)
        self.eos = eos_ids_of(self.target_path, AutoConfig.from_pretrained(self.target_path), tokenizer)
        self.eos_list = sorted(self.eos)
        self.prompts = [{"id": pid, "ids": encode_prompt(tokenizer, prompt)} for pid, prompt in self.items]
        self.mode = describe_sampling(self.sampling, args)
        self.refs = references(methods, own_family=on_llamacpp or (self.device.type, self.dtype) != ("cpu", torch.float32))
        self.results: dict[str, list[dict]] = {}
        self.load_s: dict[str, float] = {}
        self.cost_curve: dict[str, list[float]] = {}
        self.log(f"specdec bench: {len(self.prompts)} prompt(s), methods {','.join(methods)}, {self.mode}, "
                 f"max_new_tokens {args.max_new_tokens}, repeats {args.repeats}, specdec on {args.backend}, "
                 f"{self.device} {str(self.dtype)[6:]}{GGUF_TYPES if on_llamacpp or peers else ''}, "
                 f"{torch.get_num_threads()} threads")

    @staticmethod
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def time_in_turns(self, runs: dict) -> None:
        self.results.update(_time_methods(runs, self.prompts, self.args, self.device, self.eos, self.log))

    def time_transformers(self) -> None:
        """transformers' ``generate``, each method alone; its models are freed before specdec
        loads its own copy (never both in memory)."""
        import torch

        from .runtime.loading import load_hf_model

        t0 = time.perf_counter()
        hf_target = load_hf_model(self.target_path, self.device, self.dtype, self.args.load_format)
        hf_draft = None
        if "hf-assisted" in self.hf_methods:
            hf_draft = load_hf_model(self.draft_path, self.device, self.dtype, self.args.load_format)
        self.load_s["hf"] = time.perf_counter() - t0
        self.log(f"transformers models loaded in {self.load_s['hf']:.1f}s (rss {_rss_gb()})")
        for m in self.hf_methods:
            extra = {"hf-plain": {}, "hf-assisted": {"assistant_model": hf_draft},
                     "hf-lookup": {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}}[m]
            self.log(f"{m}:")
            run = _hf_runner(hf_target, self.eos_list, self.device, self.sampling, **extra)
            self.time_in_turns({m: run})
            run.close()
        del hf_target, hf_draft, extra, run
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.log(f"transformers models freed (rss {_rss_gb()})")

    def load_specdec(self) -> dict:
        """An ``LLM`` per specdec method, ``specdec-plain`` first; every one shares its target,
        and those that draft with the draft model (or the EAGLE head) share one copy of it.
        Checks that specdec's eos ids and prompt ids are the bench's, and reads the cost curves."""
        from .api import CATCH_UP_TOKENS, LLM
        from .config import SpecConfig
        from .cost import forward_costs

        args, on_llamacpp = self.args, self.on_llamacpp
        t0 = time.perf_counter()
        # (no prefix reuse: every run prefills its whole prompt, as transformers' and llama-cpp-python's runs do;
        # otherwise a prompt of 256 tokens or more would reuse the warm-up's chunks: scripts/bench_prefix_reuse.py)
        backend = {"backend": args.backend, "device": args.device, "dtype": args.dtype, "max_batch_size": 1,
                   "repack": args.repack, "load_format": args.load_format, "enforce_eager": args.enforce_eager,
                   "enable_prefix_caching": False}
        plain = LLM(str(self.gguf if on_llamacpp else self.target_path), speculative=SpecConfig(method="none"),
                    **backend)
        if on_llamacpp:  # llama.cpp (specdec's runtime and llama-cpp-python alike) stops at its own EOG tokens too
            self.eos = self.eos | plain.target.runtime.eog_ids()  # (Qwen2.5: 128247, its "</s>")
        if plain.target.eos_ids != self.eos:
            raise RuntimeError(f"eos ids differ: bench {sorted(self.eos)} vs specdec {sorted(plain.target.eos_ids)}")
        for p, (_, prompt) in zip(self.prompts, self.items):  # the ids every method gets are specdec's own
            if plain.encode(prompt) != p["ids"]:
                raise RuntimeError(f"prompt {p['id']}: token ids differ from LLM.encode")
        t_cost = time.perf_counter()  # measured (or read) before the +cost LLMs load: they
        self.cost_curve["target"] = list(forward_costs(plain.target, COST_CURVE_TOKENS).seconds)
        t_cost = time.perf_counter() - t_cost  # then read these from the cache, not measure again
        llms = {"specdec-plain": plain}
        drafts = {"draft": str(self.draft_gguf if on_llamacpp else self.draft_path), "eagle": str(self.eagle_path)}
        for m in self.sd_methods:
            if m == "specdec-plain":
                continue
            spec, which = _spec(m, args), "eagle" if m.startswith("specdec-eagle") else "draft"
            uses_draft = spec.method in DRAFT_METHODS
            llms[m] = LLM(plain.target, draft=drafts[which] if uses_draft else None, speculative=spec, **backend)
            if uses_draft:
                drafts[which] = llms[m].draft
        self.load_s["specdec"] = time.perf_counter() - t0 - t_cost
        self.log(f"specdec models loaded in {self.load_s['specdec']:.1f}s (rss {_rss_gb()})")
        for which, model in drafts.items():  # those loaded: a path still a str was not
            if not isinstance(model, str):
                # the sizes a +cost planner measured (and cached) for it: read, not measured again
                self.cost_curve[which] = list(forward_costs(model, CATCH_UP_TOKENS).seconds)
        target = self.cost_curve["target"]
        self.log(f"forward cost relative to 1 token ({target[0] * 1e3:.2f} ms): "
                 + " ".join(f"{n + 1}:{t / target[0]:.2f}" for n, t in enumerate(target)))
        return llms

    def summarize(self) -> dict[str, dict]:
        """Per method: totals and medians, its divergences from its reference, specdec's time
        split and drafts, acceptance; then each method's speed against each baseline run."""
        tolerance = None if self.on_llamacpp else NEAR_TIE[str(self.dtype).removeprefix("torch.")]
        summary = {m: summarize_method(m, self.results[m], self.results[self.refs[m]], self.refs[m],
                                       bool(self.sampling), tolerance) for m in self.methods}
        if "specdec-plain" in self.results and "target" in self.cost_curve and not self.sampling:
            add_chain_bounds(self.prompts, self.results["specdec-plain"], self.cost_curve["target"],
                             self.args.num_draft_tokens)
        for b in (b for b in BASELINES if b in summary):
            for s in summary.values():
                for how in ("median", "aggregate", "median_decode"):
                    key = f"{how}_tokens_per_s"
                    s[vs_key(b, how)] = ratio(s[key], summary[b][key])
        return summary

    def write(self, summary: dict) -> int:
        """``bench.json``, ``bench.md`` and ``bench.png`` under ``--out``; the tables and verdict
        printed. 1 when a specdec method's greedy tokens part from its reference's other than by
        near-tie flips, else 0."""
        import torch

        args, prompts, methods, sampling = self.args, self.prompts, self.methods, self.sampling
        machine = {"platform": platform.platform(), "python": platform.python_version(),
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                   "device": str(self.device), "dtype": str(self.dtype).replace("torch.", "")}
        if self.device.type == "cuda":
            machine["gpu"] = torch.cuda.get_device_name(self.device)
        if self.gguf is not None:
            machine["llama_cpp_python"] = __import__("llama_cpp").__version__
        argv0 = os.path.basename(sys.argv[0]) if sys.argv else "specdec"
        command = shlex.join(["specdec" if argv0 in ("specdec", "cli.py", "__main__.py") else argv0]
                             + sys.argv[1:])
        repacked = args.repack if self.on_llamacpp else None  # only llama.cpp repacks
        config = {"backend": args.backend, "repack": repacked, "load_format": args.load_format,
                  "enforce_eager": args.enforce_eager, "model": args.model, "model_dir": str(self.target_path),
                  "draft": args.draft if self.needs_draft else None,
                  "eagle": args.eagle if self.needs_eagle else None,
                  "eagle_dir": str(self.eagle_path) if self.eagle_path else None,
                  "draft_dir": str(self.draft_path) if self.draft_path else None,
                  "num_draft_tokens": args.num_draft_tokens,
                  "ngram_tree": {"topk": args.tree_topk, "depth": args.tree_depth, "nodes": args.tree_nodes},
                  "draft_tree_shapes": [list(x) for x in self.shapes],
                  "max_new_tokens": args.max_new_tokens, "sampling": sampling or "greedy",
                  "seeds": [args.seed, args.seed + args.repeats - 1] if sampling else None,
                  "prompts_file": os.path.abspath(args.prompts_file),
                  "num_prompts": len(prompts), "repeats": args.repeats, "methods": methods,
                  "references": self.refs, "eos_ids": self.eos_list, "hf_prompt_lookup_num_tokens": HF_LOOKUP_TOKENS,
                  "llamacpp_lookup_num_pred_tokens": LLAMACPP_LOOKUP_TOKENS,
                  "warmup_tokens": WARMUP_TOKENS, "load_seconds": self.load_s}
        baselines = [b for b in BASELINES if b in summary]
        text = tables(methods, summary, self.results, prompts, baselines) + \
            bound_table(methods, self.results, prompts)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(
            {"command": command, "config": config, "machine": machine, "summary": summary,
             "cost_curve_s": self.cost_curve, "per_prompt": self.results}, indent=1) + "\n")
        plot = write_plot(out / "bench.png", methods, summary, self.results, prompts, self.cost_curve)
        ok = all(s["diverged"] == 0 or s["near_ties_only"] for m, s in summary.items() if m.startswith("specdec-"))
        verdict = self.verdict(summary, ok)
        model_line = (f"- target `{args.model}`" + (f", draft `{args.draft}`" if self.needs_draft else "")
                      + (f", EAGLE head `{args.eagle}`" if self.needs_eagle else "")
                      + (f", k={args.num_draft_tokens}" if self.needs_draft or self.needs_eagle else "")
                      + (" - **random weights** (`--load-format dummy`): the speeds of these shapes; acceptance "
                         "and output mean nothing" if self.dummy else ""))
        md = ["# specdec bench", "", "```", command, "```", "", model_line,
              f"- {len(prompts)} prompt(s) from `{args.prompts_file}`, {self.mode}, max_new_tokens "
              f"{args.max_new_tokens}, batch size 1, repeats {args.repeats} "
              f"({'means' if args.temperature > 0 else 'medians'}), {WARMUP_TOKENS}-token warm-up per method",
              f"- specdec on the {args.backend} backend"
              + {True: " (repacked weights)", False: " (weights not repacked)", None: ""}[repacked] +
              f"; machine: {machine['platform']}, {machine['cpu_count']} CPUs, "
              f"torch {machine['torch']} with {machine['torch_threads']} threads, transformers "
              f"{machine['transformers']}, "
              + (f"llama-cpp-python {machine['llama_cpp_python']} (same threads), " if self.gguf is not None else "")
              + f"{machine['device']}{' (' + machine['gpu'] + ')' if 'gpu' in machine else ''} {machine['dtype']}"
              + (GGUF_TYPES if self.gguf is not None else ""),
              f"- hf-assisted uses transformers' default assistant settings; hf-lookup uses "
              f"prompt_lookup_num_tokens={HF_LOOKUP_TOKENS}; "
              f"HF mean accepted length = tokens / target forwards; llamacpp-lookup uses "
              f"LlamaPromptLookupDecoding(num_pred_tokens={LLAMACPP_LOOKUP_TOKENS})",
              ("- greedy references: " + ", ".join(f"{m} -> {r}" for m, r in self.refs.items() if m != r)
               if not sampling else "- sampled: no greedy references"), "",
              text, "", verdict, ""]
        (out / "bench.md").write_text("\n".join(md))
        print(text)
        print()
        print(verdict)
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f" and {plot}" if plot else
                                                                    " (no plot: pip install matplotlib)"))
        return 0 if ok else 1

    def verdict(self, summary: dict, ok: bool) -> str:
        """The report's last line: whether specdec's greedy tokens equal their references'."""
        if self.sampling:
            return ("sampled: outputs are draws, not compared token by token (the tests check specdec's "
                    "draws against the target's distribution)")
        flips = sum(s["diverged"] for m, s in summary.items() if m.startswith("specdec-"))
        peers = [m for m, s in summary.items() if s["diverged"] and not m.startswith("specdec-")]
        if not ok:
            head = "FAILED: a specdec method's greedy tokens differ from its reference's"
        elif flips:
            head = (f"OK: every specdec method's greedy tokens equal its reference's, but for {flips} near-tie "
                    "flip(s) (logit gaps in the table)")
        else:
            head = "OK: every specdec method's greedy tokens equal its reference's"
        return head + (f"; peers that differ from their own plain decoding: {', '.join(peers)}" if peers else "")


def run_bench(args) -> int:
    import torch

    bench = BenchRun(args)
    if bench.hf_methods:
        bench.time_transformers()
    # llama-cpp-python and specdec, timed in turns (llama.cpp maps the GGUF: little memory)
    context = max(len(p["ids"]) for p in bench.prompts) + args.max_new_tokens + LLAMACPP_LOOKUP_TOKENS + 1
    runs, llms = {}, {}
    for m in bench.peers:
        t0 = time.perf_counter()
        runs[m] = _llamacpp_runner(bench.gguf, context, torch.get_num_threads(), m == "llamacpp-lookup", bench.sampling)
        bench.load_s[m] = time.perf_counter() - t0
    if bench.sd_methods:
        llms = bench.load_specdec()
        runs.update({m: _specdec_runner(llms[m], bench.sampling) for m in bench.sd_methods})
    if runs:
        bench.log("timing " + ", ".join(runs) + " in turns:")
        bench.time_in_turns(runs)
        if llms and not bench.sampling:
            add_flip_gaps(llms["specdec-plain"], bench.prompts, bench.results, bench.refs)
        for run in runs.values():
            getattr(run, "close", lambda: None)()
        runs.clear()
        llms.clear()
        gc.collect()
    return bench.write(bench.summarize())


def summarize_method(m: str, recs: list[dict], ref_recs: list[dict], ref: str, sampled: bool,
                     tolerance: float | None) -> dict:
    """Method ``m``'s summary over its records (``recs``, one per prompt), against its
    reference's (``ref_recs`` of method ``ref``); pops each record's ``_all_ids``. A
    divergence passes only as a near-tie flip: on the torch runtime within the dtype's rounding
    (``tolerance``); on llama.cpp (exact verification, ``tolerance`` None) at most one on the
    bench prompts."""
    diverged = {}
    for rec, want in zip(recs, (r["token_ids"] for r in ref_recs)):
        draws = rec.pop("_all_ids")
        idx = [] if sampled else [i for i in (_first_diff(got, want) for got in draws) if i is not None]
        rec["first_diff_vs_ref"] = min(idx) if idx else None
        if idx:
            diverged[rec["id"]] = min(idx)
    tokens = sum(r["generated_tokens"] for r in recs)
    secs = sum(r["median_s"] for r in recs)
    s = {"median_tokens_per_s": median(r["tokens_per_s"] for r in recs),
         "median_decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in recs),
         "total_tokens": tokens, "total_seconds": secs,
         "aggregate_tokens_per_s": tokens / secs if secs > 0 else None,
         "target_forwards": sum(r["target_forwards"] for r in recs),
         "reference": None if sampled else ref, "diverged": len(diverged), "diverged_first_index": diverged,
         "flip_gaps": {r["id"]: r["flip_gap"] for r in recs if r.get("flip_gap") is not None}}
    s["near_ties_only"] = len(s["flip_gaps"]) == len(diverged) and (
        len(diverged) <= 1 if tolerance is None else all(g <= tolerance for g in s["flip_gaps"].values()))
    if m.startswith("specdec-"):  # every specdec method, plain too: its time split and drafts chosen
        s["time_split_s"] = {phase: sum(r["time_split_s"][phase] for r in recs)
                             for phase in ("prefill", "draft", "verify", "bookkeeping")}
        s["chosen_k"] = _sum_lists(r["chosen_k"] for r in recs)
        s["drafter_steps"] = {n: sum(r["drafter_steps"].get(n, 0) for r in recs)
                              for n in sorted({n for r in recs for n in r["drafter_steps"]})}
    if m in ("specdec-plain",) + BASELINES:
        return s
    drafted = sum(r["drafted_tokens"] or 0 for r in recs)
    accepted = sum(r["accepted_tokens"] or 0 for r in recs)
    s["acceptance_rate"] = accepted / drafted if drafted else None
    if not m.startswith("specdec-"):
        s["mean_accepted_length"] = tokens / s["target_forwards"] if s["target_forwards"] else None
        return s
    steps = [r["verify_steps"] for r in recs]  # verify steps exclude the prefill, which commits one token
    committed = sum((r["mean_accepted_length"] or 0) * n for r, n in zip(recs, steps))
    s["mean_accepted_length"] = committed / sum(steps) if sum(steps) else None
    s["nodes_per_verify_step"] = drafted / sum(steps) if sum(steps) else None
    acc, dra = (_sum_lists(r[key] for r in recs) for key in ("accepted_per_position", "drafted_per_position"))
    s["acceptance_by_depth"] = [a / d if d else None for a, d in zip(acc, dra)]
    return s


def bench_sampling(args) -> dict:
    """``{}`` for greedy (``--temperature 0``), else the sampling every method uses, checked
    as ``SamplingParams`` checks it."""
    from .config import SamplingParams

    if args.temperature == 0:
        return {}
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)  # ValueError on a bad value
    return {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}  # top_k -1 (off) is 0


def describe_sampling(sampling: dict, args) -> str:
    if not sampling:
        return "greedy"
    return (f"sampled (temperature {sampling['temperature']}, top_p {sampling['top_p']}, top_k "
            f"{sampling['top_k']}; seeds {args.seed}..{args.seed + args.repeats - 1}, one per repeat)")


def flip_gap(llm, prompt_ids: list[int], reference: list[int], j: int) -> float:
    """How near a tie the reference's output token ``j`` was: the target's top-2 logit gap after
    the prompt and ``reference[:j]``, from one fresh forward, over the top logit's size (at least 1)."""
    rt = llm.target.runtime
    top = rt.forward(rt.new_cache(1), [0], [prompt_ids + reference[:j]], last_only=True)[0].float().topk(2).values
    return (top[0] - top[1]).item() / max(1.0, top[0].abs().item())


def add_flip_gaps(llm, prompts, results: dict, refs: dict) -> None:
    """For each specdec record whose greedy tokens part from its reference's, ``flip_gap`` at
    the first token where they part (any repeat), from ``llm``'s target: a near-tie that other
    kernels (a verify forward's rows, 16-bit rounding, llama.cpp's pieces) may flip, or a bug."""
    for m, recs in results.items():
        if not m.startswith("specdec-") or refs[m] == m:
            continue
        for p, rec, ref in zip(prompts, recs, results[refs[m]]):
            idx = [i for i in (_first_diff(got, ref["token_ids"]) for got in rec["_all_ids"]) if i is not None]
            if idx:
                rec["flip_gap"] = flip_gap(llm, p["ids"], ref["token_ids"], min(idx))


def add_chain_bounds(prompts, plain_records: list[dict], cost_curve: list[float], k_max: int) -> None:
    """Give each specdec-plain record ``ngram_chain_bound``: the speed-up over its own plain
    decoding that the best schedule of n-gram chains (at most ``k_max`` drafts, the
    cost model's limit too) could reach on that output (``bound.ngram_chain_bound``), with
    target forwards priced by ``cost_curve`` (seconds of 1.. tokens), after the first token
    (``decode``) and with the measured prefill added (``end_to_end``)."""
    from .bound import ngram_chain_bound
    from .config import SpecConfig
    from .cost import ForwardCosts

    costs, spec = ForwardCosts(tuple(cost_curve)), SpecConfig(method="ngram")
    for p, rec in zip(prompts, plain_records):
        b = ngram_chain_bound(p["ids"], rec["token_ids"], costs, k_max, spec.ngram_max, spec.ngram_min)
        e2e, decode = None, rec["median_decode_s"]
        if decode is not None:
            first = statistics.median(rec["ttft_s"])
            e2e = (first + decode) / (first + decode / b.speedup)
        rec["ngram_chain_bound"] = {"decode": b.speedup, "end_to_end": e2e, "steps": len(b.ks),
                                    "chosen_k": [b.ks.count(k) for k in range(max(b.ks) + 1)] if b.ks else []}


def references(methods: list[str], own_family: bool) -> dict[str, str]:
    """For each method, the method whose greedy tokens it must reproduce: the plain decoding
    of its numeric family (``hf-plain`` for transformers, ``llamacpp-plain`` for
    llama-cpp-python, ``hf-plain`` for specdec too unless ``own_family``, then
    ``specdec-plain``), else the family's first method run. specdec's torch runtime and
    transformers agree to 1e-4 in float32 on the CPU (tested), so their greedy tokens match
    there; on llama.cpp, on a GPU or in 16-bit their kernels round differently, and a near-tie
    can part them without either being wrong."""
    def plain_of(m: str) -> str:
        if m.startswith("llamacpp-"):
            return "llamacpp-plain"
        return "specdec-plain" if m.startswith("specdec-") and own_family else "hf-plain"

    out = {}
    for m in methods:
        ref = plain_of(m)
        out[m] = ref if ref in methods else next(x for x in methods if plain_of(x) == ref)
    return out


RATIO_WEIGHTS = {"acceptance_rate": "drafted_tokens", "mean_accepted_length": "verify_steps",
                 "nodes_per_verify_step": "verify_steps"}


def pool_draws(draws: list[dict]) -> dict:
    """One prompt's counters over its repeats (sampled draws, or greedy runs whose cost-model
    choices vary), as the mean repeat: counts, per-position counts, chosen-k histograms and
    time splits averaged; the ratios of ``RATIO_WEIGHTS`` averaged weighted by their
    denominators (all tokens over all steps)."""
    pooled = {}
    for key, value in draws[0].items():
        values = [d.get(key) for d in draws]
        if key in RATIO_WEIGHTS:
            pairs = [(v, d.get(RATIO_WEIGHTS[key]) or 0) for v, d in zip(values, draws) if v is not None]
            weight = sum(w for _, w in pairs)
            pooled[key] = sum(v * w for v, w in pairs) / weight if weight else None
        elif isinstance(value, dict):
            pooled[key] = {k: sum(v.get(k, 0) for v in values) / len(draws) for k in {k for v in values for k in v}}
        elif isinstance(value, list):
            pooled[key] = [c / len(draws) for c in _sum_lists(values)]
        elif isinstance(value, (int, float)) and None not in values:
            pooled[key] = sum(values) / len(draws)
        else:
            pooled[key] = value
    return pooled


def _sum_lists(lists) -> list[int]:
    from .metrics import add_counts

    total: list[int] = []
    for xs in lists:
        add_counts(total, xs or [])
    return total



"""Command line: ``specdec generate | demo | check-vocab | bench | serve | loadtest``.

Flags map one-to-one onto ``SamplingParams`` (with ``StructuredOutputs``), ``SpecConfig`` and
``EngineConfig`` fields.
A user error prints one line ``specdec: error: ...`` and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .answer import REASONING_PARSERS
from .config import (BACKENDS, GENERATION_FIELDS, LOAD_FORMATS, METHODS, EngineConfig, SamplingParams, SpecConfig,
                     StructuredOutputs)
from .lora import LoRARequest
from .tools import PARSERS


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models and speculation")
    g.add_argument("--model", help="target: HF model dir, .gguf file or hub id "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", help="the target's tokenizer from another directory, .gguf or hub id "
                                       "(default: the model's own; e.g. the original model's beside a GGUF)")
    g.add_argument("--revision", help="the hub model's branch, tag or commit (default: main)")
    g.add_argument("--tokenizer-revision", help="a hub tokenizer's branch, tag or commit (default: --revision)")
    g.add_argument("--quantization", "-q", help="the checkpoint's quantization, checked (vLLM's flag: gguf, fp8, gptq, awq, "
                                                "...); specdec quantizes nothing at load (default: as it is)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run the checkpoint's own Python code (config, tokenizer, model on transformers' "
                        "runtime) where its config.json names it in auto_map")
    g.add_argument("--draft", help="draft model for --method draft or hybrid (same forms as --model), or an "
                                   "EAGLE / EAGLE-3 head's directory or hub id (then --method eagle / eagle3)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's form, instead of --method and --draft: e.g. '{\"method\": \"draft_model\", "
                        "\"model\": \"DRAFT\", \"num_speculative_tokens\": 5}' or '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}' or '{\"method\": \"eagle3\", \"model\": "
                        "\"HEAD\", \"num_speculative_tokens\": 3}'; other SpecConfig fields by name")
    g.add_argument("--method", choices=METHODS, default=None,
                   help="drafter (default: draft when --draft is given, else none); hybrid = "
                        "n-gram when the lookup matches, else the draft model; eagle / eagle3 = --draft is an "
                        "EAGLE or EAGLE-3 head over the target's hidden states (draft with one becomes its kind); "
                        "mtp = the model's own multi-token prediction layer (DeepSeek-V3 / V3.2, GLM-4.5 / 5, Qwen3-Next, "
                        "Qwen3.5, MiMo-V2-Flash; "
                        "no --draft), or with --draft a Gemma 4 assistant (google/gemma-4-*-it-assistant; draft with "
                        "one becomes mtp)")
    g.add_argument("--num-draft-tokens", "-k", type=int, default=SpecConfig.num_draft_tokens,
                   help="draft tokens per round, k (default %(default)s)")
    g.add_argument("--ngram-max", type=int, default=SpecConfig.ngram_max,
                   help="ngram / hybrid: the longest n-gram looked up, tried first (default %(default)s)")
    g.add_argument("--ngram-min", type=int, default=SpecConfig.ngram_min,
                   help="ngram / hybrid: the shortest n-gram looked up (default %(default)s)")
    g.add_argument("--ngram-capacity", type=int, default=SpecConfig.ngram_capacity,
                   help="ngram / hybrid: also look up the other requests' texts, those running and those "
                        "finished (up to this many tokens, oldest dropped first; default 0 = each request's own text only)")
    g.add_argument("--tree-topk", type=int, default=1,
                   help="token tree: candidates per node (draft/self: top-k children, drawn from q when sampling; ngram: matches; 1 = chain, default)")
    g.add_argument("--tree-depth", type=int, help="token tree depth (default: k)")
    g.add_argument("--tree-nodes", type=int, help="token tree node budget (default: depth * topk)")
    g.add_argument("--cost-model", action="store_true",
                   help="choose each step's drafter and k <= --num-draft-tokens (0 = plain decoding) "
                        "from measured forward times and online acceptance")
    g.add_argument("--draft-quantization", choices=["auto", "none", "int8"], default="auto",
                   help="int8 draft weights (lossless; auto = int8 for a CPU float32 draft)")
    g.add_argument("--draft-revision", help="a hub draft model's branch, tag or commit (default: main)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="auto (default): float32 on cpu, bfloat16 on cuda")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="torch = specdec's own runtime (Llama, Mistral, Ministral (3), Qwen2/3, Phi-3 (longrope too), "
                        "Granite, SmolLM3, GLM(-4), OLMo (2/3), EXAONE 4, ERNIE 4.5, Arcee, Seed-OSS, HunYuan, "
                        "Cohere (Command R, R+, R7B, A Plus's MoE, Compass), StarCoder2, Apertus, Phi, GPT-NeoX (Pythia), StableLM, "
                        "Persimmon, GPT-J, CodeGen, Falcon, GPT-2, GPT-Neo, GPT-BigCode, OPT, BLOOM, MPT, Nemotron, "
                        "EXAONE 3, InternLM 3, IQuest-Coder, Helium, Granite-SWA, HyperCLOVA X, Jais 2, NanoChat, CWM, Youtu, "
                        "MiniCPM3, Gemma, Gemma 2, VaultGemma, Gemma 3, Gemma 4 (12B's unified model too), Mixtral, "
                        "Qwen2/3-MoE, OLMoE, FlexOlmo, "
                        "EXAONE-MoE, Llama 4, Hy4, Solar Open, HunYuan-MoE, AFMoE, A.X K1, DBRX, Kolibri, Flint, MiniMax-M2, "
                        "MiMo-V2-Flash, Mellum 2, Aria, dots.llm1, "
                        "ERNIE 4.5 MoE, Granite MoE (-SWA), GPT-OSS, GLM-4.5, DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4, "
                        "Qwen3-Next, Qwen3.5 (-MoE), OLMo-Hybrid, Kimi Linear, Ling 3, Lara 4 Mini, Granite 4.0 (-H), Bamba, Nemotron-H, Falcon-H1, Jamba, "
                        "LFM2 (-MoE), LFM3, "
                        "Mamba, Falcon-Mamba, Mamba-2; and text models of vision-language checkpoints), "
                        "hf = transformers' model, "
                        "llamacpp = llama.cpp on a .gguf (pip install 'specdec[llamacpp]'); "
                        "auto picks torch when the architecture allows")
    g.add_argument("--draft-backend", choices=BACKENDS, help="for the draft model (default: --backend)")
    g.add_argument("--max-batch-size", "--max-num-seqs", type=int, default=EngineConfig.max_batch_size,
                   help="requests decoded together (--max-num-seqs: vLLM's name; default %(default)s)")
    g.add_argument("--threads", type=int, help="CPU threads: torch.set_num_threads, also llama.cpp's "
                                               "(default: torch's)")
    g.add_argument("--chunked-prefill-size", type=int,
                   help="prompt tokens prefilled per engine step over all requests: a long prompt "
                        "goes in chunks while running requests keep decoding (0 = each prompt whole; "
                        "default 256 on cpu, 2048 on cuda)")
    g.add_argument("--max-model-len", type=int,
                   help="tokens (prompt + output) a request may span (default: the model's context; "
                        "llama.cpp: 4096 per slot)")
    g.add_argument("--repack", action=argparse.BooleanOptionalAction, default=EngineConfig.repack,
                   help="llama.cpp: its repacked CPU weights (one-row decoding ~5%% faster on Q4_K; "
                        "exact verification then goes in smaller pieces, 3 rows on Qwen2.5-Coder "
                        "Q4_K_M, which lowers the ceiling of long n-gram copies; default on)")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default=EngineConfig.load_format,
                   help="auto = the checkpoint's weights; dummy = random weights of its shapes (only "
                        "config and tokenizer are read), to measure speed (default %(default)s)")
    g.add_argument("--generation-config", default=EngineConfig.generation_config,
                   help="default sampling: auto = the model's generation_config.json (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM; vllm = "
                        "specdec's own defaults (greedy); or a directory with a generation_config.json")
    g.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most alternatives a request's logprobs / prompt_logprobs may ask for "
                        "(-1 = the vocabulary; default %(default)s, vLLM's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=EngineConfig.tensor_parallel_size,
                   help="vLLM's; specdec runs each model on one device: 1 only")
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                   help="vLLM's; checked (0 < x <= 1), nothing is reserved: the KV cache grows on demand")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching,
                   help="keep a finished prompt's KV in its slot for a later prompt that starts the same, and "
                        "share a prompt's chunks among its running completions (default on; off: every "
                        "prompt computed from scratch)")
    g.add_argument("--enable-lora", action="store_true",
                   help="requests may name LoRA adapters (PEFT's) of the target, on the torch runtime (vLLM's; "
                        "on with --lora-modules or --lora)")
    g.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                   help="LoRA adapters on the device at once: a request for another waits until one is free of "
                        "requests (default %(default)s, vLLM's)")
    g.add_argument("--max-lora-rank", type=int,
                   help="refuse LoRA adapters of a higher rank (vLLM's; default: any rank)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="torch runtime on cuda: no CUDA graphs (by default decoding, verification and "
                        "drafting forwards of up to 32 tokens per row replay captured graphs)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.description = ("--max-tokens, --temperature, --top-k, --top-p, --min-p and --repetition-penalty "
                     "default to the model's generation config (see --generation-config), else to the "
                     "defaults below")
    g.add_argument("--max-tokens", "--max-new-tokens", type=int,
                   help=f"tokens to generate at most (default {SamplingParams.max_tokens})")
    g.add_argument("--temperature", type=float, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, help="0 or -1 = off (default)")
    g.add_argument("--top-p", type=float, help="1 = off (default)")
    g.add_argument("--min-p", type=float,
                   help="drop tokens less likely than this times the most likely one (0 = off, default)")
    g.add_argument("--seed", type=int, help="sampling seed: the same seed, the same output (default: a fresh one)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID",
                   help="token ids that end the output like an EOS (kept in token_ids, not in the text)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past EOS until --max-tokens")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS, stop token or stop string ends the output before this many tokens (default 0)")
    g.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string (or stop token) at the end of the text")
    g.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="leave special tokens out of the text (default on)")
    g.add_argument("--spaces-between-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="a slow (Python) tokenizer's text puts a space around added and special tokens "
                        "(vLLM's; a fast tokenizer decodes as it does; default on)")
    g.add_argument("--repetition-penalty", type=float,
                   help="divide (multiply) the positive (negative) logits of tokens in the prompt or "
                        "output by this (1 = off, default)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logits of tokens in the output (0 = off, default)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the output from its logit (0 = off, default)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--allowed-token-ids", type=int, nargs="+", metavar="ID",
                   help="only these token ids may be drawn")
    g.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="a word the output may not contain (repeatable; vLLM's: its last token is banned "
                        "where the output would complete it)")
    g.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="keep only each prompt's last N tokens (-1: as many as the context window holds; vLLM's)")
    g.add_argument("-n", "--n", type=int, default=SamplingParams.n,
                   help="completions per prompt (with --seed S, completion i draws from S + i; default 1; 1 when greedy)")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="with --json: each output token's log-probability under the target and the N "
                        "most likely alternatives (0 = the chosen token's only)")
    g.add_argument("--prompt-logprobs", type=int, metavar="N",
                   help="with --json: the same for each prompt token (null for the first)")
    g = p.add_argument_group("structured outputs (at most one; @FILE reads the value from a file)")
    g.add_argument("--structured-json", metavar="SCHEMA", help="the output is JSON following this JSON schema")
    g.add_argument("--structured-regex", metavar="REGEX", help="the output matches this regular expression")
    g.add_argument("--structured-choice", action="append", metavar="TEXT",
                   help="the output is one of these strings (repeatable)")
    g.add_argument("--structured-grammar", metavar="GRAMMAR",
                   help="the output follows this grammar (Lark, or llama.cpp's GBNF)")
    g.add_argument("--structured-json-object", action="store_true", help="the output is a JSON object")


def spec_from_args(a) -> tuple[SpecConfig, str | None]:
    """The speculation flags as ``(SpecConfig, draft model)``; ``--speculative-config``
    (vLLM's JSON) sets what it names on top of the other flags."""
    flags = dict(num_draft_tokens=a.num_draft_tokens, ngram_max=a.ngram_max, ngram_min=a.ngram_min, ngram_capacity=a.ngram_capacity,
                 draft_quantization=a.draft_quantization, draft_revision=a.draft_revision, tree_topk=a.tree_topk, tree_depth=a.tree_depth,
                 tree_nodes=a.tree_nodes, cost_model=a.cost_model)
    if a.speculative_config is None:
        return SpecConfig(method=a.method or ("draft" if a.draft else "none"), **flags), a.draft
    if a.method or a.draft:
        raise ValueError("--speculative-config names the method and the draft model; drop --method and --draft")
    try:
        config = json.loads(a.speculative_config)
    except ValueError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    return SpecConfig.from_vllm(config, **flags)


def sampling_from_args(a, defaults: dict | None = None) -> SamplingParams:
    """The sampling flags as ``SamplingParams``; the fields a model's generation config may
    set (``GENERATION_FIELDS``) and the flags leave out come from ``defaults``."""
    given = {f: getattr(a, f) for f in GENERATION_FIELDS.values() if getattr(a, f) is not None}
    return SamplingParams(**{**(defaults or {}), **given}, seed=a.seed, stop=tuple(a.stop),
                          stop_token_ids=tuple(a.stop_token_ids), ignore_eos=a.ignore_eos, min_tokens=a.min_tokens,
                          include_stop_str_in_output=a.include_stop_str_in_output,
                          skip_special_tokens=a.skip_special_tokens,
                          spaces_between_special_tokens=a.spaces_between_special_tokens,
                          presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, logit_bias=parse_logit_bias(a.logit_bias),
                          n=a.n, logprobs=a.logprobs, prompt_logprobs=a.prompt_logprobs,
                          structured_outputs=structured_from_args(a), allowed_token_ids=a.allowed_token_ids,
                          bad_words=tuple(a.bad_words), truncate_prompt_tokens=a.truncate_prompt_tokens)


def structured_from_args(a) -> StructuredOutputs | None:
    """``StructuredOutputs`` from the ``--structured-*`` flags (None without them)."""
    def value(text: str | None) -> str | None:  # @FILE: the file's text
        if text is None or not text.startswith("@"):
            return text
        try:
            text = open(text[1:], encoding="utf-8").read()
        except OSError as e:
            raise ValueError(f"cannot read {text[1:]!r}: {e.strerror}") from None
        for end in ("\r\n", "\n"):  # an editor's final newline: not the value's
            if text.endswith(end):
                return text[:-len(end)]
        return text

    choice = [value(c) for c in a.structured_choice] if a.structured_choice else None
    fields = dict(json=value(a.structured_json), regex=value(a.structured_regex), choice=choice,
                  grammar=value(a.structured_grammar), json_object=a.structured_json_object)
    if not any(fields.values()):
        return None
    return StructuredOutputs(**fields)


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``["ID=BIAS", ...]`` from ``--logit-bias``."""
    out = {}
    for item in items:
        token, _, bias = item.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS (e.g. 13=-100), got {item!r}") from None
    return out


def make_llm(a):
    from .api import LLM

    spec, draft = spec_from_args(a)
    return LLM(a.model, draft=draft, speculative=spec, device=a.device,
               dtype=a.dtype, max_batch_size=a.max_batch_size, backend=a.backend,
               draft_backend=a.draft_backend, repack=a.repack, load_format=a.load_format,
               chunked_prefill_size=a.chunked_prefill_size, max_model_len=a.max_model_len,
               enforce_eager=a.enforce_eager, generation_config=a.generation_config,
               seed=getattr(a, "llm_seed", None),  # serve's --seed (generate's seeds its SamplingParams)
               threads=a.threads, max_logprobs=a.max_logprobs,
               tensor_parallel_size=a.tensor_parallel_size, gpu_memory_utilization=a.gpu_memory_utilization,
               enable_prefix_caching=a.enable_prefix_caching, tokenizer=a.tokenizer, revision=a.revision,
               trust_remote_code=a.trust_remote_code, tokenizer_revision=a.tokenizer_revision,
               quantization=a.quantization, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank,
               enable_lora=a.enable_lora or bool(getattr(a, "lora_modules", None) or getattr(a, "lora", None)
                                                 or getattr(a, "allow_runtime_lora_updating", False)))


def parse_lora_modules(items: list[str]) -> list[LoRARequest]:
    """vLLM's ``--lora-modules``: each ``name=path``, or a JSON object with ``name``, ``path``
    and optionally ``base_model_name``; ids 1, 2, ... in order."""
    out = []
    for i, item in enumerate(items, 1):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                out.append(LoRARequest(spec["name"], i, spec["path"], spec.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {item!r}: a JSON object with \"name\" and \"path\" ({e})") from None
            continue
        name, eq, path = item.partition("=")
        if not (eq and name and path):
            raise ValueError(f"--lora-modules {item!r}: give name=path (or a JSON object)")
        out.append(LoRARequest(name, i, path))
    return out


def read_prompts_file(path: str) -> list[tuple[str, object]]:
    """``(id, prompt)`` pairs from JSONL: ``kind`` chat with ``messages`` or completion with ``prompt``."""
    try:
        lines = (sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()).splitlines()
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path!r}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: need a JSON object, not {type(obj).__name__}")
        kind = obj.get("kind", "completion")
        if kind == "chat" and isinstance(obj.get("messages"), list):
            prompt = obj["messages"]
        elif kind == "completion" and isinstance(obj.get("prompt"), str):
            prompt = obj["prompt"]
        else:
            raise ValueError(f"{path}:{n}: need kind 'chat' with 'messages' or 'completion' with 'prompt'")
        out.append((str(obj.get("id", n)), prompt))
    if not out:
        raise ValueError(f"prompts file {path!r} has no prompts")
    return out


def check_sampling_flags(a) -> SamplingParams:
    """The sampling flags checked before any model loads: the fields a model's generation
    config may give and the flags leave out are taken as permissive until it is read (sampled,
    no length cap), so ``-n 2`` or ``--min-tokens 200`` wait for the model's temperature and
    max_new_tokens. A given temperature below the floor is raised here, and warned of once."""
    sp = sampling_from_args(a, {"temperature": 1.0, "max_tokens": None})
    if a.temperature is not None:
        a.temperature = sp.temperature
    return sp


def cmd_generate(a) -> int:
    sp = check_sampling_flags(a)
    if (sp.logprobs is not None or sp.prompt_logprobs is not None) and not a.json:
        raise ValueError("--logprobs and --prompt-logprobs need --json (log-probabilities are part "
                         "of the JSON output)")
    spec_from_args(a)  # validate before loading models
    if a.prompts_file:
        if a.chat:
            raise ValueError("--chat applies to --prompt; a prompts file gives each prompt's kind (chat or completion)")
        items = read_prompts_file(a.prompts_file)
    else:
        items = [("0", [{"role": "user", "content": a.prompt}] if a.chat else a.prompt)]
    llm = make_llm(a)
    sp = sampling_from_args(a, llm.sampling_defaults)
    lora = LoRARequest("lora", 1, a.lora) if a.lora else None
    outputs = llm.generate([p for _, p in items], sp, use_tqdm=False, lora_request=lora)
    for (pid, _), o in zip(items, outputs):
        if a.json:
            print(json.dumps({"id": pid, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                              **({"outputs": [completion_json(c) for c in o.outputs]}
                                 if sp.n > 1 or sp.logprobs is not None else {}),
                              **({"prompt_logprobs": [e and logprobs_json(e) for e in o.prompt_logprobs]}
                                 if o.prompt_logprobs is not None else {}),
                              "metrics": o.metrics}, ensure_ascii=False))
            continue
        for c in o.outputs:
            if len(items) > 1 or sp.n > 1:
                print(f"--- {pid}{f' #{c.index}' if sp.n > 1 else ''} ({c.finish_reason})")
            print(c.text)
    if not a.json:
        m = llm.last_run_metrics.to_dict()
        rate = "-" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.2f}"
        print(f"[{llm.spec.method}] {m['generated_tokens']} tokens in {m['wall_s']:.2f}s "
              f"({m['tokens_per_s']:.2f} tok/s), target forwards {m['target_forwards']}, "
              f"acceptance {rate}", file=sys.stderr)
    return 0


def completion_json(c) -> dict:
    """One completion for ``generate --json``; logprobs as ``[{"id": logprob, ...}, ...]``
    (the chosen token first, then the most likely ones)."""
    out = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
    if c.logprobs is not None:
        out["logprobs"] = [logprobs_json(entry) for entry in c.logprobs]
        out["cumulative_logprob"] = c.cumulative_logprob
    return out


def logprobs_json(entry: dict) -> dict:
    """One token's ``{id: Logprob}`` as ``{"id": logprob}``."""
    return {str(t): lp.logprob for t, lp in entry.items()}


def cmd_check_vocab(a) -> int:
    from .runtime.loading import load_tokenizer
    from .vocab import compare_tokenizers

    report = compare_tokenizers(*(load_tokenizer(m, trust_remote_code=a.trust_remote_code) for m in (a.target, a.draft)))
    print(report.summary())
    for line in report.problems:
        print("  " + line)
    for line in report.notes:
        print("  note: " + line)
    return 0 if report.compatible else 1


def cmd_demo(a) -> int:
    from .demo import run_demo

    return run_demo(max_tokens=a.max_tokens, k=a.num_draft_tokens, device=a.device)


def cmd_bench(a) -> int:
    from .bench import run_bench

    return run_bench(a)


def cmd_serve(a) -> int:
    if a.model_tag is not None:
        if a.model not in (None, a.model_tag):
            raise ValueError(f"two targets: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    spec_from_args(a)  # validate before loading models
    if a.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {a.max_queue}")
    if a.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {a.max_request_bytes}")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {a.port}")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    template = a.chat_template
    if template is not None and Path(template).expanduser().is_file():
        template = Path(template).expanduser().read_text(encoding="utf-8")
    elif template is not None and "{{" not in template and "{%" not in template:
        raise ValueError(f"--chat-template {a.chat_template!r} is neither a file nor a Jinja template")
    loras = parse_lora_modules(a.lora_modules or [])
    from .server import create_app, serve
    from .server.runner import listen_socket

    sock = listen_socket(a.host, a.port)  # a port in use fails now, not after loading the models
    try:
        llm = make_llm(a)
        app = create_app(llm, served_model_name=a.served_model_name, max_queue=a.max_queue,
                         api_key=a.api_key, max_request_bytes=a.max_request_bytes,
                         enable_auto_tool_choice=a.enable_auto_tool_choice, tool_call_parser=a.tool_call_parser,
                         reasoning_parser=a.reasoning_parser, chat_template=template,
                         trust_request_chat_template=a.trust_request_chat_template,
                         allowed_origins=a.allowed_origins, allowed_methods=a.allowed_methods,
                         allowed_headers=a.allowed_headers, allow_credentials=a.allow_credentials,
                         lora_modules=loras, allow_runtime_lora_updating=a.allow_runtime_lora_updating)
        host, port = sock.getsockname()[:2]
        print(f"specdec: serving {app.state.served_model_name!r} (method {llm.spec.method}) on "
              f"http://{f'[{host}]' if ':' in host else host}:{port}/v1", file=sys.stderr)
        serve(app, log_level=a.log_level, sock=sock)
    finally:
        sock.close()
    return 0


def cmd_loadtest(a) -> int:
    from .server.loadtest import main as run_loadtest

    return run_loadtest(a)


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for the CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"need a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as specdec's other user errors."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specdec", description="Lossless speculative decoding for HF causal LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    p.commands = sub.choices  # name -> the subcommand's parser

    g = sub.add_parser("generate", help="generate text for one prompt or a JSONL file of prompts")
    add_model_flags(g)
    add_sampling_flags(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help="JSONL: {id, kind: chat|completion, messages|prompt} ('-': "
                                            "standard input)")
    g.add_argument("--chat", action="store_true", help="send --prompt through the chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, with metrics")
    g.add_argument("--lora", metavar="PATH", help="a LoRA adapter of the target (PEFT's directory or a hub id) for "
                                                  "every prompt (turns --enable-lora on)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="plain vs n-gram vs self-draft vs a draft tree on the embedded model: "
                                    "target forwards side by side; checks the outputs are equal")
    d.add_argument("--max-tokens", "--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    d.add_argument("--num-draft-tokens", "-k", type=int, default=4,
                   help="draft tokens per round for n-gram and self-draft (default 4)")
    d.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("check-vocab", help="can DRAFT draft for TARGET? (token-by-token tokenizer check)",
                       description="Compare two tokenizers id by id. Exit code 0: compatible, 1: "
                                   "incompatible (the problems are listed), 2: an error (e.g. a path).")
    c.add_argument("target", help="target model: HF dir, .gguf file or hub id")
    c.add_argument("draft", help="draft model, in the same forms")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="run a tokenizer's own Python code where its files name it")
    c.set_defaults(func=cmd_check_vocab)

    b = sub.add_parser("bench", help="side-by-side tokens/s: specdec vs transformers and llama-cpp-python (see docs/bench.md)")
    from .bench import add_bench_flags

    add_bench_flags(b)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help="the target, as --model (vLLM's `serve MODEL`)")
    add_model_flags(s)
    h = s.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0: all)")
    h.add_argument("--port", type=int, default=8000,
                   help="(default %(default)s; 0: a free port, printed) taken before the models load")
    h.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a batch slot; beyond that 429 (default %(default)s)")
    h.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (default: $SPECDEC_API_KEY, else none)")
    h.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model ids requests may name, listed in /v1/models; responses carry the first "
                        "(default: --model)")
    h.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters (PEFT's directories or hub ids) served beside the model, as vLLM's: a "
                        "request whose model is NAME runs through it; also as JSON '{\"name\": ..., \"path\": "
                        "...}' (turns --enable-lora on)")
    h.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name} "
                        "add and remove LoRA adapters while serving (vLLM's; default: "
                        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, else off; turns --enable-lora on)")
    h.add_argument("--seed", type=int, dest="llm_seed",
                   help="vLLM's global seed: requests without a seed draw theirs from it, in order "
                        "(default: a fresh seed each)")
    h.add_argument("--max-request-bytes", type=int, default=2_000_000,
                   help="larger request bodies get 413 (default %(default)s)")
    h.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat requests with tools and tool_choice auto (the default with tools): the model "
                        "decides whether to call them; needs --tool-call-parser")
    h.add_argument("--tool-call-parser", choices=PARSERS,
                   help="how tool calls are read from the model's text: hermes = <tool_call>{json}</tool_call> "
                        "(Qwen2.5, Hermes); llama3_json = {\"name\": ..., \"parameters\": ...} (Llama 3.1-4); "
                        "mistral = [TOOL_CALLS]...; pythonic = [f(a=1), g(b='x')] (Llama 3.2, 4); "
                        "qwen3_coder = <tool_call><function=f><parameter=a>1</parameter>... (Qwen3-Coder); "
                        "openai = GPT-OSS's harmony messages to functions.* (with --enable-auto-tool-choice, turns on "
                        "--reasoning-parser openai_gptoss)")
    h.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="return a thinking model's <think>...</think> as reasoning_content (qwen3: the answer "
                        "opens <think>; deepseek_r1: the prompt does; openai_gptoss: GPT-OSS's harmony analysis "
                        "channel, its final channel the content, its messages to functions.* the tool calls; the "
                        "default for a GPT-OSS model)")
    h.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) for chat requests instead of "
                        "the tokenizer's (vLLM's)")
    h.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a chat request's own chat_template field (vLLM's; refused otherwise)")
    h.add_argument("--allowed-origins", type=json_list, default=["*"], metavar="JSON",
                   help="CORS: origins a browser page may call the API from, a JSON list (vLLM's; "
                        "default '[\"*\"]': any)")
    h.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                   help="CORS: HTTP methods allowed, a JSON list (default '[\"*\"]')")
    h.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                   help="CORS: request headers allowed, a JSON list (default '[\"*\"]')")
    h.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cookies and credentials (default off)")
    h.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("loadtest", help="N concurrent streaming clients for T seconds against a server; "
                                        "checks every response against its single-request reference")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    t.add_argument("--clients", "-n", type=int, default=4, help="concurrent clients (default %(default)s)")
    t.add_argument("--duration", "-t", type=float, default=20.0, help="seconds (default %(default)s)")
    t.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    t.add_argument("--prompts", type=int, default=8, help="distinct prompts in the pool (default %(default)s)")
    t.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $SPECDEC_API_KEY, else none)")
    t.add_argument("--json", action="store_true", help="one JSON object")
    t.set_defaults(func=cmd_loadtest)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

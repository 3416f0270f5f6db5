"""LoRA's cost on the torch runtime: one chat answer decoded by the target alone and through a
LoRA adapter (random, rank --rank on every attention and MLP product, PEFT's files written
here), plainly and with the 0.5B draft model, in turns in one process (Qwen2.5-Coder-1.5B
target, the LLMs sharing one loaded target with LoRA enabled). Prints tokens per second per
run, the medians, each run's acceptance (the drafts come from the base draft model) and
whether its tokens are the base model's; then the time of one forward of 1 and 5 tokens
without and with the adapter (medians of 15, side by side).

    python scripts/bench_lora.py [--repeats 3] [--rank 16] [--max-tokens 96]
    # models from ../shared/models/fetch-models.sh qwen-coder (in $SPECDEC_MODELS, default ~/.cache/specdec-models)
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec import LLM, LoRARequest, SamplingParams, SpecConfig
from specdec.runtime import load_model

from bench_structured import DRAFT, MESSAGES, TARGET

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def random_adapter(config, path: Path, rank: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter of ``config``'s shapes at ``path``: A as PEFT initialises it (uniform,
    1/sqrt(in) wide), B small and random (PEFT's are zeros: no update)."""
    g = torch.Generator().manual_seed(seed)
    h, inner, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inner), "up_proj": (h, inner), "down_proj": (inner, h)}
    tensors = {}
    for i in range(config.num_hidden_layers):
        for block, names in MODULES.items():
            for n in names:
                fan_in, out = shapes[n]
                key = f"base_model.model.model.layers.{i}.{block}.{n}"
                tensors[key + ".lora_A.weight"] = (torch.rand(rank, fan_in, generator=g) * 2 - 1) / fan_in ** 0.5
                tensors[key + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in MODULES.values() for n in names]}))
    return path


def main(repeats: int, rank: int, max_tokens: int) -> None:
    torch.set_num_threads(2)
    target, draft = load_model(TARGET, backend="torch"), load_model(DRAFT, backend="torch")
    with tempfile.TemporaryDirectory() as tmp:
        lora = LoRARequest("random", 1, str(random_adapter(target.config, Path(tmp) / "lora", rank)))
        llms = {"plain": LLM(target, enable_lora=True),
                "draft": LLM(target, draft=draft, speculative=SpecConfig(method="draft"), enable_lora=True)}
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        runs: dict[tuple[str, str], list[float]] = {}
        tokens = {}
        for rep in range(repeats):
            for name, llm in llms.items():
                for mode, request in (("base", None), ("lora", lora)):
                    t = time.perf_counter()
                    out = llm.chat(MESSAGES, sp, lora_request=request, use_tqdm=False)[0]
                    rate = len(out.token_ids) / (time.perf_counter() - t)
                    runs.setdefault((name, mode), []).append(rate)
                    tokens.setdefault(mode, out.token_ids)
                    print(rep, name, mode, f"{rate:.2f} tok/s, acceptance", out.metrics["acceptance_rate"],
                          "tokens equal to the base model's:", out.token_ids == tokens["base"], flush=True)
        rt = target.runtime
        for n in (1, 5):
            times = {0: [], 1: []}
            for _ in range(15):
                for adapter in (0, 1):
                    cache = rt.new_cache(1)
                    cache.adapters[0] = adapter
                    rt.forward(cache, [0], [list(range(100, 164))])  # a context of 64 tokens
                    t = time.perf_counter()
                    rt.forward(cache, [0], [list(range(200, 200 + n))])
                    times[adapter].append(time.perf_counter() - t)
            base, adapted = (statistics.median(times[a]) for a in (0, 1))
            print(f"forward of {n} token(s): {base * 1e3:.1f} ms, through the adapter {adapted * 1e3:.1f} ms "
                  f"({adapted / base:.3f}x)")
    for (name, mode), rates in runs.items():
        base = statistics.median(runs[name, "base"])
        print(f"{name} {mode}: median {statistics.median(rates):.2f} tok/s "
              f"({statistics.median(rates) / base:.2f}x the base model's)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per method and model (default 3)")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (default 16)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    a = parser.parse_args()
    main(a.repeats, a.rank, a.max_tokens)

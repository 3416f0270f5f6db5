"""Forward cost of T new tokens relative to one (a verify of T - 1 drafts against a decode
step) on the torch runtime, after ``--context`` tokens, with random weights of each model's
shapes (``DummyWeights``): a Llama and two hybrids of about its width, a Granite-4.0-H-1B-like
one (Mamba-2 layers) and a Qwen3.5-0.8B-like one (DeltaNet layers), and two recurrent models of
that width alone (48 blocks of one layer): a Mamba-790M-like one (Mamba's selective scan) and a
Mamba2-780M-like one. Each forward is timed with its commit, a rewind to half its tokens (the
states a replay recomputes: Mamba-2's and DeltaNet's). Medians of ``--repeats``, all in one process.

    python scripts/bench_recurrent_cost.py [--models llama,granite,qwen35,mamba,mamba2] [--tokens 1,2,5,9,17]
        [--device cpu] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

from specdec.runtime.loading import DummyWeights
from specdec.runtime.torch_llama import TorchLlama


def configs() -> dict:
    n = 24
    return {
        "llama": AutoConfig.for_model("llama", vocab_size=100352, hidden_size=1536, num_hidden_layers=n,
                                      num_attention_heads=12, num_key_value_heads=4, intermediate_size=4096,
                                      tie_word_embeddings=True),
        "granite": AutoConfig.for_model(
            "granitemoehybrid", vocab_size=100352, hidden_size=1536, num_hidden_layers=n,
            layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(n)], num_attention_heads=12,
            num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
            mamba_expand=2, num_local_experts=0, shared_intermediate_size=4096, position_embedding_type="nope",
            tie_word_embeddings=True),
        "qwen35": AutoConfig.for_model(
            "qwen3_5_text", vocab_size=151936, hidden_size=1024, num_hidden_layers=n,
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584,
            linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            tie_word_embeddings=True),
        "mamba": AutoConfig.for_model("mamba", vocab_size=50280, hidden_size=1536, num_hidden_layers=2 * n,
                                      state_size=16, expand=2),
        "mamba2": AutoConfig.for_model("mamba2", vocab_size=50280, hidden_size=1536, num_hidden_layers=2 * n,
                                       num_heads=48, head_dim=64, state_size=128, n_groups=1, tie_word_embeddings=True),
    }


def forward_times(rt: TorchLlama, context: int, sizes: list[int], repeats: int, commit: bool = True) -> dict:
    """Median seconds of a forward of T tokens (each of ``sizes``) after ``context`` tokens, over ``repeats``;
    ``commit``: each timed with a rewind to half its tokens (a verify's commit; the states a replay
    recomputes), else untimed rewinds alone."""
    device = rt.device
    cache = rt.new_cache(1)
    rt.forward(cache, [0], [list(range(context))])
    times = {}
    for T in sizes:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rt.forward(cache, [0], [list(range(T))])
            if commit:
                cache.rewind(0, context + (T + 1) // 2)  # the verify's commit: half its tokens kept
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(time.perf_counter() - t0)
            cache.rewind(0, context)
        times[T] = statistics.median(runs)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,granite,qwen35,mamba,mamba2")
    ap.add_argument("--tokens", default="1,2,5,9,17")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = [int(t) for t in args.tokens.split(",")]
    print(f"| model | {' | '.join(map(str, sizes))} |\n|---|{'---|' * len(sizes)}")
    for name in args.models.split(","):
        config = configs()[name]
        rt = TorchLlama(config, DummyWeights(config, device), device, dtype)
        times = forward_times(rt, args.context, sizes, args.repeats)
        first = times[sizes[0]]
        cells = [f"{first * 1e3:.0f} ms"] + [f"{times[T] / first:.2f}x" for T in sizes[1:]]
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()

"""Forward cost of BitNet b1.58 2B4T's shapes on the torch runtime: its projections ternary
(``linear.Ternary``: int8 weights, integer products on the CPU), against the same model with
float weights (its -bf16 masters as transformers runs them without a quantization config,
through oneDNN in float32). Random weights (``DummyWeights``, ``--load-format dummy``'s: the
ternary ones drawn from -1, 0, 1), so the times are the real model's and the outputs are not.
For each, the time of a one-token forward after ``--context`` tokens and of T tokens at once
relative to it (a verify of T - 1 drafts against a decode step), and the weights' resident
bytes. Medians of ``--repeats``, both models in one process, one after the other.

    python scripts/bench_ternary.py [--layers 30] [--tokens 1,2,5,9,17] [--threads 2]
"""
from __future__ import annotations

import argparse

import torch
from bench_recurrent_cost import forward_times  # (beside this script)
from transformers import AutoConfig

from specdec.runtime.loading import DummyWeights
from specdec.runtime.torch_llama import TorchLlama


def weight_bytes(rt: TorchLlama) -> int:
    """The bytes of the products' weights (the head's too; the embedding's not), with their copies for
    2+ rows."""
    return sum(t.numel() * t.element_size() for lin in rt._linears()
               for t in (lin.weight, lin.multi, getattr(lin, "columns", None)) if t is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", default="1,2,5,9,17")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--multi-row", action=argparse.BooleanOptionalAction, default=True,
                    help="a second copy of the weights for 2+ row products where it fits in memory (the "
                         "runtime's choice): by columns (ternary), oneDNN's verify-packed one (float32)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(t) for t in args.tokens.split(",")]
    shape = dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=args.layers,
                 num_attention_heads=20, num_key_value_heads=5, max_position_embeddings=4096, tie_word_embeddings=True)
    print(f"| BitNet 2B4T shapes, {args.layers} layers | weights | {' | '.join(map(str, sizes))} |\n"
          f"|---|---|{'---|' * len(sizes)}")
    for name in ("ternary", "float32"):
        if name == "ternary":
            config = AutoConfig.for_model("bitnet", **shape, quantization_config={"quant_method": "bitnet"})
        else:
            config = AutoConfig.for_model("bitnet", **shape)
        weights = DummyWeights(config)  # (ternary projections under the packed quantization config)
        rt = TorchLlama(config, weights, torch.device("cpu"), torch.float32, multi_row=None if args.multi_row else False)
        times = forward_times(rt, args.context, sizes, args.repeats, commit=False)
        first = times[sizes[0]]
        cells = [f"{first * 1e3:.0f} ms"] + [f"{times[T] / first:.2f}x" for T in sizes[1:]]
        print(f"| {name} | {weight_bytes(rt) / 2 ** 30:.2f} GiB | {' | '.join(cells)} |", flush=True)
        del rt, weights


if __name__ == "__main__":
    main()

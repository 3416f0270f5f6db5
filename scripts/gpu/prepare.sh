#!/usr/bin/env bash
# Prepare the GPU check (run.sh) on the development machine: it fills .gpu/ (git-ignored),
# which the `device` tool carries to a CUDA machine that reaches no network and takes at
# most 64 MiB per call. The Qwen2.5-Coder GGUFs do not fit, so .gpu/ holds only what
# `--load-format dummy` needs: each model's config and tokenizer (random weights of the real
# shapes are made on the GPU), the bench prompts, and wheels of the pinned transformers (the
# machine's image has an older one), llguidance (structured outputs) and peft with accelerate (LoRA's reference). About 38 MB.
#
#   ../shared/models/fetch-models.sh qwen-coder   # once: the GGUFs (their metadata is read)
#   scripts/gpu/prepare.sh
#   then, through the device tool: run(command="bash scripts/gpu/run.sh", carry=[".gpu"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/../.."
models=${SPECDEC_MODELS:-$HOME/.cache/specdec-models}
rm -rf .gpu && mkdir -p .gpu
for size in 1.5b 0.5b; do
  gguf="$models/qwen2.5-coder-$size-instruct/qwen2.5-coder-$size-instruct-q4_k_m.gguf"
  [ -f "$gguf" ] || { echo "missing $gguf: run ../shared/models/fetch-models.sh qwen-coder" >&2; exit 1; }
  dir=$(python3 -c 'import sys; from specdec.runtime.loading import gguf_to_hf_dir; from pathlib import Path
print(gguf_to_hf_dir(Path(sys.argv[1]), weights=False))' "$gguf")
  mkdir -p ".gpu/qwen2.5-coder-$size"
  find "$dir" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} ".gpu/qwen2.5-coder-$size/" \;
done
cp "${SPECDEC_PROMPTS:-../shared/bench/prompts.jsonl}" .gpu/prompts.jsonl
transformers=$(python3 -c 'import transformers; print(transformers.__version__)')
llguidance=$(python3 -c 'import llguidance; print(llguidance.__version__)')  # structured outputs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu \
  "transformers==$transformers" "llguidance==$llguidance" "peft==0.22.0" "accelerate==1.16.0"  # (LoRA's reference)
du -sh .gpu

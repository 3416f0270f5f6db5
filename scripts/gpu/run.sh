#!/usr/bin/env bash
# The GPU check, in one go on a CUDA machine (made by prepare.sh; through the device tool:
# run(command="bash scripts/gpu/run.sh", carry=[".gpu"], timeout_s=300); about 4 minutes on
# an H200). Writes to $OUT (default gpu-results/):
#   env.txt      torch, transformers and the GPU
#   tests.log    tests/test_cuda.py: runtime vs transformers, CUDA graphs vs eager forwards,
#                greedy speculation equal to plain decoding (float32, bfloat16), the sampling
#                verifier, the cost model, a packed BitNet (transformers compiles its products), LoRA
#                adapters against PEFT
#   bench.log, bench/bench.{json,md,png}
#                specdec bench on random weights of Qwen2.5-Coder-1.5B / 0.5B's shapes
#                (--load-format dummy) in bfloat16, 2 prompts: specdec (CUDA graphs) and
#                transformers side by side, and the cost curves (one forward of 1..17 tokens;
#                also in bench.log as soon as they are measured). Acceptance on random weights
#                means nothing (near 0 for the draft model): the speeds of plain decoding, of
#                verification and of a drafter that is always wrong do, and whether the cost
#                model then stops drafting (specdec-draft+cost)
#   eager.log    specdec plain and n-gram again with --enforce-eager (no CUDA graphs)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if compgen -G ".gpu/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")
PY
timeout 180 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
bench=(python3 -m specdec.cli bench --device cuda --load-format dummy --model .gpu/qwen2.5-coder-1.5b
       --draft .gpu/qwen2.5-coder-0.5b --prompts-file .gpu/prompts.jsonl --limit 2 --num-draft-tokens 4)
timeout 100 "${bench[@]}" --repeats 2 --out "$OUT/bench" \
  --methods specdec-plain,specdec-ngram,specdec-draft,specdec-draft+cost,hf-plain 2>&1 | tee "$OUT/bench.log"
# the same without CUDA graphs, minutes apart on the same machine: what the graphs gain (its
# tables are in eager.log; its files are dropped, since the device tool returns 8 files at most)
timeout 45 "${bench[@]}" --repeats 1 --enforce-eager --out /tmp/eager --methods specdec-plain,specdec-ngram 2>&1 \
  | tee "$OUT/eager.log"

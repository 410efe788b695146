#!/usr/bin/env bash
# Real attention datasets for `ctxfs bench search --data`: SmolLM2-135M-Instruct's keys,
# values, prefill and decode queries (layers 1, 8, 15, 22 and 29) over source code, prose and
# structured text (ctxfs.texts), at 8,192 tokens and at 32,768 tokens with linear RoPE
# scaling by 4 (position interpolation; the model is trained to 8,192 positions). Writes
# target/data/smollm2-{code,prose,structured}-{8k,32k}.safetensors; about 50 minutes on 2
# cores. The small set the tests use, tests/data/smollm2-prose-4k.safetensors, is:
#   python -m ctxfs.capture tests/data/smollm2-prose-4k.safetensors --kind prose \
#       --tokens 4096 --layers 15 --decode 16 --train-queries 512
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash tools/python-env.sh)
mkdir -p target/data
for kind in code prose structured; do
    "$venv/bin/python" -m ctxfs.capture "target/data/smollm2-$kind-8k.safetensors" --kind "$kind" --tokens 8192
    "$venv/bin/python" -m ctxfs.capture "target/data/smollm2-$kind-32k.safetensors" --kind "$kind" --tokens 32768 --rope-scale 4
done

#!/usr/bin/env bash
# The GPU checks in one call, for a machine with a CUDA GPU and no network (the device
# machine of docs/development.md, "GPU"): install dtrain from this tree and the carried
# wheels (.whl/, when present) without network, run the `gpu`-marked tests, then the
# single-GPU figures (benchmarks/gpu_llama.py). Everything lands under $OUT (default
# /tmp/gpu-check); each check ends with one summary line starting "gpu-check:".
#
#   OUT=/tmp/gpu bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "gpu-check: carried wheels FAILED to install"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
                'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
    python3 -c "import transformers; print('transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/versions.txt"

start=$SECONDS
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/gpu/test_gpu.py \
    >"$OUT/gpu-tests.log" 2>&1
status=$?
tail -n 40 "$OUT/gpu-tests.log"
echo "gpu-check: pytest -m gpu exit $status in $((SECONDS - start)) s:" \
    "$(tail -n 1 "$OUT/gpu-tests.log")"

start=$SECONDS
timeout 300 python3 benchmarks/gpu_llama.py --json "$OUT/gpu_llama.json" \
    >"$OUT/gpu-llama.log" 2>&1
status=$?
grep "^gpu-llama:" "$OUT/gpu-llama.log" || tail -n 30 "$OUT/gpu-llama.log"
echo "gpu-check: benchmarks/gpu_llama.py exit $status in $((SECONDS - start)) s"

# The main job on the GPU: `dtrain train`'s embedded default (a small GPT on Python's own
# sources) on one process (NCCL needs a GPU per rank: the default's two ranks on one GPU
# must be refused in one line), CUDA tensors, fewer steps.
timeout 60 python3 -m dtrain.cli train --set train.steps=2 >"$OUT/train-refused.log" 2>&1
status=$?
echo "gpu-check: dtrain train, 2 ranks on 1 GPU: exit $status:" \
    "$(grep -m1 -o 'error: .*' "$OUT/train-refused.log" | cut -c1-100)"
start=$SECONDS
timeout 150 python3 -m dtrain.cli train --set parallel.nproc=1 --set train.steps=100 \
    --set train.eval_every=50 \
    --set train.out_dir=/tmp/gpu-check-run >"$OUT/train.log" 2>&1
status=$?
tail -n 6 "$OUT/train.log"
cp /tmp/gpu-check-run/metrics.jsonl "$OUT/train-metrics.jsonl" 2>/dev/null
echo "gpu-check: dtrain train (default job, 100 steps) exit $status in $((SECONDS - start)) s"

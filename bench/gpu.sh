#!/usr/bin/env bash
# The GPU run (bench/gpu.py): our Triton FP8 kernel checked against the CPU emulation, then FP8 vs
# BF16 linear, training-step and decode speed, vLLM rollout (where vLLM is installed), and the
# rollout/trainer mismatch with and without exact mode. Not yet run on a GPU; bench/gpu.py skips
# sections that would start after --budget-s (420 s by default). With 2+ GPUs,
# FSDP2 step time and bytes all-gathered, FP32 vs FP8 gather (bench/distributed.py).
# The package needs torchao: where the machine lacks it, put its wheel in .whl/ (torchao 0.18 is
# pure Python: python3 -m pip download --no-deps -d .whl torchao==0.18.0).
#
#   bash bench/gpu.sh [OUT_DIR]      # tables in OUT_DIR/gpu.md (default: $OUT or bench/results/gpu)
#
# Runs on the machine's own python3 and torch (no install): the repository goes on PYTHONPATH.
# Wheels in .whl/ (for a package the machine lacks) are installed to a temporary folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-bench/results/gpu}}"
PY="${PYTHON:-python3}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "bench/gpu.sh needs a CUDA GPU: $PY cannot import torch, or its torch sees no GPU (torch.cuda.is_available() is False)." >&2
    echo "Run it on the GPU machine; 'python bench/gpu.py --smoke --out DIR' checks the script on CPU." >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jetrl-site .whl/*.whl
    export PYTHONPATH="/tmp/jetrl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" bench/gpu.py --out "$OUT_DIR" "${@:2}"

# FSDP2 with FP8 all-gather (bench/distributed.py, NCCL): needs a GPU per rank, so 2 or more
GPUS="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
if [ "$GPUS" -ge 2 ]; then
    "$PY" bench/distributed.py --device cuda --models aligned --batch 8 --seq 512 --out "$OUT_DIR"
else
    echo "FSDP2 section skipped: $GPUS GPU here, it needs 2 (one per rank)"
fi

#!/usr/bin/env bash
# The trainer at a real model size on one GPU (benchmarks/gpu_check.py says what runs and what each
# figure means): bf16-mixed + activation checkpointing + packing on a random-init Qwen2.5-0.5B-shaped
# model, vLLM generating on the same GPU with weights from the trainer. At most 8 minutes; prints one
# JSON object. Without a GPU it stops with a message and exit status 2.
#
#   bash benchmarks/gpu_check.sh [--steps N] [--engine hf] ...     PYTHON=path/to/python to choose one
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none); this check needs one GPU" >&2
    exit 2
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py --json --timeout 450 "$@"

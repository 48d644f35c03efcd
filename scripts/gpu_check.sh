#!/usr/bin/env bash
# One prepared GPU check (README, "GPU check"): builds a Qwen2.5-0.5B-shaped model with random weights on the GPU,
# runs the gpu-marked tests, two federated rounds of two orgs on CUDA, and -- where `import vllm` works -- the
# vllm-marked tests and the same rounds with the vLLM engine. Writes OUT/gpu_check.json and prints a table.
# Nothing is downloaded. Under 10 minutes on one H200 (a --budget-s guard skips late steps).
#
#   scripts/gpu_check.sh [--out DIR] [--dry-run] [--skip-tests] [--skip-vllm] [--budget-s S] [--keep-work]
#
# --dry-run runs every step on CPU with a micro model in seconds (tests/test_gpu_check.py runs it in CI).
# Python: $PYTHON, else .venv/bin/python, else python3. Packages the machine lacks (e.g. pydantic on a bare GPU
# image) are installed offline from $GPU_CHECK_WHEELS (default ./wheels) when that folder exists; fill it on a
# networked machine with `pip download --only-binary=:all: -d wheels pydantic pyyaml` (a few MiB).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# what the check imports beyond torch + transformers (module:pip-name)
NEEDED="pydantic:pydantic yaml:pyyaml safetensors:safetensors tokenizers:tokenizers packaging:packaging"
missing=()
for pair in $NEEDED; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    wheels="${GPU_CHECK_WHEELS:-wheels}"
    if [ -d "$wheels" ]; then
        echo "gpu_check: installing ${missing[*]} from $wheels (offline)" >&2
        "$PY" -m pip install --quiet --no-index --find-links "$wheels" "${missing[@]}"
    else
        echo "gpu_check: missing Python packages: ${missing[*]} (no $wheels/ folder to install them from)" >&2
        exit 2
    fi
fi

exec "$PY" -m hacrl_fed.cli gpu-check "$@"

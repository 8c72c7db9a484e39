#!/usr/bin/env bash
# The accelerator check: on a machine with an NVIDIA GPU, Dew's train step and decode against torch on
# the same GPU, in under 8 minutes, printing the ratios. CI never runs it.
#
#     bash benchmarks/gpu_check.sh                  # from the repository root; PyPI reachable
#     DEW_WHEELS=wheels bash benchmarks/gpu_check.sh  # offline: install from a folder of wheels
#
# 1. jax's CUDA wheel: kept if the interpreter's jax already runs on the GPU, else installed
#    (`jax[cuda12]` within Dew's pin). Dew's other dependencies, torch and transformers are installed
#    where missing. Dew runs from this checkout (PYTHONPATH), without building its native CPU kernels:
#    on a GPU the kernel policy is XLA's (dew.kernels.policy).
# 2. benchmarks.train_step at the quick-start shape and the benchmark shape, fp32 and bf16, torch on
#    the same GPU (`--torch-device cuda`), one AdamW step a batch.
# 3. benchmarks.generate on a random Llama of SmolLM2-135M's shape, batch 1 and 8, transformers on the GPU.
# Each step has its own time limit; the logs go to $OUT (default gpu-check/), and the ratio lines are
# printed again at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
WHEELS=${DEW_WHEELS:-}
mkdir -p "$OUT"
started=$SECONDS

say() { echo "== [$((SECONDS - started)) s] $*"; }

install() {
    if [ -n "$WHEELS" ]; then
        "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "$@"
    else
        "$PYTHON" -m pip install --quiet "$@"
    fi
}

if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    echo "gpu_check: no NVIDIA GPU answers nvidia-smi on this machine: run it where a GPU is lent" >&2
    exit 1
fi

on_gpu() { "$PYTHON" -c 'import sys, jax; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; }
if on_gpu; then
    say "jax $("$PYTHON" -c 'import jax; print(jax.__version__)') already runs on the GPU: kept"
else
    say "installing jax's CUDA wheel"
    install "jax[cuda12]>=0.10,<0.11" || { echo "gpu_check: jax's CUDA wheel did not install" >&2; exit 1; }
    on_gpu || { echo "gpu_check: jax installed but does not see the GPU" >&2; exit 1; }
fi

# Dew's dependencies that are missing (jax's own pin aside: the GPU's jax is the one to measure), then
# the oracles the benchmarks compare with.
missing=$("$PYTHON" - <<'EOF'
import importlib.metadata
import tomllib

from packaging.requirements import Requirement

for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    requirement = Requirement(line)
    if requirement.name == "jax" or (requirement.marker and not requirement.marker.evaluate()):
        continue
    try:
        found = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found is None or found not in requirement.specifier:
        print(line)
for oracle in ("torch", "transformers>=5"):
    requirement = Requirement(oracle)
    try:
        importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        print(oracle)
EOF
)
if [ -n "$missing" ]; then
    say "installing: $(echo "$missing" | tr '\n' ' ')"
    mapfile -t packages <<< "$missing"
    install "${packages[@]}" || { echo "gpu_check: the dependencies above did not install" >&2; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    || { echo "gpu_check: torch does not see the GPU (a CPU wheel?)" >&2; exit 1; }

run() {
    local limit=$1 name=$2
    shift 2
    say "$name: $*"
    timeout "$limit" "$PYTHON" "$@" 2>&1 | tee "$OUT/$name.txt"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 124 ] && echo "gpu_check: $name ran past its $limit s" | tee -a "$OUT/$name.txt"
    return 0
}

run 150 train_quickstart -m benchmarks.train_step --shape quickstart --steps 10 --accumulation 1 \
    --kernels xla --torch-device cuda
run 150 train_benchmark -m benchmarks.train_step --shape benchmark --steps 10 --accumulation 1 \
    --kernels xla --torch-device cuda
run 120 decode -m benchmarks.generate --shape smollm2 --rounds 0 --torch-device cuda

say "ratios (Dew against torch on the same GPU)"
grep -H -E "^machine|ratio" "$OUT"/train_quickstart.txt "$OUT"/train_benchmark.txt "$OUT"/decode.txt
say "done"

#!/usr/bin/env bash
# GPU checks of issues 11 and 30 in one go: the CUDA tests, then bench/peers.py on the
# GPU (eager CUDA, torch.compile in its default mode and mode="reduce-overhead",
# ours-eager / ours-inductor / ours-auto), toy rows and real sizes.
#
# Run from the repository root on a machine with a CUDA GPU and PyTorch preinstalled in
# its python3 (the benchmark machine's torch is used as is; nothing installs another
# torch). Uses that python if it already has torch and pytest; else creates .venv-gpu
# (with the system site-packages, so the preinstalled torch is visible) and installs
# the project without dependencies plus what is missing, falling back to PYTHONPATH.
#
#     bash bench/gpu.sh            # tests + GPU benchmark, toy and real rows
#     QUICK=1 bash bench/gpu.sh    # tests + toy rows only, 3 repeats
#     CPU=1 bash bench/gpu.sh      # also the CPU peer benchmark on this machine
#
# Every step has its own time limit (seconds: TESTS_S, TOY_S, REAL_S, CPU_S), so the
# script ends within their sum; a step cut by its limit says so in the log and the
# next step runs. Results: $OUT/gpu-results.txt (or ./gpu-results.txt without $OUT).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOG=${OUT:-$ROOT}/gpu-results.txt
TESTS_S=${TESTS_S:-240}
TOY_S=${TOY_S:-300}
REAL_S=${REAL_S:-420}
CPU_S=${CPU_S:-300}
REPEATS=${REPEATS:-5}
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
step() {  # step LIMIT_S COMMAND...: run with a limit, output to the log
    local limit=$1; shift
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then say "(cut after ${limit} s)"; fi
    return 0
}

if "$PY" -c "import torch, pytest" 2>/dev/null; then
    VPY=$(command -v "$PY")
else
    if [ ! -x .venv-gpu/bin/python ]; then
        "$PY" -m venv --system-site-packages .venv-gpu || say "venv creation failed; using $PY"
    fi
    VPY=$ROOT/.venv-gpu/bin/python
    [ -x "$VPY" ] || VPY=$(command -v "$PY")
    "$VPY" -m pip install -q -e ".[test]" --no-deps --no-build-isolation >>"$LOG" 2>&1 \
        || say "editable install failed: using PYTHONPATH"
fi
for pkg in pytest pytest-timeout tqdm safetensors onnx onnxruntime; do
    mod=${pkg//-/_}
    "$VPY" -c "import $mod" 2>/dev/null || "$VPY" -m pip install -q "$pkg" >>"$LOG" 2>&1 \
        || say "could not install $pkg (continuing)"
done
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# the auto backend decides afresh in this run (and never writes the user's store)
export POPTORCH_AUTO_DECISIONS_DIR=${POPTORCH_AUTO_DECISIONS_DIR:-$(mktemp -d)}

say "== environment ($(date -u +%H:%M:%S) UTC)"
step 60 "$VPY" -c "
import os, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '',
      'cpus', os.cpu_count())"
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no CUDA device: nothing measured on a GPU"
    exit 1
fi

say "== CUDA and backend tests"
step "$TESTS_S" "$VPY" -m pytest -q -p no:cacheprovider -rs \
    tests/poptorch/test_backends.py tests/poptorch/test_backend_auto.py \
    tests/poptorch/test_backend_auto_decisions.py \
    tests/popart_compiler/optim/test_device_optimizer.py

THREADS=$("$VPY" -c "import os; print(min(8, os.cpu_count() or 1))")
say "== GPU benchmark, toy rows ($(date -u +%H:%M:%S) UTC)"
step "$TOY_S" "$VPY" bench/peers.py --device cuda --rows toy --repeats "$REPEATS" \
    --threads "$THREADS"
if [ -z "${QUICK:-}" ]; then
    say "== GPU benchmark, real sizes ($(date -u +%H:%M:%S) UTC)"
    step "$REAL_S" "$VPY" bench/peers.py --device cuda --rows real --repeats "$REPEATS" \
        --threads "$THREADS"
fi
if [ -n "${CPU:-}" ]; then
    say "== CPU peer benchmark, same machine ($(date -u +%H:%M:%S) UTC)"
    step "$CPU_S" "$VPY" bench/peers.py --repeats "$REPEATS" --threads "$THREADS"
fi
say "== done ($(date -u +%H:%M:%S) UTC); results in $LOG"

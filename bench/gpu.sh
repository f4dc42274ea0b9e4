#!/usr/bin/env bash
# GPU checks of issue 11 in one go: the CUDA tests, then the peer benchmark on the GPU.
#
# Run from the repository root on a machine with a CUDA GPU and PyTorch preinstalled in
# its python3 (the benchmark machine's torch is used as is; nothing installs another
# torch). Creates .venv-gpu (with the system site-packages, so the preinstalled torch is
# visible), installs the project without dependencies plus what is missing, and falls
# back to PYTHONPATH if the editable install fails.
#
#     bash bench/gpu.sh            # tests + benchmark
#     QUICK=1 bash bench/gpu.sh    # tests + MLP/CNN benchmark only
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOG=${OUT:-$ROOT}/gpu-results.txt
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }

if "$PY" -c "import torch, pytest" 2>/dev/null; then
    # The machine's python already holds torch and pytest (often itself a venv, whose
    # packages a --system-site-packages venv would not see): use it as it is.
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
    [ "$pkg" = pytest-timeout ] && mod=pytest_timeout
    "$VPY" -c "import $mod" 2>/dev/null || "$VPY" -m pip install -q "$pkg" >>"$LOG" 2>&1 \
        || say "could not install $pkg (continuing)"
done
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

say "== environment"
"$VPY" - <<'PYEOF' 2>&1 | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF

say "== CUDA and backend tests"
"$VPY" -m pytest -q -p no:cacheprovider tests/poptorch/test_backends.py 2>&1 | tail -25 | tee -a "$LOG"

say "== CUDA benchmark"
"$VPY" - <<'PYEOF' 2>&1 | tee -a "$LOG"
import statistics, time, torch, poptorch
from bench.peers import MODELS, DEVICE_ITERATIONS
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: skipped")
import os
keys = ["mlp", "cnn"] if os.environ.get("QUICK") else list(MODELS)
print("| model | eager cuda | ours-eager cuda | ours-inductor cuda | torch.compile cuda |")
print("|---|---|---|---|---|")
for key in keys:
    title, cls, mb, data, _ = MODELS[key]
    torch.manual_seed(0)
    model = cls().eval()
    x = data(mb * DEVICE_ITERATIONS)
    gm, gx = model.cuda(), x.cuda()
    runners = {"eager": lambda: gm(gx)}
    for c in ("eager", "inductor"):
        o = poptorch.Options().deviceIterations(DEVICE_ITERATIONS)
        o.Backend.executionDevice("cuda").compiler(c)
        o.showCompilationProgressBar(False)
        p = poptorch.inferenceModel(cls().eval(), o)
        runners["ours-" + c] = (lambda p=p: p(x))
    comp = torch.compile(gm)
    runners["torch.compile"] = lambda: comp(gx)
    times = {}
    with torch.no_grad():
        for k, fn in runners.items():
            fn(); fn(); torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                s = time.perf_counter(); fn(); torch.cuda.synchronize()
                ts.append(time.perf_counter() - s)
            times[k] = statistics.median(ts)
    ref = times["eager"]
    print(f"| {title} | " + " | ".join(f"{times[k]*1e3:.2f} ms ({times[k]/ref:.2f})"
                                       for k in runners) + " |", flush=True)
PYEOF

say "== CPU peer benchmark (same machine)"
if [ -n "${QUICK:-}" ]; then
    "$VPY" bench/peers.py --models mlp cnn --repeats 5 --threads 4 2>&1 | tail -30 | tee -a "$LOG"
else
    "$VPY" bench/peers.py --repeats 5 --threads 4 2>&1 | tail -30 | tee -a "$LOG"
fi
say "== done; results in $LOG"

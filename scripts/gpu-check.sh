#!/usr/bin/env bash
# GPU check of the TensorRT backend: install what can be installed on a machine with an NVIDIA
# GPU, run the `gpu` tests (parity with the CPU engine against real TensorRT) and a decode bench,
# and keep everything it printed in a log to paste into the issue's closing note.
#
#   scripts/gpu-check.sh                 # uses ./.venv-gpu (created if missing)
#   VENV=/path/to/venv scripts/gpu-check.sh
#   SKIP_INSTALL=1 scripts/gpu-check.sh  # tensorrt/pycuda already installed in $VENV
#
# Exits 0 only when the gpu tests ran and passed; 3 when they could not run (no GPU, no
# tensorrt/pycuda): then nothing was verified on a GPU and the note must say so.
set -u -o pipefail
cd "$(dirname "$0")/.."
LOG="gpu-check-$(date -u +%Y%m%dT%H%M%SZ).log"
exec > >(tee "$LOG") 2>&1
echo "== gpu-check $(date -u +%FT%TZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    echo "no NVIDIA GPU answers (nvidia-smi missing or failing): nothing can be checked here"
    exit 3
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv

VENV="${VENV:-.venv-gpu}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || exit 3
fi
PY="$VENV/bin/python"
if [ -z "${SKIP_INSTALL:-}" ]; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e ".[test]" || { echo "cannot install the project's test extra"; exit 3; }
    # The PyPI tensorrt packages fetch their wheels from NVIDIA's index; name it directly.
    CUDA_MAJOR="$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)"
    "$PY" -m pip install -q --extra-index-url https://pypi.nvidia.com "tensorrt-cu${CUDA_MAJOR:-12}" \
        || "$PY" -m pip install -q --extra-index-url https://pypi.nvidia.com tensorrt \
        || echo "WARNING: tensorrt did not install"
    # pycuda builds against the CUDA toolkit (nvcc and headers); point CUDA_ROOT at it if needed.
    "$PY" -m pip install -q pycuda || echo "WARNING: pycuda did not install (is the CUDA toolkit on PATH?)"
fi
"$PY" - <<'PYEOF'
from inference.cuda_device import cuda_device, tensorrt_missing
missing = tensorrt_missing()
if missing:
    print("tensorrt backend NOT usable:", missing)
else:
    import tensorrt, pycuda
    d = cuda_device(0)
    print(f"tensorrt {tensorrt.__version__}, pycuda {getattr(pycuda, 'VERSION_TEXT', '?')}, "
          f"{d.name} (compute {d.compute_capability}, {d.arch})")
PYEOF

echo "== gpu tests"
PYTHONPATH="$PWD" "$PY" -m pytest -m gpu tests/trt/test_gpu.py -v -rs -p no:cacheprovider | tee .gpu-tests.out
status=${PIPESTATUS[0]}
if grep -q " passed" .gpu-tests.out && ! grep -qE "skipped|SKIPPED" .gpu-tests.out; then ran=1; else ran=0; fi
rm -f .gpu-tests.out

echo "== decode bench"
if PYTHONPATH="$PWD" "$PY" bench/decode.py --help 2>/dev/null | grep -q -- "--backend"; then
    PYTHONPATH="$PWD" "$PY" bench/decode.py --backend tensorrt
else
    PYTHONPATH="$PWD" "$PY" bench/trt_decode.py
fi

echo "== log: $LOG"
if [ "$ran" != 1 ]; then
    echo "RESULT: the gpu tests did not all run (skipped or none passed): NOT verified on a GPU"
    exit 3
fi
[ "$status" -eq 0 ] && echo "RESULT: gpu tests passed on this GPU" || echo "RESULT: gpu tests FAILED"
exit "$status"

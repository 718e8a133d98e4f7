#!/usr/bin/env bash
# Every bench script in --quick mode (small sizes, seconds not minutes), so that a bench that
# rots fails CI (.ci/run runs this after pytest). The figures are printed, never checked: they
# are not tests. A peer that is not installed is skipped by its script with one line.
#   bench/run_quick.sh            (PYTHON=.venv/bin/python by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
run() {
  local t0=$SECONDS
  echo "== $*"
  "$@"
  echo "== $1 $2 ok ($((SECONDS - t0)) s)"
}
for script in bench/*.py; do
  run "$PYTHON" "$script" --quick
done
# The vision bench's tiled family (SmolVLM) too: its own checkpoint writer and encoder.
run "$PYTHON" bench/vision_encode.py --quick --family smolvlm
# The TensorRT bench once more against the tests' fake tensorrt/pycuda (onnxruntime underneath):
# it checks that the script runs, not TensorRT.
PYTHONPATH=tests/support/fake_tensorrt:$PYTHONPATH run "$PYTHON" bench/trt_decode.py --quick
echo "bench --quick: all ran in $(($(date +%s) - start)) s"

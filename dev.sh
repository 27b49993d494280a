#!/usr/bin/env bash
# flashmod's front door. From a fresh clone:
#   ./dev.sh example   attention through flashmod on the default device: parity with torch, speed
#   ./dev.sh test      the test suite (what CI runs)
#   ./dev.sh bench     the benchmark: bench_attention.py with CUDA, else bench_cpu.py; table, JSON, plot
# Each installs only what is missing (torch, ninja, pytest, transformers; matplotlib for bench), then builds the
# extension in place; ninja recompiles only what changed. Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

install() {
  echo "flashmod: installing $*"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check "$@"
}

ensure_dependencies() {
  # torch is pinned only when absent: an existing torch (e.g. a CUDA build) is kept as it is.
  has torch || install "torch==2.13.0"
  has ninja || install ninja || echo "flashmod: ninja unavailable, building without it (slower)"
  if [[ "${1:-}" == test ]]; then has pytest || install pytest; fi
  # matplotlib only draws the plot: without it the benchmark still prints and writes its results.
  if [[ "${1:-}" == bench ]]; then has matplotlib || install matplotlib || echo "flashmod: matplotlib unavailable, no plot"; fi
  # transformers is optional: without it (and without a network) the HF parts are skipped.
  has transformers || install "transformers>=5.0,<6" || echo "flashmod: transformers unavailable, HF parts skipped"
}

build() {
  mkdir -p build
  if ! "$PYTHON" setup.py build_ext --inplace >build/build.log 2>&1; then
    cat build/build.log
    echo "flashmod: build failed (log above, also in build/build.log)" >&2
    exit 1
  fi
}

command=${1:-}
shift || true
case "$command" in
  example)
    ensure_dependencies example
    build
    "$PYTHON" examples/quickstart.py "$@"
    if has transformers && [[ -f examples/hf_generate.py ]]; then "$PYTHON" examples/hf_generate.py; fi
    ;;
  test)
    ensure_dependencies test
    build
    "$PYTHON" -m pytest tests "$@"
    ;;
  bench)
    ensure_dependencies bench
    build
    if "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
      "$PYTHON" benchmarks/bench_attention.py "$@"
    else
      "$PYTHON" benchmarks/bench_cpu.py "$@"
    fi
    ;;
  *)
    echo "usage: ./dev.sh example|test|bench [args...]" >&2
    exit 2
    ;;
esac

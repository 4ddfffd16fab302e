#!/usr/bin/env bash
# scripts/python_tests.sh BUILD_DIR: the Python tests (tests/python) against the extension that the
# CMake build in BUILD_DIR staged in BUILD_DIR/python (FLASHKIT_PYTHON=AUTO builds it whenever the
# configuring Python imports torch). Where torch is not importable the tests are skipped with a
# message and the script succeeds; a build that should have the extension and lacks it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:?usage: scripts/python_tests.sh BUILD_DIR}
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "flashkit: skipping the Python tests: torch is not importable by $(command -v "$PYTHON")" \
       "(scripts/python_env.sh makes a virtual environment with it; .ci/run uses it)"
  exit 0
fi
if ! compgen -G "$BUILD_DIR/python/flashkit/_C*.so" >/dev/null; then
  echo "flashkit: $BUILD_DIR has no PyTorch extension although $PYTHON imports torch;" \
       "configure it with -DFLASHKIT_PYTHON=ON (and -DPython_EXECUTABLE=$(command -v "$PYTHON"))" >&2
  exit 1
fi
PYTHONPATH="$(cd "$BUILD_DIR" && pwd)/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PYTHON" -m pytest tests/python -q -p no:cacheprovider -p no:logging "${@:2}"

#!/usr/bin/env bash
# scripts/python_env.sh [VENV_DIR]: a virtual environment in which PyTorch imports, for the Python
# tests on a machine that has none (CI). Default VENV_DIR: .venv in the repository (ignored by git).
#
# PyPI's Linux torch wheel is the CUDA build; it does not import without its nvidia-* dependencies
# (libcufile, cuDNN, ...), so they are installed too: about 4.7 GB, 70 s on the development machine
# (2026-11-23). The CPU backend is what runs without a GPU. The torch version is the GPU machine's.
# transformers (pure Python, plus the tokenizers and safetensors wheels; 23 s) serves the
# integration test. Does nothing when the environment already imports torch, pytest and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
TORCH_SPEC=${FLASHKIT_TORCH_SPEC:-torch==2.11.0}
TRANSFORMERS_SPEC=${FLASHKIT_TRANSFORMERS_SPEC:-transformers==5.23.0}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, pytest, transformers" 2>/dev/null; then
  echo "flashkit: $VENV already has torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check "$TORCH_SPEC" numpy pytest \
  "$TRANSFORMERS_SPEC"
echo "flashkit: installed $TORCH_SPEC, numpy, pytest, $TRANSFORMERS_SPEC in $VENV in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# scripts/python_env.sh [VENV_DIR]: a virtual environment in which PyTorch imports, for the Python
# tests on a machine that has none (CI). Default VENV_DIR: .venv in the repository (ignored by git).
#
# PyPI's Linux torch wheel is the CUDA build; it does not import without its nvidia-* dependencies
# (libcufile, cuDNN, ...), so they are installed too: about 5 GB (120-145 s on the 2-core
# development machine, 2026-11-24). The CPU backend is what runs without a GPU. The versions are pinned in
# scripts/python_requirements.lock (torch is the GPU machine's version; transformers serves the
# integration test).
#
# Disk: a single `pip install` holds every downloaded wheel (3 GB) until it has installed them all,
# which once filled a CI machine's disk. So the wheels go in one at a time, the large ones first,
# with pip's temporary files beside the environment rather than in a possibly small /tmp. Where the
# disk cannot hold the environment (or the install fails), the environment is removed and the script
# says so and succeeds: scripts/python_tests.sh then reports the Python tests as skipped, as it does
# on any machine whose Python lacks torch, and the C++ tests still run.
#
# Does nothing when the environment already imports torch, pytest and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
LOCK=scripts/python_requirements.lock
NEED_GB=6   # the installed environment (5 GB) plus the largest wheel being unpacked

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, pytest, transformers" 2>/dev/null; then
  echo "flashkit: $VENV already has torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
skip() {
  rm -rf "$VENV" "$VENV.pip-tmp"
  echo "flashkit: no Python environment with torch: $1; the Python tests will report as skipped" >&2
  exit 0
}
mkdir -p "$(dirname "$VENV")"
free_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "$free_gb" -lt "$NEED_GB" ]; then
  skip "$free_gb GB free where $VENV would go, torch and its CUDA libraries need about $NEED_GB GB"
fi

start=$(date +%s)
python3 -m venv "$VENV" || skip "python3 -m venv failed (above)"
mkdir -p "$VENV.pip-tmp"
pip_install() {
  TMPDIR="$PWD/$VENV.pip-tmp" "$VENV/bin/pip" install --quiet --no-cache-dir --no-deps \
    --disable-pip-version-check "$@"
}
# The large wheels (torch, triton, the CUDA libraries) one by one, then the rest in one call.
mapfile -t specs < <(grep -v '^#' "$LOCK")
small=()
for spec in "${specs[@]}"; do
  if [[ $spec =~ ^(torch|triton|nvidia-|cuda-) ]]; then
    pip_install "$spec" || skip "pip failed installing $spec (above)"
  else
    small+=("$spec")
  fi
done
pip_install "${small[@]}" || skip "pip failed installing the small packages (above)"
rm -rf "$VENV.pip-tmp"
"$VENV/bin/python" -c "import torch, pytest, transformers" || skip "torch does not import after the install"
echo "flashkit: installed ${#specs[@]} packages of $LOCK in $VENV in $(( $(date +%s) - start )) s"

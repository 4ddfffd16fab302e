#!/usr/bin/env bash
# Checks (and where it can, installs) what building flashkit needs: CMake >= 3.25, Ninja, a C++17
# compiler, GoogleTest. nvcc is optional: without it only the CPU backend is built.
set -euo pipefail

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v c++ >/dev/null || missing+=(g++)
if [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/local/include/gtest/gtest.h ] \
   && [ -z "${FLASHKIT_GTEST_SOURCE_DIR:-}" ]; then
  missing+=(libgtest-dev)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "flashkit: installing ${missing[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    echo "flashkit: missing ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

cmake_version=$(cmake --version | head -1 | awk '{print $3}')
if [ "$(printf '%s\n3.25\n' "$cmake_version" | sort -V | head -1)" != "3.25" ]; then
  echo "flashkit: CMake >= 3.25 is needed, found $cmake_version (pip install cmake)" >&2
  exit 1
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "flashkit: nvcc not found; building the CPU backend only (install the CUDA toolkit for GPU kernels)"
fi

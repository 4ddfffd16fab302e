# scripts/ab_common.sh: sourced by scripts/ab_branch.sh and scripts/ab_rounds.sh.
#
# ab_build_tree NAME SRC LOG_DIR JOBS TARGETS...: configures /tmp/ab-NAME from SRC for sm_90a with
# the head-dim families $AB_FAMILIES (default "64;128;256") and dtypes $AB_DTYPES (default bf16), and
# builds TARGETS with JOBS jobs ($ROOT: the checkout, set by the caller); logs go to
# LOG_DIR/{configure,build}-NAME.log, and it prints
# "build NAME: <status>". A build directory of the same source is reused (cmake takes the options
# anew and ninja rebuilds what they change, so a tree built for other families is not run stale); one
# of another source is removed first.
ab_build_tree() {
  local name=$1 src=$2 logs=$3 jobs=$4
  shift 4
  local dir="/tmp/ab-$name"
  if [ -f "$dir/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$src" "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
  fi
  # The tests are configured only for a tree that builds them (GoogleTest: the checkout's carried
  # .deps, as scripts/gpu_check.sh takes it).
  local tests=(-DFLASHKIT_TESTS=OFF)
  [[ " $* " == *" flashkit_gpu_tests "* ]] &&
    tests=(-DFLASHKIT_TESTS=ON -DFLASHKIT_GTEST_SOURCE_DIR="$ROOT/.deps/googletest")
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DFLASHKIT_HEAD_DIMS="${AB_FAMILIES:-64;128;256}" -DFLASHKIT_DTYPES="${AB_DTYPES:-bf16}" \
    -DFLASHKIT_PYTHON=OFF "${tests[@]}" >"$logs/configure-$name.log" 2>&1 &&
    cmake --build "$dir" -j "$jobs" --target "$@" >"$logs/build-$name.log" 2>&1
  echo "build $name: $?"
}

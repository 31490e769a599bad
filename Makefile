# Set-up and entry points. `make run` and `make test` each install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast clean

# torch first, pinned: its CPU wheel lies on the machines' disk; an unpinned torch
# would pull a multi-GB CUDA build. constraints.txt pins the whole set proven together.
$(STAMP): pyproject.toml constraints.txt
	python3.11 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: install  ## the tiny GRPO job: learns single-digit addition on a CPU in minutes
	$(VENV)/bin/streamrl run configs/tiny_grpo.yaml

test: install  ## the whole suite, slow end-to-end tests included (what CI runs)
	$(PY) -m pytest

test-fast: install  ## skip the minutes-long end-to-end tests
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) runs

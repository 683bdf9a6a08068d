# Two entry points, both install what they need first (a fresh machine has nothing):
#   make train   - install, then train the embedded default (tiny offline model, CPU, a few minutes)
#   make test    - install, then run the whole test suite (fast tier first, then the slow end-to-end tier)
# They work in a virtualenv and with a plain system Python (PYTHON=python3 if there is no `python`).
PYTHON ?= $(shell command -v python >/dev/null 2>&1 && echo python || echo python3)
PIP ?= $(PYTHON) -m pip
# torch 2.13.0 is the CPU build on these machines; DeepSpeed installs as pure Python without building ops.
export DS_BUILD_OPS ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-test train test test-fast

install:
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e .

install-test:
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"

train: install
	$(PYTHON) train_bapo.py

# The slow tier must collect tests: pytest's exit code 5 ("no tests collected") fails the target.
test: install-test
	$(PYTHON) -m pytest -m "not slow" -q --durations=20
	$(PYTHON) -m pytest -m slow -q --durations=30

test-fast: install-test
	$(PYTHON) -m pytest -m "not slow" -q --durations=20

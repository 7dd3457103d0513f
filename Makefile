# Project tasks over a local virtual environment (.venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The main job: a multi-table TBE on a synthetic batch, checked and timed.
demo: venv
	$(PY) -m tbe_jax.demo

# The test suite (CPU: Pallas kernels in interpret mode; GPU: compiled).
test: venv
	$(PY) -m pytest -q

# Forward benchmark on the anchors' presets (meant for the GPU).
bench: venv
	$(PY) benchmarks/bench_forward.py

clean:
	rm -rf $(VENV) build *.egg-info

# Project tasks over a local virtual environment (.venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo check-demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The main job: train a DLRM (26 sparse features on one TBE, fused row-wise
# Adagrad; optax Adam for the MLPs) on synthetic click logs; AUC before/after.
# Small by default (a few minutes on 2 CPU cores); ARGS="--size gpu" on a GPU.
demo: venv
	$(PY) -m examples.dlrm.train $(ARGS)

# A multi-table TBE forward on a synthetic batch, checked against a float64 model and timed.
check-demo: venv
	$(PY) -m tbe_jax.demo

# The test suite (CPU: Pallas kernels in interpret mode; GPU: compiled), two workers.
test: venv
	$(PY) -m pytest -q -n 2

# Forward and backward benchmarks on the anchors' presets (meant for the GPU; results in benchmarks/results/).
bench: venv
	$(PY) -m benchmarks presets $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

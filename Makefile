PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install bench clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, from the CPU wheel, so that nothing pulls a CUDA build.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[test,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VPY) -m autopar.cli demo

# What CI runs (.ci/run): every tier, slow cases excluded.
test: $(STAMP)
	$(VPY) -m pytest tests -x -q -m "not slow" --durations=15

# The inner loop: the single-process tier (tests/unit), slow cases excluded.
test-fast: $(STAMP)
	$(VPY) -m pytest tests/unit -x -q -m "not slow"

bench: $(STAMP)
	$(VPY) bench/data_parallel.py

clean:
	rm -rf $(VENV) build *.egg-info

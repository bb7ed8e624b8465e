PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-gpu install bench clean

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

# What CI runs (.ci/run): every tier, slow cases excluded. The single-process tier runs beside the
# multi-process one (its ranks wait on each other and on rank 0's planning, which leaves a core
# free much of the time); its output is printed when both have ended, and either failing fails.
test: $(STAMP)
	@log=$$(mktemp); $(VPY) -m pytest tests/unit -q -m "not slow" -p no:cacheprovider > $$log 2>&1 & unit=$$!; \
	$(VPY) -m pytest tests --ignore=tests/unit -x -q -m "not slow" --durations=15; ranks=$$?; \
	wait $$unit; units=$$?; echo "== tests/unit (run beside the rest)"; \
	if [ $$units -eq 0 ]; then tail -n 3 $$log; else cat $$log; fi; rm -f $$log; \
	test $$ranks -eq 0 -a $$units -eq 0

# The inner loop: the single-process tier (tests/unit), slow cases excluded.
test-fast: $(STAMP)
	$(VPY) -m pytest tests/unit -x -q -m "not slow"

# The CUDA / NCCL path on one GPU (skipped where there is none).
test-gpu: $(STAMP)
	$(VPY) -m pytest tests/gpu -q -m gpu

bench: $(STAMP)
	$(VPY) bench/data_parallel.py

clean:
	rm -rf $(VENV) build *.egg-info

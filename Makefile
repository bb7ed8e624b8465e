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

# What CI runs (.ci/run): every tier, slow cases excluded, in two streams on the two cores. Stream 1: the
# single-process tier, then the rank files that mostly wait (subprocesses, restarts, timeouts: RANKS_BESIDE);
# stream 2: the other rank files. A rank test alone leaves part of a core idle (its ranks wait on each other
# and on rank 0's planning), which the other stream fills. Stream 1's output is printed when both have
# ended, and any failure fails.
UNIT_TESTS := tests/unit
RANK_TESTS := tests
RANKS_BESIDE := tests/ranks/test_elastic.py tests/ranks/test_comm_timeouts.py tests/ranks/test_launch.py \
	tests/ranks/test_launch_errors.py tests/ranks/test_calibrate.py tests/ranks/test_allocator.py
test: $(STAMP)
	@log=$$(mktemp); ( $(VPY) -m pytest $(UNIT_TESTS) -q -m "not slow" -p no:cacheprovider > $$log.unit 2>&1; \
	echo $$? > $$log.unit.rc; $(VPY) -m pytest $(RANKS_BESIDE) -x -q -m "not slow" -p no:cacheprovider \
	> $$log.beside 2>&1; echo $$? > $$log.beside.rc ) & first=$$!; \
	$(VPY) -m pytest $(RANK_TESTS) --ignore=tests/unit $(RANKS_BESIDE:%=--ignore=%) -x -q -m "not slow" --durations=15; \
	ranks=$$?; wait $$first; status=$$ranks; \
	for part in unit beside; do rc=$$(cat $$log.$$part.rc 2>/dev/null || echo 1); \
	echo "== $$part (stream 1: $(UNIT_TESTS), then $(words $(RANKS_BESIDE)) rank file(s) beside the rest)"; \
	if [ "$$rc" -eq 0 ]; then tail -n 3 $$log.$$part; else cat $$log.$$part; status=1; fi; done; \
	rm -f $$log $$log.unit $$log.unit.rc $$log.beside $$log.beside.rc; test $$status -eq 0

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

# Targets: venv, demo, test, bench-quick.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test bench-quick

venv: $(STAMP)

# (Re)install only when setup.py is newer than the stamp.
$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/torchrun --nproc-per-node 2 -m mfsdp2.examples.demo

test: venv
	$(PY) -m pytest -q tests

bench-quick: venv
	$(PY) benchmarks/compare_fsdp2.py --quick

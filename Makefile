# Targets: venv, demo, test, bench-quick.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test bench-quick bench-record

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

# Every figure of docs/benchmarks.md, recorded into benchmarks/results/ (run on a quiet machine at
# a clean commit; ~1.5 h on 2 cores). The FSDP2 tuning run goes first: its winner is "FSDP2 tuned"
# for the others. Render the tables with benchmarks/report.py.
R := benchmarks/results
bench-record: venv
	$(PY) benchmarks/fsdp2_tuning.py --json $(R)/fsdp2_tuning.json
	$(PY) benchmarks/compare_fsdp2.py --json $(R)/compare_fsdp2.json
	$(PY) benchmarks/compare_fsdp2.py --quick --json $(R)/compare_fsdp2_quick.json
	$(PY) benchmarks/strategies.py --json $(R)/strategies.json
	$(PY) benchmarks/strategies.py --cases mlp:fp32,llama:fp32,tiny:fp32 --accum 4 --json $(R)/strategies_accum4.json
	$(PY) benchmarks/allocators.py --json $(R)/allocators_mlp.json
	$(PY) benchmarks/allocators.py --model llama --json $(R)/allocators_llama.json
	$(PY) benchmarks/profile_step.py --model tiny --framework all --json $(R)/profile_tiny.json

# Targets: venv, native, demo, test, bench-quick.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native-built

.PHONY: venv native demo test bench-quick

venv: $(STAMP)

# (Re)install only when setup.py is newer than the stamp.
$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

# The optional native kernels (csrc/), built in place against the venv's torch once it is
# installed (pip's isolated build has no torch, so the install above leaves them out). A failed
# build is not an error: mfsdp2 then runs the PyTorch reference of each kernel (mfsdp2/native.py).
native: $(NATIVE)

$(NATIVE): $(STAMP) $(wildcard csrc/*)
	@if $(PY) setup.py -q build_ext --inplace; then touch $(NATIVE); \
	else echo "mfsdp2: native kernels not built; the PyTorch reference paths will be used"; fi

demo: venv native
	$(VENV)/bin/torchrun --nproc-per-node 2 -m mfsdp2.examples.demo

test: venv native
	$(PY) -m pytest -q tests

bench-quick: venv native
	$(PY) benchmarks/compare_fsdp2.py --quick

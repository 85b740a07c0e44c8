# Targets: venv, native, demo, test, lint, bench-quick, bench-record.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native-built

.PHONY: venv native demo test lint bench-quick bench-record

venv: $(STAMP)

# (Re)install only when setup.py or the constraints are newer than the stamp. constraints.txt
# pins this venv's torch (the CPU wheel on the project's machines); the package itself only
# asks for a range, so `pip install .` elsewhere keeps the torch that is there. pip byte-compiles
# what it installs (half of a fresh install's two minutes here): keep it, since this machine's
# environment sets PYTHONDONTWRITEBYTECODE, and without the installed .pyc files every process of
# the test run compiled every module it imported from source (the suite took 1443 s instead of
# about 1000 s).
$(STAMP): setup.py constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt -e '.[test]'
	@touch $(STAMP)

# The optional native kernels (csrc/), built in place against the venv's torch once it is
# installed (pip's isolated build has no torch, so the install above leaves them out). A failed
# build is not an error: mfsdp2 then runs the PyTorch reference of each kernel (mfsdp2/precision/native.py).
native: $(NATIVE)

# The stamp says the build ran; the library itself is an untracked file (`git clean` removes it
# and leaves the venv): no library, no stamp, so the next target that needs it builds again.
ifeq ($(wildcard mfsdp2/_native*.so),)
$(shell rm -f $(NATIVE))
endif

$(NATIVE): $(STAMP) $(wildcard csrc/*)
	@if $(PY) setup.py -q build_ext --inplace; then touch $(NATIVE); \
	else echo "mfsdp2: native kernels not built; the PyTorch reference paths will be used"; fi

demo: venv native
	$(VENV)/bin/torchrun --nproc-per-node 2 -m mfsdp2.examples.demo

# Two workers (the project's machines have two cores; most cases wait on gloo and on spawned
# ranks, so two files at a time take ~0.6x the serial time). --dist loadfile keeps a file on one
# worker: its module-scoped launches of ranks run once, and its xdist_group cases stay together.
test: venv native
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# ruff (pyflakes + pycodestyle at 120 columns, ruff.toml) over the package, tests, benchmarks, tools.
lint: venv
	$(PY) -m ruff check mfsdp2 tests benchmarks tools

bench-quick: venv native
	$(PY) benchmarks/compare_fsdp2.py --quick

# Every figure of the results pages (docs/benchmarks.md, docs/benchmarks_more.md, CONTRIBUTING.md's
# scorecard), recorded into benchmarks/results/ by exactly the commands benchmarks/report.py names
# (its SOURCES; the FSDP2 tuning first), then rendered: run it on a quiet machine at a clean commit
# (about two hours on 2 cores).
bench-record: venv native
	$(PY) benchmarks/record_all.py

# One command for a lent GPU machine (tools/gpu_check.py, under 5 minutes there, every step on a
# fixed budget): the CUDA-marked tests, benchmarks/gpu.py at world size 1 and one profiled step of
# two ranks on the GPU, from this tree with the machine's own python and torch (nothing
# installed); the summary (text + JSON, with the cause of every step that did not pass) goes to
# $OUT when set, else gpu-check-results/. `make gpu-suite`, a second call: the rest of the suite
# with pytest -n 14. GPU_CHECK_DRY=1: the CPU dry run of the same steps (tests/project/test_gpu_check.py
# runs it). GPU_CHECK_ARGS: e.g. --native.
GPU_PYTHON ?= python3
.PHONY: gpu-check gpu-suite
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) tools/gpu_check.py $(if $(GPU_CHECK_DRY),--dry-run) $(GPU_CHECK_ARGS)

gpu-suite:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) tools/gpu_check.py --suite $(if $(GPU_CHECK_DRY),--dry-run) $(GPU_CHECK_ARGS)

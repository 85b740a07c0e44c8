import glob
import os
import re

from setuptools import find_packages, setup

# The native kernels (csrc/) build against the torch that is already installed: pip's isolated
# build environment has no torch, and a build-time requirement on torch would make pip download
# one (a multi-GB CUDA build). So there the package installs without them, and the Makefile
# builds them in place afterwards with the venv's python (`setup.py build_ext --inplace`), which
# imports the installed torch. MFSDP2_NATIVE=0 skips them. Without them every kernel runs its
# pure-PyTorch reference (mfsdp2/precision/native.py).
ext_modules, cmdclass = [], {}
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    torch = None
if torch is not None and os.environ.get("MFSDP2_NATIVE", "1") != "0":
    # The module's name carries the torch version it is built against (mfsdp2/precision/native.py looks
    # for its own torch's name only): a build for one torch is never loaded by another.
    tag = re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)
    ext_modules = [
        CppExtension(
            f"mfsdp2._native_torch_{tag}",
            sorted(glob.glob("csrc/*.cpp")),
            depends=sorted(glob.glob("csrc/*.h")),  # a changed header rebuilds the sources
            # No -march: the binary runs on any x86-64; csrc/simd.h picks vector widths at run
            # time. -ffp-contract=off: no fused multiply-adds, so results do not depend on them.
            # -fno-math-errno: sqrt without the errno check (which keeps loops scalar); same results.
            extra_compile_args=["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi",
                                f'-DMFSDP2_TORCH_VERSION="{torch.__version__}"'],
            extra_link_args=["-fopenmp"],
        )
    ]
    # ninja (where installed; torch falls back to setuptools otherwise) compiles the sources in
    # parallel: 45 s instead of 59 s for a fresh build on two cores.
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    name="mfsdp2",
    version="0.1.0",
    description="A from-scratch FSDP2-style per-module sharding runtime for PyTorch",
    python_requires=">=3.11",
    packages=find_packages(exclude=["tests", "tests.*", "benchmarks", "benchmarks.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # A range, not a pin: pip keeps the torch a user already has (often a CUDA build of their
    # own) when it lies in the range. 2.11 and 2.13 are the versions the suite runs on; 2.11's
    # missing APIs are bridged by mfsdp2/base/compat.py. The Makefile pins the project's own CPU
    # wheel (constraints.txt) for its venv.
    # nvtx is optional ([gpu]): without it mfsdp2's ranges go to torch.cuda.nvtx, which every CUDA
    # build of torch has (mfsdp2/base/profiling.py).
    install_requires=["torch>=2.11", "numpy"],
    extras_require={
        # torchtitan: tests/integrations runs its trainer on mfsdp2 (pinned: the test drives its
        # internals). torchtitan 0.3.0 imports triton at import time on every platform (its
        # GPU kernels); CUDA builds of torch bring it, the CPU build does not (constraints.txt
        # pins the version that goes with the Makefile's torch).
        # lightning, accelerate: tests/integrations runs their trainers on mfsdp2 (pinned
        # like torchtitan: the tests go through their FSDP2 code paths, which change between
        # releases). torchao: tests/precision, tests/optim and tests/checkpoint train its
        # quantised weights and low-bit optimizers against FSDP2 (pinned: its tensor subclasses'
        # FSDP2 hooks change between releases; it has no torch dependency of its own).
        "test": ["pytest", "hypothesis", "pytest-timeout", "pytest-xdist", "ruff==0.17.5", "safetensors", "transformers",
                 "torchtitan==0.3.0", "lightning==2.6.6", "accelerate==1.15.0", "torchao==0.18.0",
                 'triton; platform_system == "Linux" and platform_machine == "x86_64"'],
        "gpu": ["nvtx"],  # the nvtx package's ranges (else torch.cuda.nvtx's, the same names)
        "bench": ["matplotlib"],  # benchmarks/report.py's plots (its tables need nothing)
        "hf": ["safetensors"],  # mfsdp2.checkpoint.hf imports it lazily
        # TE >= 2: te.py relies on its main_grad protocol (lazy main_grad lookup,
        # grad_added_to_main_grad / overwrite_main_grad); [pytorch] pulls the torch bindings.
        "te": ["transformer-engine[pytorch]>=2.0"],
    },
)

from setuptools import find_packages, setup

setup(
    name="mfsdp2",
    version="0.1.0",
    description="A from-scratch FSDP2-style per-module sharding runtime for PyTorch",
    python_requires=">=3.11",
    packages=find_packages(exclude=["tests", "tests.*", "benchmarks", "benchmarks.*"]),
    # torch is pinned exactly: on the project's machines pip takes the CPU wheel of
    # 2.13.0 that lies on disk; an unpinned torch would pull a multi-GB CUDA build.
    install_requires=["torch==2.13.0", "nvtx", "numpy"],
    extras_require={
        "test": ["pytest", "hypothesis", "pytest-timeout", "safetensors", "transformers"],
        "hf": ["safetensors"],  # mfsdp2.checkpoint.hf imports it lazily
        # TE >= 2: te.py relies on its main_grad protocol (lazy main_grad lookup,
        # grad_added_to_main_grad / overwrite_main_grad); [pytorch] pulls the torch bindings.
        "te": ["transformer-engine[pytorch]>=2.0"],
    },
)

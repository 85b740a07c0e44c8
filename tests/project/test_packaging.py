"""The package installs next to the torch a user already has.

Its metadata asks for a torch *range*: an exact pin made ``pip install .`` on a machine with its
own (CUDA) torch try to replace it. The Makefile's venv pins the project's CPU wheel through
``constraints.txt`` instead.

The pip check resolves this package's requirements the way ``pip install`` would, against an
environment whose torch is a given version (a metadata-only ``torch-X.dist-info`` placed first on
``sys.path``; the real torch's code is untouched), offline: ``--isolated --no-index`` (no index, no
find-links, no pip configuration), ``--no-build-isolation`` (the running environment's setuptools
builds the metadata, nothing is downloaded). A requirement already met by the environment is
kept; one that is not would need a download, which fails offline -- either way a torch that pip
wants to replace shows up.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOWEST, TESTED = "2.11.0", "2.13.0"  # the README's range: its lower end, and the newest tested


def _install_requires() -> list[str]:
    """``install_requires`` of setup.py's ``setup(...)`` call (a literal list)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "install_requires":
                    return ast.literal_eval(kw.value)
    raise AssertionError("setup.py: no install_requires in setup(...)")


def _torch_requirement():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _install_requires()]
    torch_reqs = [r for r in reqs if r.name == "torch"]
    assert len(torch_reqs) == 1, reqs
    return torch_reqs[0]


def test_torch_requirement_is_a_range_holding_the_supported_versions():
    pytest.importorskip("packaging")
    req = _torch_requirement()
    assert not any(s.operator in ("==", "===") for s in req.specifier), f"setup.py pins torch: {req}"
    for v in (LOWEST, TESTED, TESTED + "+cpu", "2.11.0+cu130", torch.__version__):
        assert req.specifier.contains(v, prereleases=True), f"{req} refuses torch {v}"
    assert not req.specifier.contains("2.10.0"), f"{req}: the range's lower end is {LOWEST}"
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"Supported torch: 2\.11 and later", readme), "README: state the supported torch range"


def test_make_venv_pins_its_torch_through_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in makefile and re.search(r"^\$\(STAMP\):.*constraints\.txt", makefile, re.M)
    pins = [ln.strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert "torch==2.13.0" in pins and all(p.split("==")[0] in ("torch", "triton") for p in pins), pins


def _write_dist(site: pathlib.Path, name: str, version: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _can_build_wheel_metadata() -> bool:
    """Whether setuptools here has ``bdist_wheel``, which pip runs to prepare the metadata:
    built in since setuptools 70.1, from the ``wheel`` package before (an older venv without it
    fails with "invalid command 'bdist_wheel'", whatever the package asks for)."""
    spec = importlib.util.find_spec("setuptools")  # located, not imported (it patches distutils)
    if spec is None or spec.origin is None:
        return False
    built_in = (pathlib.Path(spec.origin).parent / "command" / "bdist_wheel.py").is_file()
    return built_in or importlib.util.find_spec("wheel") is not None


def _dry_run(tmp_path: pathlib.Path, torch_version: str):
    """``pip install --dry-run --report`` of this package where torch is ``torch_version``;
    returns (pip's return code, the names and versions it would install, pip's output)."""
    site = tmp_path / f"site-{torch_version}"
    _write_dist(site, "torch", torch_version)
    # Other requirements this environment lacks (a bare source checkout) stand in the same way:
    # only torch is under test.
    for req in _install_requires():
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
        if name != "torch":
            try:
                md.version(name)
            except md.PackageNotFoundError:
                _write_dist(site, name, "999")
    report = tmp_path / f"report-{torch_version}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--report", str(report),
           "--no-index", "--no-build-isolation", str(ROOT)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    installs = []
    if proc.returncode == 0:
        installs = [(i["metadata"]["name"].lower(), i["metadata"]["version"])
                    for i in json.loads(report.read_text())["install"]]
    return proc.returncode, installs, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="pip is not installed in this environment")
@pytest.mark.skipif(not _can_build_wheel_metadata(),
                    reason="setuptools is missing, or older than 70.1 without the wheel package (no bdist_wheel): "
                    "pip cannot build this package's metadata offline here")
def test_pip_install_keeps_the_installed_torch(tmp_path):
    for version in (LOWEST, "2.14.1+cu130"):  # the lower end; a newer CUDA build of the user's
        rc, installs, out = _dry_run(tmp_path, version)
        assert rc == 0, f"torch {version}: pip could not keep it:\n{out[-3000:]}"
        assert [n for n, _ in installs] == ["mfsdp2"], f"torch {version}: pip would install {installs}"
    # Below the range pip must want another torch (offline it cannot get one and says why).
    # (The range's own end is checked without pip above; this checks pip reads it that way.)
    rc, installs, out = _dry_run(tmp_path, "2.10.0")
    assert rc != 0 or any(n == "torch" for n, _ in installs), "torch 2.10 was accepted"
    assert rc == 0 or "torch" in out, out[-3000:]


def test_nvtx_is_an_optional_extra():
    """NVTX ranges need no package of their own (torch.cuda.nvtx serves them on every CUDA build,
    tests/runtime/test_profiling.py): ``nvtx`` is in the ``gpu`` extra, not a requirement."""
    from packaging.requirements import Requirement

    assert not any(Requirement(r).name == "nvtx" for r in _install_requires())
    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    assert "nvtx" in ast.literal_eval(extras)["gpu"]

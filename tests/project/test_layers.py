"""The folders of ``mfsdp2/`` are layers: every import between folders points down.

Each folder's ``__init__.py`` declares ``MAY_IMPORT``, the folders it may import; the package
root declares its own. The check reads every import of every module with ``ast`` -- at module
top, inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module("mfsdp2...")`` with
a literal name -- and fails on

* an import of a folder the importing folder does not declare;
* declarations that do not form one order (a folder declaring one that declares it back, or any
  longer loop);
* a private name (``_x``) or private module of another folder;
* a folder without a declaration.

The tests at the bottom check the checker: each plants one violation in a copy of the package
and expects it reported.
"""

from __future__ import annotations

import ast
import pathlib
import pickle
import shutil

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "mfsdp2"
ROOT = "mfsdp2"  # the package root's own name in declarations


def _declared(init: pathlib.Path):
    """The ``MAY_IMPORT`` tuple of an ``__init__.py`` (None when it declares none)."""
    for node in ast.parse(init.read_text()).body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "MAY_IMPORT" for t in targets):
            return tuple(ast.literal_eval(node.value))
    return None


def _module_name(pkg: pathlib.Path, path: pathlib.Path) -> tuple[str, bool]:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _imports(path: pathlib.Path, module: str, is_pkg: bool):
    """``(line, absolute module, imported name or None)`` for every import in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                yield node.lineno, target, a.name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value, None


def _folder_of(pkg: pathlib.Path, parts: list[str]) -> str:
    """The layer a dotted name ``mfsdp2.<...>`` belongs to: its first folder, else the root."""
    if len(parts) > 1 and (pkg / parts[1]).is_dir():
        return parts[1]
    return ROOT


def check_layers(pkg: pathlib.Path = PKG) -> list[str]:
    """Every violation of the layer rules in the package at ``pkg``, as readable lines."""
    problems: list[str] = []
    folders = sorted(p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    declared = {ROOT: _declared(pkg / "__init__.py")}
    for f in folders:
        declared[f] = _declared(pkg / f / "__init__.py")
    for name, may in declared.items():
        if may is None:
            problems.append(f"{name}: its __init__.py declares no MAY_IMPORT")
        else:
            for other in may:
                if other not in declared:
                    problems.append(f"{name}: MAY_IMPORT names {other!r}, which is not a folder of the package")
    # The declarations must be one order: no loop in the "may import" relation.
    graph = {k: set(v or ()) & set(declared) for k, v in declared.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loop = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                problems.append("MAY_IMPORT declarations loop: " + " -> ".join(loop))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for k in sorted(graph):
        if k not in state:
            visit(k, [k])

    for path in sorted(pkg.rglob("*.py")):
        module, is_pkg = _module_name(pkg, path)
        src = _folder_of(pkg, module.split("."))
        allowed = set(declared.get(src) or ())
        for line, target, name in _imports(path, module, is_pkg):
            parts = target.split(".")
            if parts[0] != pkg.name:
                continue
            dst = _folder_of(pkg, parts)
            if name is not None and (pkg.joinpath(*parts[1:], name).is_dir()
                                     or pkg.joinpath(*parts[1:], name + ".py").exists()):
                parts = parts + [name]  # ``from pkg.folder import module``: the module is the target
                dst = _folder_of(pkg, parts)
                name = None
            where = f"{path.relative_to(pkg.parent)}:{line}"
            shown = ".".join(parts) + (f".{name}" if name else "")
            if dst == src:
                continue
            if dst not in allowed:
                problems.append(f"{where}: {src} imports {shown} (folder {dst!r} is not in {src}'s MAY_IMPORT)")
            private_module = any(p.startswith("_") and not p.startswith("__") for p in parts[1:])
            if private_module or (name is not None and name.startswith("_") and not name.startswith("__")):
                problems.append(f"{where}: {src} imports the private {shown} of folder {dst!r}")
    return problems


def test_package_layers_hold():
    assert check_layers() == []


def test_declarations_form_one_chain():
    """Beyond no loops: the declared sets nest (each folder may import all that a folder it
    imports may), so the layers read as one list bottom up -- the order of mfsdp2/__init__."""
    folders = [p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    declared = {f: set(_declared(PKG / f / "__init__.py")) for f in folders}
    declared[ROOT] = set(_declared(PKG / "__init__.py"))
    order = sorted(declared, key=lambda f: len(declared[f]))
    for lower, upper in zip(order, order[1:]):
        assert declared[lower] <= declared[upper], (lower, upper)
        assert lower in declared[upper] or not declared[lower] and not declared[upper], (lower, upper)


# -- the checker itself -------------------------------------------------------------------------
@pytest.fixture
def pkg_copy(tmp_path):
    dst = tmp_path / "mfsdp2"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert check_layers(dst) == []
    return dst


def _append(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text() + "\n" + text + "\n")


def test_checker_finds_an_import_pointing_up(pkg_copy):
    _append(pkg_copy / "memory" / "layout.py", "from ..frontend import module")
    problems = check_layers(pkg_copy)
    assert len(problems) == 1 and "memory imports mfsdp2.frontend.module" in problems[0], problems


def test_checker_finds_a_lazy_import_pointing_up(pkg_copy):
    _append(pkg_copy / "comm" / "devices.py", "def _late():\n    from mfsdp2.groups.param_group import live_groups\n")
    problems = check_layers(pkg_copy)
    assert len(problems) == 1 and "'groups' is not in comm's MAY_IMPORT" in problems[0], problems


def test_checker_finds_a_type_checking_import_and_import_module(pkg_copy):
    _append(pkg_copy / "dtensors" / "row_views.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..runtime.state import FSDPState\n"
            "import importlib\nimportlib.import_module('mfsdp2.checkpoint.model')")
    problems = check_layers(pkg_copy)
    assert len(problems) == 2, problems
    assert any("runtime" in p for p in problems) and any("checkpoint" in p for p in problems)


def test_checker_finds_a_private_name_of_another_folder(pkg_copy):
    _append(pkg_copy / "groups" / "grad_views.py", "from ..memory.buffer import _Nothing  # noqa")
    problems = check_layers(pkg_copy)
    assert len(problems) == 1 and "private" in problems[0], problems


def test_checker_finds_a_declaration_loop(pkg_copy):
    init = pkg_copy / "comm" / "__init__.py"
    init.write_text(init.read_text().replace('MAY_IMPORT: tuple[str, ...] = ("base",)',
                                             'MAY_IMPORT: tuple[str, ...] = ("base", "memory")'))
    problems = check_layers(pkg_copy)
    assert any("loop" in p and "comm" in p and "memory" in p for p in problems), problems


def test_checker_finds_a_folder_without_declaration(pkg_copy):
    (pkg_copy / "newfolder").mkdir()
    (pkg_copy / "newfolder" / "__init__.py").write_text('"""No declaration."""\n')
    problems = check_layers(pkg_copy)
    assert problems == ["newfolder: its __init__.py declares no MAY_IMPORT"], problems


# -- what users import keeps working ------------------------------------------------------------
def test_public_names_import():
    import mfsdp2

    for name in mfsdp2.__all__:
        assert getattr(mfsdp2, name) is not None, name


def test_moved_modules_keep_their_old_paths():
    """Code that imported a module by its path before the layers moved it still runs (for one
    release): the old name is the same module object."""
    import importlib

    import mfsdp2

    for old, new in mfsdp2._MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_rowshard_pickled_under_an_old_module_path_loads():
    """A file written by ``torch.save`` before a move names ``RowShard``'s module as it was then
    (protocol 2 writes the module and class as text, so the old bytes can be rebuilt here)."""
    from mfsdp2.dtensors.placement import RowShard

    for old in (b"mfsdp2.placement", b"mfsdp2.dtensors.placement"):
        data = pickle.dumps(RowShard(0, (3, 1)), protocol=2)
        assert b"mfsdp2.dtensors.placement\nRowShard" in data
        loaded = pickle.loads(data.replace(b"mfsdp2.dtensors.placement\n", old + b"\n"))
        assert type(loaded) is RowShard and loaded == RowShard(0, (3, 1))

"""How the package is put together: no module reaches into another's private names.

A name with a leading underscore belongs to the module that defines it (a function,
a class, a module constant, or an attribute the module's own classes set). Any other
module that touches it, through ``from x import _name`` or ``obj._name``, is an
offence. Importing a package-internal *module* (``from . import _format``) is fine:
its public names are the package's internal interface.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mmbuffer as mb

ROOT = Path(mb.__file__).parent
# third-party private names we depend on, each with its reason
ALLOWED = {
    "tensordict._reductions": "TorchRL dumps are loaded without pickle through tensordict's own rebuild functions",
}


def _own_private_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _own_private_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module in ALLOWED:
                continue
            base = path.parent
            for _ in range(max(node.level - 1, 0)):
                base = base.parent
            if node.module:
                base = base.joinpath(*node.module.split("."))
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                is_module = (base / f"{alias.name}.py").exists() or (base / alias.name).is_dir()
                if private and not is_module:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_touches_another_modules_private_names():
    found = [o for path in sorted(ROOT.rglob("*.py")) for o in offences(path)]
    assert found == []


def test_the_check_finds_an_offence(tmp_path):
    """The checker itself: a planted reach into another module's private name is found."""
    (tmp_path / "a.py").write_text("def _helper():\n    return 1\n")
    (tmp_path / "b.py").write_text("from .a import _helper\nimport x\nx._cache.clear()\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert offences(tmp_path / "a.py") == []
        assert len(offences(tmp_path / "b.py")) == 2
    finally:
        ROOT = saved


MAX_LINES = 520  # "no module over ~500 lines" (issue 11), with a little room


def test_no_module_is_over_about_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_buffer_composes_a_store_and_a_writer(tmp_path):
    """``Buffer`` is a facade: it is not a ``Store``; a writable buffer has a ``Writer``
    over the same store, a reader none (and writes are refused before any check)."""
    from mmbuffer._ledger.store import Store
    from mmbuffer._ledger.writer import Writer

    assert not issubclass(mb.Buffer, Store) and not issubclass(mb.Buffer, Writer)
    buf = mb.create(tmp_path / "s", {"x": ((), "int64")}, capacity=8, next_keys=())
    assert isinstance(buf.store, Store) and buf.store.lock is buf.lock
    buf.extend({"x": [1, 2, 3]})
    assert len(buf.store) == 3  # the writer advanced the store's cursors: one ledger
    buf.close()
    ro = mb.open(tmp_path / "s", mode="r")
    with pytest.raises(mb.errors.ReadOnlyError, match="mode='r'"):
        ro.extend({"x": "not even checked"})


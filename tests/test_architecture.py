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



# -- the layers (docs/design.md "The house") ---------------------------------------------
#: folders and modules from the top of the house down; a module may import only from its
#: own layer or one below it, at module level or inside a function. Within ``convert`` the
#: registry sits above the exporters, which read stores back with the readers, which share
#: the pipeline. ``errors``, ``config`` and ``schema`` are the foundation every layer uses.
LAYERS = [
    ["mmbuffer", "mmbuffer.__main__", "mmbuffer._cli"],
    ["mmbuffer.data", "mmbuffer.ray", "mmbuffer.torchrl", "mmbuffer.sb3"],
    ["mmbuffer.convert", "mmbuffer.convert.registry"],
    ["mmbuffer.convert.exporters"],
    ["mmbuffer.convert.readers"],
    ["mmbuffer.convert._pipeline"],
    ["mmbuffer._feed"],
    ["mmbuffer.opening", "mmbuffer.groups"],
    ["mmbuffer.buffer"],
    ["mmbuffer.remote", "mmbuffer.losses"],
    ["mmbuffer._read"],
    ["mmbuffer.samplers"],
    ["mmbuffer._ledger"],
    ["mmbuffer._disk"],
    ["mmbuffer.tree"],
    ["mmbuffer.kernels"],
    ["mmbuffer.errors", "mmbuffer.config", "mmbuffer.schema"],
]


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = i, name.count(".")
    return best


def _imported_modules(path: Path, root: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every mmbuffer module ``path`` imports, at any depth of the file."""
    me = _module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # ``from . import x`` counts the package itself too: its ``__init__`` runs first
            names = [base, *(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("mmbuffer") and name not in (me, "mmbuffer"):
                out.append((node.lineno, name))
    return out


def layer_offences(root: Path) -> list[str]:
    files = sorted(root.rglob("*.py"))
    known = {_module_name(f, root) for f in files}
    out = []
    for f in files:
        mine = _layer_of(_module_name(f, root))
        for line, target in _imported_modules(f, root, known):
            if _layer_of(target) < mine:
                out.append(f"{f.relative_to(root.parent)}:{line}: imports {target} from a layer above")
    return out


def test_every_module_has_a_layer():
    assert [_module_name(p) for p in ROOT.rglob("*.py") if _layer_of(_module_name(p)) < 0] == []


def test_imports_only_go_down_the_layers():
    """No module imports from a layer above its own, at module level or inside a function."""
    assert layer_offences(ROOT) == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / "mmbuffer"
    (pkg / "_disk").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_disk" / "__init__.py").write_text("")
    (pkg / "buffer.py").write_text("from ._disk import files\n")
    (pkg / "_disk" / "files.py").write_text("def f():\n    from ..buffer import Buffer\n")
    assert layer_offences(pkg) == ["mmbuffer/_disk/files.py:2: imports mmbuffer.buffer from a layer above"]


def import_cycles(root: Path) -> list[list[str]]:
    """Strongly connected components (of more than one module) of the import graph,
    imports inside functions included; a package's ``__init__`` counts as a module."""
    files = sorted(root.rglob("*.py"))
    known = {_module_name(f, root) for f in files}
    graph = {_module_name(f, root): {m for _, m in _imported_modules(f, root, known)} for f in files}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert import_cycles(ROOT) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "mmbuffer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    assert import_cycles(pkg) == [["mmbuffer.a", "mmbuffer.b"]]

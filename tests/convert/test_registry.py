"""How the converters are put together: layering, the format registry, the writer frame, the producer."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._cli.main import build_parser, main
from mmbuffer.convert._pipeline.dest import partial_path
from mmbuffer.errors import ConversionError

CONVERT = Path(mb.__file__).parent / "convert"


# -- layering ---------------------------------------------------------------------------------
def test_the_core_does_not_import_convert_but_mb_convert_works():
    code = (
        "import sys, mmbuffer as mb\n"
        "assert 'mmbuffer.convert' not in sys.modules, 'import mmbuffer imported mmbuffer.convert'\n"
        "assert callable(mb.convert.convert) and 'mmbuffer.convert' in sys.modules\n"
        "from mmbuffer import convert\n"
        "assert convert is mb.convert\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def test_no_convert_module_uses_another_modules_private_names():
    offences = []
    for path in sorted(CONVERT.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                offences += [f"{path.name}: from {node.module} import {a.name}"
                             for a in node.names if a.name.startswith("_")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls")):
                offences.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    # a third-party private module the TorchRL reader needs for safe loading is not ours
    offences = [o for o in offences if "tensordict" not in o]
    assert offences == []


# -- one registry of formats ----------------------------------------------------------------
TOY_CALLS: list = []


def convert_toy(src, dst, **options):
    """A format registered by the test below (the registry names functions by module)."""
    TOY_CALLS.append((src, dst, options))
    return {"rows": 0}


def test_cli_and_convert_read_the_one_registry(tmp_path, monkeypatch, capsys):
    from mmbuffer.convert import registry as _formats

    calls = TOY_CALLS
    calls.clear()
    monkeypatch.setitem(_formats.READERS, "toy", _formats.Format("toy", __name__, "convert_toy", "a toy format"))
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    conv = sub.choices["convert"]
    choices = next(a for a in conv._actions if a.dest == "format").choices
    assert list(choices) == list(_formats.READERS) and "toy" in choices
    assert "toy: a toy format" in " ".join(conv.format_help().split())
    export_choices = next(a for a in sub.choices["export"]._actions if a.dest == "format").choices
    assert list(export_choices) == list(_formats.WRITERS) == ["d4rl", "minari", "diffusion_policy"]
    assert main(["convert", "toy", "in", str(tmp_path / "out"), "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"rows": 0}
    assert calls[0][:2] == ("in", str(tmp_path / "out")) and calls[0][2]["progress"] is False
    assert mb.convert.convert("TOY", "a", "b") == {"rows": 0}
    # an option only the registry grants is refused for the new format
    assert main(["convert", "toy", "in", str(tmp_path / "o"), "--keep-infos"]) == 2
    assert "--keep-infos: not an option of format 'toy' (only d4rl, minari, npz, tianshou)" in capsys.readouterr().err


# -- the writer frame -------------------------------------------------------------------------
HDF5 = b"\x89HDF\r\n\x1a\n"  # an HDF5 signature: the d4rl rules of _dest accept the partial file


def _file_writer() -> type:
    """A writer class that writes ``data`` to a file (a plain file output: the d4rl rules of
    _dest); it fails where told to. Built on call: the module under test is imported there."""
    from mmbuffer.convert._pipeline import frame as _frame

    class FileWriter(_frame.Writer):
        kind = "d4rl"

        def __init__(self, data: bytes, *, fail_write: bool = False, corrupt: bool = False) -> None:
            super().__init__()
            self.data, self.fail_write, self.corrupt = data, fail_write, corrupt
            self.steps: list[str] = []

        def open(self) -> None:
            self.steps.append("open")

        def write(self, partial: Path) -> None:
            self.steps.append("write")
            partial.write_bytes(self.data[:-1] if self.corrupt else self.data)
            if self.fail_write:
                raise OSError("disk full")
            self.notes.append("a note")

        def abort(self) -> None:
            self.steps.append("abort")

        def close(self) -> None:
            self.steps.append("close")

        def verify(self, partial: Path) -> None:
            self.steps.append("verify")
            got = partial.read_bytes()
            if got != self.data:
                raise _frame.mismatch(partial, "bytes", len(self.data), len(got))

    return FileWriter


def _d4rl_like(path: Path) -> Path:
    import h5py

    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((3, 2), "float32")
        f["actions"] = np.zeros((3, 1), "float32")
        f["rewards"] = np.zeros(3, "float32")
        f["terminals"] = np.zeros(3, bool)
    return path


def test_writer_frame_writes_verifies_and_renames(tmp_path):
    from mmbuffer.convert._pipeline import frame as _frame

    FileWriter = _file_writer()
    dst = tmp_path / "out.hdf5"
    w = FileWriter(HDF5 + b"payload")
    with pytest.warns(mb.convert.ConversionWarning, match="a note"):
        assert _frame.write_and_verify(w, dst, overwrite=False, verify=True) == dst
    assert w.steps == ["open", "write", "close", "verify"] and dst.read_bytes() == HDF5 + b"payload"
    assert not partial_path(dst).exists()

    # a failed write: the partial output is removed, the destination untouched
    dst2 = _d4rl_like(tmp_path / "old.hdf5")
    before = dst2.read_bytes()
    w = FileWriter(HDF5 + b"x", fail_write=True)
    with pytest.raises(OSError, match="disk full"):
        _frame.write_and_verify(w, dst2, overwrite=True, verify=True)
    assert w.steps == ["open", "write", "abort", "close"]
    assert dst2.read_bytes() == before and not partial_path(dst2).exists()

    # a verification mismatch: the partial output is kept for inspection, nothing renamed
    w = FileWriter(HDF5 + b"payload", corrupt=True)
    with pytest.warns(mb.convert.ConversionWarning), pytest.raises(ConversionError, match="verification failed"):
        _frame.write_and_verify(w, dst2, overwrite=True, verify=True)
    assert dst2.read_bytes() == before and partial_path(dst2).read_bytes() == HDF5 + b"payloa"


# -- the producer thread ----------------------------------------------------------------------
def test_producer_hands_over_items_errors_and_stops_a_blocked_source():
    from mmbuffer._feed.threads import Producer

    with Producer(iter(range(5)), depth=2, name="t-producer") as p:
        assert list(p) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise ValueError("bad chunk")

    p = Producer(failing(), depth=1, name="t-producer")
    p.start()
    assert p.get() == 1
    with pytest.raises(ValueError, match="bad chunk"):
        p.get()
    assert p.failed
    p.close()

    made = []
    closed = threading.Event()

    def endless():
        try:
            for i in range(10**9):
                made.append(i)
                yield i
        finally:
            closed.set()

    p = Producer(endless(), depth=3, name="t-producer")
    p.start()
    assert p.get() == 0
    for _ in range(100):  # wait until the producer blocks on the full queue
        if len(made) >= 5:
            break
        threading.Event().wait(0.01)
    p.close()
    assert len(made) <= 1 + 3 + 1  # taken, queued, held by the blocked put
    assert closed.is_set()  # the source was closed once the thread left it
    assert not [t for t in threading.enumerate() if t.name == "t-producer"]

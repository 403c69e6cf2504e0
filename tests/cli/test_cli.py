"""The command line (issue 13 §4): light start-up, help everywhere, clean exits, plain output.

Start-up speed itself is a benchmark (``benchmarks/bench_cli.py``); here the cause is
checked: ``mmbuffer --help``, ``info`` and ``verify`` never import torch or numba.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm

import mmbuffer as mb
from mmbuffer._cli.main import build_parser, main

REPO = Path(mb.__file__).resolve().parents[1]
HEAVY = ("torch", "numba")


def _cli(*args, stdout=subprocess.PIPE, timeout=120):
    return subprocess.run([sys.executable, *args], env=warm.repo_env(), stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, check=False)


def _store(path, **kw):
    with mb.create(path, {"obs": ((3,), "float32"), "reward": ((), "float32")}, capacity=64, num_streams=2, **kw) as buf:
        for s in range(2):
            buf.extend({"obs": np.ones((20, 3)), "reward": np.arange(20), "terminated": np.arange(20) % 5 == 4},
                       stream=s, final_obs={"obs": np.zeros((4, 3))})
    return path


@pytest.mark.parametrize("command", [["--help"], ["info", "P"], ["info", "P", "--json"], ["verify", "S"], ["verify", "Z"]])
def test_help_info_and_verify_import_neither_torch_nor_numba(tmp_path, command):
    """P: a store with priorities (``info`` reads the tree's totals); S: without,
    Z: compressed. ``verify`` of a prioritized store recomputes the tree with the
    tree's own code, which may use compiled kernels: not covered here."""
    kinds = {"P": {"priorities": mb.PriorityConfig(alpha=0.6)}, "S": {}, "Z": {"compression": "zstd"}}
    kind = next((a for a in command if a in kinds), "S")
    store = _store(tmp_path / "s", **kinds[kind])
    argv = [str(store) if a in kinds else a for a in command]
    proc = _cli("-X", "importtime", "-m", "mmbuffer", *argv)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "mmbuffer._cli.main" in imported  # the check sees the package's imports
    assert not {m for m in imported if m.split(".")[0] in HEAVY}, sorted(m for m in imported if m.split(".")[0] in HEAVY)[:5]


def test_import_mmbuffer_is_lazy_and_every_public_name_works():
    code = ("import sys, mmbuffer as mb; light = [m for m in ('torch', 'numba') if m in sys.modules]; "
            "import mmbuffer._ledger.store, mmbuffer._feed.stream, mmbuffer._ledger.create; "  # submodules named like functions
            "names = {n: getattr(mb, n) for n in mb.__all__}; "
            "assert callable(mb.create) and callable(mb.stream) and not isinstance(mb.stream, type(sys)); "
            "from mmbuffer import create, Buffer, stream, samplers, convert; "
            "assert names['create'] is create and names['Buffer'] is mb.Buffer; "
            "assert mb.Column is __import__('mmbuffer._ledger.store', fromlist=['Column']).Column; "
            "assert set(mb.__all__) <= set(dir(mb)); print(light, 'torch' in sys.modules)")
    proc = _cli("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]  # nothing heavy at import; torch once a name needs it
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        mb.nope  # noqa: B018


def _walk(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def test_every_option_has_help():
    missing = []
    for path, parser in _walk(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            own = path[:1] in (("info",), ("verify",), ("demo",), ("bench",))  # positionals too
            if (action.option_strings or own) and not action.help:
                missing.append(f"{' '.join(path)} {action.option_strings or action.dest}")
    assert not missing
    text = " ".join(_cli("-m", "mmbuffer", "convert", "--help").stdout.split())
    assert "tdmpc2: a TD-MPC2 .pt file" in text
    text = _cli("-m", "mmbuffer", "bench", "--help").stdout
    assert re.search(r"export\s+export to D4RL", text) and "1e5 notation" in text


SCRIPTS = sorted(p.stem[len("bench_"):] for p in (REPO / "benchmarks").glob("bench_*.py"))


def test_every_bench_script_is_a_suite_and_accepts_1e5_row_counts():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from _common import count, counts
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert [count(t) for t in ("1e5", "100000", "100_000", "2.5e6")] == [100_000, 100_000, 100_000, 2_500_000]
    assert counts("1e6,1e8") == [1_000_000, 100_000_000]
    for bad in ("1.5", "0", "-1e3", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            count(bad)
    from mmbuffer._cli.main import SUITES

    assert sorted(SUITES) == SCRIPTS
    runs = [(str(REPO / "benchmarks" / f"bench_{suite}.py"), option) for suite in SCRIPTS for option in re.findall(
        r'add_argument\("(--(?:rows|append-rows|torchrl-max|torchrl-max-stored))"',
        (REPO / "benchmarks" / f"bench_{suite}.py").read_text())]
    assert runs  # the options exist: the check below is about something
    # one interpreter runs every script as __main__: the value is converted before --help
    # ends the run, so a refused 1e5 exits 2
    proc = _cli("-c", HELP_RUNS, json.dumps(runs), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[script, option, 0] for script, option in runs]


HELP_RUNS = r"""
import json, runpy, sys
out = []
for script, option in json.loads(sys.argv[1]):
    sys.argv = [script, option, "1e5", "--help"]
    sys.path.insert(0, script.rsplit("/", 1)[0])
    try:
        runpy.run_path(script, run_name="__main__")
        code = None
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.path.pop(0)
    out.append([script, option, code])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_bench_store_runs_at_1e5_rows(tmp_path):
    """``bench store --rows 1e5`` used to fail with "capacity ... got 0"."""
    env = warm.repo_env(MMBUFFER_BENCH_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "mmbuffer", "bench", "store", "--rows", "1e5", "--append-rows", "2e3",
                           "--reopens", "1"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "built the 100,000-row store" in proc.stdout


@pytest.mark.slow
def test_bench_convert_runs_at_1e5_rows(tmp_path):
    """``bench convert`` failed once the D4RL converter refused a file with no next
    observations: the file it generates (for every mode) now has them, as D4RL's v2 files do."""
    env = warm.repo_env(MMBUFFER_BENCH_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "mmbuffer", "bench", "convert", "--rows", "1e5", "--repeat", "1",
                           "--formats", "--only", "lerobot"], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.findall(r"^\| convert (\w+) \|", proc.stdout, re.MULTILINE) == ["d4rl", "lerobot"], proc.stdout


def test_info_into_a_closed_pipe_ends_without_a_traceback(tmp_path):
    store = _store(tmp_path / "s")
    r, w = os.pipe()
    os.close(r)  # `| head` that has gone away: every write fails with EPIPE
    try:
        proc = _cli("-m", "mmbuffer", "info", str(store), stdout=w)
    finally:
        os.close(w)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr and proc.stderr == ""


def test_ctrl_c_ends_without_a_traceback(tmp_path):
    # Ctrl-C as in a terminal: a shell without job control starts a background job (and so
    # this pytest and its children) with SIGINT ignored, which Python then keeps ignored
    with subprocess.Popen([sys.executable, "-m", "mmbuffer", "demo", str(tmp_path / "d"), "--episodes", "1000000"],
                          env=warm.repo_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "d" / "replay").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (tmp_path / "d" / "replay").exists()  # writing episodes now
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    # ended by SIGINT after saying so, as Python ends an uncaught KeyboardInterrupt: a shell
    # sees 130 and stops a script's loop (an ordinary exit status 130 would let it go on)
    assert proc.returncode == -signal.SIGINT and err.strip() == "mmbuffer: interrupted", err


def test_info_names_what_a_path_is(tmp_path, capsys):
    (tmp_path / "d4rl.hdf5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    (tmp_path / "data.npz").write_bytes(b"PK\x03\x04" + bytes(100))
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "folder").mkdir()
    cases = {
        "d4rl.hdf5": "expected a store directory, got an HDF5 file (D4RL? mmbuffer convert d4rl PATH STORE)",
        "data.npz": "got a zip archive (.npz? mmbuffer convert npz PATH STORE)",
        "notes.txt": "expected a store directory, got a file",
        "missing": "expected a store directory, got no such file or directory",
        "folder": "not an mmbuffer store (no manifest.json)",
    }
    for name, message in cases.items():
        for command in ("info", "verify"):
            assert main([command, str(tmp_path / name)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("mmbuffer: error: ") and message in err and str(tmp_path / name) in err, err


def test_long_column_names_stay_apart_from_what_follows(tmp_path, capsys):
    long = "observation/a_rather_long_nested_column_name"
    with mb.create(tmp_path / "s", {long: ((3,), "float32")}, capacity=8, next_keys=()) as buf:
        buf.extend({long: np.ones((4, 3)), "terminated": np.arange(4) == 3})
    assert main(["info", str(tmp_path / "s")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if long in ln)
    assert re.fullmatch(rf"\s+{long} +\(3,\) +float32 +none +[\d.]+ K?i?B +[\d.]+ K?i?B", line)


def test_copy_prints_compression_as_spelled_and_one_checksum_line(tmp_path, capsys):
    src = _store(tmp_path / "s")
    for flag, shown in ((["--compression", "zstd"], "zstd"), ([], "none"), (["--compression", "none"], "none")):
        out = tmp_path / f"c{len(flag)}{shown}"
        assert main(["copy", str(src), str(out), "--no-progress", *flag]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert re.fullmatch(rf"compression\s+{shown}", next(ln for ln in lines if ln.startswith("compression")))
        sums = [ln for ln in lines if "crc32" in ln]
        assert len(sums) == 1 and re.search(r"crc32 of \d+ lane:column pairs \(--json lists them\)", sums[0])
        assert len(lines) < 15


def test_demo_with_no_episodes_is_refused_before_anything_is_created(tmp_path, capsys):
    from mmbuffer._cli.demo import run_demo

    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal
        main(["demo", str(tmp_path / "d"), "--episodes", "0"])
    assert exit_.value.code == 2
    assert "--episodes: expected a whole number >= 1, got 0" in capsys.readouterr().err
    for bad in (0, -3, 2.5, True):
        with pytest.raises(mb.errors.InvalidArgumentError, match="episodes: expected an integer >= 1"):
            run_demo(tmp_path / "d", episodes=bad, quiet=True)
    assert not (tmp_path / "d").exists()


def test_the_lazy_namespace_pickles_by_name_like_a_module():
    """Ray ships a function's globals with cloudpickle: ``mb`` must travel by name. It is
    a plain module (no module-type patch), which cloudpickle sends by reference."""
    import types

    assert type(mb) is types.ModuleType
    cloudpickle = pytest.importorskip("cloudpickle")
    assert cloudpickle.loads(cloudpickle.dumps(lambda: mb.create))() is mb.create


def test_help_lists_exactly_the_registered_formats():
    """``mmbuffer --help`` and ``convert --help`` name every format of the converter
    registry and no other (the help is generated from it)."""
    import re

    from mmbuffer.convert.registry import READERS, WRITERS

    top = _cli("-m", "mmbuffer", "--help").stdout
    listed = {cmd: re.search(rf"{cmd}\s+.*?\(([^)]*)\)", top, re.S).group(1) for cmd in ("convert", "export")}
    assert [f.strip() for f in " ".join(listed["convert"].split()).split(",")] == list(READERS)
    assert [f.strip() for f in " ".join(listed["export"].split()).split(",")] == list(WRITERS)
    usage = _cli("-m", "mmbuffer", "convert", "--help").stdout
    choices = re.search(r"\{([^}]*)\}", usage).group(1).split(",")
    assert choices == list(READERS)


def _codec_store(path, rows=1200):
    """84x84 frames in a zstd column (complete shard files and staged rows), a raw column."""
    frames = np.zeros((rows, 84, 84), np.uint8)
    frames[:, 10:20, :] = (np.arange(rows) % 251)[:, None, None]  # compressible, every frame its own
    with mb.create(path, {"px": mb.Column((84, 84), "uint8", codec="zstd:5"), "a": ((), "int64")},
                   capacity=4000, next_keys=("px",)) as buf:
        buf.extend({"px": frames, "a": np.arange(rows), "terminated": np.arange(rows) % 100 == 99},
                   final_obs={"px": frames[99::100]})
    return path


def test_info_shows_each_columns_codec_and_its_bytes_on_disk(tmp_path, capsys):
    store = _codec_store(tmp_path / "s")
    assert main(["info", str(store), "--json"]) == 0
    cols = __import__("json").loads(capsys.readouterr().out)["columns"]
    px, a = cols["px"], cols["a"]
    assert (px["codec"], a["codec"]) == ("zstd:5", None)
    shards = [f for f in (store / "columns" / "px" / "c").rglob("*") if f.is_file()]
    assert len(shards) == 3 and px["shard_rows"] == 1200  # three complete shards of 400 rows
    assert px["bytes_per_row"] == sum(f.stat().st_size for f in shards) / 1200 < 84 * 84 / 20  # encoded
    assert 2 * 400 * 84 * 84 <= px["staging_used"] < px["disk_used"]  # two raw staging halves, counted
    assert a["bytes_per_row"] >= 8 and a["disk_used"] >= 1200 * 8
    assert main(["info", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(ln for ln in lines if ln.startswith("compression")).endswith("columns with a codec: px: zstd:5")
    header = next(ln for ln in lines if ln.startswith("columns"))
    px_line = next(ln for ln in lines if ln.strip().startswith("px "))
    a_line = next(ln for ln in lines if ln.strip().startswith("a "))
    assert re.fullmatch(r"\s+px +\(84, 84\) +uint8 +zstd:5 +[\d.]+ MiB +(\d+) B +\(\+ next_px\)  "
                        r"\(staging [\d.]+ MiB, raw\)", px_line), px_line
    assert int(px_line.split()[-8]) == int(px["bytes_per_row"])
    assert re.fullmatch(r"\s+a +\(\) +int64 +none +[\d.]+ KiB +[\d.]+ B", a_line), a_line
    assert header.index("codec") == px_line.index("zstd:5") == a_line.index("none")  # the columns line up


def test_copy_keeps_codecs_and_changes_them_when_told(tmp_path, capsys):
    src = _codec_store(tmp_path / "s")
    cases = {"keep": ([], {"px": "zstd:5", "a": None}, "px=zstd:5"),
             "some": (["--codec", "px=none", "--codec", "a=lz4"], {"px": None, "a": "lz4"}, "a=lz4"),
             "raw": (["--raw"], {"px": None, "a": None}, "none")}
    with mb.open(str(src), mode="r") as s:
        want = s.get(np.arange(1200), keys=["px", "next_px", "a"])
    for name, (flags, codecs, shown) in cases.items():
        assert main(["copy", str(src), str(tmp_path / name), "--no-progress", *flags]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("codecs"))
        assert re.fullmatch(rf"codecs\s+{re.escape(shown)}", line), line
        with mb.open(str(tmp_path / name), mode="r") as c:
            assert {k: c.columns[k].codec for k in codecs} == codecs
            got = c.get(np.arange(1200), keys=["px", "next_px", "a"])
            assert all(torch_equal(got[k], want[k]) for k in want)


def torch_equal(a, b):
    return a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("flags, message", [
    (["--codec", "px=gzip"], "column 'px': codec: expected None (raw) or one of"),
    (["--codec", "nope=zstd"], "codec: expected column names among ['a', 'px'], got 'nope'"),
    (["--raw", "--compression", "zstd"], "--raw: every column raw and memory-mapped, got --compression zstd too"),
])
def test_copy_refuses_a_bad_codec_by_name_and_writes_nothing(tmp_path, capsys, flags, message):
    src = _codec_store(tmp_path / "s", rows=50)
    assert main(["copy", str(src), str(tmp_path / "c"), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


@pytest.mark.parametrize("flags", [["--codec", "px"], ["--codec", "=zstd"], ["--raw", "--codec", "px=zstd"]])
def test_copy_codec_flags_are_checked_by_argparse(tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as exit_:
        main(["copy", str(tmp_path / "s"), str(tmp_path / "c"), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "expected COLUMN=CODEC" in err or "not allowed with argument" in err, err

"""The examples run (``--quick``) and do what they say.

Each example runs as ``python examples/NAME.py``, in a process of its own forked warm
(``tests/warm.py``: a fresh interpreter's ``sys.path``, its imports done), in a
temporary directory, and the test reads what it prints. The ```python blocks of
README.md and docs/ run one by one, standalone, in tests/guarantees/test_documented_examples.py.
"""

import re
import signal
import subprocess
from pathlib import Path

import pytest
import warm

import mmbuffer as mb

REPO = Path(mb.__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _env():
    return warm.repo_env(PYTHONWARNINGS="default")


def _run(script, args, cwd, timeout=300):
    proc = warm.run_file(script, [str(a) for a in args], cwd=cwd, env=_env(), timeout=timeout)
    assert proc.returncode == 0, f"{script} {args} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _number(pattern, text):
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text}"
    return float(m.group(1))


@pytest.mark.slow
def test_offline_world_model(tmp_path):
    out = _run(EXAMPLES / "offline_world_model.py", ["--quick", "--dir", tmp_path / "wm"], tmp_path)
    assert "verified=True" in out
    rows = _number(r"converted: rows=(\d+)", out)
    assert rows == _number(r"wrote \S+: (\d+) transitions", out)
    assert _number(r"final loss ([\d.]+)", out) < 0.5 * _number(r"initial loss ([\d.]+)", out)


@pytest.mark.slow
def test_ppo_cartpole(tmp_path):
    out = _run(EXAMPLES / "ppo_cartpole.py", ["--quick", "--store", tmp_path / "ppo"], tmp_path)
    assert _number(r"last mean return ([\d.]+)", out) > _number(r"first mean return ([\d.]+)", out)
    assert re.search(r"value error over \d+ stored episodes", out)


@pytest.mark.slow
def test_online_sac_killed_and_resumed(tmp_path):
    store = tmp_path / "sac" / "replay"
    script = EXAMPLES / "online_sac.py"
    seen = []
    with warm.start_file(script, ["--quick", "--steps", "1200", "--store", str(store)], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            for line in proc.stdout:  # kill it once it has committed at least two episodes
                m = re.match(r"committed rows=(\d+)", line)
                if m:
                    seen.append(int(m.group(1)))
                    if seen[-1] >= 400:
                        proc.send_signal(signal.SIGKILL)
                        break
        finally:
            proc.kill()
            err = proc.stderr.read()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"ran to the end before the kill:\n{err}"
    assert seen and seen[-1] >= 400

    proc = warm.run("import runpy; runpy.run_module('mmbuffer', run_name='__main__', alter_sys=True)",  # python -m
                    ["verify", str(store)], cwd=tmp_path, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the kill left a consistent store
    with mb.open(store, mode="r") as ro:
        stored = len(ro)
    assert seen[-1] <= stored < 1200 and stored % 200 == 0  # whole committed episodes

    out = _run(script, ["--quick", "--steps", "1200", "--store", store, "--resume"], tmp_path)
    assert int(_number(r"resumed from (\d+) stored rows", out)) == stored
    assert "restored learner from checkpoint" in out
    assert "new store" not in out
    assert int(_number(r"done rows=(\d+)", out)) == 1200
    with mb.open(store, mode="r") as ro:
        assert len(ro) == 1200 and ro.num_episodes == 6


# -- documents and figures ---------------------------------------------------------------------
def _numbers(obj):
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k not in ("stored_rows", "capacity"):  # axes, named in words in HISTORY.md (346M, 1e8)
                yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


def test_every_plotted_figure_is_recorded_in_results():
    import json

    data = json.loads((REPO / "benchmarks" / "figures.json").read_text())
    results = (REPO / "benchmarks" / "HISTORY.md").read_text()  # the dated log
    values = list(_numbers(data))
    assert len(values) > 20
    missing = [v for v in values if not re.search(rf"(?<![\d.]){re.escape(f'{v:g}')}0*(?![\d])", results)]
    assert not missing, f"figures.json values not in HISTORY.md: {missing}"
    for group in ("sampling", "priority", "stream"):
        title = re.match(r"HISTORY\.md, '([^']+)'", data[group]["source"]).group(1)
        assert title.replace("(", "").replace(")", "").split(",")[0] in results.replace("(", "").replace(")", "").replace("`", "")


def test_plot_draws_the_recorded_figures(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("plot", REPO / "benchmarks" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    paths = plot.draw(json.loads((REPO / "benchmarks" / "figures.json").read_text()), tmp_path)
    assert [p.name for p in paths] == ["sampling.png", "priority.png", "stream.png"]
    readme = (REPO / "README.md").read_text()
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert (REPO / "docs" / "img" / p.name).exists() and f"(docs/img/{p.name})" in readme


def _doc_files():
    yield REPO / "README.md"
    yield from sorted((REPO / "docs").glob("*.md"))
    yield from sorted((REPO / "mmbuffer").rglob("*.py"))


def test_cited_documents_exist():
    """Docstrings and documents cite files that exist in the repository."""
    missing = []
    for path in _doc_files():
        for ref in set(re.findall(r"[\w./-]*\.(?:md|png)\b", path.read_text())):
            ref = ref.lstrip("./")
            if not ref or ref in ("py.md",):
                continue
            here = path.parent / ref
            if not ((REPO / ref).exists() or here.exists()):
                missing.append(f"{path.relative_to(REPO)}: {ref}")
    assert not missing


def test_guarantees_cite_tests_that_exist():
    text = (REPO / "docs" / "guarantees.md").read_text()
    defined = set()
    for test_file in (REPO / "tests").rglob("test_*.py"):  # tests mirror the package in folders
        defined |= set(re.findall(r"^def (test_\w+)", test_file.read_text(), re.M))
    cited = set(re.findall(r"\b(test_\w+)\b", text)) - {n for n in re.findall(r"\b(test_\w+)\.py", text)}
    assert len(cited) > 10 and not (cited - defined), sorted(cited - defined)
    for f in re.findall(r"tests/((?:\w+/)?test_\w+\.py)", text):
        assert (REPO / "tests" / f).exists(), f

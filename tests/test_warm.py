"""The children of ``tests/warm.py`` are what the kill tests take them for: processes of
their own, with their own arguments, directory and environment (import-time variables
included), ended by SIGKILL at any instant, reporting their exit status as ``Popen`` does."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import warm


def test_a_child_is_its_own_process_with_its_own_arguments_directory_and_environment(tmp_path):
    script = ("import os, sys\nfrom mmbuffer.config import config\n"
              "print(os.getpid(), os.getcwd(), config.priority_log_bytes, os.environ['OTHER'], *sys.argv[1:])")
    env = dict(os.environ, MMBUFFER_PRIORITY_LOG_BYTES="1234", OTHER="x")
    with warm.start(script, ["a", "b"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env) as child:
        pid, cwd, log_bytes, other, *argv = child.stdout.read().split()
    assert child.returncode == 0
    assert int(pid) == child.pid != os.getpid()
    assert (cwd, log_bytes, other, argv) == (str(tmp_path), "1234", "x", ["a", "b"])


def test_children_share_no_state():
    """What one child changes in a module, the next child does not see."""
    script = "import mmbuffer.config as c\nprint(getattr(c, 'mark', None))\nc.mark = 1"
    for _ in range(2):
        with warm.start(script, stdout=subprocess.PIPE) as child:
            assert child.stdout.read() == b"None\n"


def test_sigkill_ends_a_child_and_exit_statuses_come_back_as_popen_gives_them():
    with warm.start("import time\nprint('ready', flush=True)\ntime.sleep(600)", stdout=subprocess.PIPE) as child:
        assert child.stdout.readline() == b"ready\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.05)
        assert child.poll() is None
        child.kill()
        assert child.wait() == -signal.SIGKILL
    assert warm.start("import sys\nsys.exit(3)").wait() == 3
    with warm.start("raise ValueError('boom')", stderr=subprocess.PIPE, text=True) as child:
        assert "ValueError: boom" in child.stderr.read()
    assert child.returncode == 1


def test_run_captures_output_and_raises_as_subprocess_run_does():
    done = warm.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(2)")
    assert (done.returncode, done.stdout, done.stderr) == (2, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        warm.run("import sys\nsys.exit(2)", check=True)
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        warm.run("import time\nprint('started', flush=True)\ntime.sleep(600)", timeout=2)
    assert hung.value.stdout == "started\n"  # what it printed before it was killed


def test_a_file_runs_as_python_file_would(tmp_path):
    """``run_file(path, argv)`` gives the script what ``python path argv`` gives it: its
    ``__name__``, ``sys.argv`` and ``sys.path`` (the script's folder first, then what a fresh
    interpreter with ``env``'s ``PYTHONPATH`` has, not the test process's folders); ``then``
    runs after it."""
    import sys

    (tmp_path / "where").mkdir()
    script = tmp_path / "where" / "show.py"
    script.write_text("import json, sys\nprint(json.dumps([__name__, sys.argv, sys.path]))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "lib"))
    fresh = subprocess.run([sys.executable, str(script), "a", "b"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, check=True)
    warmed = warm.run_file(script, ["a", "b"], env=env, cwd=tmp_path, then="print('after')", check=True)
    assert warmed.stdout == fresh.stdout + "after\n"
    assert str(script.parent) in fresh.stdout and str(tmp_path / "lib") in fresh.stdout

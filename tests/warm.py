"""Child processes forked from a warm interpreter: scripts that start with their imports done.

A kill test that starts ``python -c SCRIPT`` for each try spends most of the try in the
child's imports (torch, zarr, s3fs: 3-4 s on a loaded 2-core machine, against about a
second of publishing), so most random instants landed in the imports and the test mostly
waited. :func:`start` forks each child from a *zygote*, an interpreter of this test
process's ``sys.path`` that imported those modules (and loaded the kernels) once, one
zygote for each set of values of the variables read at import (``MMBUFFER_*``,
``NUMBA_*``, ...). The child is a process of its own, as a fresh interpreter is: its own pid,
memory and exit status, ``SCRIPT`` run as ``__main__`` with its own ``sys.argv``,
environment and working directory, stdout and stderr wherever the caller points them,
and SIGKILL ends it at any instant. It shares nothing with the test process, nor with
the other children (each forks from the zygote's state, which no child changes).

:func:`run` is ``subprocess.run`` for such a child; :func:`start_file` and :func:`run_file`
run a script file as ``python FILE`` would (its ``sys.argv`` and a fresh interpreter's
``sys.path``): the examples and the documented blocks. :func:`repo_env` is the environment
that makes any child, warm or not, import this checkout's mmbuffer.

What it does not give: the start-up of a fresh interpreter itself. The tests of what
happens at interpreter exit or in a new interpreter's imports keep ``subprocess``.

    >>> import subprocess, warm
    >>> with warm.start("import sys, torch; print(sys.argv[1], torch.ones(2).sum().item())", ["hi"],
    ...                 stdout=subprocess.PIPE) as child:
    ...     child.stdout.read()
    b'hi 2.0\\n'
    >>> child.returncode
    0
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Self

# Imported by the zygote before it forks (a name it cannot import is skipped).
PRELOAD = ("numpy", "torch", "zarr", "h5py", "fsspec", "s3fs", "icechunk", "mmbuffer.buffer", "mmbuffer.opening",
           "mmbuffer.convert._pipeline.publish", "mmbuffer.remote", "mmbuffer._feed.warm")

_ZYGOTE = r"""
import atexit, importlib, os, pickle, select, signal, socket, struct, sys, traceback, types
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
sock = socket.socket(fileno=int(os.environ.pop("MMBUFFER_ZYGOTE_FD")))
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
status_of = {}  # child pid -> the pipe its wait status goes to

def run(request, out, err):
    sock.close(); os.close(wake_r); os.close(wake_w)
    signal.set_wakeup_fd(-1); signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in status_of.values():
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0); os.dup2(out, 1); os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear(); os.environ.update(request["env"])
    sys.argv = ["-c", *request["argv"]]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(request["script"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        f.flush()
    os._exit(code or 0)

while True:
    ready = select.select([sock, wake_r], [], [])[0]
    if sock in ready:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not message:  # the test process closed its end
            break
        out, err, status = fds
        pid = os.fork()
        if pid == 0:
            os.close(status)
            run(pickle.loads(message), out, err)
        os.close(out); os.close(err)
        status_of[pid] = status
        sock.send(struct.pack("<i", pid))
    if wake_r in ready:
        os.read(wake_r, 4096)
    while status_of:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        fd = status_of.pop(pid)
        os.write(fd, struct.pack("<i", status))
        os.close(fd)
"""

# Read at import (mmbuffer.config, numba, OpenMP) or at the interpreter's start (the
# warning filters): a child whose environment differs in these gets a zygote started
# with its values.
IMPORT_TIME = ("MMBUFFER_", "NUMBA_", "OMP_", "MKL_", "TORCH_", "PYTORCH_", "PYTHONWARNINGS")

_lock = threading.Lock()
_zygotes: dict[tuple[tuple[str, str], ...], tuple[subprocess.Popen, socket.socket]] = {}


def _zygote_for(env: dict[str, str]) -> socket.socket:
    """The zygote for ``env``'s import-time values, started on first use (its imports
    take a few seconds)."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME)))
    with _lock:
        if key not in _zygotes or _zygotes[key][0].poll() is not None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            zygote_env = {k: v for k, v in os.environ.items() if not k.startswith(IMPORT_TIME)}
            zygote_env.update(key, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                              MMBUFFER_ZYGOTE_FD=str(theirs.fileno()))
            proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *PRELOAD], env=zygote_env,
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            _zygotes[key] = (proc, ours)
            atexit.register(_stop, proc, ours)
        return _zygotes[key][1]


def _stop(proc: subprocess.Popen, sock: socket.socket) -> None:
    sock.close()  # the zygote exits at the end of its socket
    proc.wait()


class Child:
    """A forked child, used as a :class:`subprocess.Popen` is: ``pid``, ``args``,
    ``stdout`` and ``stderr`` (where piped), ``poll``, ``wait``, ``send_signal``, ``kill``
    and ``returncode`` (the negative signal number when a signal ended it)."""

    def __init__(self, pid: int, args: list[str], status: int, stdout: Any, stderr: Any) -> None:
        self.pid, self.args, self._status, self.stdout, self.stderr = pid, args, status, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            status = os.read(self._status, 4)
            os.close(self._status)
            assert len(status) == 4, f"the zygote died before child {self.pid} ended"
            self.returncode = os.waitstatus_to_exitcode(struct.unpack("<i", status)[0])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._status], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"child {self.pid}", timeout)
        return self.poll()  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reported ended (as Popen's: a child that just ended is let be)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def _end(target: Any, text: bool, own: int) -> tuple[int, Any]:
    """The child's end for ``target`` (``None``: this process's descriptor ``own``;
    ``subprocess.PIPE``: a pipe whose reading end is returned; ``DEVNULL``; a file object
    or descriptor)."""
    if target is subprocess.PIPE:
        r, w = os.pipe()
        return w, open(r, "r" if text else "rb", buffering=-1 if text else 0)
    if target is None:
        return os.dup(own), None
    if target is subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY), None
    return os.dup(target if isinstance(target, int) else target.fileno()), None


def start(script: str, argv: list[str] | tuple[str, ...] = (), *, stdout: Any = None, stderr: Any = None,
          text: bool = False, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> Child:
    """Run ``python -c script *argv`` as a child forked from a zygote, with ``Popen``'s
    meaning of ``stdout``/``stderr`` (``None``, ``PIPE``, ``DEVNULL``, a file) and
    ``text``; ``env`` defaults to this process's environment, ``cwd`` to its directory.
    The zygote is the one whose import-time variables (:data:`IMPORT_TIME`) are ``env``'s."""
    out, out_file = _end(stdout, text, 1)
    err, err_file = _end(stderr, text, 2) if stderr is not subprocess.STDOUT else (os.dup(out), None)
    status_r, status_w = os.pipe()
    request = {"script": script, "argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
               "env": dict(os.environ if env is None else env)}
    try:
        sock = _zygote_for(request["env"])
        with _lock:
            socket.send_fds(sock, [pickle.dumps(request)], [out, err, status_w])
            pid = struct.unpack("<i", sock.recv(4))[0]
    finally:
        for fd in (out, err, status_w):
            os.close(fd)
    return Child(pid, [sys.executable, "-c", script, *request["argv"]], status_r, out_file, err_file)


def run(script: str, argv: list[str] | tuple[str, ...] = (), *, timeout: float | None = None, check: bool = False,
        cwd: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, "-c", script, *argv], capture_output=True, text=True)``
    as a warm child: its output as text, ``timeout`` (the child is killed, then
    ``TimeoutExpired``) and ``check`` (``CalledProcessError``) as ``subprocess.run``'s.

    >>> run("import sys; print(sys.argv[1])", ["hi"]).stdout
    'hi\\n'
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = start(script, argv, stdout=out, stderr=err, cwd=cwd, env=env)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            code = None
        out.seek(0)
        err.seek(0)
        if code is None:
            raise subprocess.TimeoutExpired(child.args, timeout, out.read(), err.read())
        done = subprocess.CompletedProcess(child.args, code, out.read(), err.read())
    if check:
        done.check_returncode()
    return done


REPO = Path(__file__).resolve().parents[1]


def repo_env(**overrides: str) -> dict[str, str]:
    """This process's environment, with ``overrides``, and the repository first on
    ``PYTHONPATH`` (then the inherited entries): a child imports this checkout's mmbuffer.

    >>> repo_env(A="1")["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    True
    """
    inherited = os.environ.get("PYTHONPATH")
    return {**os.environ, **overrides, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), inherited) if p)}


@functools.cache
def fresh_path(pythonpath: str) -> list[str]:
    """``sys.path`` of a fresh interpreter started with this ``PYTHONPATH`` (a zygote's
    holds the test process's, the tests' folders too); asked of one once."""
    out = subprocess.run([sys.executable, "-c", "import sys; print(repr(sys.path))"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": pythonpath}, check=True)
    return ast.literal_eval(out.stdout)


def _file_runner(path: str | Path, env: dict[str, str], then: str) -> str:
    where = [str(Path(path).resolve().parent), *fresh_path(env.get("PYTHONPATH", ""))[1:]]
    return f"import runpy, sys; sys.path[:] = {where!r}; runpy.run_path({str(path)!r}, run_name='__main__'); {then}"


def start_file(path: str | Path, argv: list[str] | tuple[str, ...] = (), *, env: dict[str, str], then: str = "",
               **kw: Any) -> Child:
    """:func:`start` of ``python path *argv`` as it would run in a fresh interpreter with
    ``env``: ``path`` as ``__main__`` with ``sys.argv[0]`` its path, and ``sys.path`` a fresh
    interpreter's (``path``'s folder first, then ``env``'s ``PYTHONPATH``); ``then``: code
    run after it, in the same process."""
    return start(_file_runner(path, env, then), argv, env=env, **kw)


def run_file(path: str | Path, argv: list[str] | tuple[str, ...] = (), *, env: dict[str, str], then: str = "",
             **kw: Any) -> subprocess.CompletedProcess[str]:
    """:func:`run` of ``python path *argv``, as :func:`start_file` starts it."""
    return run(_file_runner(path, env, then), argv, env=env, **kw)

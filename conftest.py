"""Set-up shared by the tests and the package's doctests (``--doctest-modules``)."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_folders_of_the_run(tmp_path_factory):
    """What a run writes outside the stores it makes lands in the run's temporary directory
    (pytest keeps the last three runs'): ``$TMPDIR`` and ``tempfile``'s folder (the doctests'
    and documented examples' ``tempfile.mkdtemp()`` stores, ~100 MB a run), the copies
    publishes keep and default remote caches (``$MMBUFFER_CACHE_DIR``, else ``~/.cache``),
    Stable-Baselines3's log folder of each ``learn()`` (``$SB3_LOGDIR``, else one
    ``SB3-<time>`` in ``/tmp`` per call). Ray keeps the system's folder (``$RAY_TMPDIR``): the
    paths of the sockets it makes there must stay under 108 bytes."""
    values = {
        "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", tempfile.gettempdir()),
        "TMPDIR": str(tmp_path_factory.mktemp("tmp")),
        "MMBUFFER_CACHE_DIR": str(tmp_path_factory.mktemp("mmbuffer-cache")),
        "SB3_LOGDIR": str(tmp_path_factory.mktemp("sb3-logs")),
    }
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None

"""The package type-checks with ``mypy --strict`` (settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_package_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache")],
        cwd=root, capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:]

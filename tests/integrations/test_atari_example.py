"""examples/atari_dqn.py: SB3's DQN trains on a real ALE game with its replay buffer in an
mmbuffer store, and a rerun resumes from the store. Each run is ``python examples/atari_dqn.py``
forked warm (``tests/warm.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import warm

pytest.importorskip("stable_baselines3")
pytest.importorskip("ale_py")
pytest.importorskip("cv2")  # SB3's AtariWrapper resizes with OpenCV

import mmbuffer as mb  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "atari_dqn.py"


def run(cwd: Path, *args: str) -> str:
    proc = warm.run_file(EXAMPLE, ["--dir", "run", *args], cwd=cwd, env=warm.repo_env(), timeout=600)  # python EXAMPLE ...
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def number(pattern: str, text: str) -> int:
    m = re.search(pattern, text, re.M)
    assert m, f"{pattern!r} not in\n{text}"
    return int(m.group(1).replace(",", ""))


@pytest.mark.slow
def test_atari_dqn_trains_then_resumes_from_the_store(tmp_path):
    out = run(tmp_path, "--steps", "600", "--learning-starts", "400")
    assert "new run: ALE/Breakout-v5" in out
    # SB3 trains every 4 steps once past learning_starts: at most (600 - 400) / 4 updates
    updates = number(r"(\d+) gradient steps in all", out)
    assert 40 <= updates <= 50, out
    assert number(r"^store holds (\d+) transitions", out) == 600
    per_transition = number(r"([\d,]+) B per transition", out)
    assert 0 < per_transition < 56_448  # a frame stored once a step, not SB3's two 4-stacks
    store = tmp_path / "run" / "replay"
    with mb.open(store, mode="r") as buf:  # the steps are in the store, committed
        assert buf.view().written.tolist() == [600]
        assert tuple(buf.columns["obs"].shape) == (1, 84, 84)  # one frame a step (VecTransposeImage: channels first)
        assert buf.attrs["sb3"]["frame_stack"] == 4
    assert (tmp_path / "run" / "replay.pkl").stat().st_size < 1_000_000  # the path and cursor, not the frames

    out = run(tmp_path, "--steps", "200")  # the same --dir: resumes
    assert "resumed: 600 steps trained, the store holds 600 transitions" in out
    assert number(r"(\d+) steps in all", out) == 800
    assert number(r"(\d+) gradient steps in all", out) == updates + 50  # past learning_starts: every 4th step
    assert number(r"^store holds (\d+) transitions", out) == 800
    with mb.open(store, mode="r") as buf:
        assert buf.view().written.tolist() == [800]

"""Exporters keep what they read or refuse by name: each loss is an explicit opt-in.

D4RL (open episodes whose last row has no next observation, open episodes of a
store with several streams), Diffusion Policy (open episodes, final
observations), Minari (open episodes, columns with no place in a dataset): each
is a :class:`ConversionError` naming what would be lost and the option that
leaves it out; a refused export writes nothing; with the option, the loss is
counted in the summary and warned about.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mmbuffer as mb
from mmbuffer._cli.main import main
from mmbuffer.convert import ConversionWarning, export
from mmbuffer.errors import ConversionError


def make_store(path: Path, *, streams: int = 1, extra: bool = False, next_keys: tuple[str, ...] = ("obs",),
               open_tail: bool = True) -> Path:
    """Per stream: episodes of 4 and 3 rows, then (``open_tail``) 2 rows of an open episode."""
    cols = {"obs": ((2,), "float32"), "action": ((), "float32"), "reward": ((), "float32")}
    if extra:
        cols["episode_index"] = ((), "int64")
    n = 9 if open_tail else 7
    with mb.create(path, cols, capacity=16 * streams, num_streams=streams, next_keys=next_keys) as buf:
        for s in range(streams):
            rows = {"obs": np.arange(2 * n, dtype=np.float32).reshape(n, 2) + 100 * s,
                    "action": np.arange(n, dtype=np.float32), "reward": np.ones(n, np.float32),
                    "terminated": np.isin(np.arange(n), [3]), "truncated": np.isin(np.arange(n), [6])}
            if extra:
                rows["episode_index"] = np.repeat([0, 1, 2], [4, 3, 2])[:n]
            final = {k: np.full((2, 2), -1, np.float32) for k in next_keys}
            buf.extend(rows, stream=s, final_obs=final or None)
    return path


def nothing_written(out: Path) -> bool:
    return not out.exists() and not Path(str(out) + ".partial").exists()


@pytest.mark.parametrize("streams", [1, 2])
def test_d4rl_open_episodes_refused_unless_dropped(tmp_path, streams):
    store = make_store(tmp_path / "s", streams=streams)
    out = tmp_path / "o.hdf5"
    with pytest.raises(ConversionError, match=rf"{2 * streams} rows of open \(unfinished\) episodes cannot be "
                                              r"written: .*next_observations.*drop_open_episodes=True "
                                              r"\(--drop-open-episodes\)"):
        export("d4rl", store, out, progress=False)
    assert nothing_written(out)
    with pytest.warns(ConversionWarning, match=r"left out \(drop_open_episodes\)"):
        s = export("d4rl", store, out, drop_open_episodes=True, progress=False)
    assert (s["rows"], s["skipped_open_rows"], s["verified"]) == (7 * streams, 2 * streams, True)
    if streams == 2:  # without next observations: one unflagged episode fits a file, two streams' do not
        with pytest.raises(ConversionError, match=r"4 rows of open .*one unflagged episode.*2 streams"):
            export("d4rl", store, tmp_path / "p.hdf5", next_observations=False, progress=False)
    else:  # without next observations the open episode is kept whole
        s = export("d4rl", store, tmp_path / "p.hdf5", next_observations=False, progress=False)
        assert (s["rows"], s["skipped_open_rows"]) == (9, 0)


def test_diffusion_policy_open_episodes_and_final_obs_refused_unless_dropped(tmp_path):
    store = make_store(tmp_path / "s")
    out = tmp_path / "o.zarr"
    with pytest.raises(ConversionError, match=r"2 rows of open .*meta/episode_ends.*drop_open_episodes=True"):
        export("diffusion_policy", store, out, progress=False)
    with pytest.raises(ConversionError, match=r"the final observations of \['obs'\].*drop_final_obs=True "
                                              r"\(--drop-final-obs\)"):
        export("diffusion_policy", store, out, drop_open_episodes=True, progress=False)
    assert nothing_written(out)
    with pytest.warns(ConversionWarning) as caught:
        s = export("diffusion_policy", store, out, drop_open_episodes=True, drop_final_obs=True, progress=False)
    assert [str(w.message).split(": ")[1] for w in caught] == ["left out (drop_open_episodes)",
                                                                "left out (drop_final_obs)"]
    assert (s["rows"], s["episodes"], s["skipped_open_rows"]) == (7, 2, 2)
    # nothing to lose: no open episode, no next-derived column -> no option needed, no warning
    plain = make_store(tmp_path / "p", next_keys=(), open_tail=False)
    s = export("diffusion_policy", plain, tmp_path / "p.zarr", progress=False)
    assert (s["rows"], s["warnings"]) == (7, [])


def test_diffusion_policy_zero_final_obs_need_no_opt_in(tmp_path):
    """Final observations that are zeros standing for unknown ones (a source without next
    observations) are no data: exporting without them loses nothing."""
    store = make_store(tmp_path / "s", open_tail=False)
    with mb.open(store, mode="a") as buf:
        buf.attrs["final_obs_source"] = "zeros"
        buf.commit()
    s = export("diffusion_policy", store, tmp_path / "o.zarr", progress=False)
    assert s["rows"] == 7 and s["warnings"] == []


def test_minari_columns_and_open_episodes_refused_unless_dropped(tmp_path):
    store = make_store(tmp_path / "s", extra=True)
    out = tmp_path / "m"
    with pytest.raises(ConversionError, match=r"columns \['episode_index'\] have no place in a Minari dataset.*"
                                              r"drop_unsupported=True \(--drop-unsupported\)"):
        export("minari", store, out, progress=False)
    with pytest.raises(ConversionError, match=r"2 rows of open .*final observation.*drop_open_episodes=True"):
        export("minari", store, out, drop_unsupported=True, progress=False)
    assert nothing_written(out)
    with pytest.warns(ConversionWarning) as caught:
        s = export("minari", store, out, drop_unsupported=True, drop_open_episodes=True, progress=False)
    assert [str(w.message).split(": ")[1] for w in caught] == ["left out (drop_unsupported)",
                                                                "left out (drop_open_episodes)"]
    assert (s["rows"], s["skipped_open_rows"], s["dropped_columns"], s["verified"]) == (7, 2, ["episode_index"], True)


def test_export_cli_flags(tmp_path, capsys):
    store = make_store(tmp_path / "s", extra=True)
    assert main(["export", "minari", str(store), str(tmp_path / "m"), "--no-progress"]) == 2
    assert "drop_unsupported=True (--drop-unsupported)" in capsys.readouterr().err
    assert main(["export", "minari", str(store), str(tmp_path / "m"), "--drop-unsupported", "--drop-open-episodes",
                 "--no-progress", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["dropped_columns"] == ["episode_index"] and s["skipped_open_rows"] == 2
    assert main(["export", "diffusion_policy", str(store), str(tmp_path / "d.zarr"), "--drop-open-episodes",
                 "--drop-final-obs", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 7
    assert main(["export", "d4rl", str(store), str(tmp_path / "o.hdf5"), "--drop-final-obs"]) == 2
    assert "--drop-final-obs: not an option of format 'd4rl' (only diffusion_policy)" in capsys.readouterr().err
    assert not (tmp_path / "o.hdf5").exists()

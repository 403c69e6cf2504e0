"""The one registry of formats: which names ``convert`` reads and ``export`` writes.

Modelled on h5py's driver table (``h5py/_hl/files.py``): every format is
listed here once, with the function that runs it, the help text the command
line shows and the format-specific options it takes; :func:`mmbuffer.convert.convert`,
:func:`mmbuffer.convert.export` and the ``mmbuffer convert|export`` commands
all read these tables, so a new format is one line here.

>>> list(READERS), list(WRITERS)
(['d4rl', 'minari', 'npz', 'torchrl', 'tdmpc2', 'diffusion_policy', 'lerobot', 'tianshou'], ['d4rl', 'minari', 'diffusion_policy'])
>>> READERS["npz"].options
('keep_infos', 'keep_next_obs')
>>> takes("keep_infos", READERS)
('d4rl', 'minari', 'npz', 'tianshou')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .readers.d4rl import convert_d4rl
from .readers.diffusion import convert_diffusion_policy
from .exporters.d4rl import export_d4rl
from .exporters.diffusion import export_diffusion_policy
from .exporters.minari import export_minari
from .readers.lerobot import convert_lerobot
from .readers.minari import convert_minari
from .readers.npz import convert_npz
from .readers.tianshou import convert_tianshou
from .readers.torchrl import convert_torchrl

__all__ = ["READERS", "WRITERS", "Format", "takes"]


@dataclass(frozen=True)
class Format:
    """One format: its name, the function that runs it, its help text, its own options.

    ``run`` is ``convert_<name>(src, dst, **options)`` for a reader and
    ``export_<name>(store, out, **options)`` for a writer. ``options`` names the
    keyword options beyond the common ones (``overwrite``, ``chunk_rows``,
    ``progress``, ``verify``, and ``compression`` for readers).
    """

    name: str
    run: Callable[..., dict[str, Any]]
    help: str
    options: tuple[str, ...] = ()


#: ``convert`` formats (sources read into a new store), in the order the CLI lists them.
READERS: dict[str, Format] = {f.name: f for f in (
    Format("d4rl", convert_d4rl, "a D4RL HDF5 file", ("keep_infos", "keep_next_obs")),
    Format("minari", convert_minari, "a Minari dataset directory (HDF5 or Arrow)", ("keep_infos",)),
    Format("npz", convert_npz, "a .npz archive or a directory of .npy files", ("keep_infos", "keep_next_obs")),
    Format("torchrl", convert_torchrl, "a TorchRL dumps() directory or a TD-MPC2 .pt file"),
    Format("tdmpc2", convert_torchrl, "a TD-MPC2 .pt file (the same reader as torchrl)"),
    Format("diffusion_policy", convert_diffusion_policy,
           "a Diffusion Policy / UMI Zarr group (data/<key>, meta/episode_ends; .zarr or .zarr.zip)"),
    Format("lerobot", convert_lerobot, "a LeRobot v3 dataset directory (meta/info.json, data/ parquet files)",
           ("skip_visual",)),
    Format("tianshou", convert_tianshou, "a Tianshou ReplayBuffer/VectorReplayBuffer save_hdf5 file",
           ("keep_infos",)),
)}

#: ``export`` formats (a store written out), in the order the CLI lists them.
WRITERS: dict[str, Format] = {f.name: f for f in (
    Format("d4rl", export_d4rl, "a D4RL HDF5 file (.hdf5)"),
    Format("minari", export_minari, "a Minari dataset directory", ("dataset_id",)),
    Format("diffusion_policy", export_diffusion_policy, "a Diffusion Policy Zarr group (.zarr)", ("zarr_format",)),
)}


def takes(option: str, table: Mapping[str, Format]) -> tuple[str, ...]:
    """The names of the formats in ``table`` that take ``option``."""
    return tuple(name for name, f in table.items() if option in f.options)

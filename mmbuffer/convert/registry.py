"""The one registry of formats: which names ``convert`` reads and ``export`` writes.

Modelled on h5py's driver table (``h5py/_hl/files.py``): every format is
listed here once, with the function that runs it, the help text the command
line shows and the format-specific options it takes; the names
``mmbuffer.convert.convert_<format>`` / ``export_<format>``, :func:`mmbuffer.convert.convert`,
:func:`mmbuffer.convert.export` and the ``mmbuffer convert|export`` commands and
their help all come from these tables, so a new format is one line here. Nothing
here imports a reader: the functions are named, and imported when first run (the
command line's ``--help`` stays free of torch).

>>> list(READERS), list(WRITERS)
(['d4rl', 'minari', 'npz', 'torchrl', 'tdmpc2', 'diffusion_policy', 'lerobot', 'tianshou'], ['d4rl', 'minari', 'diffusion_policy'])
>>> READERS["npz"].options
('drop_infos', 'drop_unsupported', 'derive_next', 'keep_next_obs', 'keep_infos', 'drop_last_transition')
>>> takes("drop_infos", READERS)
('d4rl', 'minari', 'npz', 'tianshou')

Converters and exporters are lossless by default: every option here that loses
something (``drop_*``, ``derive_next``, ``skip_visual``) is an explicit opt-in, and
what it accepts is refused, by name, without it; so is a source that leaves a flag
ambiguous (a TorchRL dump's ``next/done`` alone) until ``done_means`` says which it is.
``keep_infos`` is deprecated (infos are kept by default).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["READERS", "WRITERS", "Format", "takes"]


@dataclass(frozen=True)
class Format:
    """One format: its name, the function that runs it, its help text, its own options.

    ``function`` names ``convert_<name>(src, dst, **options)`` for a reader and
    ``export_<name>(store, out, **options)`` for a writer, defined in ``module``
    (relative to ``mmbuffer.convert``). ``options`` names the keyword options beyond
    the common ones (``overwrite``, ``chunk_rows``, ``progress``, ``verify``, and
    ``compression`` for readers).
    """

    name: str
    module: str
    function: str
    help: str
    options: tuple[str, ...] = ()

    @property
    def run(self) -> Callable[..., dict[str, Any]]:
        """The function, imported on first use."""
        fn: Callable[..., dict[str, Any]] = getattr(importlib.import_module(self.module, "mmbuffer.convert"), self.function)
        return fn


#: The options of the flat readers (D4RL keys, npz, Tianshou): see :class:`~mmbuffer.convert.D4RLReader`.
_FLAT = ("drop_infos", "drop_unsupported", "derive_next", "keep_next_obs", "keep_infos")
#: D4RL keys (d4rl, npz): also ``drop_last_transition`` (no next observations)
_D4RL = (*_FLAT, "drop_last_transition")

#: ``convert`` formats (sources read into a new store), in the order the CLI lists them.
READERS: dict[str, Format] = {f.name: f for f in (
    Format("d4rl", ".readers.d4rl", "convert_d4rl", "a D4RL HDF5 file", _D4RL),
    Format("minari", ".readers.minari", "convert_minari", "a Minari dataset directory (HDF5 or Arrow)",
           ("drop_infos", "drop_unsupported", "keep_infos")),
    Format("npz", ".readers.npz", "convert_npz", "a .npz archive or a directory of .npy files", _D4RL),
    Format("torchrl", ".readers.torchrl", "convert_torchrl", "a TorchRL dumps() directory or a TD-MPC2 .pt file",
           ("derive_next", "keep_next_obs", "drop_unsupported", "drop_reset_values", "done_means")),
    Format("tdmpc2", ".readers.torchrl", "convert_torchrl", "a TD-MPC2 .pt file (the same reader as torchrl)",
           ("drop_reset_values", "drop_unsupported")),
    Format("diffusion_policy", ".readers.diffusion", "convert_diffusion_policy",
           "a Diffusion Policy / UMI Zarr group (data/<key>, meta/episode_ends; .zarr or .zarr.zip)",
           ("drop_past_ends", "drop_unsupported")),
    Format("lerobot", ".readers.lerobot", "convert_lerobot",
           "a LeRobot v3 dataset directory (meta/info.json, data/ parquet files, videos/ decoded with PyAV)",
           ("skip_visual", "drop_unsupported", "codec")),
    Format("tianshou", ".readers.tianshou", "convert_tianshou",
           "a Tianshou ReplayBuffer/VectorReplayBuffer save_hdf5 file", _FLAT),
)}

#: ``export`` formats (a store written out), in the order the CLI lists them.
WRITERS: dict[str, Format] = {f.name: f for f in (
    Format("d4rl", ".exporters.d4rl", "export_d4rl", "a D4RL HDF5 file (.hdf5)", ("drop_open_episodes",)),
    Format("minari", ".exporters.minari", "export_minari", "a Minari dataset directory",
           ("dataset_id", "drop_open_episodes", "drop_unsupported")),
    Format("diffusion_policy", ".exporters.diffusion", "export_diffusion_policy", "a Diffusion Policy Zarr group (.zarr)",
           ("zarr_format", "drop_open_episodes", "drop_final_obs")),
)}


def takes(option: str, table: Mapping[str, Format]) -> tuple[str, ...]:
    """The names of the formats in ``table`` that take ``option``."""
    return tuple(name for name, f in table.items() if option in f.options)

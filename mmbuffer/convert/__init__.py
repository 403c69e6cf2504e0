"""Conversion tools: bring the offline datasets people have into a store, and back out.

Readers (one per source format) are separate from writing: each yields the
source in order as chunks ``(steps, final_obs)`` and a :class:`Schema`, and
:func:`write_store` writes any reader into a new store. Every converter

* streams the source a chunk at a time (the process never holds the dataset:
  memory stays at a few chunks, ~32 MiB each by default, whatever the size),
* shows a tqdm progress bar (``progress=False`` hides it),
* keeps episode boundaries and the terminated/truncated distinction exactly
  (a source that stops inside an episode, with next observations, gets
  ``truncated`` on its last row, recorded in ``attrs["tail_truncated_row"]``),
* is lossless by default: what the source holds and the store cannot derive
  is kept (``infos/*`` as columns; next observations that differ from the
  following row as an explicit ``next/<col>`` column) or refused with
  :class:`~mmbuffer.errors.ConversionError` naming the key, the rows and the
  option that accepts the loss (``derive_next``, ``drop_infos``,
  ``drop_unsupported``, ``drop_past_ends``, ``drop_reset_values``,
  ``skip_visual``); a warning never stands in for a refusal, and each reader's
  module docstring lists what its format holds and what becomes of it,
* refuses what it cannot convert (a required key that is not numeric, a file
  of another format: "expected ..., found an HDF5 file") with
  :class:`~mmbuffer.errors.ConversionError`, never drops it silently,
* verifies: every chunk is read back from the store's files as it is written
  and compared byte for byte with the source chunk (final observations too), a
  CRC-32 per column of the source is recorded in ``attrs["convert"]``, and the
  reopened store's row count, episode count, starts and lengths must match,
* builds the store at ``DST.partial`` and renames it to ``DST`` only after the
  final commit and the verification,
* writes behind (``Buffer.drop_cache``): a dataset larger than memory does not
  push what other processes use out of the page cache,
* refuses an existing ``DST`` (:class:`~mmbuffer.errors.StoreExistsError`)
  unless ``overwrite=True``, and even then replaces only an output mmbuffer
  writes (a store; for exports a D4RL HDF5 file or a Minari dataset directory),
  never a directory holding other files, another file or a symbolic link,
* raises :class:`~mmbuffer.errors.ConversionError` naming the file and key for
  bad input (missing keys, mismatched lengths, not the declared format),
* returns a summary dict (rows, episodes, open episode rows, NaN rewards,
  checksums, throughput, warnings).

Formats: ``d4rl`` (:func:`convert_d4rl`), ``minari`` (:func:`convert_minari`: a
dataset directory or a dataset id in Minari's local datasets directory),
``npz`` (:func:`convert_npz`), ``torchrl`` (:func:`convert_torchrl`: a
``dumps()`` directory or a TD-MPC2 ``.pt`` file), ``diffusion_policy``
(:func:`convert_diffusion_policy`: Diffusion Policy / UMI Zarr), ``lerobot``
(:func:`convert_lerobot`: LeRobot v3, video features decoded into image
columns), ``tianshou`` (:func:`convert_tianshou`: ``save_hdf5`` files). Export:
:func:`export_d4rl`, :func:`export_minari`, :func:`export_diffusion_policy` (what a
format cannot hold is refused by name unless ``drop_open_episodes``,
``drop_final_obs`` or ``drop_unsupported`` leaves it out); re-encode, resize or
restream a store: :func:`copy`.

Offline to online in one step: every converter and :func:`copy` take
``capacity``, ``num_streams`` and ``priorities`` (as :func:`mmbuffer._ledger.create`),
so a dataset becomes a replay buffer with room to grow, one stream per
environment and a priority tree; episodes are dealt to the streams in
contiguous runs (:mod:`._lanes`). Every format is listed
once, in the registry :mod:`._formats` that :func:`convert`, :func:`export` and
the command line read.

Layout: the reader contract is :mod:`._reader` (one reader per format:
``_d4rl``, ``_minari``, ``_npz``, ``_torchrl``); every output (a converted or
copied store, an export) is a writer of :mod:`._frame` (write streamed, verify
by read-back, rename into place): :mod:`._write`, :mod:`._copy`,
:mod:`._export_d4rl`, :mod:`._export_minari`. This package depends on the core
modules of :mod:`mmbuffer`, never the reverse (``mmbuffer.convert`` is imported
on first use).

Examples
--------
>>> import tempfile, numpy as np, mmbuffer as mb
>>> from mmbuffer.convert import convert_npz
>>> d = tempfile.mkdtemp()
>>> T = 10
>>> obs = np.random.rand(T + 1, 3).astype("float32")
>>> np.savez(d + "/data.npz", observations=obs[:-1], next_observations=obs[1:],
...          actions=np.zeros((T, 1), "float32"), rewards=np.ones(T, "float32"),
...          terminals=np.arange(T) == 3, timeouts=np.arange(T) == T - 1)
>>> summary = convert_npz(d + "/data.npz", d + "/store", progress=False)
>>> summary["rows"], summary["episodes"], summary["verified"]
(10, 2, True)
>>> mb.open(d + "/store", mode="r").episodes()[1].tolist()
[4, 6]
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from .registry import READERS, WRITERS

if TYPE_CHECKING:
    from ._pipeline.publish import copy as copy, copy_store as copy_store, publish as publish
    from ._pipeline.reader import Chunk as Chunk, ConversionWarning as ConversionWarning, Reader as Reader, Schema as Schema
    from ._pipeline.write import write_store as write_store
    from .exporters.d4rl import export_d4rl as export_d4rl
    from .exporters.diffusion import export_diffusion_policy as export_diffusion_policy
    from .exporters.minari import export_minari as export_minari
    from .readers.d4rl import D4RLReader as D4RLReader, convert_d4rl as convert_d4rl
    from .readers.diffusion import DiffusionPolicyReader as DiffusionPolicyReader, convert_diffusion_policy as convert_diffusion_policy
    from .readers.lerobot import LeRobotReader as LeRobotReader, convert_lerobot as convert_lerobot
    from .readers.minari import MinariReader as MinariReader, convert_minari as convert_minari
    from .readers.npz import NpzReader as NpzReader, convert_npz as convert_npz
    from .readers.tdmpc2 import TDMPC2Reader as TDMPC2Reader
    from .readers.tianshou import TianshouReader as TianshouReader, convert_tianshou as convert_tianshou
    from .readers.torchrl import TorchRLReader as TorchRLReader, convert_torchrl as convert_torchrl

# public name -> (module, attribute): the converters and exporters come from the registry,
# the rest is listed here; each is imported on first use (PEP 562), as ``mmbuffer`` does
_LAZY: dict[str, tuple[str, str]] = {
    **{f.function: (f.module, f.function) for f in (*READERS.values(), *WRITERS.values())},
    "copy": ("._pipeline.publish", "copy"),
    "copy_store": ("._pipeline.publish", "copy_store"),
    "publish": ("._pipeline.publish", "publish"),
    "Chunk": ("._pipeline.reader", "Chunk"),
    "ConversionWarning": ("._pipeline.reader", "ConversionWarning"),
    "Reader": ("._pipeline.reader", "Reader"),
    "Schema": ("._pipeline.reader", "Schema"),
    "write_store": ("._pipeline.write", "write_store"),
    "D4RLReader": (".readers.d4rl", "D4RLReader"),
    "DiffusionPolicyReader": (".readers.diffusion", "DiffusionPolicyReader"),
    "LeRobotReader": (".readers.lerobot", "LeRobotReader"),
    "MinariReader": (".readers.minari", "MinariReader"),
    "NpzReader": (".readers.npz", "NpzReader"),
    "TDMPC2Reader": (".readers.tdmpc2", "TDMPC2Reader"),
    "TianshouReader": (".readers.tianshou", "TianshouReader"),
    "TorchRLReader": (".readers.torchrl", "TorchRLReader"),
}

__all__ = sorted({*_LAZY, "FORMATS", "convert", "export"})


def __getattr__(name: str) -> Any:
    """Import a public name on first use and keep it in the namespace."""
    if name == "FORMATS":  # ``convert`` format name -> converter
        value: Any = {n: f.run for n, f in READERS.items()}
    elif name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module, __name__), attr)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def convert(
    format: str,  # noqa: A002 - the CLI's word
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    **options: Any,
) -> dict[str, Any]:
    """Convert ``src`` of the given ``format`` into a new store at ``dst``.

    ``format`` is one of the registry's readers (``d4rl``, ``minari``, ``npz``,
    ``torchrl``/``tdmpc2``, ``diffusion_policy``, ``lerobot``, ``tianshou``);
    ``options`` are those of the format's converter (``overwrite``,
    ``compression``, ``chunk_rows``, ``progress``, ``verify``, ``capacity``,
    ``num_streams``, ``priorities``, and the format's own: ``derive_next``,
    ``drop_infos``... as the registry lists them). Returns the summary dict.

    >>> import tempfile, numpy as np, mmbuffer as mb
    >>> d = tempfile.mkdtemp()
    >>> obs = np.random.rand(11, 3).astype("float32")
    >>> np.savez(d + "/data.npz", observations=obs[:-1], next_observations=obs[1:],
    ...          actions=np.zeros((10, 1), "float32"), rewards=np.ones(10, "float32"),
    ...          terminals=np.arange(10) % 5 == 4, timeouts=np.zeros(10, bool))
    >>> s = convert("npz", d + "/data.npz", d + "/replay", capacity=1000, num_streams=2,
    ...             priorities=mb.PriorityConfig(alpha=0.6), progress=False)
    >>> buf = mb.open(d + "/replay")
    >>> buf.capacity, buf.num_streams, buf.num_episodes
    (1000, 2, 2)
    >>> buf.extend({"obs": np.zeros((3, 3)), "action": np.zeros((3, 1)), "reward": np.zeros(3)})
    >>> buf.num_episodes  # nothing evicted
    2
    >>> buf.close()

    Raises
    ------
    InvalidArgumentError
        Unknown format, or an option the format does not take.
    """
    entry = READERS.get(str(format).lower())
    if entry is None:
        raise InvalidArgumentError(f"format: expected one of {sorted(READERS)}, got {format!r}")
    try:
        return entry.run(src, dst, **options)
    except TypeError as exc:
        if "unexpected keyword" in str(exc):
            raise InvalidArgumentError(f"convert {format}: {exc}") from None
        raise


def export(
    format: str,  # noqa: A002
    store: Any,
    out: str | os.PathLike[str],
    **options: Any,
) -> dict[str, Any]:
    """Export a store (path or open buffer) as ``d4rl`` HDF5 or a ``minari`` dataset.

    ``format`` is one of the registry's writers; ``options`` are those of the
    format's exporter. Returns the summary dict.

    Raises
    ------
    InvalidArgumentError
        Unknown format.
    """
    entry = WRITERS.get(str(format).lower())
    if entry is None:
        raise InvalidArgumentError(f"format: expected one of {sorted(WRITERS)}, got {format!r}")
    return entry.run(store, out, **options)

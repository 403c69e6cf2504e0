"""D4RL HDF5 files: one flat array per key, one row per transition.

Layout read (``d4rl.qlearning_dataset`` conventions)::

    observations       [N, *obs]        (or a group of leaves -> ``obs/<leaf>`` columns)
    actions            [N, *act]
    rewards            [N] or [N, 1]
    terminals          [N]  episode ended by the MDP        -> ``terminated``
    timeouts           [N]  episode cut by a time limit      -> ``truncated``
    next_observations  [N, *obs]        optional: final observation of each episode
    infos/*            [N, ...]         optional: ``infos/<name>`` columns with keep_infos=True
    metadata/*                          optional: small values, into ``attrs["source_metadata"]``

Store columns: ``obs``, ``action``, ``reward`` (+ ``infos/*``, + any other
top-level ``[N, ...]`` numeric dataset under its own name), and the flags.
``obs`` is next-derived; with ``next_observations`` each episode's final
observation is ``next_observations[last row]``, without it zeros (D4RL's mujoco
``-v2`` files have none; ``attrs["final_obs_source"]`` says which). A file
that stops inside an episode (no flag on its last row, common in D4RL) keeps
every row: with ``next_observations`` the episode is closed as truncated there
(``attrs["tail_truncated_row"]``; :func:`~mmbuffer.convert.export_d4rl` writes
the row back unflagged), without them it stays open (warning). A required key
(``observations, actions, rewards, terminals, timeouts``, and
``next_observations`` when present) that is not numeric is an error; other
non-numeric datasets are left out with a warning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...schema import PriorityConfig
from .._pipeline.flat import ArrayLike, FlatReader
from .._pipeline.reader import Reader, jsonable, reader_error, reader_warn
from .._pipeline.sniff import HDF5, expect
from .._pipeline.write import write_store

__all__ = ["D4RLReader", "convert_d4rl", "D4RL_KEYS"]

#: Source key -> store column.
D4RL_KEYS = {"observations": "obs", "actions": "action", "rewards": "reward"}
_FLAG_KEYS = {"terminals": "terminated", "timeouts": "truncated"}
_OPTIONAL = ("next_observations", "infos", "metadata")
#: Keys whose values must convert (``next_observations`` too when present: it holds
#: the final observations); other non-numeric datasets are left out with a warning.
_REQUIRED = frozenset({*D4RL_KEYS, *_FLAG_KEYS, "next_observations"})


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """Datasets under an h5py group (or the dataset itself), keyed ``prefix/<path>``."""
    import h5py

    if isinstance(node, h5py.Dataset):
        return {prefix: node}
    out: dict[str, Any] = {}
    for name in node:
        out.update(_leaves(node[name], f"{prefix}/{name}"))
    return out


def _numeric(ds: Any) -> bool:
    return np.dtype(ds.dtype).kind in "biuf"


def flat_columns(
    reader: Reader,
    arrays: Mapping[str, ArrayLike],
    *,
    keep_infos: bool,
    keep_next_obs: bool,
) -> dict[str, Any]:
    """Map D4RL keys (``a/b`` paths) to FlatReader arguments; shared with the npz reader."""
    from ...errors import ConversionError

    tops = {k.split("/", 1)[0] for k in arrays}
    missing = [k for k in (*D4RL_KEYS, *_FLAG_KEYS) if k not in tops]
    if missing:
        raise ConversionError(
            f"{reader.path}: missing key{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(m) for m in missing)} (a D4RL dataset has observations, actions, "
            "rewards, terminals and timeouts; found "
            f"{', '.join(sorted(tops)) or 'nothing'})"
        )
    columns: dict[str, ArrayLike] = {}
    keys: dict[str, str] = {}
    next_arrays: dict[str, ArrayLike] = {}
    flags: dict[str, ArrayLike] = {}
    dropped: list[str] = []
    obs_cols: list[str] = []
    for key, arr in arrays.items():
        top, _, rest = key.partition("/")
        if top == "metadata":
            continue
        if top in _FLAG_KEYS:
            if rest:
                raise reader_error(reader, "expected a dataset, got a group", key)
            flags[_FLAG_KEYS[top]] = arr
            keys[_FLAG_KEYS[top]] = key
        if not _numeric(arr):
            if top in _REQUIRED:  # never dropped: the store would silently lack it
                raise reader_error(
                    reader,
                    f"expected a numeric array (bool, int, uint or float), got dtype {np.dtype(arr.dtype)}", key
                )
            dropped.append(key)
            continue
        if top in _FLAG_KEYS:
            continue
        if top in D4RL_KEYS:
            name = D4RL_KEYS[top] + (f"/{rest}" if rest else "")
            if top == "observations":
                obs_cols.append(name)
        elif top == "next_observations":
            name = "obs" + (f"/{rest}" if rest else "")
            if keep_next_obs:
                columns["next/" + name] = arr
                keys["next/" + name] = key
            else:
                next_arrays[name] = arr
                keys[f"next_{name}"] = key
            continue
        elif top == "infos":
            if not keep_infos:
                continue
            name = key
        else:
            name = key
        columns[name] = arr
        keys[name] = key
    if dropped:
        reader_warn(reader, f"skipped non-numeric datasets {dropped}")
    next_keys: tuple[str, ...] = ()
    if not keep_next_obs:
        next_keys = tuple(obs_cols)
    return dict(
        columns=columns,
        terminated=flags["terminated"],
        truncated=flags["truncated"],
        next_arrays=next_arrays,
        next_keys=next_keys,
        keys=keys,
    )


class D4RLReader(FlatReader):
    """Read a D4RL-layout HDF5 file in row chunks (see the module docstring).

    Parameters
    ----------
    path
        The ``.hdf5`` / ``.h5`` file.
    keep_infos
        Keep ``infos/*`` datasets as ``infos/<name>`` columns.
    keep_next_obs
        Store ``next_observations`` as an explicit ``next/obs`` column instead of
        deriving next observations from the following row (for datasets whose
        next observations disagree with the following row).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, keep_infos: bool = False, keep_next_obs: bool = False
    ) -> None:
        import h5py

        from ...errors import ConversionError

        Reader.__init__(self, path)
        expect(self.path, (HDF5,), "a D4RL HDF5 file")
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise ConversionError(f"{self.path}: not an HDF5 file ({exc})") from exc
        try:
            arrays: dict[str, Any] = {}
            for name in self._file:
                arrays.update(_leaves(self._file[name], name))
            args = flat_columns(self, arrays, keep_infos=keep_infos, keep_next_obs=keep_next_obs)
            attrs: dict[str, Any] = {
                "source_format": "d4rl",
                "source_metadata": _metadata(self._file),
            }
            if self._file.attrs:
                attrs["source_attrs"] = jsonable(dict(self._file.attrs))
            notes = self.notes
            super().__init__(path, fmt="d4rl", attrs=attrs, **args)
            self.notes = notes + self.notes
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()


def _metadata(f: Any) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = {}
    meta = f.get("metadata")
    if meta is None:
        return out
    if isinstance(meta, h5py.Dataset):
        return {"metadata": jsonable(meta[()])} if meta.size <= 4096 else {}
    for key, node in _leaves(meta, "").items():
        key = key.lstrip("/")
        if node.size <= 4096:
            out[key] = jsonable(node[()])
    if meta.attrs:
        out.update({f"@{k}": jsonable(v) for k, v in meta.attrs.items()})
    return out


def convert_d4rl(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    keep_infos: bool = False,
    keep_next_obs: bool = False,
    overwrite: bool = False,
    compression: str | None = None,
    chunk_rows: int | None = None,
    progress: bool = True,
    verify: bool = True,
    capacity: int | None = None,
    num_streams: int | None = None,
    priorities: PriorityConfig | None = None,
) -> dict[str, Any]:
    """Convert a D4RL HDF5 file into a new store at ``dst``.

    Streams the file in row chunks (memory stays at a few chunks whatever the
    file size), keeps ``terminals`` as ``terminated`` and ``timeouts`` as
    ``truncated``, and verifies the result (see :func:`mmbuffer.convert.write_store`
    for the options and the returned summary).

    Raises
    ------
    ConversionError
        Not an HDF5 file, a required key missing, arrays of different lengths.
    StoreExistsError
        ``dst`` exists and ``overwrite`` is false.

    Examples
    --------
    >>> import tempfile, h5py, numpy as np
    >>> from mmbuffer.convert import convert_d4rl
    >>> d = tempfile.mkdtemp()
    >>> with h5py.File(d + "/hopper.hdf5", "w") as f:
    ...     obs = np.random.rand(21, 11).astype("float32")
    ...     f["observations"], f["next_observations"] = obs[:-1], obs[1:]
    ...     f["actions"] = np.random.rand(20, 3).astype("float32")
    ...     f["rewards"] = np.ones(20, "float32")
    ...     f["terminals"] = np.arange(20) == 6
    ...     f["timeouts"] = np.arange(20) == 19
    >>> summary = convert_d4rl(d + "/hopper.hdf5", d + "/store", progress=False)
    >>> summary["rows"], summary["episodes"], summary["verified"]
    (20, 2, True)
    """
    from .._pipeline.dest import check_destination

    check_destination(dst, overwrite)
    reader = D4RLReader(src, keep_infos=keep_infos, keep_next_obs=keep_next_obs)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )

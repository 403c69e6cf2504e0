"""D4RL HDF5 files: one flat array per key, one row per transition.

Layout read (``d4rl.qlearning_dataset`` conventions)::

    observations       [N, *obs]        (or a group of leaves -> ``obs/<leaf>`` columns)
    actions            [N, *act]
    rewards            [N] or [N, 1]
    terminals          [N]  episode ended by the MDP        -> ``terminated``
    timeouts           [N]  episode cut by a time limit      -> ``truncated``
    next_observations  [N, *obs]        optional: final observation of each episode
    infos/*            [N, ...]         optional: ``infos/<name>`` columns (unless drop_infos=True)
    metadata/*                          optional: small values, into ``attrs["source_metadata"]``

Store columns: ``obs``, ``action``, ``reward`` (+ ``infos/*``, + any other
top-level ``[N, ...]`` numeric dataset under its own name), and the flags.
``obs`` is next-derived; with ``next_observations`` each episode's final
observation is ``next_observations[last row]``. Without them (D4RL's mujoco
``-v2`` files have none) it is unknown, and the file is refused by name unless
``drop_last_transition=True`` (``--drop-last-transition``) drops each episode's last
transition, whose observation becomes the final one (``attrs["final_obs_source"]``
says which). A file
that stops inside an episode (no flag on its last row, common in D4RL) keeps
every row: with ``next_observations`` the episode is closed as truncated there
(``attrs["tail_truncated_row"]``; :func:`~mmbuffer.convert.export_d4rl` writes
the row back unflagged), without them it stays open (warning). A required key
(``observations, actions, rewards, terminals, timeouts``, and
``next_observations`` when present) that is not numeric is an error.

**Lossless by default.** What the file holds that the store cannot derive, and
what happens to it:

* ``next_observations`` that differ from the following row's observation
  inside an episode (dropped frames, resets, sticky timeouts): the store would
  derive a different ``next_obs``, so the whole column is kept as an explicit
  ``next/obs`` column (obs is then not next-derived; ``attrs["next_obs"]``
  names the count and the first rows). ``derive_next=True`` (``--derive-next``)
  derives anyway and loses those rows' next observations;
  ``keep_next_obs=True`` keeps the column even when nothing differs. Where
  every row agrees, nothing is lost by deriving and nothing is stored twice.
* ``infos/*``: kept as ``infos/<name>`` columns; ``drop_infos=True``
  (``--drop-infos``) leaves them out (listed in the summary's ``dropped_keys``).
* other numeric ``[N, ...]`` datasets: kept under their own name.
* a non-numeric dataset (strings, compound types): a store holds numeric
  columns only, so it is refused (:class:`~mmbuffer.errors.ConversionError`
  naming the key) unless ``drop_unsupported=True`` (``--drop-unsupported``)
  accepts leaving it out.
* ``metadata/*`` and the file's attributes: into ``attrs["source_metadata"]`` /
  ``attrs["source_attrs"]`` as JSON; a value of more than 4096 elements (a
  policy's weights, in D4RL's mujoco files) is not replay data and would bloat
  the manifest rewritten at every commit: it is recorded by shape and dtype
  only, and named in the summary's ``metadata_omitted`` and in
  ``attrs["source_metadata_omitted"]``.
* the flags of the last row when the file stops inside an episode: see above
  (recorded, and written back by the export).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...schema import PriorityConfig
from .._pipeline.flat import ArrayLike, FlatReader, next_mode
from .._pipeline.reader import Reader, jsonable, reader_error
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


def infos_option(reader: Reader | str, keep_infos: bool | None, drop_infos: bool) -> bool:
    """Whether ``infos`` are dropped, from ``drop_infos`` and the deprecated ``keep_infos``.

    ``keep_infos=True`` is the default now (accepted, changes nothing);
    ``keep_infos=False`` asks for the old default, dropping them, like ``drop_infos=True``.
    """
    from ...errors import ConversionError

    if keep_infos and drop_infos:
        where = reader if isinstance(reader, str) else reader.path
        raise ConversionError(f"{where}: keep_infos=True and drop_infos=True contradict each other "
                              "(infos are kept by default; drop_infos=True drops them)")
    return bool(drop_infos or keep_infos is False)


def flat_columns(
    reader: Reader,
    arrays: Mapping[str, ArrayLike],
    *,
    drop_infos: bool,
    drop_unsupported: bool,
) -> dict[str, Any]:
    """Map D4RL keys (``a/b`` paths) to FlatReader arguments; shared with the npz reader.

    ``infos/*`` are kept as columns unless ``drop_infos``; a dataset that is not
    numeric (outside the required keys, which are always refused) is refused
    unless ``drop_unsupported`` (or ``drop_infos`` for an ``infos/*`` one).
    """
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
        if top == "infos" and drop_infos:
            dropped.append(key)
            continue
        if not _numeric(arr):
            if top in _REQUIRED or not drop_unsupported:  # never dropped unless asked
                accept = "" if top in _REQUIRED else (
                    " (a store holds numeric columns only; drop_unsupported=True (--drop-unsupported) "
                    "converts without it" + (", drop_infos=True (--drop-infos) without any infos/*" if top == "infos"
                                            else "") + ")")
                raise reader_error(
                    reader,
                    f"expected a numeric array (bool, int, uint or float) of {arr.shape[0] if arr.shape else 0} "
                    f"rows, got dtype {np.dtype(arr.dtype)}{accept}", key
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
            next_arrays[name] = arr
            keys[f"next_{name}"] = key
            continue
        else:
            name = key
        columns[name] = arr
        keys[name] = key
    if dropped:  # only as asked (drop_infos / drop_unsupported): listed in the summary
        reader.stats["dropped_keys"] = dropped
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
    drop_infos
        Leave ``infos/*`` datasets out (kept as ``infos/<name>`` columns by default).
    drop_unsupported
        Leave out datasets a store cannot hold (not numeric) instead of refusing them.
    derive_next
        Derive next observations from the following row even where
        ``next_observations`` disagrees with it (those rows' next observations
        are lost; by default they are kept, see the module docstring).
    keep_next_obs
        Always store ``next_observations`` as an explicit ``next/obs`` column.
    keep_infos
        Deprecated: infos are kept by default. ``True`` changes nothing,
        ``False`` is ``drop_infos=True``.
    drop_last_transition
        Without ``next_observations`` the final observation of each episode is
        unknown and the file is refused; this drops each episode's last transition
        instead and keeps its observation as the final one (as
        ``d4rl.qlearning_dataset``; the module docstring of ``flat`` says how).
    zero_unknown_finals
        For :func:`~mmbuffer.convert.export_d4rl`'s read-back check only: zeros for
        unknown final observations (compared, never stored).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, drop_infos: bool = False, drop_unsupported: bool = False,
        derive_next: bool = False, keep_next_obs: bool = False, keep_infos: bool | None = None,
        drop_last_transition: bool = False, zero_unknown_finals: bool = False,
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
            mode = next_mode(derive_next, keep_next_obs, str(self.path))
            args = flat_columns(self, arrays, drop_infos=infos_option(self, keep_infos, drop_infos),
                                drop_unsupported=drop_unsupported)
            attrs: dict[str, Any] = {"source_format": "d4rl"}
            omitted: dict[str, Any] = {}
            attrs["source_metadata"] = _metadata(self._file, omitted)
            if omitted:
                attrs["source_metadata_omitted"] = omitted
                self.stats["metadata_omitted"] = sorted(omitted)
            if self._file.attrs:
                attrs["source_attrs"] = jsonable(dict(self._file.attrs))
            notes, stats = self.notes, self.stats
            super().__init__(path, fmt="d4rl", attrs=attrs, next_mode=mode, drop_last_transition=drop_last_transition,
                             zero_unknown_finals=zero_unknown_finals, **args)
            self.notes, self.stats = notes + self.notes, {**stats, **self.stats}
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()


def _metadata(f: Any, omitted: dict[str, Any]) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = {}
    meta = f.get("metadata")
    if meta is None:
        return out
    if isinstance(meta, h5py.Dataset):
        if meta.size > 4096:
            omitted["metadata"] = {"shape": list(meta.shape), "dtype": str(meta.dtype)}
            return {}
        return {"metadata": jsonable(meta[()])}
    for key, node in _leaves(meta, "").items():
        key = key.lstrip("/")
        if node.size <= 4096:
            out[key] = jsonable(node[()])
        else:  # recorded by shape and dtype (see the module docstring)
            omitted[key] = {"shape": list(node.shape), "dtype": str(node.dtype)}
    if meta.attrs:
        out.update({f"@{k}": jsonable(v) for k, v in meta.attrs.items()})
    return out


def convert_d4rl(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    drop_infos: bool = False,
    drop_unsupported: bool = False,
    derive_next: bool = False,
    keep_next_obs: bool = False,
    keep_infos: bool | None = None,
    drop_last_transition: bool = False,
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
    for the options and the returned summary). Lossless by default: ``infos/*``
    are kept as columns, and ``next_observations`` that differ from the following
    row are kept as an explicit ``next/obs`` column (see the module docstring);
    ``drop_infos``, ``drop_unsupported`` and ``derive_next`` accept a loss
    explicitly (the options of :class:`D4RLReader`).

    Raises
    ------
    ConversionError
        Not an HDF5 file, a required key missing, arrays of different lengths, a
        non-numeric dataset (unless ``drop_unsupported``).
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
    reader = D4RLReader(src, drop_infos=drop_infos, drop_unsupported=drop_unsupported, derive_next=derive_next,
                        keep_next_obs=keep_next_obs, keep_infos=keep_infos, drop_last_transition=drop_last_transition)
    return write_store(
        reader, dst, overwrite=overwrite, compression=compression, chunk_rows=chunk_rows,
        progress=progress, verify=verify, capacity=capacity, num_streams=num_streams, priorities=priorities,
    )

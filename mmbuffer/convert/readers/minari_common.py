"""What Minari's two storage formats share: the metadata checks and the episode ends.

:class:`MinariCommon` is the base of ``MinariReader`` (``minari.py``: the HDF5 file and
the constructor) through ``ArrowEpisodes`` (``minari_arrow.py``: the Arrow/Parquet
episodes); it declares the state the constructor sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._pipeline.reader import Reader, Schema, jsonable

__all__ = ["MinariCommon"]


class MinariCommon(Reader):
    """The part of a Minari reader that does not depend on the storage format."""

    metadata: dict[str, Any]
    data_format: str
    _data: Path
    _keep_infos: bool
    _drop_unsupported: bool
    _obs_space: Any
    _act_space: Any
    _jpeg: bool
    _schema: Schema
    _lengths: list[int]
    _cols: Any
    _dirs: list[tuple[int, Path]]
    _dropped_leaves: set[str]

    # -- common ----------------------------------------------------------------------------
    def _attrs(self) -> dict[str, Any]:
        return {"source_format": "minari", "minari": jsonable(self.metadata)}

    def _refuse_or_drop(self, leaves: dict[str, str]) -> None:
        """Info leaves a store cannot hold (leaf -> why): refused, unless ``drop_unsupported``."""
        if not leaves:
            return
        if not self._drop_unsupported:
            col, why = next(iter(sorted(leaves.items())))
            more = f" (and {len(leaves) - 1} more: {sorted(leaves)[1:9]})" if len(leaves) > 1 else ""
            raise self._error(
                f"info leaf {col!r} cannot be stored as a column: {why}{more}; drop_unsupported=True "
                "(--drop-unsupported) converts without such leaves, drop_infos=True (--drop-infos) without any infos",
                col,
            )
        self.stats["dropped_keys"] = sorted(set(self.stats.get("dropped_keys", [])) | set(leaves))

    def _check_totals(self, steps: int, episodes: int) -> None:
        for key, got in (("total_steps", steps), ("total_episodes", episodes)):
            want = self.metadata.get(key)
            if want is not None and int(want) != got:
                raise self._error(f"metadata.json says {key}={want} but the data holds {got}", key)

    def _finish_episode(self, ep: int, term: np.ndarray, trunc: np.ndarray) -> None:
        """Close Minari episode ``ep`` whose last step has neither flag as truncated, and record it.

        A store ends an episode with a flag; the Minari episode is complete (its own
        group), only the flag is missing. Every such episode id is recorded, none
        left out, in ``stats["forced_truncation_episodes"]`` (the store's
        ``attrs["convert"]["stats"]``): the source's flags are recoverable exactly
        (those episodes' last ``truncated`` was ``False``, nothing else changed).
        """
        if len(term) and not (term[-1] or trunc[-1]):
            trunc[-1] = True
            self.stats["forced_truncations"] = self.stats.get("forced_truncations", 0) + 1
            self.stats.setdefault("forced_truncation_episodes", []).append(int(ep))
            if self.stats["forced_truncations"] == 1:
                self._warn(
                    f"episode {ep} ends with neither terminated nor truncated: marked truncated "
                    "(every such episode id is recorded in attrs['convert']['stats']"
                    "['forced_truncation_episodes'])"
                )

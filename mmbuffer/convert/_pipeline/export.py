"""What every exporter shares: its writer's constructor and its frame (write, verify, summary)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ...errors import ConversionError
from .frame import Writer, write_and_verify
from .walk import OpenedStore

__all__ = ["ExportWriter", "write_export"]


class ExportWriter(Writer):
    """A :class:`Writer` of an export (D4RL, Minari, Diffusion Policy) of ``store`` (a
    path or an open ``Buffer``) to ``out``: its :meth:`~Writer.write` fills
    :attr:`summary` (rows, episodes, checksums). Subclasses add their own options."""

    def __init__(self, store: Any, out: str | os.PathLike[str], *, chunk_rows: int | None, progress: bool) -> None:
        super().__init__()
        self.summary: dict[str, Any] = {}
        self.opened = OpenedStore(store)
        self.store = store
        self.out_path = Path(out)
        self.chunk_rows = chunk_rows
        self.progress = progress

    def leave_out(self, where: Any, what: str, option: str, allowed: bool) -> None:
        """Refuse to export without ``what`` (a ``ConversionError`` naming ``option``, the
        keyword whose ``True`` accepts the loss, and its command-line flag) unless
        ``allowed``; an accepted loss is noted in the summary."""
        if not allowed:
            flag = "--" + option.replace("_", "-")
            raise ConversionError(f"{where}: {what}; {option}=True ({flag}) leaves them out")
        self.notes.append(f"{self.out_path}: left out ({option}): {what}")


def write_export(writer: ExportWriter, out: str | os.PathLike[str], *, overwrite: bool, verify: bool, started: float) -> dict[str, Any]:
    """An exporter's frame: :func:`write_and_verify`, then the writer's summary with
    ``verified`` and ``seconds`` (since ``started``, a ``time.perf_counter()`` taken
    before the writer was built)."""
    write_and_verify(writer, out, overwrite=overwrite, verify=verify)
    summary = writer.summary
    summary["verified"] = verify
    summary["seconds"] = round(time.perf_counter() - started, 3)
    return summary

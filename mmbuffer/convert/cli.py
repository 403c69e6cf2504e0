"""Command-line front ends of the converters: ``mmbuffer convert|export|copy`` and ``tools/``.

``add_subcommands(sub)`` registers the three subcommands on the ``mmbuffer``
parser (each sets ``func(args) -> exit code``); ``tool_main(format, argv)`` is the
whole of a ``tools/convert_<format>.py`` script. Errors are left to the caller
(``mmbuffer.cli.main`` prints ``MMBufferError`` messages; ``tool_main`` does the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from ..errors import InvalidArgumentError, MMBufferError
from ._formats import READERS, WRITERS, Format, takes
from ._reader import ConversionWarning

__all__ = ["add_subcommands", "tool_main"]



def _compression(value: str) -> str | None:
    if value.lower() in ("none", "raw", ""):
        return None
    if value.lower() not in ("zstd", "lz4"):
        raise argparse.ArgumentTypeError(f"expected zstd, lz4 or none, got {value!r}")
    return value.lower()


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace an existing output that mmbuffer wrote (a store, D4RL file or "
                   "Minari dataset; never other files), after verification")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows read and written at a time")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the verification pass")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _add_convert_options(p: argparse.ArgumentParser, fmt: str | None) -> None:
    _common(p)
    p.add_argument("--compression", type=_compression, default=None, help="zstd | lz4 | none (default)")
    with_infos, with_next = takes("keep_infos", READERS), takes("keep_next_obs", READERS)
    if fmt is None or fmt in with_infos:
        p.add_argument("--keep-infos", action="store_true",
                       help=f"keep infos/* as columns ({', '.join(with_infos)})")
    if fmt is None or fmt in with_next:
        p.add_argument("--keep-next-obs", action="store_true",
                       help=f"store next_observations as an explicit next/obs column ({', '.join(with_next)})")


def _format_help(table: dict[str, Format]) -> str:
    """``name: help`` of every format in ``table``, for the FORMAT argument."""
    return "; ".join(f"{name}: {f.help}" for name, f in table.items())


def _print(summary: dict[str, Any], as_json: bool) -> None:
    """The summary, one ``key  value`` line each; checksums as one line (``--json``
    lists them); ``compression`` as it is spelled on the command line."""
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    skip = {"checksums", "final_obs_checksums", "columns", "warnings"}
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key == "compression":
            value = value or "none"
        if key not in skip:
            print(f"{key:<{width}}  {value}")
    sums = len(summary.get("checksums") or ()) + len(summary.get("final_obs_checksums") or ())
    if sums:
        print(f"{'checksums':<{width}}  crc32 of {sums} array(s) (--json lists them)")
    for note in summary.get("warnings", []):
        print(f"warning: {note}", file=sys.stderr)


def _run_convert(args: argparse.Namespace) -> int:
    from . import convert

    fmt = args.format
    options: dict[str, Any] = dict(
        overwrite=args.overwrite, compression=args.compression, chunk_rows=args.chunk_rows,
        progress=args.progress, verify=args.verify,
    )
    if getattr(args, "keep_infos", False):
        if fmt not in (with_infos := takes("keep_infos", READERS)):
            raise _invalid(f"--keep-infos: not an option of format {fmt!r} (only {', '.join(with_infos)})")
        options["keep_infos"] = True
    if getattr(args, "keep_next_obs", False):
        if fmt not in (with_next := takes("keep_next_obs", READERS)):
            raise _invalid(f"--keep-next-obs: not an option of format {fmt!r} (only {', '.join(with_next)})")
        options["keep_next_obs"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)  # the summary lists them
        summary = convert(fmt, args.src, args.dst, **options)
    _print(summary, args.json)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from . import export

    options: dict[str, Any] = dict(overwrite=args.overwrite, chunk_rows=args.chunk_rows,
                                   progress=args.progress, verify=args.verify)
    if args.dataset_id is not None:
        if args.format not in (with_id := takes("dataset_id", WRITERS)):
            raise _invalid(f"--dataset-id: only for {', '.join(with_id)} exports")
        options["dataset_id"] = args.dataset_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        summary = export(args.format, args.store, args.out, **options)
    _print(summary, args.json)
    return 0


def _run_copy(args: argparse.Namespace) -> int:
    from . import copy

    _print(copy(args.src, args.dst, compression=args.compression, chunk_rows=args.chunk_rows,
                overwrite=args.overwrite, progress=args.progress, verify=args.verify), args.json)
    return 0


def _invalid(message: str) -> Exception:
    return InvalidArgumentError(message)


def add_subcommands(sub: Any) -> None:
    """Register ``convert``, ``export`` and ``copy`` on an ``add_subparsers()`` object."""
    p = sub.add_parser("convert", help=f"convert a dataset ({', '.join(READERS)}) into a store")
    p.add_argument("format", choices=tuple(READERS), help=_format_help(READERS))
    p.add_argument("src", help="source file or directory")
    p.add_argument("dst", help="store to create")
    _add_convert_options(p, None)
    p.set_defaults(func=_run_convert)

    p = sub.add_parser("export", help="write a store as a D4RL HDF5 file or a Minari dataset")
    p.add_argument("format", choices=tuple(WRITERS), help=_format_help(WRITERS))
    p.add_argument("store")
    p.add_argument("out", help=f"the output: {_format_help(WRITERS)}")
    p.add_argument("--dataset-id", default=None, help=f"{', '.join(takes('dataset_id', WRITERS))}: namespace/name-vN")
    _common(p)
    p.set_defaults(func=_run_export)

    p = sub.add_parser("copy", help="re-encode a store (raw memory-mapped <-> zstd/lz4 archive)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--compression", type=_compression, default=None, help="zstd | lz4 | none (default)")
    _common(p)
    p.set_defaults(func=_run_copy)


def tool_main(fmt: str, argv: list[str] | None = None) -> int:
    """``tools/convert_<fmt>.py SRC DST [options]``: the same code as ``mmbuffer convert``."""
    p = argparse.ArgumentParser(prog=f"convert_{fmt}.py", description=f"Convert a {fmt} dataset into an mmbuffer store.")
    p.add_argument("src", help="source file or directory")
    p.add_argument("dst", help="store to create")
    _add_convert_options(p, fmt)
    p.set_defaults(format=fmt)
    args = p.parse_args(argv)
    try:
        return _run_convert(args)
    except MMBufferError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2

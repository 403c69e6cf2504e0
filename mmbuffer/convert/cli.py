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
from typing import Any

__all__ = ["add_subcommands", "tool_main"]

_FORMATS = ("d4rl", "minari", "npz", "torchrl", "tdmpc2")
_WITH_INFOS = ("d4rl", "minari", "npz")
_WITH_NEXT = ("d4rl", "npz")


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
    if fmt is None or fmt in _WITH_INFOS:
        p.add_argument("--keep-infos", action="store_true", help="keep infos/* as columns (d4rl, minari, npz)")
    if fmt is None or fmt in _WITH_NEXT:
        p.add_argument("--keep-next-obs", action="store_true",
                       help="store next_observations as an explicit next/obs column (d4rl, npz)")


def _print(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    skip = {"checksums", "final_obs_checksums", "columns", "warnings"}
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        if key not in skip:
            print(f"{key:<{width}}  {value}")
    if summary.get("checksums"):
        print("checksums (crc32)")
        for key, value in summary["checksums"].items():
            print(f"  {key:<{width}}{value}")
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
        if fmt not in _WITH_INFOS:
            raise _invalid(f"--keep-infos: not an option of format {fmt!r} (only {', '.join(_WITH_INFOS)})")
        options["keep_infos"] = True
    if getattr(args, "keep_next_obs", False):
        if fmt not in _WITH_NEXT:
            raise _invalid(f"--keep-next-obs: not an option of format {fmt!r} (only {', '.join(_WITH_NEXT)})")
        options["keep_next_obs"] = True
    import warnings

    from ._common import ConversionWarning

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
        if args.format != "minari":
            raise _invalid("--dataset-id: only for minari exports")
        options["dataset_id"] = args.dataset_id
    import warnings

    from ._common import ConversionWarning

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
    from ..errors import InvalidArgumentError

    return InvalidArgumentError(message)


def add_subcommands(sub: Any) -> None:
    """Register ``convert``, ``export`` and ``copy`` on an ``add_subparsers()`` object."""
    p = sub.add_parser("convert", help="convert a dataset (d4rl, minari, npz, torchrl, tdmpc2) into a store")
    p.add_argument("format", choices=_FORMATS)
    p.add_argument("src", help="source file or directory")
    p.add_argument("dst", help="store to create")
    _add_convert_options(p, None)
    p.set_defaults(func=_run_convert)

    p = sub.add_parser("export", help="write a store as a D4RL HDF5 file or a Minari dataset")
    p.add_argument("format", choices=("d4rl", "minari"))
    p.add_argument("store")
    p.add_argument("out", help="the .hdf5 file (d4rl) or the dataset directory (minari)")
    p.add_argument("--dataset-id", default=None, help="minari: namespace/name-vN")
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
    from ..errors import MMBufferError

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

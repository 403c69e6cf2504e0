"""Command-line front ends of the converters: ``mmbuffer convert|export|copy`` and ``tools/``.

``add_subcommands(sub)`` registers the three subcommands on the ``mmbuffer``
parser (each sets ``func(args) -> exit code``); ``tool_main(format, argv)`` is the
whole of a ``tools/convert_<format>.py`` script. Errors are left to the caller
(``mmbuffer._cli.main.main`` prints ``MMBufferError`` messages; ``tool_main`` does the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from ..errors import InvalidArgumentError, MMBufferError
from ..convert.registry import READERS, WRITERS, Format, takes
from ..convert._pipeline.reader import ConversionWarning

__all__ = ["add_subcommands", "tool_main"]



def _compression(value: str) -> str | None:
    if value.lower() in ("none", "raw", ""):
        return None
    if value.lower() not in ("zstd", "lz4"):
        raise argparse.ArgumentTypeError(f"expected zstd, lz4 or none, got {value!r}")
    return value.lower()


def _column_codec(value: str) -> tuple[str, str | None]:
    """``COLUMN=CODEC`` of ``copy --codec``: ``pixels=zstd``, ``pixels=zstd:5``, ``pixels=none`` (raw)."""
    name, eq, codec = value.rpartition("=")
    if not eq or not name or not codec:
        raise argparse.ArgumentTypeError(f"expected COLUMN=CODEC (pixels=zstd, pixels=none), got {value!r}")
    return name, None if codec.lower() in ("none", "raw") else codec


def _count(value: str) -> int:
    """A row or stream count; ``1e6`` and ``1_000_000`` notation accepted."""
    try:
        f = float(value.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1000000, 1e6), got {value!r}") from None
    if not f.is_integer() or f < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1000000, 1e6), got {value!r}")
    return int(f)


def _priorities(value: str) -> Any:
    """``none``, ``keep`` (copy), a bare alpha (``0.6``) or ``alpha=0.6,eps=1e-6,max_priority=1``."""
    from ..schema import PriorityConfig

    low = value.strip().lower()
    if low in ("none", "off", ""):
        return None
    if low == "keep":
        return "keep"
    fields: dict[str, float] = {}
    try:
        for part in low.split(","):
            key, eq, number = part.partition("=")
            if not eq:
                key, number = "alpha", key
            if key.strip() not in ("alpha", "eps", "max_priority"):
                raise ValueError(key)
            fields[key.strip()] = float(number)
        return PriorityConfig(**fields)
    except (ValueError, MMBufferError):
        raise argparse.ArgumentTypeError(
            f"expected none, an alpha (0.6) or alpha=A,eps=E,max_priority=M, got {value!r}") from None


def _layout(p: argparse.ArgumentParser, *, copy: bool) -> None:
    keep = "the source's" if copy else "the source's rows"
    p.add_argument("--capacity", type=_count, default=None, metavar="ROWS",
                   help=f"rows of the new store over all streams (default: {keep}); room to append "
                        "new data without evicting the converted episodes (1e6 notation accepted)")
    p.add_argument("--streams", dest="num_streams", type=_count, default=None, metavar="N",
                   help=f"streams (lanes) of the new store, one per environment of an online collector "
                        f"(default: {'the source' + chr(39) + 's' if copy else '1'}); episodes are dealt "
                        "to the streams in contiguous runs of about rows/N rows")
    p.add_argument("--priorities", type=_priorities, default="keep" if copy else None, metavar="SPEC",
                   help="a priority tree for prioritized replay: an alpha (0.6) or "
                        "alpha=0.6,eps=1e-6,max_priority=1; none for no tree"
                        + ("; keep (default) copies the source's settings and stored priorities" if copy
                           else " (default); rows start at the largest priority"))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace an existing output that mmbuffer wrote (a store, D4RL file or "
                   "Minari dataset; never other files), after verification")
    p.add_argument("--chunk-rows", type=_count, default=None, help="rows read and written at a time "
                   "(default: about 32 MiB of rows)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the verification pass")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


#: The converters' own boolean options (registry ``Format.options``) and their flags. Converters
#: are lossless by default: each option that loses something is an explicit opt-in.
READER_FLAGS: dict[str, tuple[str, str]] = {
    "drop_infos": ("--drop-infos", "leave infos/* out (kept as columns by default)"),
    "drop_unsupported": ("--drop-unsupported", ("leave out source keys a store cannot hold (non-numeric, "
                                                "ragged) instead of refusing them by name")),
    "derive_next": ("--derive-next", ("derive next observations from the following row even where the source's "
                                      "next observations differ (those rows' are lost; by default the source's "
                                      "are kept as an explicit next/obs column)")),
    "keep_next_obs": ("--keep-next-obs", "always store the source's next observations as an explicit next/obs column"),
    "drop_last_transition": ("--drop-last-transition", ("without next_observations: drop each episode's last transition "
                                                        "and keep its observation as the final one (refused by name "
                                                        "otherwise)")),
    "drop_reset_values": ("--drop-reset-values", ("leave out values in TD-MPC2 reset rows (row 0 of each "
                                                  "episode, NaN in TD-MPC2's own files) instead of refusing them")),
    "drop_past_ends": ("--drop-past-ends", "leave out rows past the last episode end instead of refusing them"),
    "skip_visual": ("--skip-visual", "leave video/image features out instead of refusing them"),
    "keep_infos": ("--keep-infos", "deprecated, changes nothing: infos are kept by default"),
}


#: The exporters' own boolean options (registry ``Format.options`` of WRITERS): each loses something,
#: and what it accepts is refused, by name, without it.
WRITER_FLAGS: dict[str, tuple[str, str]] = {
    "drop_open_episodes": ("--drop-open-episodes", ("leave out the rows of open (unfinished) episodes the "
                                                    "format cannot hold instead of refusing them")),
    "drop_final_obs": ("--drop-final-obs", ("leave out final observations the format has no place for "
                                            "instead of refusing them")),
    "drop_unsupported": ("--drop-unsupported", ("leave out columns the format has no place for instead of "
                                                "refusing them by name")),
}


def _add_convert_options(p: argparse.ArgumentParser, fmt: str | None) -> None:
    _common(p)
    p.add_argument("--compression", type=_compression, default=None,
                   help="zstd | lz4 (compressed archive) | none (default: raw, memory-mapped, for training)")
    _layout(p, copy=False)
    if (with_codec := takes("codec", READERS)) and (fmt is None or fmt in with_codec):
        p.add_argument("--codec", default=None, metavar="NAME",
                       help=f"codec of the image columns decoded from video (an mb.Column codec such as zstd; "
                            f"default: raw, lossless) ({', '.join(with_codec)})")
    if (with_done := takes("done_means", READERS)) and (fmt is None or fmt in with_done):
        p.add_argument("--done-means", default=None, choices=("terminated", "truncated"), metavar="WHICH",
                       help=f"terminated or truncated: what next/done is in a source with no next/terminated "
                            f"or next/truncated (refused without it: it does not say which) ({', '.join(with_done)})")
    for option, (flag, text) in READER_FLAGS.items():
        formats = takes(option, READERS)
        if formats and (fmt is None or fmt in formats):
            p.add_argument(flag, dest=option, action="store_true", help=f"{text} ({', '.join(formats)})")


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
            value = value or "none"  # as the user spells it
        if key == "codecs":
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
        if key not in skip:
            print(f"{key:<{width}}  {value}")
    checksums = summary.get("checksums") or {}
    if summary.get("format") == "copy" and checksums:
        print(f"{'checksums':<{width}}  crc32 of {len(checksums)} lane:column pairs (--json lists them)")
    elif checksums:
        print("checksums (crc32)")
        name_width = max(len(k) for k in checksums)  # long column names never run into their value
        for key, value in checksums.items():
            print(f"  {key:<{name_width}}  {value}")
    for note in summary.get("warnings", []):
        print(f"warning: {note}", file=sys.stderr)


def _run_convert(args: argparse.Namespace) -> int:
    from ..convert import convert

    fmt = args.format
    options: dict[str, Any] = dict(
        overwrite=args.overwrite, compression=args.compression, chunk_rows=args.chunk_rows,
        progress=args.progress, verify=args.verify, capacity=args.capacity, num_streams=args.num_streams,
        priorities=args.priorities,
    )
    for option, (flag, _) in READER_FLAGS.items():
        if getattr(args, option, False):
            if fmt not in (formats := takes(option, READERS)):
                raise _invalid(f"{flag}: not an option of format {fmt!r} (only {', '.join(formats)})")
            options[option] = True
    if getattr(args, "codec", None) is not None:
        if fmt not in (formats := takes("codec", READERS)):
            raise _invalid(f"--codec: not an option of format {fmt!r} (only {', '.join(formats)})")
        options["codec"] = args.codec
    if getattr(args, "done_means", None) is not None:
        if fmt not in (formats := takes("done_means", READERS)):
            raise _invalid(f"--done-means: not an option of format {fmt!r} (only {', '.join(formats)})")
        options["done_means"] = args.done_means
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)  # the summary lists them
        summary = convert(fmt, args.src, args.dst, **options)
    _print(summary, args.json)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from ..convert import export

    options: dict[str, Any] = dict(overwrite=args.overwrite, chunk_rows=args.chunk_rows,
                                   progress=args.progress, verify=args.verify)
    if args.dataset_id is not None:
        if args.format not in (with_id := takes("dataset_id", WRITERS)):
            raise _invalid(f"--dataset-id: only for {', '.join(with_id)} exports")
        options["dataset_id"] = args.dataset_id
    if args.zarr_format is not None:
        if args.format not in (with_zf := takes("zarr_format", WRITERS)):
            raise _invalid(f"--zarr-format: only for {', '.join(with_zf)} exports")
        options["zarr_format"] = args.zarr_format
    for option, (flag, _) in WRITER_FLAGS.items():
        if getattr(args, option, False):
            if args.format not in (formats := takes(option, WRITERS)):
                raise _invalid(f"{flag}: not an option of format {args.format!r} (only {', '.join(formats)})")
            options[option] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        summary = export(args.format, args.store, args.out, **options)
    _print(summary, args.json)
    return 0


def _run_copy(args: argparse.Namespace) -> int:
    from ..convert import copy

    codec: dict[str, str | None] | str | None = dict(args.codec) if args.codec else "keep"
    if args.raw:
        if args.compression is not None:
            raise _invalid(f"--raw: every column raw and memory-mapped, got --compression {args.compression} too")
        codec = None
    _print(copy(args.src, args.dst, compression=args.compression, chunk_rows=args.chunk_rows,
                overwrite=args.overwrite, progress=args.progress, verify=args.verify,
                capacity=args.capacity, num_streams=args.num_streams, priorities=args.priorities,
                codec=codec), args.json)
    return 0


def _invalid(message: str) -> Exception:
    return InvalidArgumentError(message)


#: The layouts ``convert --help`` spells out (the sources a user writes by hand).
CONVERT_EPILOG = """\
npz layout (one row per transition, N rows; a .npz archive, or a directory of
.npy files with the same names, nested keys as sub-directories; never unpickled):
  observations       [N, ...]  any numeric dtype
  actions            [N, ...]
  rewards            [N] or [N, 1]
  terminals          [N]       nonzero: the episode ended (terminated)
  timeouts           [N]       nonzero: the episode was cut (truncated)
  next_observations  [N, ...]  optional: gives each episode's final observation
                               (without it: refused, or --drop-last-transition)
  infos/<name>       [N, ...]  optional, kept as columns (--drop-infos leaves them out)
  metadata/<name>              optional, small arrays kept in the store's attrs
Episodes end at rows where terminals or timeouts is set.

Lossless by default: next_observations that differ from the following row
inside an episode are kept as an explicit next/obs column (--derive-next
derives them instead), infos are kept, and a key the store cannot hold is
refused by name (--drop-unsupported leaves it out).

minari SRC may be a dataset directory or a dataset id (namespace/name-vN),
looked up in $MINARI_DATASETS_PATH (default ~/.minari/datasets); nothing is
downloaded.

Offline to online in one step: --capacity, --streams and --priorities give the
new store room to grow, one stream per environment and a priority tree:
  mmbuffer convert d4rl hopper.hdf5 runs/replay --capacity 2e6 --streams 8 --priorities 0.6
"""


def add_subcommands(sub: Any) -> None:
    """Register ``convert``, ``export`` and ``copy`` on an ``add_subparsers()`` object."""
    p = sub.add_parser("convert", help=f"convert a dataset ({', '.join(READERS)}) into a store",
                       description="Convert a dataset into a new store, streamed, verified by read-back.",
                       epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", choices=tuple(READERS), help=_format_help(READERS))
    p.add_argument("src", help="source file or directory (minari: also a dataset id)")
    p.add_argument("dst", help="store to create (must not exist unless --overwrite)")
    _add_convert_options(p, None)
    p.set_defaults(func=_run_convert)

    p = sub.add_parser("export", help=f"write a store out ({', '.join(WRITERS)})")
    p.add_argument("format", choices=tuple(WRITERS), help=_format_help(WRITERS))
    p.add_argument("store", help="the store to export (read-only)")
    p.add_argument("out", help=f"the output: {_format_help(WRITERS)}")
    p.add_argument("--dataset-id", default=None, help=f"{', '.join(takes('dataset_id', WRITERS))}: namespace/name-vN")
    for option, (flag, text) in WRITER_FLAGS.items():
        p.add_argument(flag, dest=option, action="store_true", help=f"{text} ({', '.join(takes(option, WRITERS))})")
    p.add_argument("--zarr-format", type=int, choices=(2, 3), default=None,
                   help=f"{', '.join(takes('zarr_format', WRITERS))}: Zarr format 2 (default, what Diffusion "
                        "Policy opens) or 3")
    _common(p)
    p.set_defaults(func=_run_export)

    p = sub.add_parser("copy", help="copy a store: re-encode (raw <-> zstd/lz4), resize, restream, add priorities")
    p.add_argument("src", help="the store to copy (read-only)")
    p.add_argument("dst", help="the new store (must not exist unless --overwrite)")
    p.add_argument("--compression", type=_compression, default=None,
                   help="zstd | lz4 (compressed archive) | none (default: raw, memory-mapped, for training); "
                        "the columns without a codec")
    recode = p.add_mutually_exclusive_group()
    recode.add_argument("--codec", type=_column_codec, action="append", default=None, metavar="COLUMN=CODEC",
                        help="change a column's codec (zstd, zstd:<level>, lz4; jpeg, jpeg:<quality>: lossy, uint8 "
                             "(H, W[, 1|3]) frames only; none: raw); repeatable. By default each column keeps its codec")
    recode.add_argument("--raw", action="store_true",
                        help="every column raw and memory-mapped (codecs decoded once, for training)")
    _layout(p, copy=True)
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

"""The ``mmbuffer`` command line: info, verify, convert, export, copy, demo, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _disk_usage(path: Path) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of every file under ``path``."""
    used = apparent = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            used += st.st_blocks * 512
            apparent += st.st_size
    return used, apparent


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def info(path: str) -> dict[str, Any]:
    """A summary of the store at ``path`` (opened read-only)."""
    import mmbuffer as mb

    buf = mb.open(path, mode="r")
    used, apparent = _disk_usage(Path(path))
    out: dict[str, Any] = {
        "path": str(path),
        "generation": buf.generation,
        "rows": len(buf),
        "episodes": buf.num_episodes,
        "capacity": buf.capacity,
        "num_streams": buf.num_streams,
        "compression": buf.compression,
        "columns": {k: {"shape": list(c.shape), "dtype": c.dtype} for k, c in buf.columns.items()},
        "next_keys": list(buf.next_keys),
        "disk_used": used,
        "disk_apparent": apparent,
        "priorities": None,
    }
    ptree = buf.view().tree
    if ptree is not None and buf.priorities is not None:
        from . import tree

        out["priorities"] = {
            "alpha": buf.priorities.alpha,
            "eps": buf.priorities.eps,
            "max_priority": buf.priorities.max_priority,
            "total": tree.total(ptree),
            "min": tree.min_live(ptree),
            "max": tree.max_live(ptree),
        }
    return out


def _print_info(summary: dict[str, Any]) -> None:
    print(f"store        {summary['path']}  (generation {summary['generation']})")
    print(f"rows         {summary['rows']:,} live of {summary['capacity']:,} capacity, {summary['num_streams']} stream(s)")
    print(f"episodes     {summary['episodes']:,} complete")
    print(f"on disk      {_human(summary['disk_used'])} used ({_human(summary['disk_apparent'])} apparent, sparse)")
    print(f"compression  {summary['compression'] or 'none (memory-mapped)'}")
    print("columns")
    for name, col in summary["columns"].items():
        derived = "  (+ next_" + name + ")" if name in summary["next_keys"] else ""
        print(f"  {name:<20} {str(tuple(col['shape'])):<14} {col['dtype']}{derived}")
    pri = summary["priorities"]
    if pri:
        print(f"priorities   alpha={pri['alpha']} eps={pri['eps']} max_priority={pri['max_priority']}; "
              f"sum={pri['total']:.6g} min={pri['min']:.6g} max={pri['max']:.6g}")
    else:
        print("priorities   none")


def _cmd_info(args: argparse.Namespace) -> int:
    summary = info(args.path)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_info(summary)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import mmbuffer as mb

    from .verify import verify

    buf = mb.open(args.path, mode="a" if args.repair else "r")
    try:
        report = verify(buf, repair=args.repair)
    finally:
        buf.close()
    for line in report["problems"]:
        print("problem:", line)
    for line in report["notes"]:
        print("note:", line)
    if report["repaired"]:
        print("repaired: index and tree rewritten from the data and committed")
    print("ok" if report["ok"] else ("repaired" if report["repaired"] else "FAILED"))
    return 0 if report["ok"] or report["repaired"] else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.dir, episodes=args.episodes)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"bench_{args.suite}.py"
    if not script.exists():
        print(f"no benchmark {script} (benchmarks/ ships with the source tree)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmbuffer", description="On-disk, memory-mapped RL trajectory stores.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="rows, episodes, columns, size on disk, priorities")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("verify", help="check that data, index and tree agree")
    p.add_argument("path")
    p.add_argument("--repair", action="store_true", help="rebuild derived state from the data")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("demo", help="build, sample and reopen a store of generated trajectories")
    p.add_argument("dir", nargs="?", default=None)
    p.add_argument("--episodes", type=int, default=400)
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    p.add_argument("suite", choices=["store", "sampling", "priority", "convert", "export", "stream"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    from .convert import cli as convert_cli

    convert_cli.add_subcommands(sub)  # convert, export, copy
    return parser


def main(argv: list[str] | None = None) -> int:
    from . import errors

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except errors.MMBufferError as exc:
        print(f"mmbuffer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``mmbuffer`` command line: info, verify, convert, export, copy, demo, bench."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from .convert import add_subcommands as add_convert_subcommands


def _disk_usage(path: Path) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of every file under ``path``."""
    used = apparent = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            used += st.st_blocks * 512
            apparent += st.st_size
    return used, apparent


def _column_disk(path: Path, name: str, codec: str | None, rows: int,
                 objects: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """A column's bytes on disk: ``disk_used`` (allocated: its array and, with a codec,
    its raw staging rows, ``staging_used``) and ``bytes_per_row``: with a codec the
    shard files' bytes per row they hold (the encoded size), else allocated per live row.
    ``objects``: a published snapshot's object table (``path`` its mirror): its sizes."""
    from .._disk import files as _files

    def size(rel: str) -> int:
        if objects is None:
            return _disk_usage(path / rel)[0]
        return sum(n for r, (n, _) in objects.items() if r.startswith(rel + "/"))

    used = size(f"columns/{name}")
    if codec is None:
        return {"disk_used": used, "bytes_per_row": used / rows if rows else None}
    staging = size(f"staging/{name}")
    # the store was opened (its zarr.json checked) before this is read
    shard_rows = int(_files.read_json_in(path, f"columns/{name}/zarr.json")["chunk_grid"]["configuration"]["chunk_shape"][0])
    shards = [os.stat(os.path.join(root, f)).st_size for root, _, fs in os.walk(path / "columns" / name / "c") for f in fs] \
        if objects is None else [n for r, (n, _) in objects.items() if r.startswith(f"columns/{name}/c/")]
    held = len(shards) * shard_rows
    return {"disk_used": used + staging, "staging_used": staging, "shard_rows": held,
            "bytes_per_row": sum(shards) / held if held else None}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _remote(url: str) -> Any:
    """The published store at ``url``, its snapshot opened read-only (exact reads, no pool)."""
    import threading

    from ..remote import RemoteSource

    source = RemoteSource(url, pool=None)
    return source, source.open(threading.RLock())


def info(path: str) -> dict[str, Any]:
    """A summary of the store at ``path`` (opened read-only, without torch), or of the
    snapshot a URL's pointer names now (``snapshot``, ``sequence``, ``engine`` added)."""
    from .._disk.urls import is_url
    from .._ledger.store import Store

    extra: dict[str, Any] = {}
    objects, where = None, Path(path)
    if is_url(path):
        source, buf = _remote(path)
        source.table.need()  # every part: the bytes of every object
        used = apparent = sum(size for size, _ in source.table.entries.values())
        objects, where = source.table.entries, Path(buf.path)
        extra = {"snapshot": source.snapshot, "sequence": source.sequence,
                 "engine": "icechunk" if source.repo is not None else "snapshots"}
        source.close()
    else:
        _check_store_path(path)
        buf = Store(path, mode="r")
        used, apparent = _disk_usage(Path(path))
    out: dict[str, Any] = {
        "path": str(path),
        "generation": buf.generation,
        "rows": len(buf),
        "episodes": buf.num_episodes,
        "capacity": buf.capacity,
        "num_streams": buf.num_streams,
        "compression": buf.compression,
        "columns": {k: {"shape": list(c.shape), "dtype": c.dtype, "codec": c.codec,
                        **_column_disk(where, k, c.codec, len(buf), objects)} for k, c in buf.columns.items()},
        "next_keys": list(buf.next_keys),
        "disk_used": used,
        "disk_apparent": apparent,
        "priorities": None,
    }
    ptree = buf.view().tree
    if ptree is not None and buf.priorities is not None:
        from .. import tree

        out["priorities"] = {
            "alpha": buf.priorities.alpha,
            "eps": buf.priorities.eps,
            "max_priority": buf.priorities.max_priority,
            "total": tree.total(ptree),
            "min": tree.min_live(ptree),
            "max": tree.max_live(ptree),
        }
    return {**out, **extra}


_MAGIC = {b"\x89HDF\r\n\x1a\n": "an HDF5 file (D4RL? mmbuffer convert d4rl PATH STORE)",
          b"PK\x03\x04": "a zip archive (.npz? mmbuffer convert npz PATH STORE)"}


def _check_store_path(path: str | os.PathLike[str]) -> None:
    """Say what ``path`` is when it is not a store directory: missing, or which kind of file."""
    from .. import errors

    p = Path(path)
    if p.is_dir() or os.path.lexists(p / "manifest.json"):
        return  # a directory: the store's own checks say what is wrong with it
    if not os.path.lexists(p):
        raise errors.StoreNotFoundError(f"{p}: expected a store directory, got no such file or directory")
    kind = "a file"
    try:
        with open(p, "rb") as f:
            head = f.read(8)
        kind = next((what for magic, what in _MAGIC.items() if head.startswith(magic)), kind)
        if kind == "a file" and p.suffix == ".pt":
            kind = "a PyTorch file (TD-MPC2? mmbuffer convert tdmpc2 PATH STORE)"
    except OSError:
        pass
    raise errors.StoreNotFoundError(f"{p}: expected a store directory, got {kind}")


def _print_info(summary: dict[str, Any]) -> None:
    print(f"store        {summary['path']}  (generation {summary['generation']})")
    print(f"rows         {summary['rows']:,} live of {summary['capacity']:,} capacity, {summary['num_streams']} stream(s)")
    print(f"episodes     {summary['episodes']:,} complete")
    print(f"on disk      {_human(summary['disk_used'])} used ({_human(summary['disk_apparent'])} apparent, sparse)")
    codecs = ", ".join(f"{n}: {c['codec']}" for n, c in summary["columns"].items() if c["codec"])
    store_wide = summary["compression"] or "none (memory-mapped)"
    print(f"compression  {store_wide + '; columns with a codec: ' + codecs if codecs else store_wide}")
    width = max([20, *(len(n) for n in summary["columns"])])
    print(f"{'columns':<{width + 30}} {'codec':<10} {'on disk':>10} {'per row':>10}")
    for name, col in summary["columns"].items():
        derived = "  (+ next_" + name + ")" if name in summary["next_keys"] else ""
        codec = col["codec"] or ("none" if summary["compression"] is None or name in ("terminated", "truncated")
                                 else summary["compression"])
        per_row = "-" if col["bytes_per_row"] is None else _human(col["bytes_per_row"])
        staged = f"  (staging {_human(col['staging_used'])}, raw)" if col["codec"] else ""
        print(f"  {name:<{width}} {str(tuple(col['shape'])):<14} {col['dtype']:<12} {codec:<10} "
              f"{_human(col['disk_used']):>10} {per_row:>10}{derived}{staged}")
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
    from .._disk.urls import is_url
    from .._ledger.store import Store
    from .._ledger.verify import verify

    if is_url(args.path):
        return _verify_url(args)
    _check_store_path(args.path)
    if args.repair:  # the writer (it takes the lock and commits): the full package
        from ..opening import open as open_buffer

        buf: Any = open_buffer(args.path, mode="a")
    else:  # a reader needs neither torch nor the writer
        buf = Store(args.path, mode="r")
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


def _verify_url(args: argparse.Namespace) -> int:
    """``verify URL``: every object of the current snapshot fetched and checked against
    the snapshot's table, then the store's own checks (index, tree) on it."""
    from .. import errors
    from .._ledger.verify import verify

    if args.repair:
        raise errors.InvalidArgumentError(f"--repair: expected a local store (a published snapshot is immutable), got {args.path!r}")
    source, store = _remote(args.path)
    try:
        objects, nbytes, problems = source.check_objects()
        report: dict[str, Any] = verify(store, repair=False) if not problems else {"ok": False, "problems": [], "notes": []}
    finally:
        store.close()
        source.close()
    for line in problems + report["problems"]:
        print("problem:", line)
    for line in report["notes"]:
        print("note:", line)
    print(f"checked {objects} objects ({_human(nbytes)}) of snapshot {source.snapshot}")
    ok = not problems and report["ok"]
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.dir, episodes=args.episodes, interrupted=lambda: _SIGINT.seen)
    return 0


class _Interrupt:
    """SIGINT as ``KeyboardInterrupt`` (what Python does), remembered in ``seen``: one
    that lands in a callback (an import's module lock, numba's compiler) is swallowed
    there by the interpreter, so a long-running command also asks ``seen``."""

    seen = False

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def unraisable(self, info: Any) -> None:
        """``sys.unraisablehook``: a swallowed interrupt is not reported as a traceback."""
        if not isinstance(info.exc_value, KeyboardInterrupt):
            sys.__unraisablehook__(info)


_SIGINT = _Interrupt()


SUITES = {
    "store": "append, gather and reopen against plain numpy memmaps",
    "sampling": "slice and transition sampling against TorchRL, by store size",
    "flat": "slice index, sample and online extend + sample at 1e9 stored rows against 1e6, interleaved, and what a step costs the next",
    "floor": "the loads alone of a PER step, a slice index and a sample, big store against small, also between real calls",
    "priority": "prioritized sample + update against TorchRL's PrioritizedSampler",
    "convert": "D4RL conversion throughput and memory",
    "export": "export to D4RL HDF5 and Minari, and back",
    "stream": "mb.stream feeding a training loop: share of the step spent waiting",
    "handover": "what mb.stream(processes=N) costs the training thread per batch, against another checkout (--baseline DIR)",
    "readers": "readers against a live writer, and writers killed at random",
    "compare": "this tree against another checkout (--baseline DIR)",
    "cli": "start-up time of mmbuffer --help, info and verify",
    "commit": "commit latency with and without refreshing the Zarr attributes",
    "torchrl": "the TorchRL drop-in against TorchRL's own replay buffer",
    "gather": "sample + gather of slices and transitions against memcpy and numpy fancy indexing",
    "gpu": "a TD-MPC2-sized GPU training loop fed by mb.stream and DataLoader (needs CUDA)",
    "remote": "sampling a store on object storage (S3 on loopback) against local disk",
    "remote_ceiling": "remote sampling (cache cold) against plain GETs of the same objects; cold start by store size",
    "groups": "writer groups: group publish, open and sample(256) against one store (S3 on loopback)",
    "ray": "rows/s ingested from Ray actors, and the learner's sample latency meanwhile",
    "pixels": "frame-stacked sampling of 84x84 frames against the same sample without a stack",
    "pixels_ale": "real ALE frames: disk, RSS, add and 4-stack sampling against SB3 and TorchRL buffers",
    "recovery": "committed rows lost and reopen time after a writer is SIGKILLed mid-extend",
    "small_batch": "sample(32) and sample(256) against SB3's and TorchRL's in-RAM buffers",
    "sb3": "the SB3 drop-in: DQN wall clock on ALE, RSS at 1M and save/load against SB3's own buffer",
    "sb3_frame_stack": "the SB3 drop-in with frame_stack on ALE frames against SB3's own buffer",
    "codec": "zstd columns on ALE frames: disk per transition, decode, sample and extend against raw",
    "finals_disk": "disk of an 84x84 pixel store: frames against final observations (--baseline DIR)",
    "jpeg": "the lossy jpeg codec on camera-like 224x224 frames: bytes, error (PSNR) and decode rate",
}


def _cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    root = Path(__file__).resolve().parents[2] / "benchmarks"  # mmbuffer/_cli/main.py -> the source tree
    script = root / f"bench_{args.suite}.py"
    if not script.exists():
        print(f"mmbuffer: error: no benchmark {script} (benchmarks/ ships with the source tree)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``mmbuffer`` parser. ``convert``, ``export`` and ``copy`` and their formats
    come from the converter registry (``mmbuffer.convert.registry``), which imports no
    reader: ``--help``, ``info`` and ``verify`` start without torch."""
    parser = argparse.ArgumentParser(
        prog="mmbuffer",
        description="On-disk, memory-mapped RL trajectory stores.",
        epilog="Each command has its own --help. Errors exit with status 2, a failed verify with 1, "
        "an interrupt ends it by SIGINT (130 in a shell).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="rows, episodes, columns, size on disk, priorities",
                       description="Summarize a store (opened read-only; a writer may be running).")
    p.add_argument("path", help="the store directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("verify", help="check that data, index and tree agree",
                       description="Recompute the episode index and the priority tree from the data and "
                       "compare; exit status 1 when they disagree.")
    p.add_argument("path", help="the store directory")
    p.add_argument("--repair", action="store_true",
                   help="rebuild derived state from the data and commit (needs the writer lock)")
    p.set_defaults(func=_cmd_verify)
    add_convert_subcommands(sub)  # convert, export, copy
    p = sub.add_parser("demo", help="build, sample and reopen a store of generated trajectories",
                       description="The main job end to end on generated trajectories: write 4 streams, "
                       "sample transitions, slices and priorities, reopen read-only, verify.")
    p.add_argument("dir", nargs="?", default=None, help="directory to create the store in (default: a fresh temporary one)")
    p.add_argument("--episodes", type=_positive, default=400, help="episodes to generate (>= 1; default 400)")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="run a benchmark script from benchmarks/",
                       description="Run benchmarks/bench_SUITE.py (source tree only); options after SUITE "
                       "go to the script (mmbuffer bench SUITE --help). Row counts accept 1e5 notation.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="suites:\n" + "\n".join(f"  {k:<9} {v}" for k, v in SUITES.items()))
    p.add_argument("suite", choices=tuple(SUITES), metavar="SUITE", help="one of: " + ", ".join(SUITES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the suite")
    p.set_defaults(func=_cmd_bench)
    return parser


INTERRUPTED = 130


def run() -> None:
    """The ``mmbuffer`` program: :func:`main`, then exit with its status. An interrupt
    ends the process by SIGINT, as Python ends an uncaught ``KeyboardInterrupt``
    (after ``atexit``): a shell sees 130, and a script looping over ``mmbuffer``
    stops too instead of going on to its next command, which an ordinary exit
    status 130 would let it do. ``main`` has said ``mmbuffer: interrupted``; the
    interpreter prints no traceback."""
    status = main()
    if status == INTERRUPTED:
        sys.excepthook = _quiet_interrupt
        raise KeyboardInterrupt
    sys.exit(status)


def _quiet_interrupt(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (KeyboardInterrupt: 130, a
    closed output pipe, as in ``mmbuffer info PATH | head``: 141, without a traceback).
    The program itself is :func:`run`."""
    from .. import errors

    argv = sys.argv[1:] if argv is None else list(argv)
    ours = threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        _SIGINT.seen, hook = False, sys.unraisablehook
        signal.signal(signal.SIGINT, _SIGINT)
        sys.unraisablehook = _SIGINT.unraisable
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except errors.MMBufferError as exc:
        print(f"mmbuffer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmbuffer: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # the reader of our output went away (| head): say nothing more, and keep
        # the interpreter's final flush of stdout from failing again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = hook

"""Draw the recorded benchmark figures as PNGs for the README (``docs/img/``).

Reads ``benchmarks/figures.json``: figures copied from ``benchmarks/HISTORY.md``
(the dated log; each group names its section; ``tests/test_examples.py`` checks
that every value is in HISTORY.md). Nothing is measured here. Needs matplotlib (the
``bench`` extra)::

    python benchmarks/plot.py [--out docs/img]

Draws ``sampling.png`` (slice sampling time against stored rows, log-log, with
TorchRL), ``priority.png`` (prioritized sample and update against capacity, and
lowering the max priority) and ``stream.png`` (a GPU training loop's share of its
compute-only steps/s, fed by ``mb.stream`` and by ``DataLoader``). A group holding ``null``
draws only the points that were measured.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _axes_loglog(ax, xs, series, xlabel, **legend):
    for (name, ys), marker in zip(series.items(), "osD^v"):
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per call (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**{"fontsize": 8, **legend})


def _caption(fig, text):
    fig.text(0.01, 0.01, textwrap.fill(text, int(fig.get_figwidth() * 17)), fontsize=7, va="bottom")


def draw(data: dict, out: Path) -> list[Path]:
    """Write the PNGs of ``data`` (figures.json) under ``out``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    s = data["sampling"]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    # the legend right of the last TorchRL points, between them and mmbuffer's lines
    _axes_loglog(ax, s["stored_rows"], s["series"], "stored rows (log)",
                 loc="center right", bbox_to_anchor=(1.0, 0.6), fontsize=7)
    ax.set_title("Slice sampling: 256 slices of 4 steps")
    fig.subplots_adjust(bottom=0.24)
    _caption(fig, s["source"])
    written.append(out / "sampling.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    p = data["priority"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.4))
    _axes_loglog(a1, p["capacity"], p["series"], "capacity (log)")
    a1.set_title("Prioritized: sample and update 256 rows")
    _axes_loglog(a2, p["capacity"], p["lower_max"], "capacity (log)")
    a2.set_title("Lowering the row that holds the max priority")
    fig.subplots_adjust(bottom=0.24, wspace=0.3)
    _caption(fig, p["source"])
    written.append(out / "priority.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    st = data["stream"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    width = 0.8 / len(st["series"])
    for k, (name, ys) in enumerate(st["series"].items()):
        xs = [i + (k - (len(st["series"]) - 1) / 2) * width for i in range(len(st["steps"]))]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.1f%%", fontsize=7)
    ax.set_xticks(range(len(st["steps"])), st["steps"])
    ax.set_ylim(0, 135)
    ax.set_ylabel("% of a compute-only loop's throughput")
    ax.set_title("GPU training loop fed by mmbuffer")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.subplots_adjust(bottom=0.24)
    _caption(fig, st["source"])
    written.append(out / "stream.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=HERE / "figures.json", help="the recorded figures (JSON)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="directory for the PNGs")
    args = ap.parse_args()
    for path in draw(json.loads(args.data.read_text()), args.out):
        print(path)


if __name__ == "__main__":
    main()

"""Draw the benchmark plots of docs/benchmarks.md from tools/bench_sweep.py's JSON.

One PNG per area (forward.png, backward.png, decode.png): a panel per (head_dim, mask), TFLOP/s or
TB/s against sequence length (kv length for decode), a line per implementation, jitattn first and
in the same colour everywhere. A panel with a single length is drawn as bars (one bar per
implementation), since a line through one point shows nothing. The title names the GPU, torch
and date of the records, so a plot says where its numbers come from.

Needs matplotlib (`pip install matplotlib`, or `pip install -e ".[docs]"`).
Run: python3 tools/plot_benchmarks.py RESULTS.json [--out docs/img] [--title-note "..."]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sweep import AREAS, load_records  # noqa: E402

COLOURS = {"jitattn": "#d62728", "torch-varlen": "#1f77b4", "sdpa": "#2ca02c", "sdpa-cudnn": "#006d2c",
           "sdpa-flash": "#9467bd"}
OTHER_COLOURS = ("#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def panels(records, area):
    """(head_dim, causal) -> impl -> sorted [(seqlen, value)] of one area's records."""
    out = {}
    for r in records:
        if r["area"] == area:
            out.setdefault((r["head_dim"], r["causal"]), {}).setdefault(r["impl"], []).append((r["seqlen"], r["value"]))
    return {key: {impl: sorted(points) for impl, points in impls.items()} for key, impls in sorted(out.items())}


def ordered_impls(impls):
    """jitattn first, then the known peers in COLOURS' order, then any other (so colours and legends
    agree across plots)."""
    known = list(COLOURS)
    return sorted(impls, key=lambda name: (known.index(name) if name in known else len(known), name))


_EXTRA_COLOURS = {}  # impls outside COLOURS, in the order first seen


def colour(impl):
    if impl in COLOURS:
        return COLOURS[impl]
    return _EXTRA_COLOURS.setdefault(impl, OTHER_COLOURS[len(_EXTRA_COLOURS) % len(OTHER_COLOURS)])


def source_line(records) -> str:
    """'GPU, torch X, DATE' of the records (joined with '/' where they differ)."""
    def joined(key):
        return " / ".join(dict.fromkeys(str(r[key]) for r in records))
    return f"{joined('gpu')}, torch {joined('torch')}, {joined('date')}"


def plot_area(records, area, out_dir: Path, title_note: str = "") -> Path | None:
    """Write <out_dir>/<area>.png; None if the records hold no point of that area."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = panels(records, area)
    if not grid:
        return None
    area_records = [r for r in records if r["area"] == area]
    unit = area_records[0]["unit"]
    head_dims = sorted({key[0] for key in grid})
    masks = sorted({key[1] for key in grid})
    fig, axes = plt.subplots(len(head_dims), len(masks), figsize=(max(8.0, 5.2 * len(masks)), 3.4 * len(head_dims) + 0.6),
                             squeeze=False)
    for row, head_dim in enumerate(head_dims):
        for col, causal in enumerate(masks):
            ax = axes[row][col]
            impls = grid.get((head_dim, causal), {})
            mask = "" if area == "decode" else (", causal" if causal else ", full")
            ax.set_title(f"D{head_dim}{mask}", fontsize=10)
            lengths = sorted({n for points in impls.values() for n, _ in points})
            names = ordered_impls(impls)
            if len(lengths) == 1:  # one length: bars side by side
                for i, impl in enumerate(names):
                    value = impls[impl][0][1]
                    ax.bar(i, value, color=colour(impl), label=impl)
                    ax.text(i, value, f"{value:.0f}" if value >= 10 else f"{value:.2f}", ha="center", va="bottom",
                            fontsize=8)
                ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
                ax.set_xlabel(f"{'kv length' if area == 'decode' else 'sequence length'} {lengths[0]}")
            else:
                for impl in names:
                    xs, ys = zip(*impls[impl])
                    ax.plot(xs, ys, marker="o", color=colour(impl), label=impl,
                            linewidth=2.2 if impl == "jitattn" else 1.4)
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
                ax.set_xlabel("kv length" if area == "decode" else "tokens per sequence (fixed total)")
                ax.legend(fontsize=8)
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    title = f"{area}: {unit} ({source_line(area_records)})"
    fig.suptitle(title + (f"\n{title_note}" if title_note else ""), fontsize=11)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{area}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="JSON written by tools/bench_sweep.py --json")
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNGs")
    parser.add_argument("--title-note", default="", help="a second title line, e.g. where the numbers come from")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("matplotlib is not installed: pip install matplotlib")
    records = load_records(args.results)
    for area in AREAS:
        path = plot_area(records, area, args.out, args.title_note)
        if path:
            print(f"{area}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

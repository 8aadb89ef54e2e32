"""`omniattn plot` and `bench --plot`: a PNG of bench records (matplotlib, imported when
drawing)."""
from __future__ import annotations

import re
from pathlib import Path

from .report import device_name, results_header

# rows of one workload family at this many sequence lengths or more, each with the same batch x
# seqlen, are drawn as time against sequence length (`plot_results`)
MIN_SEQLEN_SERIES = 3


def plot_results(results: list[dict], path: str | Path, device: str | None = None) -> None:
    """PNG at `path`, one column per mode: time (ms) against density for the sparse rows, one
    line per provider (top); time against sequence length for the rows of a workload family
    measured at MIN_SEQLEN_SERIES or more lengths with the same batch x seqlen (the seqlen suite);
    and TFLOP/s of the other rows as bars grouped by workload (bottom). Rows without a time
    (errors) are left out. `device` names the GPU in the title (default: this
    machine's). Needs matplotlib (imported here, not with the module); raises ValueError if no
    row has a time."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    timed = [r for r in results if r["ms"] is not None]
    if not timed:
        raise ValueError("no run has a time to plot")
    modes = list(dict.fromkeys(r["mode"] for r in timed))
    sparse = [r for r in timed if r["density"] is not None]
    series_families = _seqlen_series_families(timed)
    series = [r for r in timed if r["density"] is None and _family(r) in series_families]
    others = [r for r in timed if r["density"] is None and _family(r) not in series_families]
    panel_rows = [(draw, rows) for draw, rows in ((_plot_time_vs_density, sparse),
                                                  (_plot_time_vs_seqlen, series),
                                                  (_plot_tflops_bars, others)) if rows]
    fig = Figure(figsize=(7 * len(modes), 4.5 * len(panel_rows)), layout="constrained")
    axes = fig.subplots(len(panel_rows), len(modes), squeeze=False)
    for (draw, rows), row_axes in zip(panel_rows, axes):
        for ax, mode in zip(row_axes, modes):
            mode_rows = [r for r in rows if r["mode"] == mode]
            if mode_rows:
                draw(ax, mode_rows, mode)
            else:  # every run of this mode failed
                ax.set_visible(False)
    fig.suptitle(f"{results_header(results, tflops=bool(others))} ({device or device_name()})")
    fig.savefig(path, dpi=120)


def _heads_label(r: dict) -> str:
    return f"H{r['heads']}" if r["heads"] == r["heads_k"] else f"H{r['heads']}/{r['heads_k']}"


def _shape_label(r: dict) -> str:
    return f"B{r['batch']} {_heads_label(r)} S{r['seqlen_q']} D{r['head_dim']} {r['dtype']}"


def _plot_time_vs_density(ax, rows: list[dict], mode: str) -> None:
    shapes = list(dict.fromkeys(_shape_label(r) for r in rows))
    lines = {}
    for r in sorted(rows, key=lambda r: r["density"]):
        # a provider's line per shape, should one run mix sparse shapes
        label = r["provider"] if len(shapes) == 1 else f"{r['provider']} {_shape_label(r)}"
        lines.setdefault(label, []).append((r["density"], r["ms"]))
    for label, points in lines.items():
        ax.plot(*zip(*points), marker="o", label=label)
    block = rows[0]["block_size"]
    ax.set_title(f"{mode}: block-sparse, {' | '.join(shapes)}, {block}x{block} blocks")
    ax.set_xlabel("density (listed blocks / all blocks)")
    ax.set_ylabel("time (ms)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()


# what a workload family shares across the sequence lengths of a series, besides its tokens
_FAMILY_FIELDS = ("heads", "heads_k", "head_dim", "causal", "dtype", "density", "block_size",
                  "topk", "bias", "row_lengths", "window", "documents")


def _family(r: dict) -> tuple:
    # records read back from JSON hold windows as lists
    return tuple(tuple(r[f]) if isinstance(r[f], list) else r[f] for f in _FAMILY_FIELDS) \
        + (r["batch"] * r["seqlen_q"],)


def _seqlen_series_families(rows: list[dict]) -> set[tuple]:
    """The families (`_family`: fields but the shape, at one batch x seqlen) that rows measured
    at MIN_SEQLEN_SERIES or more sequence lengths."""
    seqlens = {}
    for r in rows:
        seqlens.setdefault(_family(r), set()).add((r["seqlen_q"], r["seqlen_k"]))
    return {family for family, lengths in seqlens.items() if len(lengths) >= MIN_SEQLEN_SERIES}


def _series_shape(r: dict) -> str:
    return (f"{_heads_label(r)} D{r['head_dim']} {r['dtype']}, {r['batch'] * r['seqlen_q']} "
            f"tokens per call")


def _plot_time_vs_seqlen(ax, rows: list[dict], mode: str) -> None:
    from matplotlib.ticker import FuncFormatter

    series = {}  # family -> its rows by sequence length
    for r in sorted(rows, key=lambda r: r["seqlen_q"]):
        series.setdefault(_family(r), []).append(r)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = [f"C{i}" for i in range(len(providers))]  # as the bars: a colour per provider
    styles = ["-", "--", ":", "-."]
    shapes = list(dict.fromkeys(_series_shape(r) for r in rows))
    for f, mine in enumerate(series.values()):
        # the workload's name without its batch and length: "dense", "causal", "sliding1024"
        label = re.sub(r"-b\d+-s\d+", "", mine[0]["name"])
        if len(shapes) > 1:
            label += f" ({_series_shape(mine[0])})"
        for p, provider in enumerate(providers):
            points = [(r["seqlen_q"], r["ms"]) for r in mine if r["provider"] == provider]
            if points:
                ax.plot(*zip(*points), marker="o", color=colors[p],
                        linestyle=styles[f % len(styles)], label=f"{provider} {label}")
    ax.set_title(f"{mode}: time against sequence length"
                 + (f"\n{shapes[0]} (batch x seqlen)" if len(shapes) == 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)  # time doubles with the length at a fixed token count
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    seqlens = sorted({r["seqlen_q"] for r in rows})
    ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", ncol=2)


def _plot_tflops_bars(ax, rows: list[dict], mode: str) -> None:
    names = list(dict.fromkeys(r["name"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        mine = [r for r in rows if r["provider"] == provider]
        offset = (i - (len(providers) - 1) / 2) * width
        ax.bar([names.index(r["name"]) + offset for r in mine], [r["tflops"] for r in mine],
               width, label=provider)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_title(f"{mode}: TFLOP/s on the tiles omniattn computes")
    ax.set_ylabel("TFLOP/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()

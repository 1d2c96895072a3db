"""Bar charts for the benchmarks (matplotlib is the optional `plots` extra)."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a hint) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: pip install 'hetserve[plots]' for plots)", file=sys.stderr)
        return None
    return plt


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], title: str,
                 errors_up: dict[str, list[float]] | None = None) -> None:
    """One cluster of bars per group, one bar per series; errors_up: optional upper whiskers."""
    width = 0.8 / max(len(series), 1)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + j * width for i in range(len(groups))]
        yerr = None
        if errors_up is not None:
            yerr = [[0] * len(values), [max(u - v, 0) for u, v in zip(errors_up[name], values)]]
        ax.bar(xs, values, width, label=name, yerr=yerr, capsize=3 if yerr else 0)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_title(title)


def bar_panels(path: str, title: str, groups: list[str],
               panels: list[tuple[str, dict[str, list[float]], dict[str, list[float]] | None]]) -> bool:
    """A row of grouped-bar panels, (panel title, series, upper whiskers or None) each, saved to
    `path`; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
    for ax, (label, series, errors_up) in zip(axes, panels):
        grouped_bars(ax, groups, series, label, errors_up)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

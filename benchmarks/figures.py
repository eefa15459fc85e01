"""The benchmark figures (matplotlib, written next to the tables: ``docs/figures/*.png``).

Each function draws one figure with axes, ticks, units, a legend and the goal line where
there is one, saves it as ``FIGURES / <name>.png`` and returns the markdown line that
shows it.
"""

from __future__ import annotations

import math

from benchmarks.common import REPO_ROOT

FIGURES = REPO_ROOT / "docs" / "figures"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, name: str) -> str:
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return f"![{name}](figures/{path.name})"


def ratio_bars(
    name: str,
    groups: list[str],
    series: dict[str, list[float]],
    *,
    goal: float | None,
    ylabel: str,
    title: str,
) -> str:
    """Grouped bars of ratios (one group per entry of ``groups``, one bar per series), the
    parity line at 1 and the ``goal`` line; NaN leaves a bar out."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [0 if math.isnan(v) else v for v in values], width, label=label)
        ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.2f}" for v in values], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if goal is not None:
        ax.axhline(goal, color="tab:red", linestyle="--", label=f"goal {goal:g}")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(fig, name)


def ratio_lines(
    name: str,
    xs: list[float],
    series: dict[str, list[float]],
    *,
    goal: float | None,
    xlabel: str,
    ylabel: str,
    title: str,
) -> str:
    """Lines of ratios against ``xs``, the parity line at 1 and the ``goal`` line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for label, values in series.items():
        ax.plot(xs, values, marker="o", label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if goal is not None:
        ax.axhline(goal, color="tab:red", linestyle="--", label=f"goal {goal:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(fig, name)

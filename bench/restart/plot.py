"""Draws bench/restart/RESULTS.md's tables as bench/restart/restart.png (medians, min-max bars).

Usage: .venv/bin/python bench/restart/plot.py
"""

import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CELL = re.compile(r"([\d.]+) ms \(([\d.]+)-([\d.]+)\)")


def tables(text):
    """Each `## heading` with its rows: workers -> [(median, lo, hi) per column]."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif title and line.startswith("| ") and line[2].isdigit():
            cells = [c.strip() for c in line.strip("|").split("|")]
            vals = [tuple(float(x) for x in m.groups()) for m in map(CELL.match, cells[1:4]) if m]
            out.setdefault(title, {})[int(cells[0])] = vals
    return out


def main():
    data = tables(open(os.path.join(HERE, "RESULTS.md")).read())
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), sharey=True)
    labels = ["rlaunch", "rlaunch before (fe64d3c)", "torchrun"]
    for ax, (title, rows) in zip(axes, data.items()):
        workers = sorted(rows)
        width = 0.27
        for k, label in enumerate(labels):
            med = [rows[w][k][0] for w in workers]
            lo = [rows[w][k][0] - rows[w][k][1] for w in workers]
            hi = [rows[w][k][2] - rows[w][k][0] for w in workers]
            xs = [i + (k - 1) * width for i in range(len(workers))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=label)
        ax.set_xticks(range(len(workers)), [str(w) for w in workers])
        ax.set_xlabel("workers")
        ax.set_title(title.replace("`", ""), fontsize=10)
    axes[0].set_ylabel("crash -> every worker running again (ms)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "restart.png"), dpi=110)


if __name__ == "__main__":
    main()

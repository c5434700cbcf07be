"""Turns one or more results*.jsonl files into table.md (busbw side by side, ratio to gloo)
and busbw.png. With several files (several full runs), each (implementation, ranks, size)
keeps its best time, for every implementation alike: the machine is shared and noisy.

    report.py OUTDIR results-run1.jsonl [results-run2.jsonl ...]
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def human(b):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def main(outdir, paths):
    rows = [json.loads(l) for p in paths for l in open(p) if l.strip()]
    data = defaultdict(dict)  # (impl, ranks) -> bytes -> row (best time over runs)
    for r in rows:
        d = data[(r["impl"], r["ranks"])]
        if r["bytes"] not in d or r["time_us"] < d[r["bytes"]]["time_us"]:
            d[r["bytes"]] = r
    impls = sorted({r["impl"] for r in rows}, key=lambda s: (s != "rlaunch-shm", s != "rlaunch-tcp", s))
    lines = []
    for n in sorted({r["ranks"] for r in rows}):
        sizes = sorted({b for (i, k), d in data.items() if k == n for b in d})
        head = "| size | " + " | ".join(f"{i} time (µs) | {i} busbw (GB/s)" for i in impls) + " | shm / gloo | tcp / gloo |"
        lines += [f"### {n} ranks", "", head, "|" + "---|" * (1 + 2 * len(impls) + 2)]
        for b in sizes:
            cells = []
            for i in impls:
                r = data[(i, n)].get(b)
                cells += [f"{r['time_us']:.1f}", f"{r['busbw']:.3f}"] if r else ["", ""]
            g = data[("gloo", n)].get(b)
            ratios = []
            for i in ("rlaunch-shm", "rlaunch-tcp"):
                r = data[(i, n)].get(b)
                ratios.append(f"{g['time_us'] / r['time_us']:.1f}×" if (r and g) else "")
            lines.append(f"| {human(b)} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        lines.append("")
    open(f"{outdir}/table.md", "w").write("\n".join(lines))
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = {"rlaunch-shm": "-o", "rlaunch-tcp": "-s", "gloo": "--^"}
    for (i, n), d in sorted(data.items()):
        xs = sorted(d)
        ax.plot(xs, [d[x]["busbw"] for x in xs], styles.get(i, "-"), label=f"{i}, {n} ranks", markersize=4,
                color={2: None, 4: None}[n], alpha=1.0 if n == 2 else 0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s) = algbw · 2(n−1)/n")
    ax.set_title("all_reduce f32 sum on one host (2 cores, 24 GiB): rlaunch vs torch gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{outdir}/busbw.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

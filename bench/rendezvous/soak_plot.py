"""Draws the soak's CSVs (rdzv_soak --csv): the service's memory, the jobs it holds and etcd's
keys over time, one panel per store.

    .venv/bin/python bench/rendezvous/soak_plot.py bench/rendezvous/soak-memory.csv \
        bench/rendezvous/soak-etcd.csv -o bench/rendezvous/SOAK.png
"""

import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    runs = [load(p) for p in args.csvs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.6 * len(runs)), squeeze=False)
    for ax, rows in zip(axes[:, 0], runs):
        store = rows[0]["store"]
        t = [float(r["t_s"]) / 60 for r in rows]
        rss = [float(r["service_rss_mib"]) for r in rows]
        ax.plot(t, rss, color="tab:blue", label="service RSS (MiB)")
        ax.set_ylabel("service RSS (MiB)", color="tab:blue")
        ax.set_ylim(bottom=0)
        drain = next((x for x, r in zip(t, rows) if r["phase"] == "drain"), None)
        if drain is not None:
            ax.axvline(drain, color="grey", linestyle=":", label="load ends")
        right = ax.twinx()
        jobs = [int(r["service_jobs"]) if r["service_jobs"] else 0 for r in rows]
        right.plot(t, jobs, color="tab:orange", label="jobs held")
        if any(r["etcd_keys"] for r in rows):
            keys = [int(r["etcd_keys"]) if r["etcd_keys"] else 0 for r in rows]
            right.plot(t, keys, color="tab:green", label="etcd keys")
        right.set_ylabel("jobs held / etcd keys")
        right.set_ylim(bottom=0)
        last = rows[-1]
        ax.set_title(
            f"{store} store: {last['jobs_run']} jobs ({last['jobs_right']} right, {last['jobs_wrong']} wrong)"
        )
        ax.set_xlabel("minutes")
        lines = ax.get_legend_handles_labels()
        lines2 = right.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Plots the scale curves of `aviary-bench scale` (its TSV) into a PNG.

    plot-scale.py POINTS.tsv OUT.png "machine description"

Run by scripts/bench.sh from a throwaway venv with a pinned matplotlib.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

points, out, machine = sys.argv[1], sys.argv[2], sys.argv[3]
rows = list(csv.DictReader(open(points), delimiter="\t"))
if not rows:
    sys.exit("plot-scale: no points to plot")
alive = [int(r["alive"]) for r in rows]
fig, (lat, mem) = plt.subplots(1, 2, figsize=(11, 4.2))
lat.plot(alive, [float(r["create_exec_ms"]) for r in rows], "o-", label="cold create → first exec (p50)")
lat.plot(alive, [float(r["exec_ms"]) for r in rows], "s-", label="exec round trip of `true` (p50)")
lat.set_xscale("log")
lat.set_xlabel("idle sandboxes alive")
lat.set_ylabel("ms")
lat.set_ylim(bottom=0)
lat.legend()
lat.grid(True, alpha=0.3)
mem.plot(alive, [float(r["mem_mib"]) for r in rows], "o-", label="host memory per idle sandbox (MemAvailable drop)")
mem.plot(alive, [float(r["rss_mib"]) for r in rows], "s-", label="RSS of its processes (envd)")
mem.set_xscale("log")
mem.set_xlabel("idle sandboxes alive")
mem.set_ylabel("MiB per sandbox")
mem.set_ylim(bottom=0)
mem.legend()
mem.grid(True, alpha=0.3)
fig.suptitle("Aviary scale curves — " + machine, fontsize=9)
fig.tight_layout()
fig.savefig(out, dpi=100)

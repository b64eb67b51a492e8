#!/usr/bin/env python3
"""Per-kernel table from an Nsight Compute CSV (`ncu --csv --metrics gpu__time_duration.sum[,
dram__bytes_read.sum]`), e.g. the ncu-8b-warm.csv of scripts/gpu-check.sh's tarball.

Usage: scripts/ncu-table.py FILE.csv

Kernels are grouped by name, grid size and (when read) DRAM megabytes; for each group: launches, mean and minimum time (us),
mean DRAM bytes read (MB) and the bandwidth that gives (TB/s). Lines that are not CSV (ncu's
==PROF== messages, the benchmark's own output) are skipped.
"""
import collections
import csv
import sys


def main(path):
    rows = list(csv.reader(l for l in open(path) if l.startswith('"')))
    if not rows:
        sys.exit(f"{path}: no CSV rows")
    h = rows[0]
    kn, mn, mv, gs, ids = (h.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value",
                                                 "Grid Size", "ID"))
    launches = collections.defaultdict(dict)
    for r in rows[1:]:
        try:
            launches[int(r[ids])].update({"k": (r[kn][:44], r[gs]),
                                          r[mn]: float(r[mv].replace(",", ""))})
        except (ValueError, IndexError):
            continue
    # Same kernel and grid but different weights (a GEMV's qkv, o and down launches) read
    # different byte counts: those are told apart by the MB read, rounded.
    groups = collections.defaultdict(list)
    for l in launches.values():
        mb = round(l.get("dram__bytes_read.sum", 0.0) / 1e6)
        groups[l["k"] + ((mb,) if mb >= 1 else ())].append(l)
    total = 0.0
    print(f"{'kernel':44} {'grid':>14} {'n':>4} {'mean us':>9} {'min us':>8} {'MB':>8} {'TB/s':>6}")
    for (name, grid, *_), ls in sorted(groups.items(),
                                   key=lambda g: -sum(x.get("gpu__time_duration.sum", 0)
                                                      for x in g[1])):
        t = [x.get("gpu__time_duration.sum", 0.0) / 1e3 for x in ls]  # ns -> us
        b = [x.get("dram__bytes_read.sum", 0.0) / 1e6 for x in ls]  # MB
        mean_t, mean_b = sum(t) / len(t), sum(b) / len(b)
        total += sum(t)
        bw = f"{mean_b / mean_t:.2f}" if mean_t > 0 and mean_b > 0 else ""
        print(f"{name:44} {grid:>14} {len(ls):4} {mean_t:9.2f} {min(t):8.2f} {mean_b:8.1f} {bw:>6}")
    print(f"total {total:.1f} us over {len(launches)} launches")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

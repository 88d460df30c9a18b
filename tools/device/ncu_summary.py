#!/usr/bin/env python3
"""Per-kernel totals of an ncu CSV (ncu --csv --metrics gpu__time_duration.sum --log-file F ...), largest first.

usage: tools/device/ncu_summary.py FILE.csv [--width 80]
Prints launches, total and mean microseconds and the grid sizes seen per kernel name, and the step's total.
"""
import argparse
import collections
import csv


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--width", type=int, default=80, help="characters of each kernel name shown")
    args = parser.parse_args()
    with open(args.csv) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    header, rows = rows[0], rows[1:]
    name_i, value_i, unit_i = header.index("Kernel Name"), header.index("Metric Value"), header.index("Metric Unit")
    grid_i = header.index("Grid Size") if "Grid Size" in header else None
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    totals = collections.defaultdict(lambda: [0, 0.0, set()])
    for r in rows:
        us = float(r[value_i].replace(",", "")) * scale[r[unit_i]]
        t = totals[r[name_i][: args.width]]
        t[0] += 1
        t[1] += us
        if grid_i is not None:
            t[2].add(r[grid_i])
    step = sum(t[1] for t in totals.values())
    print(f"{len(rows)} launches, {step:.1f} us")
    for name, (n, us, grids) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:5d} {us:9.1f} {us / n:8.2f}  {name}  {' '.join(sorted(grids)[:3])}")


if __name__ == "__main__":
    main()

"""Sums an `ncu --metrics gpu__time_duration.sum --csv` log by kernel: total, calls, per step.

usage: ncu_summary.py LOG.csv STEPS LABEL
"""
import csv, sys
from collections import defaultdict

path, steps, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = open(path, errors="replace").read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
tot, calls = defaultdict(float), defaultdict(int)
for row in csv.DictReader(lines[start:]):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"].split("(")[0][:70]
    v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "nsecond")
    ns = v * {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1)
    tot[name] += ns
    calls[name] += 1
all_ns = sum(tot.values())
print(f"{label}: {all_ns / steps / 1e3:.1f} us of kernel time per step ({steps} steps)")
print("| kernel | calls/step | us/step | share |")
print("|---|---|---|---|")
for name, ns in sorted(tot.items(), key=lambda kv: -kv[1])[:16]:
    print(f"| {name} | {calls[name] / steps:.1f} | {ns / steps / 1e3:.1f} | {100 * ns / all_ns:.0f}% |")

"""Sums an `ncu --csv` log of `gpu__time_duration.sum` (and, when present,
`dram__bytes_read.sum`) by kernel and launch shape (grid x block): calls, us per call, us per
step, share, and the DRAM read rate (GB/s) where the log has it.

usage: ncu_summary.py LOG.csv STEPS LABEL
"""
import csv, sys
from collections import defaultdict

path, steps, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = open(path, errors="replace").read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
tot, calls, dram = defaultdict(float), defaultdict(int), defaultdict(float)
scale = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
byte_scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
for row in csv.DictReader(lines[start:]):
    name = row["Kernel Name"].split("(")[0][:40]
    key = f'{name} {row.get("Grid Size", "")}x{row.get("Block Size", "")}'
    metric, unit = row.get("Metric Name"), row.get("Metric Unit", "")
    if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
        continue
    v = float(row["Metric Value"].replace(",", ""))
    if metric == "gpu__time_duration.sum":
        tot[key] += v * scale.get(unit, 1)
        calls[key] += 1
    else:
        dram[key] += v * byte_scale.get(unit, 1)
all_ns = sum(tot.values())
print(f"{label}: {all_ns / steps / 1e3:.1f} us of kernel time per step ({steps} steps)")
print("| kernel, grid x block | calls/step | us/call | us/step | share | DRAM GB/s |")
print("|---|---|---|---|---|---|")
for key, ns in sorted(tot.items(), key=lambda kv: -kv[1])[:40]:
    rate = f"{dram[key] / ns:.0f}" if key in dram else ""
    print(
        f"| {key} | {calls[key] / steps:.1f} | {ns / calls[key] / 1e3:.1f} | {ns / steps / 1e3:.1f} "
        f"| {100 * ns / all_ns:.0f}% | {rate} |"
    )

#!/usr/bin/env python3
"""Timeline of traced decode steps (`harrier-cuda-tool bench --trace FILE` with kernels built
with `HARRIER_KERNEL_DEFINES=-DHARRIER_TRACE`).

Each CSV row is one block: batch, mode, grid id, blocks, threads, SM, global time (ns) before
and after its PDL wait and at its exit, cycles. Per launch (grid id, in launch order) this
prints, relative to the end of the launch before it (its last block's exit):
  start   its first block's start (negative: it was resident before the previous one ended):
          the time the block reached PDL_ENTER, so after whatever it issues before its wait
          (a skinny GEMM's first weight loads, which can take microseconds to go out while
          every SM streams: session 43),
  wait    its first block's return from the PDL wait (the dependency's latency),
  mid     its median block's exit,
  end     its last block's exit: the launch's share of the critical path,
  work    last exit minus first wait return (its own run after the dependency).
Launches are summarised by (previous shape, shape) over every step traced, medians in us, so
the 1B's o and down (both 128 x 512) separate by what runs before them.

usage: trace_summary.py TRACE.csv [--launches]   (--launches: also every launch of one step)
"""
import collections
import statistics
import sys


def main():
    path = sys.argv[1]
    per_launch = "--launches" in sys.argv
    runs = collections.OrderedDict()
    for line in open(path):
        f = line.strip().split(",")
        if len(f) != 10 or int(f[2]) >> 62:  # (grid | k << 62: grp_phases.py's records)
            continue
        key = (f[0], f[1])
        g = runs.setdefault(key, {}).setdefault(int(f[2]), [])
        g.append(tuple(int(x) for x in f[3:]))
    for (batch, mode), grids in runs.items():
        launches = []
        stamps = set()
        # A graph replayed again reuses its launches' grid ids: split a grid's blocks where
        # their wait returns lie more than 100 us apart (one launch's blocks return together).
        split = []
        for gid, recs in grids.items():
            recs = sorted(recs, key=lambda r: r[4])
            cut = [0] + [i for i in range(1, len(recs)) if recs[i][4] - recs[i - 1][4] > 100_000] + [len(recs)]
            split += [(gid, recs[a:b]) for a, b in zip(cut, cut[1:])]
        for gid, recs in sorted(split, key=lambda gr: gr[1][0][4]):
            blocks, threads = recs[0][0], recs[0][1]
            before = [r[3] for r in recs]
            after = [r[4] for r in recs]
            exits = [r[5] for r in recs]
            stamps.update(before + after + exits)
            launches.append(
                dict(
                    gid=gid,
                    shape=f"{blocks}x{threads}",
                    recorded=len(recs),
                    start=min(before),
                    wait=min(after),
                    end=max(exits),
                    mid=sorted(exits)[len(exits) // 2],
                    sms=len({r[2] for r in recs}),
                )
            )
        s = sorted(stamps)
        res = min((b - a for a, b in zip(s, s[1:]) if b > a), default=0)
        span = launches[-1]["end"] - launches[0]["start"] if launches else 0
        print(
            f"## batch {batch} {mode}: {len(launches)} launches, {span / 1e3:.1f} us from the first start to the last exit, "
            f"timer step {res} ns"
        )
        groups = collections.OrderedDict()
        prev = None
        for i, l in enumerate(launches):
            if prev is not None:
                pe = prev["end"]
                row = (l["start"] - pe, l["wait"] - pe, l["mid"] - pe, l["end"] - pe, l["end"] - l["wait"])
                groups.setdefault((prev["shape"], l["shape"]), []).append(row)
                if per_launch and i < 140:
                    print(
                        f"{i:4d} {l['shape']:>10} blocks seen {l['recorded']:5d} on {l['sms']:3d} SMs  "
                        + "  ".join(f"{n} {v / 1e3:7.2f}" for n, v in zip(("start", "wait", "mid", "end", "work"), row))
                    )
            prev = l
        print("| after -> launch | count | start | wait | median exit | end (critical path) | work | total end |")
        print("|---|---|---|---|---|---|---|---|")
        for (a, b), rows in sorted(groups.items(), key=lambda kv: -sum(r[3] for r in kv[1])):
            med = [statistics.median(r[j] for r in rows) / 1e3 for j in range(5)]
            tot = sum(r[3] for r in rows) / 1e3
            print(f"| {a} -> {b} | {len(rows)} | " + " | ".join(f"{v:.2f}" for v in med) + f" | {tot:.1f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Phases of `paged_attention_grpc*` blocks from a trace of kernels built with
`-DHARRIER_TRACE -DGRP_PHASE` (`harrier-cuda-tool bench --trace FILE`; measurement only).

Each traced grpc block writes three records after its own (grid id | k << 62, k = 1..3):
its PDL wait's return and the times at which thread 0 had q and the position (1), its first
key's slot (2), its tile's scores (3), the softmax (4), P V (5), the block's first barrier (6),
the second (7) and the end of the cluster merge (8: rank 0 after the peers' pushes and its
output; other ranks after their pushes). Stamps 2-5 are thread 0's last warp tile's (a warp
with two tiles of the split shows its second). Prints, per batch, the medians over blocks (us
after the block's own wait returns) by cluster rank, with the split's 32-key tiles, and the
spread of the wait returns in a launch.

usage: grp_phases.py TRACE.csv
"""
import collections
import statistics
import sys

NAMES = ["q,pos", "slot", "scores", "softmax", "PV", "sync1", "sync2", "merge"]


def main():
    rows = collections.defaultdict(list)
    for line in open(sys.argv[1]):
        f = line.strip().split(",")
        if len(f) != 10:
            continue
        rows[f[0]].append([int(x) for x in f[2:]])
    for batch, recs in rows.items():
        blocks = []
        for i, r in enumerate(recs):
            if r[0] >> 62 == 1 and i + 2 < len(recs) and recs[i + 1][0] >> 62 == 2 and recs[i + 2][0] >> 62 == 3:
                a, b, c = r, recs[i + 1], recs[i + 2]
                t = [a[4], a[5], a[6], b[4], b[5], b[6], c[4], c[5], c[6]]
                info = a[7]
                blocks.append((info & 0xFF, (info >> 20) - ((info >> 8) & 0xFFF), t))
        if not blocks:
            continue
        # Launches: blocks whose wait returns lie within 50 us of each other.
        blocks.sort(key=lambda b: b[2][0])
        launches, cur = [], [blocks[0]]
        for b in blocks[1:]:
            if b[2][0] - cur[0][2][0] > 50_000:
                launches.append(cur)
                cur = []
            cur.append(b)
        launches.append(cur)
        print(f"batch {batch}: {len(launches)} grpc launches, {len(blocks)} blocks")
        by_rank = collections.defaultdict(lambda: [[] for _ in NAMES])
        tiles_of = collections.defaultdict(list)
        spread = []
        for l in launches:
            w0 = min(b[2][0] for b in l)
            spread.append((max(b[2][0] for b in l) - w0) / 1000)
            for rank, tiles, t in l:
                tiles_of[rank].append(tiles)
                for k in range(len(NAMES)):
                    by_rank[rank][k].append((t[k + 1] - t[0]) / 1000)
        print(f"  wait-return spread in a launch: median {statistics.median(spread):.2f} us")
        print("  rank | tiles | " + " | ".join(NAMES))
        for rank in sorted(by_rank):
            times = " | ".join(f"{statistics.median(v):.2f}" for v in by_rank[rank])
            print(f"  {rank} | {statistics.median(tiles_of[rank]):g} | {times}")


if __name__ == "__main__":
    main()

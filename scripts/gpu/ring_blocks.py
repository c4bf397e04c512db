#!/usr/bin/env python3
"""Per-block view of a decode-ring trace dump (issue 16, session 31).

`HARRIER_RING_TRACE=1 HARRIER_RING_TRACE_DUMP=PREFIX harrier-cuda-tool bench --batches 1 ...`
writes PREFIX.MODE.csv: one line per (stage, block), the stage index, the block, then the
kernel's RING_TRACE_WORDS stamps in ns (word 0: the block starts waiting for the stage's input,
1: has it staged (an attention stage: its q|k|v words read), 2: has finished the stage; the
rest only with the kernel's measurement defines). Stages are four a layer (q|k|v, attention,
o, MLP), then the head and the logits' conversion (none where the head stores the logits
itself: 2,048-wide models since session 50).

    python3 scripts/gpu/ring_blocks.py PREFIX.graph-async.csv LAYERS [KV_HEADS]

prints, per stage kind (medians over layers 1..LAYERS-1): when blocks have their input staged
after the previous stage's last block finished, their work, how late the last blocks end
against the median one and whether the same blocks are late layer after layer; then each
attention block's start and q|k|v words read relative to the last q|k|v block's finish, by
(KV head, split). The global timer of an H200 ticks in 256 ns: read the figures as such.

A dump from a `-DRING_ATTN_TRACE` kernel (attention stamps 3-7: q|k|v read and RoPE done, the
first K tile staged, its scores, its P V, the partial stored) also gets the attention stage's
phases (session 45): their median times after the last q|k|v block, each phase's percentiles
over blocks and layers, and the blocks whose "barrier + scores" took over 2 us set beside the
rest (the previous MLP's end, their q|k|v work and end, their attention's start). That phase
starts at thread 0's "tile staged" stamp, which runs before the first tile's barrier releases
it (session 47), so it holds the barrier's wait for the last warp as well as the scores.

With --warps, the dump is a `-DRING_ATTN_TRACE -DRING_ATTN_WTRACE=2` kernel's (session 46):
words 6 and 7 are then the other warps' last scores end and warp 0's scores start (not P V and
stored), and the phases stop at the scores, followed by who was late: warp 0 (thread 0 stamps
the tile staged, then starts its scores) or the others. With --arrivals (a
`-DRING_ATTN_WTRACE=3` kernel's dump) word 6 is instead the last warp's arrival at the first
tile's barrier (its own K copies landed): if it comes as late as warp 0's start, the barrier
waited for that warp and the "tile staged" stamp ran before the barrier's release (session 47:
it does).

With --barriers (a `-DRING_BAR_CHECK` kernel's dump, session 47) it prints instead, per stage
kind, the stage-blocks in which the consumers' barrier released thread 0 before some consumer warp
had arrived (words 3-6: violations, the first one's `ring_cbar` site, warp and count difference
in threads).
"""
import sys

import numpy as np

KINDS = ["q|k|v", "attention", "o", "mlp"]


def main():
    flags = {"--warps", "--arrivals", "--barriers"}
    warps = 3 if "--arrivals" in sys.argv else 2 if "--warps" in sys.argv else 0
    args = [a for a in sys.argv[1:] if a not in flags]
    path, layers = args[0], int(args[1])
    nkv = int(args[2]) if len(args) > 2 else 8
    d = np.loadtxt(path, delimiter=",", dtype=np.int64)
    stages, blocks = d[:, 0].max() + 1, d[:, 1].max() + 1
    if "--barriers" in sys.argv:
        barrier_check(d[:, 2:].reshape(stages, blocks, -1), layers)
        return
    w = d[:, 2:].reshape(stages, blocks, -1).astype(np.float64)
    w = (w - w[0, :, 0].min()) / 1e3
    t1, t2 = w[:, :, 1], w[:, :, 2]
    ls = range(1, layers)
    print(f"{stages} stages, {blocks} blocks, layers 1..{layers - 1} (us)")
    for j, name in enumerate(KINDS):
        staged = [np.median(t1[4 * l + j] - t2[4 * l + j - 1].max()) for l in ls]
        work = [np.median(t2[4 * l + j] - t1[4 * l + j]) for l in ls]
        late = np.array([t2[4 * l + j] - np.median(t2[4 * l + j]) for l in ls])
        corr = [np.corrcoef(late[i], late[i + 1])[0, 1] for i in range(len(late) - 1)]
        tail = np.sort(late, axis=1).mean(0)
        print(
            f"{name:9s} staged {np.mean(staged):5.2f} after the last block before, work {np.mean(work):5.2f}; "
            f"end - median: last {tail[-1]:.2f}, 5th {tail[-5]:.2f}, 17th {tail[-17]:.2f}, first {tail[0]:.2f}; "
            f"lateness correlation layer to layer {np.mean(corr):.2f}"
        )
    split = blocks // nkv
    start = np.median([w[4 * l + 1, :, 0] - t2[4 * l].max() for l in ls], 0)
    read = np.median([t1[4 * l + 1] - t2[4 * l].max() for l in ls], 0)
    print("attention blocks: start / q|k|v words read, after the last q|k|v block finished")
    for h in range(nkv):
        print(f"  KV head {h}: " + " ".join(f"{start[h * split + s]:.2f}/{read[h * split + s]:.2f}" for s in range(split)))
    if w.shape[2] >= 8 and (w[5, : nkv * split, 3:8] > 0).all():
        attention_phases(w, layers, nkv * split, warps)


def barrier_check(w, layers):
    """Early releases of the consumers' barrier from a RING_BAR_CHECK dump (words 3-6)."""
    kinds = {}
    for s in range(w.shape[0]):
        kind = KINDS[(s % 4)] if s < 4 * layers else "head"
        for b in np.nonzero(w[s, :, 3] > 0)[0]:
            kinds.setdefault(kind, []).append((s, int(b), *map(int, w[s, b, 3:7])))
    print(f"{w.shape[0]} stages x {w.shape[1]} blocks: stage-blocks with an early release "
          f"{sum(len(v) for v in kinds.values())}")
    for kind, v in kinds.items():
        print(f"  {kind}: {len(v)}; first (stage, block, violations, site, warp, count difference) {v[0]}")


# Thread 0 stamps "K tile staged" right after the first tile's barrier, but the stamp runs
# before the barrier releases it (session 47), so the phase after it holds the barrier's wait
# for the last warp as well as the scores.
PHASES = ["q|k|v read, RoPE", "K tile staged (t0)", "barrier + scores", "P V", "stored"]


def attention_phases(w, layers, used, warps=0):
    """The attention stage's phases from a RING_ATTN_TRACE dump (`w` rebased, us)."""
    ls = range(1, layers)
    qkv_end = np.array([w[4 * l, :, 2].max() for l in ls])[:, None]
    a = np.array([w[4 * l + 1, :used] for l in ls])  # layers x blocks x words
    phases = PHASES[:3] if warps else PHASES
    stamps = a[:, :, 3:3 + len(phases)] - qkv_end[:, :, None]
    print("attention phases (medians, us after the last q|k|v block): " + ", ".join(
        f"{n} {v:.2f}" for n, v in zip(phases, np.median(stamps, axis=(0, 1)))))
    for i in range(1, len(phases)):
        x = stamps[:, :, i] - stamps[:, :, i - 1]
        p = np.percentile(x, [50, 90, 99, 100])
        print(f"  {PHASES[i]:18s} percentiles 50/90/99/max {p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f} / {p[3]:.2f}, over 2 us {(x > 2).mean():.1%}")
    slow = (stamps[:, :, 2] - stamps[:, :, 1]) > 2
    if warps:
        staged = a[:, :, 4]
        word6 = "the last warp's arrival" if warps == 3 else "the other warps' last end"
        for name, v in [("warp 0's scores start", a[:, :, 7] - staged), (word6, a[:, :, 6] - staged)]:
            p = np.percentile(v, [50, 90, 99, 100])
            late = f"{np.median(v[slow]):.2f} / {np.median(v[~slow]):.2f}" if slow.any() else "-"
            print(f"  {name:26s} after the tile staged: 50/90/99/max {p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f} / {p[3]:.2f}; "
                  f"blocks whose barrier + scores took over 2 us / the rest {late}")
    if not slow.any():
        return
    mlp_end = np.array([w[4 * l - 1, :used, 2] - np.median(w[4 * l - 1, :used, 2]) for l in ls])
    qkv = np.array([w[4 * l, :used] for l in ls])
    rows = [
        ("the previous MLP's end - its median", mlp_end),
        ("own q|k|v work", qkv[:, :, 2] - qkv[:, :, 1]),
        ("own q|k|v end - the last", qkv[:, :, 2] - qkv_end),
        ("attention start - the last q|k|v end", a[:, :, 0] - qkv_end),
    ]
    print("blocks whose barrier + scores took over 2 us / the rest (medians, us):")
    for name, v in rows:
        print(f"  {name:38s} {np.median(v[slow]):6.2f} / {np.median(v[~slow]):6.2f}")


if __name__ == "__main__":
    main()
